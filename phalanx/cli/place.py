"""``phalanx place``: the what-if tool. Runs the placement core over a fabric file and a JSONL request list, offline.

    phalanx place --fabric topology.conf --profile dgx-h100 --requests jobs.jsonl [--json]

Every node the fabric names gets the same host profile (a shipped profile name, or a path to an
``nvidia-smi topo -m`` dump: the node's GPU count is the number of GPUs in it; a gang that fits on one node
gets the GPUs its matrix says are closest, e.g. one NUMA node of ``pcie-2numa``). Each request line is decided once,
at its line, in file order, and never retried; a placed request is reserved, so later lines see it, until a
``{"release": NAME}`` line frees it. Request lines::

    {"name": "train", "replicas": 4, "gpus_per_replica": 8, "required_tier": "spine", "priority": 0}
    {"name": "llm", "replicas": 288, "gpus_per_replica": 4, "segment": 18, "segment_tier": "nvlink"}

``required_tier`` (a fabric tier name, or ``node`` / ``cluster``): the gang must fit under one domain of that tier
now, else it is refused and nothing is reserved. ``preferred_tier`` is accepted and best effort (the core already
places at the lowest tier it can). ``mig`` (a MIG profile such as ``"3g.40gb"``, on a MIG-capable profile's GPUs)
or ``gpu_milli`` (1-999 thousandths of a GPU) make each replica a partial GPU (``gpus_per_replica`` is then 1 and may
be left out), placed by the FGD-style fragmentation score. A malformed line is refused per line (its reason names
the line number); the run goes on. ``segment`` (replicas per segment, dividing ``replicas``) and ``segment_tier``
make it a multi-level gang (see placement/segments.py). ``--mig-gpus`` (``all`` or a comma list of indexes, e.g.
``7``) puts those GPUs of every node in MIG mode: MIG requests go only there, whole-GPU and ``gpu_milli`` requests
never there (without it no GPU is in MIG mode, so no MIG request is placed).

Output, one line per request (and per release), then a summary line. With ``--json`` every such line is one JSON
object: ``{"name", "placed", "allocations": [{"replica", "node", "gpus"}, plus "slices": [{"gpu", "profile",
"start", "size"}] for a MIG instance or "gpu_milli" for a share], "cost": {"tier", "leaves", "leaf_crossings",
"spine_crossings", "rails", "rail_changes"} | null, "reason", "segments"}`` (``segments``: a multi-level gang's
domain of each segment, ``segment`` replicas each, [] otherwise), ``{"release": NAME}``, and finally
``{"summary": {"requests", "placed", "not_placed", "gpus_allocated"}}``. Errors about the command itself (a
missing file, an unreadable fabric, an unknown profile) go to standard error with exit code 2.

Cost of a placement (phalanx.core.cost): ``tier`` is the highest tier the gang crosses (``node`` when it fits in
one node); ``leaves`` the number of distinct leaf switches under its nodes (1 when it sits in one node; NVLink
domains are not leaves); the ring runs over the replicas in rank order with the wrap-around from last to first, and
its hops between nodes are counted: ``leaf_crossings`` those between different leaves, ``spine_crossings`` those
between different spines (``path[1]``; 0 when the fabric has fewer than two switch tiers). On a rail-optimized
fabric (``rails: N`` in the YAML) ``rails`` lists the rails the inter-node traffic uses and ``rail_changes`` counts
hops inside one leaf domain where a channel changes rail (which takes it up to a spine); on other fabrics ``rails``
is empty and ``rail_changes`` 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.core import mig
from phalanx.core.capacity import ClusterCapacity
from phalanx.core.closeness import GpuCloseness
from phalanx.core.cost import ring_cost
from phalanx.core.fabric import Fabric, FabricError, group_nvlink_domains, load_fabric
from phalanx.core.model import GangRequest, NodeCapacity, Placement
from phalanx.core.placement import Unplaceable, place_gang
from phalanx.core.topo_dump import TopoParseError

from . import render

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_FAILURE = 1  # a malformed request line

_FIELDS = {
    "name",
    "replicas",
    "gpus_per_replica",
    "required_tier",
    "preferred_tier",
    "mig",
    "gpu_milli",
    "priority",
    "segment",
    "segment_tier",
}


class _CommandError(Exception):
    """A problem with the command itself (not with one request line): stderr, exit code 2."""


@dataclass
class _Request:
    lineno: int
    name: str
    replicas: int = 0
    gpus_per_replica: int = 0
    required_tier: str | None = None
    priority: int = 0
    mig: str = ""
    gpu_milli: int = 0
    segment: int = 0  # a multi-level gang: replicas per segment (0: none), in domains of segment_tier
    segment_tier: str = ""
    error: str = ""  # a per-line refusal decided before placement


@dataclass
class _Outcome:
    name: str
    placement: Placement | None
    reason: str
    cost: dict[str, Any] | None
    malformed: bool = False  # the request line itself is wrong (not JSON, not a request): the command exits 1


# -- inputs ----------------------------------------------------------------------------------------------------


def _load_fabric(path: str) -> Fabric:
    if not Path(path).is_file():
        raise _CommandError(f"fabric file {path} does not exist")
    try:
        fabric = load_fabric(path)
    except FabricError as exc:
        raise _CommandError(f"cannot read fabric {path}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _CommandError(f"cannot read fabric {path}: {exc}") from None
    if not fabric.paths:
        raise _CommandError(f"fabric {path} names no nodes")
    return fabric


def _gpu_count(profile: str) -> int:
    return _host_profile(profile).gpu_count


def _host_profile(profile: str):
    """The shipped profile of that name, or the profile / topo dump in that file (a HostProfile)."""
    from phalanx.profiles import UnknownProfile, load_profile, load_profile_file

    path = Path(profile)
    try:
        if path.is_file():
            prof = load_profile_file(path)
            where = f"topology dump {profile}"
        elif "/" in profile or path.suffix:
            raise _CommandError(f"profile file {profile} does not exist")
        else:
            prof = load_profile(profile)
            where = f"profile {profile}"
    except UnknownProfile as exc:
        raise _CommandError(str(exc)) from None
    except (TopoParseError, ValueError) as exc:
        raise _CommandError(f"cannot read profile {profile}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _CommandError(f"cannot read profile {profile}: {exc}") from None
    if prof.gpu_count < 1:
        raise _CommandError(f"{where} has no GPUs")
    return prof


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise _CommandError(f"requests file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _CommandError(f"cannot read requests file {path}: {exc}") from None


def _positive_int(doc: dict, key: str) -> int:
    value = doc.get(key)
    if value is None:
        raise ValueError(f"missing {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key!r} must be an integer, got {json.dumps(value)}")
    if value < 1:
        raise ValueError(f"{key!r} must be positive, got {value}")
    return value


def _parse_request(lineno: int, doc: dict, tier_order: list[str]) -> _Request:
    name = doc.get("name")
    label = name if isinstance(name, str) and name else f"line {lineno}"
    try:
        unknown = sorted(set(doc) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}")
        if not isinstance(name, str) or not name:
            raise ValueError("missing 'name' (a non-empty string)")
        replicas = _positive_int(doc, "replicas")
        profile, milli = doc.get("mig"), doc.get("gpu_milli")
        if profile is not None and (not isinstance(profile, str) or not mig.known_profile(profile)):
            raise ValueError(
                f"'mig' must be a MIG profile ({', '.join(mig.all_profile_names())}), got {json.dumps(profile)}"
            )
        if milli is not None and (isinstance(milli, bool) or not isinstance(milli, int) or not 1 <= milli <= 999):
            raise ValueError(f"'gpu_milli' must be an integer 1-999, got {json.dumps(milli)}")
        if profile and milli:
            raise ValueError("give 'mig' or 'gpu_milli', not both")
        partial = bool(profile) or bool(milli)
        gpus = 1 if partial and doc.get("gpus_per_replica") is None else _positive_int(doc, "gpus_per_replica")
        if partial and gpus != 1:
            raise ValueError(f"a MIG or fractional replica uses one GPU: 'gpus_per_replica' must be 1, got {gpus}")
        priority = doc.get("priority", 0)
        if priority is None:
            priority = 0
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"'priority' must be an integer, got {json.dumps(priority)}")
        tiers: dict[str, str | None] = {}
        for key in ("required_tier", "preferred_tier"):
            value = doc.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key!r} must be a tier name, got {json.dumps(value)}")
            if value is not None and value not in tier_order:
                raise ValueError(f"unknown {key} {value!r}; this fabric has {', '.join(tier_order)}")
            tiers[key] = value
        segment, segment_tier = _segment_fields(doc, replicas, partial, tier_order)
    except ValueError as exc:
        return _Request(lineno, label, error=f"line {lineno}: {exc}")
    return _Request(
        lineno,
        name,
        replicas,
        gpus,
        tiers["required_tier"],
        priority,
        (profile or "").lower(),
        milli or 0,
        segment,
        segment_tier,
    )


def _segment_fields(doc: dict, replicas: int, partial: bool, tier_order: list[str]) -> tuple[int, str]:
    """`segment` (replicas per segment, dividing `replicas`) and `segment_tier` of a request line."""
    segment = _positive_int(doc, "segment") if doc.get("segment") is not None else 0
    if segment and replicas % segment:
        raise ValueError(f"'segment' {segment} does not divide 'replicas' {replicas}")
    if segment and partial:
        raise ValueError("segments need whole GPUs per replica (no 'mig' or 'gpu_milli')")
    tier = doc.get("segment_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in tier_order):
        raise ValueError(f"unknown segment_tier {json.dumps(tier)}; this fabric has {', '.join(tier_order)}")
    if tier and not segment:
        raise ValueError("'segment_tier' needs 'segment'")
    return segment, tier or ""


# -- cost ------------------------------------------------------------------------------------------------------


def placement_cost(placement: Placement, fabric: Fabric) -> dict[str, Any]:
    """`tier`, `leaves` spanned, ring hops that cross leaves / spines, and rails (see the module docstring)."""
    return ring_cost(placement, fabric).to_dict()


# -- the run ---------------------------------------------------------------------------------------------------


def run_place(
    fabric: Fabric,
    gpus_per_node: int,
    lines: list[str],
    closeness: GpuCloseness | None = None,
    gpu_model: str = "",
    memory_mib: int = 0,
    mig_gpus: frozenset[int] = frozenset(),
):
    """Decide every line in order. Yields `_Outcome` per request line, `("release", name, freed)` per release.

    `closeness`: the host profile's GPU closeness (from its topo matrix), given to every node: a gang on one node
    gets the GPUs that share the closest links (see placement.pick_gpus). `gpu_model` / `memory_mib`: the
    profile's GPUs, which decide the MIG profiles they offer. `mig_gpus`: the GPUs of every node in MIG mode (only
    MIG instances go there, and only there)."""
    capacity = ClusterCapacity(
        NodeCapacity(
            name,
            gpus_per_node,
            set(range(gpus_per_node)),
            True,
            fabric.path(name),
            closeness,
            gpu_model,
            memory_mib,
            mig_gpus=mig_gpus,
        )
        for name in sorted(fabric.paths)
    )
    tier_order = ["node", *fabric.tiers, "cluster"]
    held: dict[str, Placement] = {}
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            yield _Outcome(f"line {lineno}", None, f"line {lineno}: invalid JSON: {exc.msg}", None, True)
            continue
        if not isinstance(doc, dict):
            yield _Outcome(f"line {lineno}", None, f"line {lineno}: expected a JSON object", None, True)
            continue
        if "release" in doc:
            target = doc["release"]
            if set(doc) != {"release"} or not isinstance(target, str) or not target:
                yield _Outcome(
                    f"line {lineno}",
                    None,
                    f'line {lineno}: a release is {{"release": NAME}} with NAME a non-empty string',
                    None,
                    True,
                )
                continue
            placement = held.pop(target, None)
            if placement is not None:
                capacity.release_placement(placement)
            yield ("release", target, placement is not None)
            continue
        request = _parse_request(lineno, doc, tier_order)
        if request.error:
            yield _Outcome(request.name, None, request.error, None, True)
            continue
        if request.name in held:
            yield _Outcome(
                request.name,
                None,
                f"line {lineno}: {request.name!r} already holds a placement; release it first",
                None,
                True,
            )
            continue
        gang = GangRequest(
            request.name,
            request.replicas,
            request.gpus_per_replica,
            priority=request.priority,
            mig_profile=request.mig,
            gpu_milli=request.gpu_milli,
            segment=request.segment,
            segment_tier=request.segment_tier,
        )
        result = place_gang(capacity, gang, fabric.tiers)
        if isinstance(result, Unplaceable):
            yield _Outcome(request.name, None, result.reason, None)
            continue
        if request.required_tier is not None:
            got, want = _rank(tier_order, result.tier), tier_order.index(request.required_tier)
            if got > want:
                yield _Outcome(
                    request.name,
                    None,
                    f"required_tier {request.required_tier}: no single {request.required_tier} holds "
                    f"{gang.replicas} x {gang.gpus_per_replica} GPUs now (the best placement crosses {result.tier})",
                    None,
                )
                continue
        capacity.reserve(result)
        held[request.name] = result
        yield _Outcome(request.name, result, "", placement_cost(result, fabric))


def _rank(tier_order: list[str], tier: str) -> int:
    try:
        return tier_order.index(tier)
    except ValueError:  # a generated name beyond the fabric's: above every named tier but the cluster
        return len(tier_order) - 1


# -- output ----------------------------------------------------------------------------------------------------


def _ranges(gpus) -> str:
    gpus = sorted(gpus)
    parts, i = [], 0
    while i < len(gpus):
        j = i
        while j + 1 < len(gpus) and gpus[j + 1] == gpus[j] + 1:
            j += 1
        parts.append(str(gpus[i]) if i == j else f"{gpus[i]}-{gpus[j]}")
        i = j + 1
    return ",".join(parts)


def _compact(placement: Placement) -> str:
    """`n01:[0-3][4-7] n02:[0-7]`: nodes in rank order, each replica's GPUs in brackets."""
    by_node: dict[str, list[str]] = {}
    for rep in placement.replicas:
        if rep.mig_profile:
            part = f"[{rep.gpus[0]}:{rep.mig_profile}@{rep.mig_start}]"
        elif rep.gpu_milli:
            part = f"[{rep.gpus[0]}:{rep.gpu_milli}m]"
        else:
            part = f"[{_ranges(rep.gpus)}]"
        by_node.setdefault(rep.node, []).append(part)
    return " ".join(f"{node}:{''.join(reps)}" for node, reps in by_node.items())


def _allocation(r) -> dict[str, Any]:
    """As `phalanx job --json` prints an allocation."""
    out: dict[str, Any] = {"replica": r.replica, "node": r.node, "gpus": list(r.gpus)}
    if r.mig_profile:
        out["slices"] = [{"gpu": r.gpus[0], "profile": r.mig_profile, "start": r.mig_start, "size": r.mig_size}]
    if r.gpu_milli:
        out["gpu_milli"] = r.gpu_milli
    return out


def _json_line(outcome: _Outcome) -> dict[str, Any]:
    allocations = [] if outcome.placement is None else [_allocation(r) for r in outcome.placement.replicas]
    return {
        "name": outcome.name,
        "placed": outcome.placement is not None,
        "allocations": allocations,
        "cost": outcome.cost,
        "reason": outcome.reason,
        "segments": [] if outcome.placement is None else list(outcome.placement.segments),
    }


def cmd_place(args: argparse.Namespace) -> int:
    try:
        fabric = _load_fabric(args.fabric)
        profile = _host_profile(args.profile)
        gpus = profile.gpu_count
        if profile.nvlink_domain_nodes > 1:
            # Hosts such as gb200-nvl72 trays share multi-node NVLink domains: the nodes in no declared domain
            # form domains of nodes_per_domain consecutive nodes under each leaf, as their agents' cliques would.
            fabric = group_nvlink_domains(fabric, profile.nvlink_domain_nodes, prefix=profile.nvlink_domain or "nvl")
        lines = _read_lines(args.requests)
        mig_gpus = parse_gpu_list(args.mig_gpus, gpus) if args.mig_gpus else frozenset()
        if mig_gpus and mig.mig_family(profile.gpu_model, profile.memory_mib) is None:
            raise _CommandError(f"--mig-gpus: the GPUs of profile {args.profile} ({profile.gpu_model}) have no MIG")
    except _CommandError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return EXIT_USAGE

    out: list[str] = []
    requests = placed = allocated = 0
    malformed: list[str] = []
    for item in run_place(
        fabric, gpus, lines, GpuCloseness.from_dump(profile.dump), profile.gpu_model, profile.memory_mib, mig_gpus
    ):
        if isinstance(item, tuple):
            if args.json:
                out.append(render.to_json({"release": item[1]}, lines=True))
            else:
                out.append(f"release {item[1]}: " + ("freed" if item[2] else "nothing held under that name"))
            continue
        requests += 1
        if item.malformed:
            malformed.append(item.reason)
        if item.placement is not None:
            placed += 1
            allocated += sum(len(r.gpus) for r in item.placement.replicas)
        if args.json:
            out.append(render.to_json(_json_line(item), lines=True))
        elif item.placement is not None:
            p, c = item.placement, item.cost or {}
            first = p.replicas[0]
            what = (
                f"MIG {first.mig_profile}"
                if first.mig_profile
                else f"{first.gpu_milli}/1000 GPU"
                if first.gpu_milli
                else f"{len(first.gpus)} GPUs"
            )
            out.append(
                f"{item.name}  PLACED  {len(p.replicas)} x {what}  {_compact(p)}  "
                f"tier={c['tier']} leaves={c['leaves']} spine_crossings={c['spine_crossings']}"
                + (
                    f" rails={','.join(map(str, c['rails']))} rail_changes={c['rail_changes']}"
                    if fabric.rails and c["rails"]
                    else ""
                )
            )
        else:
            out.append(f"{item.name}  NOT PLACED  {item.reason}")
    summary = {"requests": requests, "placed": placed, "not_placed": requests - placed, "gpus_allocated": allocated}
    if args.json:
        out.append(render.to_json({"summary": summary}, lines=True))
    else:
        out.append(
            f"{requests} request(s): {placed} placed, {requests - placed} not placed, "
            f"{allocated} GPUs allocated ({len(fabric.paths)} nodes x {gpus} GPUs)"
        )
    sys.stdout.write("\n".join(out) + "\n")
    sys.stdout.flush()
    if malformed:
        sys.stderr.write(f"error: {len(malformed)} malformed request line(s); the first: {malformed[0]}\n")
        sys.stderr.flush()
        return EXIT_FAILURE
    return EXIT_OK


def register(subparsers) -> None:
    """Add ``place`` to the ``phalanx`` CLI."""
    p = subparsers.add_parser(
        "place",
        help="what-if: place a list of gang requests on a fabric, offline (no services)",
        description="Run the placement core over a fabric file and a JSONL list of requests, one pass in file "
        "order, and report where each gang would go and what it costs.",
    )
    p.add_argument(
        "--fabric",
        required=True,
        metavar="FILE",
        help="fabric file: Slurm topology.conf (tree or block syntax) or Phalanx YAML",
    )
    p.add_argument(
        "--profile",
        required=True,
        metavar="NAME|DUMP",
        help="host profile of every node: a shipped profile name or an `nvidia-smi topo -m` dump file",
    )
    p.add_argument(
        "--requests",
        required=True,
        metavar="FILE.jsonl",
        help='one JSON request per line; {"release": NAME} frees an earlier placement',
    )
    p.add_argument(
        "--mig-gpus",
        default="",
        metavar="GPUS",
        help="GPUs of every node in MIG mode: `all` or a comma list of indexes (e.g. `7` or `6,7`); only "
        "MIG requests go there, and MIG requests only go there (default: none)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line, then a summary object")
    p.set_defaults(func=cmd_place)


def parse_gpu_list(text: str, gpus: int) -> frozenset[int]:
    """`all` or a comma list of GPU indexes below `gpus` (as `phalanx-agent --simulate-mig` takes them)."""
    try:
        return mig.parse_gpu_indexes(text, gpus)
    except ValueError as exc:
        raise _CommandError(f"--mig-gpus: {exc}") from exc
