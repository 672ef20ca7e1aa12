"""Node and GPU rows: registration, state, health, MIG switches, heartbeats and acks, events and assignments."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, insert, select, text, update

from db.models import Assignment, Gpu, Node, NodeEvent
from phalanx.core import mig
from phalanx.core.closeness import GpuCloseness

from ..state import MigSwitch, NodeRecord
from ._sql import CHANGES, _changed_nodes, _chunks, _json_list, _raised, insert_rows
from .allocations import read_releasing, read_releasing_use, recount_use


def read_node_records(conn: Connection, fabric_path, node_ids: Iterable[int] | None = None) -> dict[str, NodeRecord]:
    """The nodes (all, or those of `node_ids`) as view records, with their GPUs' ids, MIG modes and switches."""
    wanted = None if node_ids is None else sorted(set(node_ids))
    nodes: dict[str, NodeRecord] = {}
    if wanted is not None and not wanted:
        return nodes
    gpu_ids: dict[int, dict[int, int]] = {}
    memory: dict[int, int] = {}
    mig_gpus: dict[int, set[int]] = {}
    foreign: dict[int, dict[int, int]] = {}
    switches: dict[int, tuple[dict, dict, dict]] = {}  # node id -> (switches, pending modes, switched at)
    gpu_stmt = select(
        Gpu.id,
        Gpu.node_id,
        Gpu.index.label("gpu_index"),
        Gpu.memory_mib,
        Gpu.mig_mode,
        Gpu.mig_instances,
        *MIG_SWITCH_COLUMNS,
    )
    node_stmt = select(*Node.__table__.c)
    if wanted is not None:
        gpu_stmt = gpu_stmt.where(Gpu.node_id.in_(wanted))
        node_stmt = node_stmt.where(Node.id.in_(wanted))
    for row in conn.execute(gpu_stmt):
        gpu_ids.setdefault(row.node_id, {})[row.gpu_index] = row.id
        if row.mig_switch_to or row.mig_mode_pending or row.mig_switched_at:
            mine = switches.setdefault(row.node_id, ({}, {}, {}))
            if row.mig_switch_to:
                mine[0][row.gpu_index] = MigSwitch(
                    row.mig_switch_to == "ENABLED",
                    row.mig_switch_at or 0.0,
                    int(row.mig_switch_revision or 0),
                    row.mig_switch_error or "",
                    row.mig_retry_after or 0.0,
                )
            if row.mig_mode_pending:
                mine[1][row.gpu_index] = row.mig_mode_pending == "ENABLED"
            if row.mig_switched_at:
                mine[2][row.gpu_index] = row.mig_switched_at
        memory[row.node_id] = max(memory.get(row.node_id, 0), row.memory_mib or 0)
        if row.mig_mode == "ENABLED":
            mig_gpus.setdefault(row.node_id, set()).add(row.gpu_index)
        mask = foreign_mask(_json_list(row.mig_instances))
        if mask:
            foreign.setdefault(row.node_id, {})[row.gpu_index] = mask
    releasing = read_releasing(conn, wanted)
    releasing_use = read_releasing_use(conn, wanted)
    for n in conn.execute(node_stmt).mappings():
        path = tuple(n["fabric_path"] or ()) or fabric_path(n["name"])
        nodes[n["name"]] = NodeRecord(
            id=n["id"],
            name=n["name"],
            state=n["state"],
            gpus=n["gpus"],
            gpu_ids=gpu_ids.get(n["id"], {}),
            gpu_model=n["gpu_model"] or "",
            memory_mib=memory.get(n["id"], 0),
            path=path,
            address=n["address"],
            last_heartbeat=n["last_heartbeat"],
            persisted_heartbeat=n["last_heartbeat"],
            agent_instance=n["agent_instance"],
            revision=n["revision"],
            closeness=node_closeness(n["topology"]),
            health=n["health"] or "HEALTHY",
            health_reason=(n["health_detail"] or {}).get("reason", ""),
            gpu_health=gpu_health_from_detail(n["health_detail"]),
            mig_gpus=frozenset(mig_gpus.get(n["id"], ())),
            foreign=foreign.get(n["id"], {}),
            mig_manage=bool(n["mig_manage"]),
            acked_revision=int(n["acked_revision"] or 0),
            confirms_release=bool(n["confirms_release"]),
            releasing=releasing.get(n["id"], {}),
            releasing_use=releasing_use.get(n["id"], {}),
            rank_ports=(int(n["rank_port_low"] or 0), int(n["rank_port_high"] or 0)),
            cpu_milli=int(n["cpu_milli"] or 0),
            memory=int(n["memory"] or 0),
        )
        if n["id"] in switches:
            node = nodes[n["name"]]
            node.mig_switches, node.mig_pending, node.mig_switched_at = switches[n["id"]]
    return nodes


def nodes_of_gpus(conn: Connection, gpu_ids: Iterable[int]) -> set[int]:
    wanted = sorted(set(gpu_ids))
    if not wanted:
        return set()
    return {r.node_id for r in conn.execute(select(Gpu.node_id).where(Gpu.id.in_(wanted)))}


def node_closeness(topology: Any) -> GpuCloseness | None:
    """The GPU closeness of a node from its stored `topology` (the registered HostTopology as a dict); None when
    it has no GPU matrix or cannot be read (placement then chooses GPUs by index)."""
    if isinstance(topology, str):  # a JSON column read back as text by some drivers
        try:
            topology = json.loads(topology)
        except ValueError:
            return None
    if not isinstance(topology, dict):
        return None
    try:
        return GpuCloseness.from_topology(topology)
    except (TypeError, ValueError, AttributeError):
        return None


def append_assignments(
    conn: Connection, items: Sequence[tuple[NodeRecord, str, int, str, Any]], now: float
) -> list[tuple[str, int, Any]]:
    """Store assignments, each under its node's next revision. Returns (node name, revision, Assignment) each.

    Revisions come from the view: cycles hold the clock row and decide on a fresh view, so the next revision of a
    node is known without asking; the unique (node_id, revision) constraint would refuse a wrong one.
    `items` are (node, job id, attempt, kind, build) where `build(revision)` returns the phalanx.v1.Assignment.
    """
    rows, out = [], []
    touched: dict[int, NodeRecord] = {}
    for node, job_id, attempt, kind, build in items:
        node.revision += 1
        touched[node.id] = node
        revision = node.revision
        message = build(revision)
        payload = message.SerializeToString()
        rows.append(
            dict(
                node_id=node.id,
                revision=revision,
                job_id=job_id,
                attempt=attempt,
                kind=kind,
                payload=payload,
                created_at=now,
            )
        )
        out.append((node.name, revision, message))
    insert_rows(conn, Assignment, rows)
    _raise_node_column(conn, "revision", "int8", {nid: n.revision for nid, n in touched.items()})
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.assigned.update(n.name for n in touched.values())
    return out


def assignments_after(conn: Connection, node_name: str, after: int, limit: int = 500) -> list[tuple[int, bytes]]:
    rows = conn.execute(
        select(Assignment.revision, Assignment.payload)
        .join(Node, Node.id == Assignment.node_id)
        .where(Node.name == node_name, Assignment.revision > after)
        .order_by(Assignment.revision)
        .limit(limit)
    )
    return [(r.revision, bytes(r.payload)) for r in rows]


class Registered(NamedTuple):
    """A node's rows after its registration: ids, the acked and last assignment revisions, whether an admin
    drained it, and its GPUs' row ids by index."""

    node_id: int
    acked: int
    revision: int
    cordoned: bool
    gpu_ids: dict[int, int]


def upsert_node(
    conn: Connection,
    *,
    name: str,
    gpus: list[dict[str, Any]],
    topology: dict[str, Any],
    address: str,
    agent_instance: str,
    profile: str,
    gpu_model: str,
    fabric_path: Sequence[str],
    now: float,
    mig_manage: bool = False,
) -> tuple[int, int, int]:
    """Insert or refresh a node and its GPU rows; the node becomes READY.

    Returns (node id, acked revision, last assignment revision).
    """
    got = upsert_nodes(
        conn,
        [
            dict(
                name=name,
                gpus=gpus,
                topology=topology,
                address=address,
                agent_instance=agent_instance,
                profile=profile,
                gpu_model=gpu_model,
                fabric_path=fabric_path,
                now=now,
                mig_manage=mig_manage,
            )
        ],
    )[name]
    return got.node_id, got.acked, got.revision


_GPU_COLUMNS = ("uuid", "name", "memory_mib", "mig_mode", "mig_instances")


def upsert_nodes(conn: Connection, rows: Sequence[dict[str, Any]]) -> dict[str, Registered]:
    """Insert or refresh many nodes and their GPU rows at once (a registration storm costs a handful of
    statements per cycle, not a handful per node); every node becomes READY. `rows`: upsert_node's arguments each,
    names distinct."""
    if not rows:
        return {}
    names = [r["name"] for r in rows]
    assert len(set(names)) == len(names), "one registration per node per call"
    found: dict[str, Any] = {}
    for chunk in _chunks(names, 500):
        for hit in conn.execute(
            select(Node.id, Node.name, Node.acked_revision, Node.revision, Node.cordoned).where(Node.name.in_(chunk))
        ):
            found[hit.name] = hit
    nodes_t, gpus_t = cast(Table, Node.__table__), cast(Table, Gpu.__table__)

    def values(r: dict[str, Any]) -> dict[str, Any]:
        return dict(
            state="READY",
            message="",
            gpus=len(r["gpus"]),
            gpu_model=r["gpu_model"],
            profile=r["profile"],
            address=r["address"],
            topology=r["topology"],
            fabric_path=list(r["fabric_path"]),
            agent_instance=r["agent_instance"],
            last_heartbeat=r["now"],
            mig_manage=r.get("mig_manage", False),
            containment=r.get("containment", ""),
            confirms_release=r.get("confirms_release", False),
            rank_port_low=r.get("rank_ports", (0, 0))[0],
            rank_port_high=r.get("rank_ports", (0, 0))[1],
            cpu_milli=r.get("cpu_milli", 0),
            memory=r.get("memory", 0),
            logs_port=r.get("logs_port", 0),
        )

    new = [r for r in rows if r["name"] not in found]
    old = [r for r in rows if r["name"] in found]
    ids: dict[str, int] = {name: found[name].id for name in found}
    if new:
        inserted = conn.execute(
            insert(nodes_t).returning(nodes_t.c.id, nodes_t.c.name),
            [dict(values(r), name=r["name"], registered_at=r["now"], revision=0, acked_revision=0) for r in new],
        )
        ids.update({row.name: row.id for row in inserted})
    if old:
        cols = list(values(old[0]))
        conn.execute(
            update(nodes_t).where(nodes_t.c.id == bindparam("node_id")).values({c: bindparam(c) for c in cols}),
            [dict(values(r), node_id=ids[r["name"]]) for r in old],
        )
    known: dict[int, dict[int, int]] = {}
    old_ids = [ids[r["name"]] for r in old]
    recount_use(conn, old_ids)  # each registration re-counts its node's held host resources
    for id_chunk in _chunks(old_ids, 500):
        for node_id, index, gpu_id in conn.execute(
            select(Gpu.node_id, Gpu.index, Gpu.id).where(Gpu.node_id.in_(id_chunk))
        ):
            known.setdefault(node_id, {})[index] = gpu_id
    updates, inserts = [], []
    for reg in rows:
        node_id = ids[reg["name"]]
        mine = known.get(node_id, {})
        for g in reg["gpus"]:
            gpu = dict(
                uuid=g["uuid"],
                name=g["name"],
                memory_mib=g["memory_mib"],
                mig_mode=g.get("mig_mode", "UNSUPPORTED"),
                mig_instances=list(g.get("mig_instances", ())),
            )
            if g["index"] in mine:
                updates.append(dict(gpu, gpu_id=mine[g["index"]]))
            else:
                inserts.append(dict(gpu, node_id=node_id, index=g["index"]))
    if updates:
        conn.execute(
            update(gpus_t).where(gpus_t.c.id == bindparam("gpu_id")).values({c: bindparam(c) for c in _GPU_COLUMNS}),
            updates,
        )
    if inserts:
        made = conn.execute(insert(gpus_t).returning(gpus_t.c.node_id, gpus_t.c.index, gpus_t.c.id), inserts)
        for node_id, index, gpu_id in made:
            known.setdefault(node_id, {})[index] = gpu_id
    _changed_nodes(conn, *ids.values())
    return {
        r["name"]: Registered(
            ids[r["name"]],
            int(found[r["name"]].acked_revision or 0) if r["name"] in found else 0,
            int(found[r["name"]].revision or 0) if r["name"] in found else 0,
            bool(found[r["name"]].cordoned) if r["name"] in found else False,
            dict(known.get(ids[r["name"]], {})),
        )
        for r in rows
    }


def foreign_mask(instances: Iterable[Any]) -> int:
    """The memory slices held by MIG instances Phalanx did not make (managed false), as a GPU's slice mask. An
    instance whose geometry cannot be read holds the whole GPU."""
    mask = 0
    for inst in instances:
        if not isinstance(inst, dict) or inst.get("managed"):
            continue
        try:
            start, size = int(inst.get("start", -1)), int(inst.get("size", 0))
        except (TypeError, ValueError):
            start = size = -1
        if 0 <= start < mig.MEMORY_SLICES and 1 <= size <= mig.MEMORY_SLICES - start:
            mask |= ((1 << size) - 1) << start
        else:
            mask |= mig.FULL_MASK
        if mig.is_media(str(inst.get("profile", ""))):
            mask |= mig.MEDIA_BIT  # a +me instance holds the GPU's media engines (one set per GPU)
    return mask


MIG_SWITCH_COLUMNS = (
    Gpu.mig_mode_pending,
    Gpu.mig_switch_to,
    Gpu.mig_switch_at,
    Gpu.mig_switch_revision,
    Gpu.mig_switch_error,
    Gpu.mig_retry_after,
    Gpu.mig_switched_at,
)


def set_gpu_mig(conn: Connection, gpu_id: int, **values: Any) -> None:
    """Update a GPU row's MIG mode or switch columns (mig_mode, mig_instances, mig_mode_pending, mig_switch_*, ...)."""
    conn.execute(update(Gpu).where(Gpu.id == gpu_id).values(**values))
    changes = conn.info.get(CHANGES)
    if changes is not None:
        changes.gpus.add(gpu_id)
        changes.sched = True


def strike_node(conn: Connection, node_id: int) -> int:
    """Count one more strike against the node (a rank its host could not set up); returns the new count."""
    conn.execute(update(Node).where(Node.id == node_id).values(strikes=Node.strikes + 1))
    return int(conn.scalar(select(Node.strikes).where(Node.id == node_id)) or 0)


def gpu_ids(conn: Connection, node_id: int) -> dict[int, int]:
    rows = conn.execute(select(Gpu.index.label("gpu_index"), Gpu.id).where(Gpu.node_id == node_id))
    return {r.gpu_index: r.id for r in rows}


def set_node_state(
    conn: Connection, node_id: int, state: str, message: str, *, only_if_heartbeat_before: float | None = None
) -> bool:
    stmt = update(Node).where(Node.id == node_id)
    if only_if_heartbeat_before is not None:
        stmt = stmt.where(Node.last_heartbeat < only_if_heartbeat_before, Node.state != state)
    _changed_nodes(conn, node_id)
    return conn.execute(stmt.values(state=state, message=message)).rowcount == 1


def node_cordoned(conn: Connection, node_id: int) -> bool:
    """Whether an admin drained the node (`phalanx node drain`): it stays DRAINED when its agent registers."""
    return bool(conn.execute(select(Node.cordoned).where(Node.id == node_id)).scalar())


def set_node_cordoned(conn: Connection, node_id: int, cordoned: bool) -> None:
    _changed_nodes(conn, node_id)
    conn.execute(update(Node).where(Node.id == node_id).values(cordoned=cordoned))


def gpu_health_from_detail(detail: dict[str, Any] | None) -> dict[int, tuple[str, tuple[str, ...]]]:
    gpus = (detail or {}).get("gpus") or {}
    return {int(i): (g.get("state", "HEALTHY"), tuple(g.get("reasons", ()))) for i, g in gpus.items()}


def set_node_health(
    conn: Connection, node_id: int, health: str, reason: str, gpus: dict[int, tuple[str, tuple[str, ...]]]
) -> None:
    detail = {
        "reason": reason,
        "gpus": {str(i): {"state": h, "reasons": list(r)} for i, (h, r) in sorted(gpus.items())},
    }
    _changed_nodes(conn, node_id)
    conn.execute(update(Node).where(Node.id == node_id).values(health=health, health_detail=detail))


def add_node_events(conn: Connection, node_id: int, events: list[dict[str, Any]]) -> None:
    if events:
        conn.execute(insert(NodeEvent), [dict(node_id=node_id, **e) for e in events])


def read_node_events(conn: Connection, node_name: str | None = None, limit: int = 100) -> list[Any]:
    """The latest health events, newest first (with the node's name)."""
    stmt = (
        select(
            Node.name, NodeEvent.at, NodeEvent.gpu, NodeEvent.severity, NodeEvent.kind, NodeEvent.code, NodeEvent.reason
        )
        .join(Node, Node.id == NodeEvent.node_id)
        .order_by(NodeEvent.at.desc(), NodeEvent.id.desc())
        .limit(limit)
    )
    if node_name is not None:
        stmt = stmt.where(Node.name == node_name)
    return list(conn.execute(stmt).mappings())


def persist_heartbeats(conn: Connection, beats: dict[int, float]) -> None:
    _raise_node_column(conn, "last_heartbeat", "float8", beats)


def persist_acks(conn: Connection, acks: dict[int, int]) -> None:
    _raise_node_column(conn, "acked_revision", "int8", acks)


def _raise_node_column(conn: Connection, column: str, pg_type: str, values: dict[int, Any]) -> None:
    """Raise a monotonic node column to new values for many nodes in one statement."""
    if not values:
        return
    _raised(conn, column, values)
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"UPDATE nodes SET {column} = v.x FROM unnest(%s::int4[], %s::{pg_type}[]) AS v(id, x) "
            f"WHERE nodes.id = v.id AND nodes.{column} < v.x",
            (list(values), list(values.values())),
        )
    else:
        conn.execute(
            text(f"UPDATE nodes SET {column} = :x WHERE id = :id AND {column} < :x"),
            [{"id": k, "x": v} for k, v in values.items()],
        )


def raise_node_status(conn: Connection, beats: dict[int, float], acks: dict[int, int]) -> set[int]:
    """The status lane's write (status_lane.py): raise the nodes' last heartbeat and acked revision, never lower
    them, in one statement. Not inside a cycle: it records no change for other replicas (they need neither until
    they lead, and a new leader reads the whole table). On PostgreSQL a node row some cycle holds locked is skipped,
    not waited for: returns those nodes, for the next batch."""
    ids = sorted(set(beats) | set(acks))
    if not ids:
        return set()
    at = [float(beats.get(i, 0.0)) for i in ids]
    acked = [int(acks.get(i, 0)) for i in ids]
    if conn.dialect.name == "postgresql":
        locked = conn.exec_driver_sql(
            "WITH locked AS (SELECT id FROM nodes WHERE id = ANY(%s::int4[]) FOR NO KEY UPDATE SKIP LOCKED), "
            "raised AS (UPDATE nodes SET last_heartbeat = GREATEST(nodes.last_heartbeat, v.at), "
            "acked_revision = GREATEST(nodes.acked_revision, v.acked) "
            "FROM unnest(%s::int4[], %s::float8[], %s::int8[]) AS v(id, at, acked) "
            "WHERE nodes.id = v.id AND nodes.id IN (SELECT id FROM locked) "
            "AND (nodes.last_heartbeat < v.at OR nodes.acked_revision < v.acked)) "
            "SELECT id FROM locked",
            (ids, ids, at, acked),
        ).scalars()
        return set(ids) - set(locked)
    conn.execute(
        text(
            "UPDATE nodes SET last_heartbeat = MAX(last_heartbeat, :at), acked_revision = MAX(acked_revision, :acked) "
            "WHERE id = :id AND (last_heartbeat < :at OR acked_revision < :acked)"
        ),
        [{"id": i, "at": a, "acked": r} for i, a, r in zip(ids, at, acked, strict=True)],
    )
    return set()
