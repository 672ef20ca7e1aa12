"""A sample training program for a Phalanx gang: every rank counts steps and checkpoints through phalanx.train.

    python -m phalanx.examples.count_steps --steps 80 --every 10 --step-time 0.1 --out DIR

Each rank restores the job's latest committed checkpoint (``train.restore()``) or starts at step 0 with
``{"count": 0}``, then loops: ``step += 1; state["count"] += 1``, sleeps ``--step-time`` (the "work"), and saves a
checkpoint (``train.save(step, state)``) when ``train.should_checkpoint(step)`` says so: every ``--every`` steps, or
when the coordinator asks (a preemption, ``phalanx checkpoint``) or a time policy fires. However often the gang is
killed, preempted and restarted, a run ends with ``count == steps``: the proof that no committed step is lost or
repeated.

Lockstep. A checkpoint commits only when every rank reports a shard of the same step. Every rank calls
``train.should_checkpoint(step)`` at every step; a request (or a time policy) is seen by each rank at its own step,
and the checkpoint coordinator agrees with the ranks on one step for it, so their answers agree. Real
data-parallel training is in lockstep anyway (every step's gradient all-reduce); the ranks of this program do not
otherwise talk, so :class:`FileLockstep` stands in for those collectives (``torch.distributed.barrier`` and
``all_gather_object``) with small files in a shared directory: per step, each rank writes a file with its
decision and waits for every rank's, and checks they agree. The directory is namespaced by job id and attempt, so
a restarted gang never meets the files of a superseded one. It needs a directory every rank sees (one host, or a
shared file system), which a local cluster has.

Outputs, under ``--out``/<job id>/:
    rank-<r>.json   at the end: {"rank", "count", "step", "attempt", "restored_step", "node"} (restored_step -1:
                    started from scratch)
    events.log      JSON lines, appended as they happen: {"event": "start", "attempt", "rank", "restored_step",
                    "node", "pid"} per rank start; {"event": "checkpoint", "attempt", "rank": 0, "step",
                    "requested"} per checkpoint, written by rank 0 ("requested": not a multiple of --every, so
                    a request or a time policy asked for it); {"event": "done", ...} at the end
    sync/attempt-<a>/   the lockstep's files (each rank removes its old ones as it goes)
Exit codes: 0 done; 2 the ranks restored different steps; 3 a lockstep wait timed out (a peer died and nobody
stopped this rank); 4 the ranks disagreed whether to checkpoint at a step (the step agreement failed); a
phalanx.train error (e.g. this attempt was superseded) is raised (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from phalanx import train


class LockstepTimeout(RuntimeError):
    pass


class FileLockstep:
    """Barrier + all-gather for ``world_size`` ranks through files in ``directory`` (a stand-in for collectives).

    ``exchange(tag, value)`` writes this rank's ``value`` for ``tag``, waits until every rank wrote its own, and
    returns all of them by rank: a barrier that also gathers (every rank's decision, to check they agree). Tags
    must be used in the same order by every rank; each rank deletes its file of the previous tag once every rank
    has written the current one (so every rank has read the previous one).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        rank: int,
        world_size: int,
        *,
        timeout: float = 300.0,
        poll_s: float = 0.005,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world_size, self.timeout, self.poll_s = rank, world_size, timeout, poll_s
        self._previous: Path | None = None

    def _path(self, tag: str, rank: int) -> Path:
        return self.dir / f"{tag}.r{rank}"

    def exchange(self, tag: str, value: str = "") -> list[str]:
        mine = self._path(tag, self.rank)
        tmp = mine.with_name(f".{mine.name}.tmp")
        tmp.write_text(value)
        os.replace(tmp, mine)  # a reader sees the whole value or nothing
        values: list[str | None] = [None] * self.world_size
        deadline = time.monotonic() + self.timeout
        while True:
            for r in range(self.world_size):
                if values[r] is None:
                    try:
                        values[r] = self._path(tag, r).read_text()
                    except FileNotFoundError:
                        pass
            if all(v is not None for v in values):
                break
            if time.monotonic() > deadline:
                missing = [r for r, v in enumerate(values) if v is None]
                raise LockstepTimeout(f"ranks {missing} did not reach {tag!r} within {self.timeout:g}s")
            time.sleep(self.poll_s)
        if self._previous is not None:
            self._previous.unlink(missing_ok=True)
        self._previous = mine
        return values  # type: ignore[return-value]


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:  # one short write per line (O_APPEND): lines never interleave
        f.write(json.dumps(record, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m phalanx.examples.count_steps", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, required=True, help="total steps; the run ends with count == steps")
    p.add_argument(
        "--every",
        type=int,
        default=None,
        help="checkpoint every K steps (sets PHALANX_CHECKPOINT_EVERY; default: the job's env/policy)",
    )
    p.add_argument("--step-time", type=float, default=0.1, help="seconds of 'work' per step (default 0.1)")
    p.add_argument("--out", required=True, help="directory for the results (and the lockstep's files)")
    p.add_argument(
        "--sync-timeout",
        type=float,
        default=300.0,
        help="seconds to wait for the other ranks at a step before giving up (exit 3)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.every is not None:
        os.environ["PHALANX_CHECKPOINT_EVERY"] = str(args.every)
    env = os.environ
    job_id, attempt = env["PHALANX_JOB_ID"], int(env.get("PHALANX_ATTEMPT", "0"))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    node = env.get("PHALANX_NODE", "")
    every = int(env.get("PHALANX_CHECKPOINT_EVERY", "0") or 0)
    out = Path(args.out) / job_id
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.log"
    sync = FileLockstep(out / "sync" / f"attempt-{attempt}", rank, world, timeout=args.sync_timeout)

    restored = train.restore()
    step, state = restored if restored is not None else (0, {"count": 0})
    restored_step = restored[0] if restored is not None else -1
    _append(
        events,
        dict(
            event="start",
            attempt=attempt,
            rank=rank,
            restored_step=restored_step,
            node=node,
            pid=os.getpid(),
            count=state["count"],
        ),
    )
    try:
        steps_seen = sync.exchange("start", str(restored_step))
        if len(set(steps_seen)) != 1:  # every rank must resume from the same step
            print(f"rank {rank}: the ranks restored different steps {steps_seen}", file=sys.stderr, flush=True)
            return 2
        while step < args.steps:
            step += 1
            state["count"] += 1
            time.sleep(args.step_time)
            # Every rank asks (the coordinator agrees a request's step with all of them); they must agree.
            decisions = sync.exchange(f"step-{step}", "1" if train.should_checkpoint(step) else "0")
            if len(set(decisions)) != 1:
                print(
                    f"rank {rank}: the ranks disagree whether to checkpoint at step {step}: {decisions}",
                    file=sys.stderr,
                    flush=True,
                )
                return 4
            if decisions[0] == "1":
                if rank == 0:
                    _append(
                        events,
                        dict(
                            event="checkpoint",
                            attempt=attempt,
                            rank=rank,
                            step=step,
                            requested=not (every and step % every == 0),
                        ),
                    )
                train.save(step, state)
    except LockstepTimeout as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 3
    result = dict(rank=rank, count=state["count"], step=step, attempt=attempt, restored_step=restored_step, node=node)
    target = out / f"rank-{rank}.json"
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(result, sort_keys=True))
    os.replace(tmp, target)
    _append(events, dict(event="done", **result))
    train.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
