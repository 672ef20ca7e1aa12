"""The rank-side checkpoint client: restore, save and should_checkpoint for one rank of a gang."""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from phalanx.api.v1 import checkpoint_pb2 as pb
from phalanx.api.v1 import checkpoint_pb2_grpc
from phalanx.core.restore_account import restore_message

from . import state_format, torch_dcp
from .errors import CheckpointConfigError, CheckpointError, CheckpointPickleError, CheckpointRejectedError
from .store import CheckpointStore, LocalStore, sha256_checksum

log = logging.getLogger("phalanx.train")

# Set by the scheduler for every rank (services/scheduler/transitions.py launches()).
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_MIN_REPLICAS = "PHALANX_MIN_REPLICAS"
ENV_MAX_REPLICAS = "PHALANX_MAX_REPLICAS"
ENV_JOB_ID = "PHALANX_JOB_ID"
ENV_ATTEMPT = "PHALANX_ATTEMPT"
# Defined here; the scheduler/agent will set them (not wired yet).
ENV_ADDR = "PHALANX_CHECKPOINT_ADDR"  # coordinator host:port
ENV_DIR = "PHALANX_CHECKPOINT_DIR"  # root of the LocalStore
# Policy, set by the job's env.
ENV_EVERY = "PHALANX_CHECKPOINT_EVERY"  # every N steps (0/unset: off)
ENV_INTERVAL = "PHALANX_CHECKPOINT_INTERVAL_S"  # every S seconds since the last save (0/unset: off)
# When neither of those is set: "auto" (default) checkpoints every interval_s the coordinator suggests (the
# Young/Daly interval, docs/design.md "Checkpoint interval policy"); "off" does not.
ENV_POLICY = "PHALANX_CHECKPOINT_POLICY"
ENV_POLL = "PHALANX_CHECKPOINT_POLL_S"  # how often to ask the coordinator for a request (default 10)
ENV_DEADLINE = "PHALANX_CHECKPOINT_DEADLINE_S"  # deadline of a checkpoint this rank begins (0: coordinator default)

DEFAULT_POLL_S = 10.0
POLICY_AUTO = "auto"
POLICY_OFF = "off"
# UNAVAILABLE is retried 4 times over about 5 s (0.4, 0.8, 1.6, 2 s apart, +-20%), by gRPC's retry policy on the
# channel (phalanx.client.open_channel(retries=...)), read when a Checkpointer opens its channel: a coordinator
# restart, or a connection still in gRPC's reconnect backoff after one, must not fail a rank's save. 4 is gRPC's
# cap (5 attempts; more is clamped). The backoffs are shortened to take at most half of the call's timeout.
RETRIES = 4
RETRY_BACKOFF = (0.4, 2.0)  # initial, max seconds (doubling)
# restore(verify=...): "gang" checks every rank's shard of a checkpoint (so every rank that sees the same shared
# store picks the same step), "rank" only this rank's own.
VERIFY_GANG = "gang"
VERIFY_RANK = "rank"
LIST_PAGE = 100
MAX_REASON = 1000  # the coordinator's limit on a skipped checkpoint's reason
INTERVAL_REASON = "interval"  # the reason of the request a rank's time policy sends (RequestCheckpoint)
# Where a rank stands in the step agreement for the outstanding request (should_checkpoint).
_IDLE = "idle"  # no request (or an older coordinator's, which is acted on at once)
_REPORTING = "reporting"  # a request whose step is undecided: report the step at every call
_HOLDING = "holding"  # the agreed step is known: checkpoint at it


@dataclass(frozen=True)
class SaveResult:
    step: int
    uri: str
    checksum: str
    size_bytes: int
    committed: bool  # True when this report was the last one and the checkpoint committed
    checkpoint_id: str


@dataclass(frozen=True)
class SkippedCheckpoint:
    checkpoint_id: str
    step: int
    reason: str  # e.g. "sha256 mismatch in rank 2's shard"


@dataclass(frozen=True)
class RestoreResult:
    """What `restore()` did (`Checkpointer.last_restore`): the step restored (-1: none, start from 0), the newer
    committed checkpoints it skipped and why, newest first, and the one-line account also shown by the
    coordinator's GetRestore."""

    step: int
    checkpoint_id: str
    skipped: tuple[SkippedCheckpoint, ...]
    message: str

    @property
    def fell_back(self) -> bool:
        return bool(self.skipped)


def _missing(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, (FileNotFoundError, KeyError)):
            return True
        exc = exc.__cause__
    return False


def _require(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise CheckpointConfigError(f"environment variable {name} is not set (the Phalanx agent sets it)")
    return value


def _int(env: Mapping[str, str], name: str, *, default: int | None = None, minimum: int = 0) -> int:
    raw = env.get(name, "")
    if raw == "" and default is not None:
        return default
    try:
        value = int(_require(env, name))
    except ValueError:
        raise CheckpointConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise CheckpointConfigError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CheckpointConfigError(f"environment variable {name}={raw!r} is not a number") from None
    if not value >= 0:
        raise CheckpointConfigError(f"environment variable {name}={raw!r} must be >= 0")
    return value


class Checkpointer:
    """One rank's view of its gang's checkpoints, configured from the environment (default `os.environ`)."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        store: CheckpointStore | None = None,
        *,
        timeout: float = 30.0,
        channel: grpc.Channel | None = None,
    ) -> None:
        """`channel`: an open channel to the coordinator to use (shared, e.g. by many Checkpointers of one
        process) instead of opening one to PHALANX_CHECKPOINT_ADDR; close() leaves it open. Retries of UNAVAILABLE
        are that channel's own retry policy (the one opened here has :data:`RETRIES`; for the same on a shared
        channel, open it with ``phalanx.client.open_channel(addr, retries=RETRIES,
        retry_backoff=RETRY_BACKOFF, retry_budget=timeout)``)."""
        env = os.environ if env is None else env
        self.job_id = _require(env, ENV_JOB_ID)
        self.attempt = _int(env, ENV_ATTEMPT)
        self.world_size = _int(env, ENV_WORLD_SIZE, minimum=1)
        self.rank = _int(env, ENV_RANK)
        # An elastic gang (phalanx submit --replicas MIN:MAX) restarts at another world size: see restore.
        self.elastic = elastic_range(env)
        if self.rank >= self.world_size:
            raise CheckpointConfigError(f"{ENV_RANK}={self.rank} must be < {ENV_WORLD_SIZE}={self.world_size}")
        self.addr = _require(env, ENV_ADDR)
        self.store = store if store is not None else LocalStore(_require(env, ENV_DIR))
        self.every = _int(env, ENV_EVERY, default=0)
        self.interval_s = _float(env, ENV_INTERVAL, 0.0)
        self.poll_s = _float(env, ENV_POLL, DEFAULT_POLL_S)
        self.deadline_s = _float(env, ENV_DEADLINE, 0.0)
        self.policy = (env.get(ENV_POLICY, "") or POLICY_AUTO).strip().lower()
        if self.policy not in (POLICY_AUTO, POLICY_OFF):
            raise CheckpointConfigError(
                f"environment variable {ENV_POLICY}={env.get(ENV_POLICY)!r} must be {POLICY_AUTO!r} or {POLICY_OFF!r}"
            )
        # The coordinator's suggested interval, learned from the request polls (0: none yet).
        self.suggested_interval_s = 0.0
        self.timeout = timeout
        # With authentication on, each attempt's ranks get a credential of their own, scoped to the job and the
        # attempt (PHALANX_JOB_TOKEN, from the scheduler); PHALANX_TOKEN (a token the operator passes) is the
        # fallback. With TLS, the PHALANX_TLS_CA/CERT/KEY files.
        self._owns_channel = channel is None
        if channel is None:
            from phalanx.client import open_channel

            tls = None
            if env.get("PHALANX_TLS_CA"):
                from phalanx.client import TLSConfig

                tls = TLSConfig(env["PHALANX_TLS_CA"], env.get("PHALANX_TLS_CERT", ""), env.get("PHALANX_TLS_KEY", ""))
            channel = open_channel(
                self.addr,
                token=(env.get("PHALANX_JOB_TOKEN") or env.get("PHALANX_TOKEN") or "").strip(),
                tls=tls,
                retries=RETRIES,
                retry_backoff=RETRY_BACKOFF,
                retry_budget=timeout,
            )
        self._channel = channel
        self._stub = checkpoint_pb2_grpc.CheckpointCoordinatorStub(self._channel)
        self._last_save = time.monotonic()
        self._poll_slot: int | None = None  # floor(time.time() / poll_s) at the last poll
        self._poll_failed = False
        self._asked_slot: int | None = None  # the poll slot of the time policy's last ask
        self._request: pb.CheckpointRequestState | None = None
        self._agreeing: bool | None = None  # the coordinator agrees the step (None: no answer yet)
        self._target: tuple[float, int] | None = None  # (requested_at, agreed step) of the outstanding request
        self._done: tuple[float, int] | None = None  # the (requested_at, agreed step) this rank saved at
        self._satisfied_request_at = 0.0  # an older coordinator's request this rank saved for
        self.last_restore: RestoreResult | None = None

    # -- plumbing ------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, request):
        """Call the coordinator; the channel's retry policy retries UNAVAILABLE within the timeout (every call here
        is idempotent)."""
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise CheckpointRejectedError(exc.code().name, exc.details() or "") from None

    # -- the API -------------------------------------------------------------------------------------------------
    def restore(
        self, into: Any = None, *, allow_pickle: bool = False, verify: str = VERIFY_GANG
    ) -> tuple[int, Any] | None:
        """`(step, state)` of this rank from the job's newest intact committed checkpoint, or None when there is
        none (start from step 0).

        The coordinator lists the job's complete committed checkpoints newest first (ListCheckpoints); each one's
        shards are checked against the size and sha256 it committed, every rank's (`verify="gang"`, the default:
        on a shared store every rank then reaches the same verdict and restores the same step) or only this
        rank's (`verify="rank"`: cheaper, for stores a rank cannot read the others' shards from; the ranks may
        then disagree). A checkpoint with a missing or damaged shard is skipped for the next older one, with a
        warning in the log; what was restored, and what was skipped and why, is reported to the coordinator
        (ReportRestore, shown by its GetRestore: "restored from step S (step T was damaged: sha256 mismatch in
        rank 2's shard)", or "started from step 0: no intact checkpoint (...)") and kept in `last_restore`.

        A JSON shard (what `save` writes for anything but a torch state_dict) returns its state; `into` is ignored.
        A torch.distributed.checkpoint shard (a torch state_dict that `save` wrote with DCP, see
        phalanx.train.torch_dcp) is loaded in place into `into`, a template state_dict (e.g. `{"model":
        model.state_dict(), ...}`), and returns `(step, into)`; without a template it raises CheckpointError.
        Either way, use the returned state. `into` may also be a function that returns the template, called only
        when a DCP checkpoint is loaded: building a template can change what it is built from
        (`torch.distributed.checkpoint.state_dict.get_state_dict` creates an empty optimizer's state by taking a
        step with learning rate 0, which advances Adam's step count), so a run that finds no checkpoint should not
        build one.

        A pickle shard (written by an older phalanx.train) is refused with CheckpointPickleError: unpickling bytes
        from storage can run arbitrary code. Pass `allow_pickle=True` to load one from a store you trust.
        A checkpoint of another world size raises CheckpointError (no resharding), except in an elastic gang
        (PHALANX_MIN_REPLICAS is set: it grew or shrank since), whose data-parallel ranks hold the same state: rank R
        then restores the shard of rank R modulo the checkpoint's world size (a torch DCP checkpoint reshards into
        the template by itself).
        """
        if verify not in (VERIFY_GANG, VERIFY_RANK):
            raise CheckpointError(f"restore(verify={verify!r}): use {VERIFY_GANG!r} or {VERIFY_RANK!r}")
        skipped: list[SkippedCheckpoint] = []
        for ckpt in self._restore_points():
            mine = self.rank
            if len(ckpt.shards) != self.world_size:
                if self.elastic is None:
                    raise CheckpointError(
                        f"checkpoint {ckpt.id} (step {ckpt.step}) has {len(ckpt.shards)} shards but this gang has "
                        f"world size {self.world_size}; resharding is not supported"
                    )
                mine = self.rank % len(ckpt.shards)  # elastic: the data-parallel ranks' states are the same
            shard = next((s for s in ckpt.shards if s.rank == mine), None)
            if shard is None:
                raise CheckpointError(f"checkpoint {ckpt.id} (step {ckpt.step}) has no shard for rank {mine}")
            checked = sorted(ckpt.shards, key=lambda s: s.rank) if verify == VERIFY_GANG else [shard]
            problem, data = None, None
            for s in checked:
                problem, got = self._check_shard(s)
                if problem is not None:
                    break
                if s.rank == mine:
                    data = got
            if problem is not None:
                skipped.append(SkippedCheckpoint(ckpt.id, ckpt.step, problem[:MAX_REASON]))
                log.warning(
                    "checkpoint_restore_skipped job=%s attempt=%d rank=%d checkpoint=%s step=%d reason=%r",
                    self.job_id,
                    self.attempt,
                    self.rank,
                    ckpt.id,
                    ckpt.step,
                    problem,
                    extra={
                        "checkpoint": {
                            "event": "checkpoint_restore_skipped",
                            "job_id": self.job_id,
                            "attempt": self.attempt,
                            "rank": self.rank,
                            "checkpoint_id": ckpt.id,
                            "step": ckpt.step,
                            "reason": problem,
                        }
                    },
                )
                continue
            state = self._load(ckpt, shard, data, into, allow_pickle)
            self._restored(ckpt, skipped)
            return ckpt.step, state
        self._restored(None, skipped)
        return None

    def _restore_points(self):
        """The job's complete committed checkpoints, newest first, a page at a time (a coordinator without
        ListCheckpoints: its latest one only)."""
        token = ""
        while True:
            try:
                page = self._call(
                    "ListCheckpoints",
                    pb.ListCheckpointsRequest(job_id=self.job_id, page_size=LIST_PAGE, page_token=token),
                )
            except CheckpointRejectedError as exc:
                if exc.code != "UNIMPLEMENTED" or token:
                    raise
                try:
                    yield self._call("GetLatestCheckpoint", pb.GetLatestCheckpointRequest(job_id=self.job_id))
                except CheckpointRejectedError as inner:
                    if not (inner.code == "NOT_FOUND" and "no committed checkpoint" in inner.message):
                        raise
                return
            yield from page.checkpoints
            if not page.next_page_token:
                return
            token = page.next_page_token

    def _check_shard(self, shard: pb.Shard) -> tuple[str | None, bytes | None]:
        """(None, the shard's bytes: None for a DCP directory) when the shard matches the size and sha256 its
        checkpoint committed, else (why not, None)."""
        rank = shard.rank
        if not shard.checksum:
            return f"rank {rank}'s shard has no sha256 to check it against", None
        if torch_dcp.is_dcp_uri(shard.uri):
            found = torch_dcp.verify(shard.uri, shard.checksum, shard.size_bytes)
            if found is None:
                return None, None
            kind, detail = found
        else:
            try:
                data = self.store.get(shard.uri)
            except Exception as exc:  # any store's failure to read is a shard we cannot restore
                kind, detail = ("missing", shard.uri) if _missing(exc) else ("unreadable", str(exc)[:300])
            else:
                if len(data) != shard.size_bytes:
                    kind, detail = "size", f"expected {shard.size_bytes} bytes, found {len(data)}"
                elif sha256_checksum(data) != shard.checksum:
                    kind, detail = "sha256", ""
                else:
                    return None, data
        if kind == "missing":
            return f"rank {rank}'s shard is missing ({shard.uri})", None
        if kind == "unreadable":
            return f"rank {rank}'s shard cannot be read ({detail})", None
        if kind == "size":
            return f"size mismatch in rank {rank}'s shard: {detail}", None
        return f"sha256 mismatch in rank {rank}'s shard", None

    def _load(self, ckpt: pb.Checkpoint, shard: pb.Shard, data: bytes | None, into: Any, allow_pickle: bool) -> Any:
        what = f"checkpoint {ckpt.id} (step {ckpt.step}, rank {self.rank})"
        if torch_dcp.is_dcp_uri(shard.uri):
            if callable(into):  # a template built only when there is a checkpoint to load into it
                into = into()
            return torch_dcp.load(shard.uri, shard.checksum, shard.size_bytes, into, what, verified=True)
        assert data is not None
        if into is not None:
            log.warning(
                "restore(into=...): step %d of rank %d is not a torch.distributed.checkpoint shard; the "
                "template is not loaded, use the returned state",
                ckpt.step,
                self.rank,
            )
        if state_format.is_state(data):
            return state_format.decode(data)
        if not allow_pickle:
            raise CheckpointPickleError(
                f"{what} is a pickle ({shard.uri}), written by an older phalanx.train: restoring it would unpickle "
                "bytes from storage, which can run arbitrary code, so restore() refuses it. If you trust the "
                "checkpoint storage, pass restore(allow_pickle=True) (or train.restore(allow_pickle=True)) to "
                "resume from it; the next save writes JSON."
            )
        log.warning("restore(allow_pickle=True): unpickling %s", what)
        return pickle.loads(data)

    def _restored(self, ckpt: pb.Checkpoint | None, skipped: list[SkippedCheckpoint]) -> None:
        """Tell the coordinator (ReportRestore) and the log what this rank restored from; keep it in
        `last_restore`. A failed report is logged, never raised: it must not stop training."""
        step = ckpt.step if ckpt is not None else -1
        message = restore_message(step, skipped)
        try:
            reply = self._call(
                "ReportRestore",
                pb.ReportRestoreRequest(
                    job_id=self.job_id,
                    attempt=self.attempt,
                    rank=self.rank,
                    checkpoint_id=ckpt.id if ckpt is not None else "",
                    skipped=[pb.SkippedCheckpoint(checkpoint_id=s.checkpoint_id, reason=s.reason) for s in skipped],
                ),
            )
        except CheckpointError as exc:
            log.warning("checkpoint restore report failed: %s", exc)
        else:
            message = reply.message or message
        self.last_restore = RestoreResult(step, ckpt.id if ckpt is not None else "", tuple(skipped), message)
        (log.warning if skipped else log.info)(
            "checkpoint_restored job=%s attempt=%d rank=%d step=%d fell_back_from=%d message=%r",
            self.job_id,
            self.attempt,
            self.rank,
            step,
            skipped[0].step if skipped else -1,
            message,
            extra={
                "checkpoint": {
                    "event": "checkpoint_restored",
                    "job_id": self.job_id,
                    "attempt": self.attempt,
                    "rank": self.rank,
                    "step": step,
                    "checkpoint_id": ckpt.id if ckpt else "",
                    "fell_back_from": skipped[0].step if skipped else -1,
                    "message": message,
                    "skipped": [s.__dict__ for s in skipped],
                }
            },
        )

    def save(self, step: int, state: Any) -> SaveResult:
        """Write `state` as this rank's shard of `step`, and report it to the coordinator.

        A torch state_dict (a Mapping holding torch.Tensors) goes through torch.distributed.checkpoint into a
        directory shard when torch is importable and the store is a directory store (LocalStore); anything else,
        and any state with another store (an object store), is written as JSON, its tensors and numpy arrays as
        raw bytes after it (phalanx.train.state_format; nothing is pickled). A value it cannot hold (a custom
        object) raises CheckpointError naming where it is in the state.

        The checkpoint commits when the last rank reports; until then it is not a restore point.
        """
        if step < 0:
            raise CheckpointError(f"step must be >= 0, got {step}")
        # Begin before serializing and writing, so the checkpoint's created_at (the first rank's begin) to its
        # committed_at (the last rank's report) measures the whole save: the coordinator's interval policy takes
        # that as the checkpoint's cost. Begin is idempotent: every rank of the gang sends it.
        self._call(
            "BeginCheckpoint",
            pb.BeginCheckpointRequest(
                job_id=self.job_id,
                attempt=self.attempt,
                step=step,
                world_size=self.world_size,
                deadline_s=self.deadline_s,
            ),
        )
        if torch_dcp.supports(self.store, state):
            uri, size, checksum = torch_dcp.save(
                self.store, self.job_id, self.attempt, step, self.rank, state, world_size=self.world_size
            )
        else:
            data = state_format.encode(state)
            uri = self.store.put(self.job_id, self.attempt, step, self.rank, data)
            checksum, size = sha256_checksum(data), len(data)
        ckpt = self._call(
            "ReportShard",
            pb.ReportShardRequest(
                job_id=self.job_id,
                attempt=self.attempt,
                step=step,
                world_size=self.world_size,
                shard=pb.Shard(rank=self.rank, uri=uri, size_bytes=size, checksum=checksum),
                deadline_s=self.deadline_s,
            ),
        )
        self._last_save = time.monotonic()
        req = self._request
        if req is not None and req.requested:
            if not req.agreeing:
                self._satisfied_request_at = req.requested_at
            elif self._target is not None and step == self._target[1]:
                self._done = self._target  # the agreed step is saved: not acted on again
        return SaveResult(step, uri, checksum, size, ckpt.state == "COMMITTED", ckpt.id)

    def should_checkpoint(self, step: int) -> bool:
        """True when this rank should checkpoint after completing `step`: call it at every step, on every rank.

        - Every N steps (PHALANX_CHECKPOINT_EVERY): decided here; it is the same step on every rank.
        - A request (a user's `phalanx checkpoint`, a preemption) and the time policies (S seconds since this
          rank's last save, PHALANX_CHECKPOINT_INTERVAL_S; or else, with PHALANX_CHECKPOINT_POLICY "auto", the
          default, the coordinator's suggested Young/Daly interval, learned from the request polls) are agreed
          with the coordinator, so that every rank checkpoints at the same step (a checkpoint commits only with
          one shard of each rank for one step): when a time policy fires, this rank asks for a checkpoint
          (RequestCheckpoint, reason "interval"; an outstanding request is kept). While a request is outstanding
          and its step undecided, each rank reports its step with every call; once every rank has, the
          coordinator picks the first step every rank can still reach (the highest reported + 1), and this returns
          True exactly at that step, on every rank. So a request is answered a step or two after every rank has
          seen it. After `save` at that step the request is not acted on again.
        - The job's own policy (PHALANX_CHECKPOINT_EVERY / PHALANX_CHECKPOINT_INTERVAL_S) overrides the suggested
          interval, which applies only when both are 0/unset and the policy is not "off".

        Without an outstanding request, the coordinator is polled at most once per PHALANX_CHECKPOINT_POLL_S
        seconds, at wall-clock multiples of it, so the ranks of a gang notice a new request within about a step of
        each other. A failing poll counts as "no request" (it never stops training). A coordinator that does not
        agree steps (an older one) gets the old behaviour: each rank acts on a request, or its time policy, at its
        own step, and for one consistent step rank 0 would have to decide and broadcast it.
        """
        polled = self._poll_if_due(step)  # also learns the suggested interval
        if self.every and step > 0 and step % self.every == 0:
            return True
        interval = self.interval_s or self.auto_interval_s
        if interval and time.monotonic() - self._last_save >= interval:
            if not self._agreeing:
                return True  # an older coordinator (or none answered yet): this rank decides alone, as before
            self._interval_passed(step, polled)
        return self._at_target(step)

    @property
    def auto_interval_s(self) -> float:
        """The interval the automatic policy applies now: the coordinator's suggestion, or 0 (none) when the job
        sets its own policy, PHALANX_CHECKPOINT_POLICY is "off", or no suggestion has arrived."""
        if self.every or self.interval_s or self.policy == POLICY_OFF:
            return 0.0
        return self.suggested_interval_s

    # -- the step agreement (should_checkpoint) ---------------------------------------------------------------------
    def _slot(self) -> int | None:
        """The wall-clock poll slot, floor(time.time() / poll_s); None when polling at every call (poll_s 0)."""
        return math.floor(time.time() / self.poll_s) if self.poll_s > 0 else None

    def _phase(self) -> str:
        req = self._request
        if req is None or not req.requested or not req.agreeing:
            return _IDLE
        if self._target is not None and self._target[0] == req.requested_at:
            return _HOLDING
        return _REPORTING

    def _missed(self, step: int) -> bool:
        """The agreed step is behind this rank and it did not save at it (it learned it too late)."""
        return (
            self._phase() == _HOLDING
            and self._target is not None
            and step > self._target[1]
            and self._done != self._target
        )

    def _poll_if_due(self, step: int) -> bool:
        """Poll when due: at every call while the request's step is undecided (or this rank missed the agreed
        one), else once per poll slot; after a failed poll, once per poll slot until one succeeds. Sends the step
        unless this rank knows the agreed step. Returns whether it polled."""
        phase = self._phase()
        missed = self._missed(step)
        eager = (phase == _REPORTING or missed) and not self._poll_failed
        slot = self._slot()
        if not eager and slot is not None and slot == self._poll_slot:
            return False
        send = phase != _HOLDING or missed
        if missed:
            # Only when this rank's polls failed, or it skipped steps: a lone shard at another step could never
            # commit, so it reports its step, past the agreed one, and the coordinator starts the agreement over.
            log.warning(
                "checkpoint_step_missed job=%s attempt=%d rank=%d step=%d target_step=%d: this rank learned the "
                "agreed step too late; asking for a new agreement",
                self.job_id,
                self.attempt,
                self.rank,
                step,
                self._target[1] if self._target is not None else -1,
            )
        if self._poll(step if send else None) and not send and self._phase() == _REPORTING:
            # A new request, or the agreement started over (a rank was past the agreed step): report from now on.
            self._poll(step)
        return True

    def _poll(self, step: int | None) -> bool:
        self._poll_slot = self._slot()
        request = pb.GetCheckpointRequestRequest(job_id=self.job_id, attempt=self.attempt, rank=self.rank)
        if step is not None:
            request.step = step
        try:
            reply = self._call("GetCheckpointRequest", request)
        except CheckpointError as exc:
            log.warning("checkpoint request poll failed: %s", exc)
            self._poll_failed = True
            if self._phase() == _IDLE:
                self._request = None  # counts as no request; an agreement under way is kept
            return False
        self._poll_failed = False
        suggested = reply.interval_s
        # Keep the last good suggestion when a (older) coordinator sends none or a nonsensical one.
        if math.isfinite(suggested) and suggested > 0:
            self.suggested_interval_s = suggested
        self._request = reply
        self._agreeing = reply.agreeing
        if reply.agreeing and reply.requested and reply.HasField("target_step"):
            self._target = (reply.requested_at, reply.target_step)
        else:
            self._target = None
        return True

    def _interval_passed(self, step: int, polled: bool) -> None:
        """A time policy fired (with a coordinator that agrees steps): make sure a request is outstanding and this
        rank takes part in its agreement. At most once per poll slot."""
        if self._phase() != _IDLE:
            # A checkpoint is being agreed, or agreed (ahead, or saved and not yet committed: a rank that did not
            # save at the agreed step reports a step past it, which starts the agreement over).
            return
        slot = self._slot()
        if slot is not None and slot == self._asked_slot:
            return
        self._asked_slot = slot
        if not polled and self._poll(step) and self._phase() != _IDLE:
            return  # another rank asked already: this poll joined its agreement
        try:
            self._call("RequestCheckpoint", pb.RequestCheckpointRequest(job_id=self.job_id, reason=INTERVAL_REASON))
        except CheckpointError as exc:
            log.warning("checkpoint request (time policy) failed: %s", exc)
            return
        self._poll(step)

    def _at_target(self, step: int) -> bool:
        req = self._request
        if req is None or not req.requested:
            return False
        if not req.agreeing:  # an older coordinator: act on the request at once, once
            return req.requested_at != self._satisfied_request_at
        if self._phase() != _HOLDING or self._done == self._target or self._target is None:
            return False
        return step == self._target[1]


_default: Checkpointer | None = None


def default() -> Checkpointer:
    """The process-wide Checkpointer built from os.environ on first use."""
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default


def reset() -> None:
    """Drop the process-wide Checkpointer (closing its channel); the next call rebuilds it from os.environ."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


def restore(into: Any = None, *, allow_pickle: bool = False, verify: str = VERIFY_GANG) -> tuple[int, Any] | None:
    return default().restore(into, allow_pickle=allow_pickle, verify=verify)


def save(step: int, state: Any) -> SaveResult:
    return default().save(step, state)


def should_checkpoint(step: int) -> bool:
    return default().should_checkpoint(step)


def world_size(env: Mapping[str, str] | None = None) -> int:
    """The gang's current world size (WORLD_SIZE): an elastic gang's changes when it grows or shrinks, each time
    a new attempt restarted from the last committed checkpoint."""
    env = os.environ if env is None else env
    return _int(env, ENV_WORLD_SIZE, minimum=1)


def elastic_range(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(MIN, MAX) replicas of an elastic gang (PHALANX_MIN_REPLICAS, PHALANX_MAX_REPLICAS); None for a gang that is
    not elastic. Its current replicas are PHALANX_REPLICAS (and WORLD_SIZE its ranks)."""
    env = os.environ if env is None else env
    if not env.get(ENV_MIN_REPLICAS):
        return None
    return _int(env, ENV_MIN_REPLICAS, minimum=1), _int(env, ENV_MAX_REPLICAS, minimum=1)
