"""What a gang may ask for serving, and what a service spec must be: every problem in words, before anything is
written (the servicers raise them as INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from phalanx.api.v1 import common_pb2, service_pb2

START_ORDERS = ("", "any", "leader-first", "workers-first")
RESTARTS = ("", "always", "never")
SERVICE_RESTARTS = {"always": "always", "none": "never", "never": "never", "": "always"}
_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_ROLES = 16
MAX_PROBE_PERIOD_S = 3600.0
MAX_SERVICE_REPLICAS = 10_000


def normalize_roles(spec: common_pb2.JobSpec) -> None:
    """A gang with roles and no replica count counts the roles' replicas."""
    if spec.roles and spec.replicas == 0:
        spec.replicas = sum(max(0, r.replicas) for r in spec.roles)


def serving_problems(spec: common_pb2.JobSpec) -> list[str]:
    """What is wrong with a JobSpec's serving fields (roles, start order, ready probe, restart)."""
    problems: list[str] = []
    if spec.roles:
        problems += _role_problems(spec)
    if spec.start_order not in START_ORDERS:
        problems.append(f"start_order {spec.start_order[:40]!r} must be one of any, leader-first, workers-first")
    if spec.start_order in ("leader-first", "workers-first") and spec.replicas < 2:
        problems.append(f"start_order {spec.start_order} needs a gang of at least 2 replicas (nodes)")
    if spec.restart not in RESTARTS:
        problems.append(f"restart {spec.restart[:40]!r} must be always or never (or empty for a batch job)")
    if spec.restart and spec.max_restarts:
        problems.append("ask for restart (always, never) or max_restarts, not both")
    if spec.HasField("ready_probe"):
        problems += probe_problems(spec.ready_probe)
    return problems


def _role_problems(spec: common_pb2.JobSpec) -> list[str]:
    problems = []
    if len(spec.roles) > MAX_ROLES:
        problems.append(f"at most {MAX_ROLES} roles, got {len(spec.roles)}")
    names = [r.name for r in spec.roles]
    for role in spec.roles:
        if not _NAME.match(role.name):
            problems.append(f"role name {role.name[:70]!r} must be 1-63 lowercase letters, digits or '-'")
        if role.replicas < 1:
            problems.append(f"role {role.name[:63]!r} must have at least 1 replica (node), got {role.replicas}")
        if any("\x00" in a for a in role.command):
            problems.append(f"role {role.name[:63]!r}: command arguments must not contain NUL characters")
        for key, value in role.env.items():
            if not _ENV_KEY.match(key) or "\x00" in value:
                problems.append(f"role {role.name[:63]!r}: env name {key[:40]!r} is not a valid variable name")
                break
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"role names must be unique; repeated: {', '.join(dupes)}")
    total = sum(max(0, r.replicas) for r in spec.roles)
    if spec.replicas and total != spec.replicas:
        problems.append(f"the roles have {total} replicas (nodes) in all, but the gang asks for {spec.replicas}")
    return problems


def probe_problems(probe: common_pb2.ReadyProbe) -> list[str]:
    problems = []
    if bool(probe.command) == bool(probe.http_port):
        problems.append("a ready probe is a command or an HTTP port and path, exactly one of the two")
    if probe.http_port and not 1 <= probe.http_port <= 65535:
        problems.append(f"ready probe port must be 1-65535, got {probe.http_port}")
    if probe.http_path and (not probe.http_path.startswith("/") or len(probe.http_path) > 1024):
        problems.append(f"ready probe path {probe.http_path[:60]!r} must start with '/' (at most 1024 characters)")
    if any("\x00" in a for a in probe.command):
        problems.append("ready probe command arguments must not contain NUL characters")
    for name in ("period_s", "initial_delay_s", "timeout_s"):
        value = getattr(probe, name)
        if not (math.isfinite(value) and 0 <= value <= MAX_PROBE_PERIOD_S):
            problems.append(f"ready probe {name} must be 0-{MAX_PROBE_PERIOD_S:g} seconds, got {value}")
    if not 0 <= probe.failure_threshold <= 1000:
        problems.append(f"ready probe failure_threshold must be 0-1000, got {probe.failure_threshold}")
    return problems


def name_problems(name: str) -> list[str]:
    if not _NAME.match(name or ""):
        return [
            f"service name {name[:70]!r} must be 1-63 lowercase letters, digits or '-', starting and ending "
            "with a letter or digit"
        ]
    return []


def service_problems(spec: service_pb2.ServiceSpec, tier_names: Sequence[str]) -> list[str]:
    """What is wrong with a service spec beyond its template's job checks (servicer.validate_spec runs those)."""
    problems = name_problems(spec.name)
    if not 1 <= spec.replicas <= MAX_SERVICE_REPLICAS:
        problems.append(f"replicas must be 1-{MAX_SERVICE_REPLICAS}, got {spec.replicas}")
    if spec.spread_tier and spec.spread_tier not in tier_names:
        problems.append(
            f"spread_tier {spec.spread_tier[:60]!r} is not a tier of this cluster; valid tiers: {', '.join(tier_names)}"
        )
    surge = spec.max_surge if spec.HasField("max_surge") else 0
    unavailable = spec.max_unavailable if spec.HasField("max_unavailable") else 1
    if surge < 0 or unavailable < 0:
        problems.append("max_surge and max_unavailable cannot be negative")
    elif surge == 0 and unavailable == 0:
        problems.append("max_surge and max_unavailable cannot both be 0: a rolling update could never start")
    if not 0 <= spec.port <= 65535:
        problems.append(f"port must be 0-65535, got {spec.port}")
    if spec.template.restart == "":
        pass  # "always" unless asked
    elif spec.template.restart not in ("always", "never"):
        problems.append(f"restart {spec.template.restart[:30]!r} must be always or none")
    if spec.template.time_limit_s:
        problems.append("a service's replicas run until stopped: time_limit_s must be 0")
    if spec.template.max_restarts:
        problems.append("a service's replicas restart by its restart policy: max_restarts must be 0")
    if spec.HasField("autoscale") and spec.autoscale.max_replicas:
        problems += autoscale_problems(spec)
    return problems


def autoscale_problems(spec: service_pb2.ServiceSpec) -> list[str]:
    from .autoscaling import policy_of

    a = spec.autoscale
    problems = policy_of(a).problems()
    if a.max_replicas > MAX_SERVICE_REPLICAS:
        problems.append(f"autoscale max must be at most {MAX_SERVICE_REPLICAS}, got {a.max_replicas}")
    if not 0 <= a.metrics_port <= 65535:
        problems.append(f"autoscale metrics_port must be 0-65535, got {a.metrics_port}")
    if a.metrics_path and not a.metrics_path.startswith("/"):
        problems.append(f"autoscale metrics_path {a.metrics_path[:60]!r} must start with '/'")
    if not (math.isfinite(a.period_s) and 0 <= a.period_s <= 3600):
        problems.append(f"autoscale period_s must be 0-3600 seconds, got {a.period_s}")
    return problems
