"""Fuzz the public gRPC APIs with hypothesis against real servers on 127.0.0.1, on SQLite and PostgreSQL.

Each test starts its servers once (the scheduler with two LiteAgents, or the checkpoint coordinator), then drives
a hypothesis loop from a worker thread through a blocking channel: random and extreme field values, huge strings,
unicode (NUL included), negative and overflowing numbers (raw protobuf), NaN/inf, unknown enum values, oversized
and malformed messages. The oracles, for every request:

- the status is OK or one of ALLOWED (never UNKNOWN or INTERNAL), and its details leak no traceback;
- the server still answers a health check;
- a rejected request changes nothing in the ledger (row counts and a checksum of the key tables, compared before and
  after; when something in the background moved meanwhile, the request is repeated once on a settled ledger);
- after every request the ledger's invariants hold (no GPU double-booked, no share over a whole GPU, no active
  allocation of a job that is not RUNNING, committed checkpoints complete).

Runs are derandomized (CI-stable); PHALANX_FUZZ_EXAMPLES scales the example counts, PHALANX_FUZZ_SHRINK=1 shrinks
a failure to a minimal example (slower).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.lite_cluster import LiteCluster
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import bindparam, insert, text

from db.engine import make_engine
from db.models import Job
from phalanx.api.v1 import agent_pb2, checkpoint_pb2, common_pb2, scheduler_pb2
from phalanx.testing.lite_agent import LiteAgent
from services.checkpoint_coordinator import serve as serve_coordinator
from services.checkpoint_coordinator.store import ledger_world_size
from services.common.server import MAX_MESSAGE_BYTES
from services.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.timeout(240)

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
LEAKS = ("Traceback", 'File "')
SCALE = float(os.environ.get("PHALANX_FUZZ_EXAMPLES", "1"))
SCHEDULER = "phalanx.v1.Scheduler"
NODES = "phalanx.v1.NodeService"
COORDINATOR = "phalanx.v1.CheckpointCoordinator"
AGENT_NAMES = ("lite-0", "lite-1")
CLIENT_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# The tables a request may write; nodes.last_heartbeat is left out (heartbeats reach the ledger on their own).
TABLES = (
    "jobs",
    "allocations",
    "checkpoints",
    "checkpoint_shards",
    "nodes",
    "gpus",
    "job_attempts",
    "ranks",
    "assignments",
    "checkpoint_requests",
    "node_events",
    "checkpoint_restores",
)
VOLATILE = {"nodes": {"last_heartbeat"}}


def fuzz_settings(n: int) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("PHALANX_FUZZ_SHRINK") else [])
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        phases=phases,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


# ---------------------------------------------------------------------------------------------------------------
# Raw protobuf: values the Python classes refuse (overflowing int32, invalid UTF-8) go on the wire as the bytes a
# buggy or hostile client would send.


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def raw_varint(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def raw_bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def raw_double(field: int, value: float) -> bytes:
    import struct

    return _varint(field << 3 | 1) + struct.pack("<d", value)


# ---------------------------------------------------------------------------------------------------------------
# Strategies

INT32 = st.one_of(
    st.sampled_from([0, 1, -1, 2, 7, 8, 999, 1000, 1001, 1024, 1025, 100_000, 100_001, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
SMALL = st.one_of(st.integers(0, 4), INT32)
INT64 = st.one_of(
    st.sampled_from([0, 1, -1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1)
)
WIRE64 = st.one_of(INT64, st.integers(0, 2**64 - 1))  # raw varints: any 64-bit pattern
DOUBLE = st.one_of(
    st.sampled_from(
        [
            0.0,
            -0.0,
            0.001,
            1.0,
            -1.0,
            math.nan,
            math.inf,
            -math.inf,
            1e308,
            -1e308,
            5e-324,
            604800.0,
            604800.0001,
            31622400.0,
            31622400.5,
            1.7e9,
            4e9,
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
# Any Unicode scalar (protobuf strings cannot hold surrogates), NUL and other controls included.
CHARS = st.characters(blacklist_categories=("Cs",))
WEIRD = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a\x00b",
        "\n",
        "x\n",
        "\u202e",
        "\ufeff",
        "😀" * 3,
        "名前",
        "../../etc",
        "'; DROP TABLE jobs; --",
        "%s%n",
        "\r\n",
        "\t",
        "\U0010ffff",
        "\x7f",
        "null",
        "${HOME}",
    ]
)


def huge(min_size: int = 254) -> st.SearchStrategy[str]:
    sizes = [s for s in (254, 513, 4097, 65_537, 262_145, 1 << 20) if s >= min_size]
    return st.builds(
        lambda c, n: (c * n)[:n], st.sampled_from(["x", "é", "😀", "\x00", "ab\x00"]), st.sampled_from(sizes)
    )


TEXT = st.one_of(WEIRD, st.text(CHARS, max_size=40), st.text(CHARS, min_size=200, max_size=400), huge())
SHORT_TEXT = st.one_of(WEIRD, st.text(CHARS, max_size=20))
HEX12 = st.text("0123456789abcdef", min_size=12, max_size=12)
JOB_ID_SHAPES = st.one_of(
    HEX12,
    st.sampled_from(
        [
            "",
            "0" * 12,
            "f" * 12,
            "0123456789ab\n",
            "0123456789AB",
            "0123456789a",
            "0123456789abc",
            "0123456789a\x00",
            "job-ckpt-1",
            "x" * 32,
            "x" * 33,
        ]
    ),
    TEXT,
)
UNKNOWN_ENUM = st.one_of(st.integers(-5, 12), st.sampled_from([2**31 - 1, -(2**31), 100]))


def one_of_list(items: list[str], fallback: str) -> st.SearchStrategy[str]:
    """An item of a list that grows while the loop runs (an index, so that hypothesis's draws stay the same)."""
    return st.integers(0, 1 << 16).map(lambda i: items[i % len(items)] if items else fallback)


def job_ids(known: list[str]) -> st.SearchStrategy[str]:
    return st.one_of(one_of_list(known, "0" * 12), JOB_ID_SHAPES)


COMMANDS = st.one_of(
    st.just(["run"]),
    st.lists(st.sampled_from(["python", "train.py", "--lr", "1e-3", "-x"]), min_size=1, max_size=5),
    st.lists(SHORT_TEXT, max_size=5),
    st.builds(lambda a, n: ["run", *[a] * n], st.sampled_from(["a", "x" * 100]), st.sampled_from([4095, 4096, 5000])),
    st.builds(lambda n: ["run", "y" * n], st.sampled_from([262_140, 262_141, 1 << 20])),
).filter(lambda c: not c or c[0] not in ("sleep", "exit", "hang"))  # LiteAgent programs (they finish or hang)
ENV_KEYS = st.one_of(
    st.sampled_from(["A", "_", "PATH", "A1", "1A", "A-B", "A=B", "A\n", "", "\x00", "ÄÖ", "A B"]),
    st.text(CHARS, max_size=10),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
)
ENV = st.dictionaries(ENV_KEYS, st.one_of(SHORT_TEXT, huge(4097)), max_size=4)
TIERS = st.one_of(st.sampled_from(["", "node", "cluster", "leaf", "spine", "NODE", "node ", "x" * 65]), SHORT_TEXT)
MIG = st.one_of(st.sampled_from(["", "1g.10gb", "3g.40gb", "7g.80gb", "0g.0gb", "1g.10GB", "9g.999gb"]), SHORT_TEXT)
# time limits: 0, huge and invalid ones; a small valid limit would stop a gang in the middle of the run (churn).
TIME_LIMIT = st.one_of(
    st.sampled_from([0.0, 3600.0, 31622400.0, 31622400.5, -1.0, -0.0, math.nan, math.inf, -math.inf, 1e308]),
    st.floats(max_value=-1e-9),
    st.floats(min_value=1e8),
)


def mutated(draw, base: dict, extremes: dict, most: int = 3) -> dict:
    """`base` (a valid request's fields) with up to `most` of its fields replaced by extreme values."""
    fields = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(extremes)), max_size=most, unique=True)):
        fields[name] = draw(extremes[name])
    return fields


SPEC_EXTREMES = {
    "name": TEXT,
    "replicas": INT32,
    "gpus_per_replica": INT32,
    "priority": INT64,
    "procs_per_replica": INT32,
    "command": COMMANDS,
    "env": ENV,
    "required_tier": TIERS,
    "preferred_tier": TIERS,
    "gpu_model": st.one_of(st.sampled_from(["", "H100", "h100", "A100", "x" * 128, "x" * 129]), SHORT_TEXT),
    "mig_profile": MIG,
    "gpu_milli": st.one_of(st.sampled_from([1, 500, 999, 1000]), INT32),
    "max_restarts": st.one_of(st.sampled_from([1000, 1001]), INT32),
    "time_limit_s": TIME_LIMIT,
}


@st.composite
def job_specs(draw) -> common_pb2.JobSpec:
    """A valid spec (whole GPUs, a MIG instance or a GPU share) with up to three fields made extreme."""
    kind = draw(st.sampled_from(["whole", "whole", "whole", "mig", "milli"]))
    base = {
        "name": draw(
            st.one_of(
                st.just("fuzz"), st.text(CHARS.filter(lambda c: c != "\x00"), min_size=1, max_size=30).filter(str.strip)
            )
        ),
        "replicas": draw(st.integers(1, 3)),
        "gpus_per_replica": draw(st.sampled_from([1, 2, 4, 8])),
        "priority": draw(st.integers(-5, 5)),
        "command": ["run"],
        "env": draw(
            st.dictionaries(
                st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True),
                SHORT_TEXT.filter(lambda v: "\x00" not in v),
                max_size=2,
            )
        ),
        "preferred_tier": draw(st.sampled_from(["", "node", "cluster"])),
    }
    if kind == "mig":
        base.update(gpus_per_replica=1, mig_profile=draw(st.sampled_from(["1g.10gb", "3g.40gb"])))
    elif kind == "milli":
        base.update(gpus_per_replica=1, gpu_milli=draw(st.integers(1, 999)))
    return common_pb2.JobSpec(**mutated(draw, base, SPEC_EXTREMES))


REQUEST_IDS = st.one_of(
    st.just(""), st.builds(lambda: uuid.uuid4().hex), st.sampled_from(["x" * 128, "x" * 129]), SHORT_TEXT
)


@st.composite
def raw_submit(draw) -> bytes:
    """A SubmitJobRequest whose ints are any 64-bit pattern (an int32 field truncates, a negative int32 takes ten
    bytes). Strings are valid UTF-8 here; test_malformed_messages sends invalid UTF-8."""
    name = draw(st.one_of(st.just(b"fuzz"), SHORT_TEXT.map(lambda t: t.encode())))
    spec = raw_bytes(1, name)
    for number in (2, 3, 4, 5, 12, 13):
        if draw(st.booleans()):
            spec += raw_varint(number, draw(WIRE64))
    spec += raw_bytes(6, draw(st.sampled_from([b"run", b"run\x00", "\u00e9".encode()])))
    if draw(st.booleans()):
        spec += raw_double(14, draw(DOUBLE))
    return raw_bytes(1, spec) + raw_bytes(2, draw(st.sampled_from([b"", b"r" * 129, uuid.uuid4().hex.encode()])))


def _mig_instance():
    return st.builds(agent_pb2.GpuInfo.MigInstance, profile=MIG, start=INT32, size=INT32, uuid=SHORT_TEXT)


@st.composite
def topologies(draw) -> agent_pb2.HostTopology:
    count = draw(st.one_of(st.integers(0, 8), st.sampled_from([16, 64])))
    indices = list(range(count))
    shape = draw(st.sampled_from(["ok", "ok", "shuffled", "duplicate", "negative", "gap", "random"]))
    if shape == "shuffled":
        indices = draw(st.permutations(indices))
    elif shape == "duplicate" and count:
        indices[-1] = 0
    elif shape == "negative" and count:
        indices[0] = -1
    elif shape == "gap" and count:
        indices[-1] = count
    elif shape == "random":
        indices = [draw(INT32) for _ in indices]
    gpus = [
        agent_pb2.GpuInfo(
            index=i,
            uuid=draw(st.one_of(st.builds(lambda: f"GPU-{uuid.uuid4()}"), SHORT_TEXT, st.just("u" * 65))),
            name=draw(st.one_of(st.just("NVIDIA H100 80GB HBM3"), SHORT_TEXT, st.just("n" * 129))),
            memory_mib=draw(st.one_of(st.just(81559), INT64)),
            pci_bus_id=draw(SHORT_TEXT),
            numa_node=draw(st.one_of(st.just(-1), INT32)),
            nic=draw(SHORT_TEXT),
            compute_capability=draw(st.sampled_from(["", "9.0", "x"])),
            mig_mode=draw(UNKNOWN_ENUM),
            mig_instances=draw(st.lists(_mig_instance(), max_size=2)),
        )
        for i in indices
    ]
    nics = draw(
        st.lists(
            st.builds(
                agent_pb2.NicInfo,
                name=SHORT_TEXT,
                device=SHORT_TEXT,
                nearest_gpu=INT32,
                numa_node=INT32,
                pci_bus_id=SHORT_TEXT,
            ),
            max_size=2,
        )
    )
    topo = agent_pb2.HostTopology(
        gpus=gpus,
        nics=nics,
        profile=draw(st.one_of(st.just("lite"), SHORT_TEXT, st.just("p" * 129))),
        fabric_cluster_uuid=draw(st.one_of(st.just(""), SHORT_TEXT, st.just("f" * 300))),
        fabric_clique=draw(st.one_of(st.just(""), SHORT_TEXT)),
    )
    for key, row in draw(
        st.dictionaries(SHORT_TEXT, st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=2), max_size=2)
    ).items():
        topo.matrix[key].cells.update(row)
    return topo


NODE_NAMES = st.one_of(
    st.builds(lambda s: f"fz-{s}", st.text("abcdefghij0123456789._-", min_size=1, max_size=12)),
    st.sampled_from(["", "-a", ".a", "a b", "a\n", "a\x00", "ä", "n" * 253, "n" * 254]),
    SHORT_TEXT,
).filter(lambda n: n not in AGENT_NAMES)
HEALTH = st.builds(
    common_pb2.NodeHealth,
    state=UNKNOWN_ENUM,
    reason=TEXT,
    gpus=st.lists(
        st.builds(common_pb2.GpuHealth, index=INT32, state=UNKNOWN_ENUM, reasons=st.lists(SHORT_TEXT, max_size=2)),
        max_size=2,
    ),
)
EVENTS = st.lists(
    st.builds(
        common_pb2.HealthEvent,
        gpu=INT32,
        severity=UNKNOWN_ENUM,
        kind=st.one_of(st.sampled_from(["xid", "ecc_dbe", "gpu_lost", "recovered"]), TEXT),
        code=INT64,
        reason=TEXT,
        at=DOUBLE,
    ),
    max_size=3,
)


# ---------------------------------------------------------------------------------------------------------------
# The client side: raw unary calls, an oracle per call, ledger snapshots.


class Harness:
    def __init__(self, address: str, db_url: str) -> None:
        self.channel = grpc.insecure_channel(address, options=CLIENT_OPTIONS)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.engine = make_engine(db_url)
        self.calls: dict[str, dict[str, int]] = {}
        self.known: dict[str, int] = {}

    def close(self) -> None:
        self.channel.close()
        self.engine.dispose()

    # -- calls -------------------------------------------------------------------------------------------------

    def unary(self, method: str, payload: bytes, timeout: float = 30.0) -> tuple[grpc.StatusCode, str, bytes]:
        call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", call(payload, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details() or "", b""

    def stream(self, method: str, payload: bytes, expect: int) -> tuple[grpc.StatusCode, str, bytes]:
        """Read up to `expect` messages of a never-ending stream; an open stream that is still answering is OK."""
        call = self.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        responses = call(payload, timeout=0.25 if expect == 0 else 10.0)
        got = 0
        try:
            for _ in responses:
                got += 1
                if got >= expect:
                    responses.cancel()
                    break
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and got >= expect:
                return grpc.StatusCode.OK, "", b""
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and expect == 0:
                return grpc.StatusCode.OK, "", b""  # open and quiet: nothing to send yet
            return err.code(), err.details() or "", b""
        return grpc.StatusCode.OK, "", b""

    def check_health(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    # -- ledger ------------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, tuple[int, str]]:
        out = {}
        with self.engine.connect() as conn:
            for table in TABLES:
                result = conn.execute(text(f'SELECT * FROM "{table}"'))
                keep = [i for i, c in enumerate(result.keys()) if c not in VOLATILE.get(table, ())]
                rows = sorted(repr(tuple(row[i] for i in keep)) for row in result)
                out[table] = (len(rows), hashlib.sha256("\n".join(rows).encode("utf-8", "surrogatepass")).hexdigest())
        return out

    def settle(self, timeout: float = 30.0, quiet_s: float = 1.2) -> dict[str, tuple[int, str]]:
        """Wait until the background (placement, agents' reports, sweeps, acks) stops moving the ledger.

        Settled means the real agents have acked every revision sent to them, and nothing moved for `quiet_s`:
        longer than a heartbeat interval, so an agent's next report (an ack, a rank's exit) is not still due.
        """
        end = time.monotonic() + timeout
        last, quiet_since = self.snapshot(), time.monotonic()
        while time.monotonic() - quiet_since < quiet_s:
            if time.monotonic() > end:
                raise AssertionError(
                    f"the ledger did not stay still for {quiet_s}s within {timeout}s (agents acked, "
                    f"nothing moving); last snapshot: {last}"
                )
            time.sleep(0.1)
            now = self.snapshot()
            if now != last or not self.agents_caught_up():
                last, quiet_since = now, time.monotonic()
        return last

    def agents_caught_up(self) -> bool:
        with self.engine.connect() as conn:
            behind = conn.execute(
                text("SELECT count(*) FROM nodes WHERE acked_revision < revision AND name IN :names").bindparams(
                    bindparam("names", expanding=True)
                ),
                {"names": list(AGENT_NAMES)},
            ).scalar_one()
        return behind == 0

    def invariants(self) -> None:
        with self.engine.connect() as conn:
            doubled = conn.execute(
                text(
                    "SELECT gpu_id, unit, count(*) FROM allocations WHERE released_at IS NULL AND kind <> 'share' "
                    "GROUP BY gpu_id, unit HAVING count(*) > 1"
                )
            ).all()
            assert not doubled, f"GPU double-booked: {doubled}"
            over = conn.execute(
                text(
                    "SELECT gpu_id, sum(gpu_milli) FROM allocations WHERE released_at IS NULL AND kind = 'share' "
                    "GROUP BY gpu_id HAVING sum(gpu_milli) > 1000"
                )
            ).all()
            assert not over, f"GPU shared beyond 1000 milli: {over}"
            idle = conn.execute(
                text(
                    "SELECT a.job_id, j.state FROM allocations a JOIN jobs j ON j.id = a.job_id "
                    "WHERE a.released_at IS NULL AND j.state <> 'RUNNING'"
                )
            ).all()
            assert not idle, f"active allocations of jobs that are not RUNNING: {idle[:5]}"
            torn = conn.execute(
                text(
                    "SELECT c.id, c.world_size, count(s.rank) FROM checkpoints c LEFT JOIN checkpoint_shards s "
                    "ON s.checkpoint_id = c.id WHERE c.state = 'COMMITTED' GROUP BY c.id, c.world_size "
                    "HAVING count(s.rank) <> c.world_size"
                )
            ).all()
            assert not torn, f"committed checkpoints without every shard: {torn}"
            ranks = conn.execute(
                text(
                    "SELECT s.checkpoint_id, s.rank FROM checkpoint_shards s JOIN checkpoints c ON c.id = s.checkpoint_id "
                    "WHERE s.rank < 0 OR s.rank >= c.world_size"
                )
            ).all()
            assert not ranks, f"shards outside 0..world_size-1: {ranks}"
            # No client number is believed: a commit of the current attempt has the ledger's world size.
            for job_id, attempt, world, replicas, gpus, procs in conn.execute(
                text(
                    "SELECT c.job_id, c.attempt, c.world_size, j.replicas, j.gpus_per_replica, j.procs_per_replica "
                    "FROM checkpoints c JOIN jobs j ON j.id = c.job_id AND j.attempt = c.attempt "
                    "WHERE c.state = 'COMMITTED'"
                )
            ).all():
                want = ledger_world_size(conn, job_id, attempt, replicas, gpus, procs)
                assert world == want, (
                    f"checkpoint of {job_id} attempt {attempt} committed with {world} ranks, the ledger has {want}"
                )

    # -- the oracle --------------------------------------------------------------------------------------------

    def check(
        self, method: str, payload: bytes, shown: str, *, expect_stream: int | None = None, check_state: bool = True
    ) -> tuple[grpc.StatusCode, bytes]:
        def once():
            if expect_stream is None:
                return self.unary(method, payload)
            return self.stream(method, payload, expect_stream)

        before = self.snapshot() if check_state else None
        code, details, reply = once()
        self._judge(method, code, details, shown)
        if check_state and code != grpc.StatusCode.OK:
            after = self.snapshot()
            if after != before:
                # Something moved: the request, or the background meanwhile. Ask again on a settled ledger.
                before = self.settle()
                code, details, reply = once()
                self._judge(method, code, details, shown)
                if code != grpc.StatusCode.OK:
                    after = self.snapshot()
                    changed = {t: (before[t], after[t]) for t in TABLES if before[t] != after[t]}
                    assert not changed, (
                        f"{method} was refused ({code.name}: {details[:200]}) yet changed {changed} for {shown}"
                    )
        self.check_health()
        self.invariants()
        stats = self.calls.setdefault(method.rsplit("/", 1)[1], {})
        stats[code.name] = stats.get(code.name, 0) + 1
        return code, reply

    def _judge(self, method: str, code: grpc.StatusCode, details: str, shown: str) -> None:
        bug = known_bug(method, code, details)
        if bug:
            self.known[bug] = self.known.get(bug, 0) + 1
            return
        # The server's answer must reach the client: details too big for the trailers come back as
        # RESOURCE_EXHAUSTED from the client's own transport, which says nothing about the request.
        assert "metadata size exceeds" not in details, (
            f"{method}: the error could not be delivered ({details[:200]!r}) for {shown}"
        )
        assert code in ALLOWED, f"{method} answered {code.name}: {details[:300]!r} for {shown}"
        for leak in LEAKS:
            assert leak not in details, f"{method} leaked a traceback: {details[:500]!r} for {shown}"


# Known product bugs (each has a strict xfail test below that reproduces it): the fuzz loops count their hits
# instead of failing, so they keep looking for new ones. Remove an entry when its bug is fixed.
KNOWN_BUGS: dict[str, object] = {}


def known_bug(method: str, code: grpc.StatusCode, details: str) -> str | None:
    for name, matches in KNOWN_BUGS.items():
        if matches(method, code, details):
            return name
    return None


def short(message) -> str:
    shown = repr(message) if isinstance(message, bytes) else str(message)
    return shown if len(shown) < 600 else f"{shown[:500]}...({len(shown)} chars)"


def send(h: Harness, service: str, method: str, request, **kw) -> tuple[grpc.StatusCode, bytes]:
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    return h.check(f"/{service}/{method}", payload, f"{method}({short(request)})", **kw)


def report(h: Harness, label: str) -> None:
    lines = [f"{label} fuzz calls:"] + [f"  {m}: {c}" for m, c in sorted(h.calls.items())]
    lines += [f"  known bug {bug}: hit {n} times" for bug, n in sorted(h.known.items())]
    print("\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# The scheduler: job API and node API


def _scheduler_settings(db_url: str) -> SchedulerSettings:
    # Long leases and launch deadlines: nodes the fuzz registers never heartbeat, and must not be declared lost
    # (and their gangs requeued) while the loop runs. The production preemption policy keeps running gangs put.
    return SchedulerSettings(
        db_url=db_url,
        listen="127.0.0.1:0",
        lease_timeout=600.0,
        launch_timeout=600.0,
        heartbeat_interval=1.0,
        poll_interval=0.5,
    )


def _agents(address: str) -> list[LiteAgent]:
    return [LiteAgent(address, AGENT_NAMES[0], gpus=8), LiteAgent(address, AGENT_NAMES[1], gpus=4)]


class SchedulerFuzz:
    def __init__(self, h: Harness) -> None:
        self.h = h
        self.jobs: list[str] = []
        self.nodes: list[str] = list(AGENT_NAMES)
        self.fuzz_nodes: list[str] = []

    def submit(self, request) -> None:
        code, reply = send(self.h, SCHEDULER, "SubmitJob", request)
        if code == grpc.StatusCode.OK:
            job = common_pb2.Job.FromString(reply)
            assert (
                len(job.id) == 12
                and job.state in (common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_RUNNING)
                or job.id in self.jobs
            ), f"a submit answered {job}"
            if job.id not in self.jobs:
                self.jobs.append(job.id)

    def step(self, data) -> None:
        h, jobs = self.h, self.jobs
        what = data.draw(
            st.sampled_from(
                ["submit"] * 6
                + [
                    "raw_submit",
                    "get",
                    "get",
                    "cancel",
                    "list",
                    "list",
                    "watch",
                    "nodes",
                    "checkpoint",
                    "goodput",
                    "register",
                    "register",
                    "heartbeat",
                    "ack",
                    "rank",
                    "rank",
                    "stream",
                ]
            ),
            label="rpc",
        )
        if what == "submit":
            spec = data.draw(job_specs(), label="spec")
            self.submit(scheduler_pb2.SubmitJobRequest(spec=spec, request_id=data.draw(REQUEST_IDS)))
        elif what == "raw_submit":
            self.submit(data.draw(raw_submit(), label="raw"))
        elif what == "get":
            send(h, SCHEDULER, "GetJob", scheduler_pb2.GetJobRequest(job_id=data.draw(job_ids(jobs))))
        elif what == "cancel":
            send(h, SCHEDULER, "CancelJob", scheduler_pb2.CancelJobRequest(job_id=data.draw(job_ids(jobs))))
        elif what == "list":
            states = data.draw(st.lists(st.one_of(st.integers(0, 7), UNKNOWN_ENUM), max_size=4))
            send(h, SCHEDULER, "ListJobs", scheduler_pb2.ListJobsRequest(states=states, limit=data.draw(INT32)))
        elif what == "watch":
            ids = data.draw(st.lists(job_ids(jobs), max_size=3))
            known = set(ids) <= set(jobs)
            send(
                h,
                SCHEDULER,
                "WatchJobs",
                scheduler_pb2.WatchJobsRequest(job_ids=ids),
                expect_stream=len(set(ids)) if known else 0,
            )
        elif what == "nodes":
            send(h, SCHEDULER, "ListNodes", scheduler_pb2.ListNodesRequest())
        elif what == "checkpoint":
            send(
                h,
                SCHEDULER,
                "CheckpointJob",
                scheduler_pb2.CheckpointJobRequest(job_id=data.draw(job_ids(jobs)), reason=data.draw(TEXT)),
            )
        elif what == "goodput":
            send(
                h,
                SCHEDULER,
                "GetGoodput",
                scheduler_pb2.GetGoodputRequest(since=data.draw(DOUBLE), limit=data.draw(INT32)),
            )
        elif what == "register":
            name = data.draw(NODE_NAMES, label="node")
            request = agent_pb2.RegisterNodeRequest(
                node_name=name,
                topology=data.draw(topologies()),
                address=data.draw(st.one_of(st.just("127.0.0.1"), SHORT_TEXT, st.just("a" * 256))),
                agent_instance=data.draw(st.one_of(st.builds(lambda: uuid.uuid4().hex), SHORT_TEXT, st.just("i" * 65))),
            )
            code, _ = send(h, NODES, "RegisterNode", request)
            if code == grpc.StatusCode.OK and name not in self.nodes:
                self.nodes.append(name)
                self.fuzz_nodes.append(name)
        elif what == "heartbeat":
            request = agent_pb2.HeartbeatRequest(
                node_name=data.draw(st.one_of(one_of_list(self.fuzz_nodes, "fz-none"), NODE_NAMES)),
                agent_instance=data.draw(SHORT_TEXT),
                events=data.draw(EVENTS),
                draining=data.draw(st.booleans()),
            )
            if data.draw(st.booleans()):
                request.health.CopyFrom(data.draw(HEALTH))
            send(h, NODES, "Heartbeat", request)
        elif what == "ack":
            send(
                h,
                NODES,
                "AckAssignments",
                agent_pb2.AckAssignmentsRequest(
                    node_name=data.draw(st.one_of(one_of_list(self.nodes, AGENT_NAMES[0]), NODE_NAMES)),
                    revision=data.draw(INT64),
                ),
            )
        elif what == "rank":
            send(
                h,
                NODES,
                "ReportRankStatus",
                agent_pb2.ReportRankStatusRequest(
                    node_name=data.draw(st.one_of(one_of_list(self.nodes, AGENT_NAMES[0]), NODE_NAMES)),
                    job_id=data.draw(job_ids(jobs)),
                    attempt=data.draw(SMALL),
                    rank=data.draw(SMALL),
                    state=data.draw(st.one_of(st.integers(0, 6), UNKNOWN_ENUM)),
                    exit_code=data.draw(INT32),
                    message=data.draw(TEXT),
                    pid=data.draw(INT32),
                ),
            )
        elif what == "stream":
            name = data.draw(st.one_of(one_of_list(self.fuzz_nodes, "fz-none"), NODE_NAMES))
            send(
                h,
                NODES,
                "StreamAssignments",
                agent_pb2.StreamAssignmentsRequest(node_name=name, after_revision=data.draw(INT64)),
                expect_stream=0,
            )


def _scheduler_loop(address: str, db_url: str, examples: int) -> None:
    h = Harness(address, db_url)
    fuzz = SchedulerFuzz(h)
    try:
        fuzz.submit(
            scheduler_pb2.SubmitJobRequest(
                spec=common_pb2.JobSpec(name="seed", replicas=1, gpus_per_replica=2, command=["run"])
            )
        )

        @fuzz_settings(examples)
        @given(st.data())
        def run(data) -> None:
            fuzz.step(data)

        run()
        h.settle()
        h.invariants()
        report(h, "scheduler")
    finally:
        h.close()


@pytest.mark.slow
async def test_scheduler_api_survives_fuzzing(db_url, service_logs):
    examples = 400 if db_url.startswith("sqlite") else 150
    async with LiteCluster(_scheduler_settings(db_url), _agents) as cluster:
        await asyncio.to_thread(_scheduler_loop, cluster.scheduler.address, db_url, examples)


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint coordinator

RUNNING_JOB = "job-fz-running"
PENDING_JOB = "job-fz-pending"


def _coordinator_jobs(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        for job_id, state, attempt in ((RUNNING_JOB, "RUNNING", 1), (PENDING_JOB, "PENDING", 0)):
            conn.execute(
                insert(Job).values(
                    id=job_id,
                    name=job_id,
                    state=state,
                    replicas=2,
                    gpus_per_replica=1,
                    command=["train"],
                    attempt=attempt,
                    submitted_at=time.time(),
                )
            )
    engine.dispose()


CKPT_JOBS = st.one_of(st.just(RUNNING_JOB), JOB_ID_SHAPES, st.just(PENDING_JOB))
ATTEMPTS = st.one_of(st.sampled_from([0, 2]), INT32)
STEPS = st.one_of(st.integers(-3, 5), INT64)
WORLD = st.one_of(st.sampled_from([0, -1, 1 << 20, (1 << 20) + 1]), INT32)
DEADLINES = st.one_of(st.sampled_from([0.0, 30.0, 604800.0]), DOUBLE)
URIS = st.one_of(st.builds(lambda n: f"file:///ckpt/{n}", st.integers(0, 99)), TEXT)
CHECKSUMS = st.one_of(
    st.builds(lambda n: f"sha256:{n:064x}", st.integers(0, 99)),
    st.sampled_from(["", "c" * 128, "c" * 129]),
    SHORT_TEXT,
    huge(),
)
TARGET_EXTREMES = {
    "job_id": CKPT_JOBS,
    "attempt": ATTEMPTS,
    "step": STEPS,
    "world_size": WORLD,
    "deadline_s": DEADLINES,
}
SHARD_EXTREMES = {"rank": INT32, "uri": URIS, "size_bytes": INT64, "checksum": CHECKSUMS}


def ckpt_target(draw, **skip) -> dict:
    """A valid (job, attempt, step, world_size, deadline_s) of the running job, with up to two extreme fields."""
    base = {
        "job_id": RUNNING_JOB,
        "attempt": 1,
        "step": draw(st.integers(0, 5)),  # the job has 2 ranks
        "world_size": draw(st.sampled_from([0, 2, 2, 1, 3])),
        "deadline_s": draw(st.sampled_from([0.0, 30.0, 600.0])),
    }
    fields = mutated(draw, base, TARGET_EXTREMES, most=2)
    return {k: v for k, v in fields.items() if k not in skip}


def shard(draw, rank: int) -> checkpoint_pb2.Shard:
    base = {
        "rank": rank,
        "uri": f"file:///ckpt/{rank}-{draw(st.integers(0, 3))}",
        "size_bytes": draw(st.integers(0, 10**9)),
        "checksum": f"sha256:{draw(st.integers(0, 3)):064x}",
    }
    return checkpoint_pb2.Shard(**mutated(draw, base, SHARD_EXTREMES, most=2))


@st.composite
def raw_report(draw) -> bytes:
    """A ReportShardRequest with any 64-bit pattern in its int fields (valid UTF-8 strings)."""
    shard = raw_varint(1, draw(WIRE64)) + raw_bytes(2, draw(st.sampled_from([b"file:///x", b""])))
    shard += raw_varint(3, draw(WIRE64)) + raw_bytes(4, b"sha256:0")
    body = raw_bytes(1, draw(st.sampled_from([RUNNING_JOB.encode(), PENDING_JOB.encode(), b"job\x00"])))
    body += raw_varint(2, draw(st.sampled_from([1, 2**32 + 1, 2**64 - 1])))
    body += raw_varint(3, draw(WIRE64)) + raw_varint(4, draw(st.sampled_from([2, 2**32 + 2, 2**63])))
    return body + raw_bytes(5, shard) + raw_double(6, draw(DOUBLE))


def _coordinator_step(h: Harness, data) -> None:
    what = data.draw(
        st.sampled_from(
            [
                "begin",
                "begin",
                "report",
                "report",
                "report",
                "report",
                "raw",
                "record",
                "latest",
                "request",
                "get_request",
                "policy",
                "list",
                "restore",
                "get_restore",
            ]
        ),
        label="rpc",
    )
    draw = data.draw
    if what == "begin":
        send(h, COORDINATOR, "BeginCheckpoint", checkpoint_pb2.BeginCheckpointRequest(**ckpt_target(draw)))
    elif what == "report":
        request = checkpoint_pb2.ReportShardRequest(**ckpt_target(draw))
        if draw(st.integers(0, 9)):  # the shard is required: leave it out sometimes
            request.shard.CopyFrom(shard(draw, draw(st.integers(0, max(0, min(request.world_size, 4) - 1)))))
        send(h, COORDINATOR, "ReportShard", request)
    elif what == "raw":
        send(h, COORDINATOR, "ReportShard", draw(raw_report()))
    elif what == "record":
        target = ckpt_target(draw, world_size=True, deadline_s=True)
        listed = [shard(draw, r) for r in range(draw(st.integers(0, 4)))]
        send(h, COORDINATOR, "RecordCheckpoint", checkpoint_pb2.RecordCheckpointRequest(**target, shards=listed))
    elif what == "latest":
        send(h, COORDINATOR, "GetLatestCheckpoint", checkpoint_pb2.GetLatestCheckpointRequest(job_id=draw(CKPT_JOBS)))
    elif what == "request":
        send(
            h,
            COORDINATOR,
            "RequestCheckpoint",
            checkpoint_pb2.RequestCheckpointRequest(
                job_id=draw(CKPT_JOBS), reason=draw(st.one_of(st.just("user"), TEXT))
            ),
        )
    elif what == "get_request":
        send(
            h,
            COORDINATOR,
            "GetCheckpointRequest",
            checkpoint_pb2.GetCheckpointRequestRequest(
                job_id=draw(CKPT_JOBS), attempt=draw(st.one_of(st.just(1), ATTEMPTS))
            ),
        )
    elif what == "policy":
        send(h, COORDINATOR, "GetCheckpointPolicy", checkpoint_pb2.GetCheckpointPolicyRequest(job_id=draw(CKPT_JOBS)))
    elif what == "list":
        send(
            h,
            COORDINATOR,
            "ListCheckpoints",
            checkpoint_pb2.ListCheckpointsRequest(
                job_id=draw(CKPT_JOBS),
                page_size=draw(st.one_of(st.sampled_from([0, 1, 1000, 1001]), INT32)),
                page_token=draw(st.one_of(st.sampled_from(["", "1", "999999999", "-1"]), SHORT_TEXT)),
            ),
        )
    elif what == "restore":
        ids = st.one_of(st.just(""), SHORT_TEXT, st.builds(lambda n: f"{n:016x}", st.integers(0, 3)))
        send(
            h,
            COORDINATOR,
            "ReportRestore",
            checkpoint_pb2.ReportRestoreRequest(
                job_id=draw(CKPT_JOBS),
                attempt=draw(st.one_of(st.just(1), ATTEMPTS)),
                rank=draw(st.one_of(st.integers(0, 2), INT32)),
                checkpoint_id=draw(ids),
                skipped=[
                    checkpoint_pb2.SkippedCheckpoint(
                        checkpoint_id=draw(ids),
                        reason=draw(st.one_of(st.just("sha256 mismatch in rank 0's shard"), TEXT)),
                    )
                    for _ in range(draw(st.integers(0, 2)))
                ],
            ),
        )
    elif what == "get_restore":
        request = checkpoint_pb2.GetRestoreRequest(job_id=draw(CKPT_JOBS))
        if draw(st.booleans()):
            request.attempt = draw(st.one_of(st.just(1), ATTEMPTS))
        send(h, COORDINATOR, "GetRestore", request)


def _coordinator_loop(address: str, db_url: str, examples: int) -> None:
    h = Harness(address, db_url)
    try:

        @fuzz_settings(examples)
        @given(st.data())
        def run(data) -> None:
            _coordinator_step(h, data)

        run()
        report(h, "coordinator")
    finally:
        h.close()


@pytest.mark.slow
async def test_checkpoint_coordinator_survives_fuzzing(db_url, service_logs):
    _coordinator_jobs(db_url)
    server = await serve_coordinator(db_url, "127.0.0.1:0", sweep_interval=0.2)
    try:
        examples = 400 if db_url.startswith("sqlite") else 150
        await asyncio.to_thread(_coordinator_loop, server.address, db_url, examples)
    finally:
        await server.stop(0)


# ---------------------------------------------------------------------------------------------------------------
# Oversized and malformed messages, against both servers


OVERSIZED = MAX_MESSAGE_BYTES + (1 << 20)


def _wire_loop(sched: str, coord: str, db_url: str, examples: int) -> None:
    hs, hc = Harness(sched, db_url), Harness(coord, db_url)
    try:
        big = "x" * OVERSIZED
        for h, service, method, request in (
            (
                hs,
                SCHEDULER,
                "SubmitJob",
                scheduler_pb2.SubmitJobRequest(
                    spec=common_pb2.JobSpec(name=big, replicas=1, gpus_per_replica=1, command=["run"])
                ),
            ),
            (hs, SCHEDULER, "GetJob", scheduler_pb2.GetJobRequest(job_id=big)),
            (hs, NODES, "RegisterNode", agent_pb2.RegisterNodeRequest(node_name="fz-big", address=big)),
            (
                hc,
                COORDINATOR,
                "ReportShard",
                checkpoint_pb2.ReportShardRequest(
                    job_id=RUNNING_JOB, attempt=1, world_size=1, shard=checkpoint_pb2.Shard(uri=big, checksum="c")
                ),
            ),
        ):
            code, _ = send(h, service, method, request)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method} of {OVERSIZED} bytes answered {code.name}"

        methods = [
            (hs, f"/{SCHEDULER}/{m}")
            for m in ("SubmitJob", "GetJob", "ListJobs", "CancelJob", "CheckpointJob", "GetGoodput")
        ]
        methods += [(hs, f"/{NODES}/{m}") for m in ("RegisterNode", "Heartbeat", "AckAssignments", "ReportRankStatus")]
        methods += [
            (hc, f"/{COORDINATOR}/{m}")
            for m in (
                "BeginCheckpoint",
                "ReportShard",
                "RecordCheckpoint",
                "GetLatestCheckpoint",
                "GetCheckpointPolicy",
                "ListCheckpoints",
                "ReportRestore",
                "GetRestore",
            )
        ]

        @fuzz_settings(examples)
        @given(
            st.sampled_from(methods),
            st.one_of(
                st.binary(max_size=64),
                st.sampled_from(
                    [b"\xff", b"\x0a\xff", b"\x0a\x05ab", b"\x08", b"\x12\x02\xff\xfe", b"\x0b", b"\x80" * 11]
                ),
            ),
        )
        def garbage(target, payload) -> None:
            h, method = target
            h.check(method, payload, f"{method}({payload!r})")

        garbage()
        report(hs, "scheduler wire")
        report(hc, "coordinator wire")
    finally:
        hs.close()
        hc.close()


@pytest.mark.slow
async def test_oversized_and_malformed_messages(db_url, service_logs):
    _coordinator_jobs(db_url)
    coordinator = await serve_coordinator(db_url, "127.0.0.1:0", sweep_interval=0)
    try:
        async with LiteCluster(_scheduler_settings(db_url), _agents) as cluster:
            await asyncio.to_thread(
                _wire_loop,
                cluster.scheduler.address,
                coordinator.address,
                db_url,
                80 if db_url.startswith("sqlite") else 30,
            )
    finally:
        await coordinator.stop(0)


# ---------------------------------------------------------------------------------------------------------------
# The bugs the fuzzing found, reproduced one by one (strict xfail: each turns red once fixed, to drop its
# KNOWN_BUGS entry and the mark).


def _one_call(address: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address, options=CLIENT_OPTIONS) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=30)
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as err:
            return err.code(), err.details() or ""


async def test_malformed_request_is_invalid_argument(sqlite_url, service_logs):
    _coordinator_jobs(sqlite_url)
    server = await serve_coordinator(sqlite_url, "127.0.0.1:0", sweep_interval=0)
    try:
        for payload in (b"\n\xff", raw_bytes(1, b"\xff\xfe")):  # a truncated field; invalid UTF-8 in job_id
            code, details = await asyncio.to_thread(
                _one_call, server.address, f"/{COORDINATOR}/GetLatestCheckpoint", payload
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    finally:
        await server.stop(0)


async def test_coordinator_error_for_a_huge_job_id_is_not_found(sqlite_url, service_logs):
    _coordinator_jobs(sqlite_url)
    server = await serve_coordinator(sqlite_url, "127.0.0.1:0", sweep_interval=0)
    try:
        for method, request in (
            ("GetLatestCheckpoint", checkpoint_pb2.GetLatestCheckpointRequest(job_id="x" * 20_000)),
            ("GetCheckpointPolicy", checkpoint_pb2.GetCheckpointPolicyRequest(job_id="x" * 20_000)),
            ("BeginCheckpoint", checkpoint_pb2.BeginCheckpointRequest(job_id="x" * 20_000, world_size=1)),
        ):
            code, details = await asyncio.to_thread(
                _one_call, server.address, f"/{COORDINATOR}/{method}", request.SerializeToString()
            )
            assert code == grpc.StatusCode.NOT_FOUND and len(details) < 1000, (method, code, details[:200])
    finally:
        await server.stop(0)


def _register(topology=None, **fields) -> agent_pb2.RegisterNodeRequest:
    topology = topology or agent_pb2.HostTopology(gpus=[agent_pb2.GpuInfo(index=0, uuid="GPU-0", name="H100")])
    return agent_pb2.RegisterNodeRequest(
        **{"node_name": "fz-pg", "address": "127.0.0.1", "agent_instance": "i", **fields}, topology=topology
    )


PG_REFUSED = [
    (NODES, "RegisterNode", _register(address="a\x00b")),
    (NODES, "RegisterNode", _register(address="a" * 256)),
    (NODES, "RegisterNode", _register(agent_instance="i" * 65)),
    (NODES, "RegisterNode", _register(agent_pb2.HostTopology(gpus=[agent_pb2.GpuInfo(index=0, uuid="u" * 65)]))),
    (NODES, "RegisterNode", _register(agent_pb2.HostTopology(gpus=[agent_pb2.GpuInfo(index=0, name="n" * 129)]))),
    (NODES, "RegisterNode", _register(agent_pb2.HostTopology(gpus=[agent_pb2.GpuInfo(index=0, name="a\x00")]))),
    (NODES, "RegisterNode", _register(agent_pb2.HostTopology(profile="p" * 129))),
    (
        SCHEDULER,
        "SubmitJob",
        scheduler_pb2.SubmitJobRequest(
            spec=common_pb2.JobSpec(name="a", replicas=1, gpus_per_replica=1, command=["run"]), request_id="r\x00"
        ),
    ),
    (
        NODES,
        "ReportRankStatus",
        agent_pb2.ReportRankStatusRequest(node_name=AGENT_NAMES[0], job_id="a\x00", attempt=1, rank=0, state=2),
    ),
]


@pytest.mark.parametrize("case", range(len(PG_REFUSED)), ids=[f"{m}-{i}" for i, (_, m, _) in enumerate(PG_REFUSED)])
async def test_postgres_refusals_are_invalid_argument(pg_url, service_logs, case):
    service, method, request = PG_REFUSED[case]
    async with LiteCluster(_scheduler_settings(pg_url), _agents) as cluster:
        code, details = await asyncio.to_thread(
            _one_call, cluster.scheduler.address, f"/{service}/{method}", request.SerializeToString()
        )
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (code, details)
