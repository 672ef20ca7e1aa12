"""A scenario of the model world, as data: the cluster (:class:`ClusterSpec`), the jobs (:class:`JobSpec`), the
actions (each picking its object by index modulo what exists then) and the policy knobs (:class:`Scenario`), and
its readable rows (:func:`parse_actions`, :func:`format_actions`: the regression table's language). Imports
nothing of ``phalanx.testing``; the world that plays a scenario is :mod:`phalanx.testing.world`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from phalanx.core.model import GangRequest
from phalanx.core.quota import DEFAULT_QUEUE, QueueSpec
from phalanx.core.spares import inflated, inflated_min

# The two GPU models of a mixed cluster: (model name, memory MiB); the first has MIG (H100 80GB: 7 slices).
MODELS = (("NVIDIA H100 80GB HBM3", 81559), ("NVIDIA A100-SXM4-40GB", 40960))


@dataclass(frozen=True)
class ClusterSpec:
    """`nodes` nodes of `gpus` GPUs, `per_leaf` to a leaf switch (8 leaves to a spine); `nvlink` > 0: NVLink
    domains of that many nodes; `mixed`: the second half of the nodes has the second GPU model; `mig_gpus`: the last
    node's last GPUs start in MIG mode; `confirming`: the nodes whose agents confirm releases ("all", "none",
    "odd")."""

    nodes: int = 3
    gpus: int = 8
    per_leaf: int = 4
    nvlink: int = 0
    mixed: bool = False
    mig_gpus: int = 0
    confirming: str = "all"


@dataclass(frozen=True)
class JobSpec:
    """A job of a scenario. `work`: seconds of work it needs in all; `checkpoint`: when asked to checkpoint it
    commits "early" (at once), "late" (near the end of the grace period) or "never"; `fails`: how many of its
    attempts fail (a rank exits non-zero) half way."""

    job: str
    replicas: int = 1
    gpus_per_replica: int = 8
    priority: int = 0
    queue: str = DEFAULT_QUEUE
    work: float = 10.0
    time_limit: float = 0.0
    mig_profile: str = ""
    gpu_milli: int = 0
    required_tier: str = ""
    gpu_model: str = ""
    checkpoint: str = "early"
    fails: int = 0
    by_admin: bool = True
    preempts: bool = True  # False: a service's surge replica, which waits instead of preempting
    segment: int = 0  # a multi-level gang: replicas per segment, each in one domain of the lowest tier (0: none)
    spares: int = 0  # spares kept in each segment's domain (needs segment; placed as segments of segment + spares)
    min_replicas: int = 0  # an elastic gang's minimum (`replicas` its maximum; 0: not elastic)

    def request(self, submitted_at: float) -> GangRequest:
        partial = bool(self.mig_profile or self.gpu_milli)
        replicas, segment = inflated(self.replicas, self.segment, self.spares)
        return GangRequest(
            self.job,
            replicas,
            1 if partial else self.gpus_per_replica,
            self.priority,
            submitted_at,
            required_tier=self.required_tier,
            gpu_model=self.gpu_model,
            mig_profile=self.mig_profile,
            gpu_milli=self.gpu_milli,
            time_limit=self.time_limit,
            segment=segment,
            min_replicas=inflated_min(self.min_replicas, self.segment, self.spares),
            spares=self.spares if self.segment else 0,
        )


# An action: (verb, argument). Verbs: submit (a JobSpec), advance (seconds), release, commit, fail, down, up,
# cancel, mig, gpu (an index: the object is picked modulo the candidates there are at that moment).
Action = tuple[str, object]


@dataclass(frozen=True)
class Scenario:
    cluster: ClusterSpec = ClusterSpec()
    actions: tuple[Action, ...] = ()
    queues: tuple[QueueSpec, ...] = ()
    min_runtime_s: float = 5.0
    grace_s: float = 3.0
    backoff_s: float = 1.0
    max_attempts: int = 3
    switch_s: float = 2.0  # how long a MIG mode switch takes


# ---- readable rows -------------------------------------------------------------------------------------------------


def parse_actions(text: str) -> tuple[Action, ...]:
    """Actions written one a line, for the regression table:

        submit NAME RxG [p=PRIORITY] [q=QUEUE] [work=S] [limit=S] [mig=PROFILE] [milli=M] [tier=T] [ckpt=early|late|never]
               [fails=N] [seg=S] [sp=K] [min=MIN] [user] [surge]
        advance SECONDS | release K | commit K | fail K | down K | up K | cancel K | mig K | gpu K

    ("#" starts a comment.)"""
    out: list[Action] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        verb, *args = line.split()
        if verb == "submit":
            name, shape, *opts = args
            r, _, g = shape.partition("x")
            kw: dict[str, object] = {}
            for opt in opts:
                key, _, value = opt.partition("=")
                if key == "user":
                    kw["by_admin"] = False
                    continue
                if key == "surge":  # a service's surge replica: it never preempts
                    kw["preempts"] = False
                    continue
                field_name, conv = _OPTIONS[key]
                kw[field_name] = conv(value)
            out.append(("submit", JobSpec(name, int(r), int(g), **kw)))  # type: ignore[arg-type]
        elif verb == "advance":
            out.append(("advance", float(args[0])))
        else:
            out.append((verb, int(args[0]) if args else 0))
    return tuple(out)


_OPTIONS = {
    "p": ("priority", int),
    "q": ("queue", str),
    "work": ("work", float),
    "limit": ("time_limit", float),
    "mig": ("mig_profile", str),
    "milli": ("gpu_milli", int),
    "tier": ("required_tier", str),
    "model": ("gpu_model", str),
    "ckpt": ("checkpoint", str),
    "fails": ("fails", int),
    "seg": ("segment", int),
    "sp": ("spares", int),
    "min": ("min_replicas", int),
}


def format_actions(actions: Iterable[Action]) -> str:
    """The inverse of `parse_actions` (what a shrunk failure prints, to paste into the regression table)."""
    lines = []
    defaults = JobSpec("x")
    for verb, arg in actions:
        if verb == "submit":
            assert isinstance(arg, JobSpec)
            parts = [f"submit {arg.job} {arg.replicas}x{arg.gpus_per_replica}"]
            for key, (name, _) in _OPTIONS.items():
                value = getattr(arg, name)
                if value != getattr(defaults, name):
                    parts.append(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}")
            if not arg.by_admin:
                parts.append("user")
            if not arg.preempts:
                parts.append("surge")
            lines.append(" ".join(parts))
        elif verb == "advance":
            lines.append(f"advance {float(arg):g}")  # type: ignore[arg-type]
        else:
            lines.append(f"{verb} {arg}")
    return "\n".join(lines)
