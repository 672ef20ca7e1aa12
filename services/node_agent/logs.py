"""The agent's rank logs over gRPC (AgentLogs), and their rotation.

Each rank's stdout and stderr go to one file, `<state dir>/logs/<job>-a<attempt>-r<rank>.log` (launcher.rank_paths),
opened for appending. `rotate` keeps it under `--log-max-bytes`: past it, the file is copied to `.log.1` (replacing
the older one) and truncated, so a rank holds at most twice that on disk, and its writes, appending, go on at the
new start. `ReadRankLog` serves a rank's log to a client holding a credential the scheduler gave it for that job's
attempt on this node (Scheduler.GetRankLogs; phalanx.common.tokens.check_log_credential): the whole log (the
rotated part first), or its last lines, then, with `follow`, what the rank writes until it has ended.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from phalanx.api.v1 import agent_pb2, agent_pb2_grpc
from phalanx.common.tokens import check_log_credential

from . import launcher

log = structlog.get_logger()

CHUNK = 64 * 1024
TAIL_WINDOW = 4 * 1024 * 1024  # the last lines are looked for in at most this much of the end
FOLLOW_POLL_S = 0.2
START_WAIT_S = 60.0  # following a rank not started yet: how long its log may take to appear
SERVICE_NAME = agent_pb2.DESCRIPTOR.services_by_name["AgentLogs"].full_name


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def rotate(path: Path, max_bytes: int) -> bool:
    """Copy-truncate `path` into `path`.1 when it is over `max_bytes`; True when it did."""
    try:
        if max_bytes <= 0 or path.stat().st_size <= max_bytes:
            return False
        shutil.copyfile(path, rotated(path))
        with open(path, "r+b") as f:
            f.truncate(0)
        return True
    except OSError as exc:
        log.warning("rank_log_rotate_failed", path=str(path), error=str(exc))
        return False


def tail(paths: list[Path], lines: int) -> bytes:
    """The last `lines` lines of the concatenation of `paths` (read from at most TAIL_WINDOW of their end)."""
    data = b""
    for path in reversed(paths):
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                take = min(size, TAIL_WINDOW - len(data))
                f.seek(size - take)
                data = f.read(take) + data
        except FileNotFoundError:
            continue
        if data.count(b"\n") > lines or len(data) >= TAIL_WINDOW:
            break
    kept = data.splitlines(keepends=True)[-lines:]
    return b"".join(kept)


class AgentLogsServicer(agent_pb2_grpc.AgentLogsServicer):
    """`key()`: the key this node checks credentials with (from its registration); `state_dir`: the agent's;
    `live(job, attempt, rank)`: whether that rank still runs here (a follow ends once it does not)."""

    def __init__(self, key: Callable[[], str], state_dir: Path, live: Callable[[str, int, int], bool]) -> None:
        self.key, self.state_dir, self.live = key, state_dir, live

    async def ReadRankLog(self, request, context):
        why = check_log_credential(self.key(), request.credential, request.job_id, request.attempt, time.time())
        if why:
            log.warning(
                "audit", outcome="denied", method="ReadRankLog", object=f"job/{request.job_id[:40]}", reason=why
            )
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        if request.rank < 0 or request.tail_lines < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "rank and tail_lines must not be negative")
        path = launcher.rank_paths(self.state_dir, request.job_id, request.attempt, request.rank)[1]
        old = rotated(path)
        if request.follow:  # a rank this agent has but has not started yet: its log is on its way
            deadline = time.monotonic() + START_WAIT_S
            while not path.exists() and time.monotonic() < deadline:
                if not self.live(request.job_id, request.attempt, request.rank):
                    break
                await asyncio.sleep(FOLLOW_POLL_S)
        if not path.exists() and not old.exists():
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no log of rank {request.rank} of job {request.job_id} attempt {request.attempt} on this node",
            )
        offset = 0
        if request.tail_lines:
            data = await asyncio.to_thread(tail, [old, path], request.tail_lines)
            # In CHUNKs like the rest: a tail can be TAIL_WINDOW long, gRPC's default message limit.
            for start in range(0, len(data), CHUNK):
                yield agent_pb2.RankLogChunk(data=data[start : start + CHUNK])
            offset = path.stat().st_size if path.exists() else 0
        else:
            for chunk in _read_from(old, 0)[0]:
                yield agent_pb2.RankLogChunk(data=chunk)
        while True:
            chunks, offset = await asyncio.to_thread(_read_from, path, offset)
            for chunk in chunks:
                yield agent_pb2.RankLogChunk(data=chunk)
            if not request.follow or (not chunks and not self.live(request.job_id, request.attempt, request.rank)):
                # Once the rank has ended, one more read takes what it wrote last.
                if request.follow:
                    last, offset = await asyncio.to_thread(_read_from, path, offset)
                    for chunk in last:
                        yield agent_pb2.RankLogChunk(data=chunk)
                return
            if not chunks:
                await asyncio.sleep(FOLLOW_POLL_S)


def _read_from(path: Path, offset: int) -> tuple[list[bytes], int]:
    """The chunks of `path` from `offset` (from 0 when it shrank: it was rotated), and the offset after them."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < offset:
                offset = 0
            f.seek(offset)
            chunks = []
            while True:
                chunk = f.read(CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
            return chunks, offset
    except FileNotFoundError:
        return [], offset
