"""What a gang may ask for serving (roles, start order, readiness probe, restart): every problem in words, before
anything is written (servicer.validate_spec raises them as INVALID_ARGUMENT). The service-level checks are in
serving/spec.py."""

from __future__ import annotations

import math
import re

from phalanx.api.v1 import common_pb2

START_ORDERS = ("", "any", "leader-first", "workers-first")
RESTARTS = ("", "always", "never")
NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_ROLES = 16
MAX_PROBE_PERIOD_S = 3600.0


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
        if not NAME.match(role.name):
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
