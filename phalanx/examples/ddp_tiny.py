"""A tiny but real data-parallel training job for a Phalanx gang: torch.distributed over gloo, DDP, DCP checkpoints.

    python -m phalanx.examples.ddp_tiny --steps 40 --out DIR [--every N] [--step-time S] [--seed 0]

Needs torch (`pip install 'phalanx[torch]'`). Each rank:
1. joins the gang's process group, `torch.distributed.init_process_group("gloo")`, from the environment Phalanx
   gives every rank (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; LOCAL_RANK names its GPU on the node);
2. all-reduces a known tensor (rank r contributes r + 1) and checks the sum is N(N+1)/2, so a gang whose ranks
   cannot talk fails at once (exit 4) instead of hanging in its first gradient all-reduce;
3. restores the job's newest intact committed checkpoint (`phalanx.train.restore(into=template)`: a
   torch.distributed.checkpoint loaded collectively into the model and the Adam state), or starts from the seed;
4. trains a small MLP with DistributedDataParallel: each step every rank draws its own batch from a generator
   seeded by (seed, step, rank), so a run resumed from step S sees exactly the batches an uninterrupted one does;
5. asks `phalanx.train.should_checkpoint(step)` on every rank every step (the coordinator makes every rank agree
   on one step: `--every`, a user's `phalanx checkpoint`, a preemption) and saves collectively
   (`phalanx.train.save`): each rank writes its own de-duplicated part of the checkpoint once, none a full copy.

Without PHALANX_CHECKPOINT_ADDR (run by hand, or as the uninterrupted baseline) it trains without checkpoints.

Outputs, under ``--out``/<job id or "local">/:
    rank-<r>.json   at the end: {"rank", "world_size", "step", "attempt", "restored_step", "node",
                    "params_sha256" (of every parameter's bytes, in name order), "saves", "save_s", "restore_s",
                    "train_s"}; every rank's params_sha256 is the same (DDP keeps the replicas equal)
    events.log      JSON lines: {"event": "start", "attempt", "rank", "restored_step", "node", "pid"},
                    {"event": "checkpoint", "attempt", "rank", "step", "committed"}, {"event": "done", ...}
Exit codes: 0 done; 4 the all-reduce check failed; a phalanx.train error (e.g. a superseded attempt) raises (1).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from phalanx import train

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2.0) + 0.1 * torch.randn(BATCH, OUT, generator=g)


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0" + p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def check_all_reduce(rank: int, world: int) -> bool:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return int(t.item()) == world * (world + 1) // 2


def warm_up(model: DistributedDataParallel, loss_fn) -> None:
    """One backward pass whose gradients are thrown away, so DDP has rebuilt its gradient buckets (in the order the
    first backward produced the gradients) before the first real step. Otherwise the first step of every process
    reduces with the initial layout and later ones with the rebuilt one, and a run resumed from step S would reduce
    step S+1 differently from an uninterrupted run: with more than two ranks, a change in the order of a float sum
    changes its bits. The parameters are not touched (no optimizer step)."""
    x, y = batch(0, 0, 0)
    loss_fn(model(x), y).backward()
    model.zero_grad(set_to_none=True)


def state_of(model: DistributedDataParallel, optim: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


class Events:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **fields) -> None:
        with open(self.path, "a") as f:  # one short line per write: appends from ranks do not interleave
            f.write(json.dumps(fields) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m phalanx.examples.ddp_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="train to this step")
    parser.add_argument(
        "--every",
        type=int,
        default=0,
        help="also checkpoint every N steps (sets PHALANX_CHECKPOINT_EVERY; 0: only when asked)",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds of 'work' per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", required=True, help="directory for rank-<r>.json and events.log")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds the process group waits for a peer")
    args = parser.parse_args(argv)
    if args.every:
        os.environ.setdefault("PHALANX_CHECKPOINT_EVERY", str(args.every))

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("PHALANX_ATTEMPT", "0"))
    node = os.environ.get("PHALANX_NODE", socket.gethostname())
    out = Path(args.out) / os.environ.get("PHALANX_JOB_ID", "local")
    events = Events(out / "events.log")
    checkpoints = bool(os.environ.get("PHALANX_CHECKPOINT_ADDR"))

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    try:
        if not check_all_reduce(rank, world):
            print(f"rank {rank}: the all-reduce check failed", file=sys.stderr)
            return 4
        model = DistributedDataParallel(build_model(args.seed))
        optim = torch.optim.Adam(model.parameters(), lr=args.lr)
        step, restored_step, restore_s = 0, -1, 0.0
        if checkpoints:
            t0 = time.perf_counter()
            # A function, not a template: building one steps an empty Adam (lr 0), which would change its state.
            restored = train.restore(into=lambda: state_of(model, optim))
            restore_s = time.perf_counter() - t0
            if restored is not None:
                step, state = restored
                set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
                restored_step = step
        events.write(event="start", attempt=attempt, rank=rank, restored_step=restored_step, node=node, pid=os.getpid())

        loss_fn = torch.nn.MSELoss()
        warm_up(model, loss_fn)
        saves, save_s = 0, 0.0
        t_train = time.perf_counter()
        while step < args.steps:
            step += 1
            x, y = batch(args.seed, step, rank)
            optim.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()  # DDP all-reduces the gradients
            optim.step()
            if args.step_time:
                time.sleep(args.step_time)
            if checkpoints and train.should_checkpoint(step):
                t0 = time.perf_counter()
                result = train.save(step, state_of(model, optim))
                save_s += time.perf_counter() - t0
                saves += 1
                events.write(event="checkpoint", attempt=attempt, rank=rank, step=step, committed=result.committed)
        train_s = time.perf_counter() - t_train
        summary = {
            "rank": rank,
            "world_size": world,
            "step": step,
            "attempt": attempt,
            "restored_step": restored_step,
            "node": node,
            "params_sha256": params_sha256(model.module),
            "saves": saves,
            "save_s": save_s,
            "restore_s": restore_s,
            "train_s": train_s,
        }
        tmp = out / f".rank-{rank}.json.tmp"
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, out / f"rank-{rank}.json")
        events.write(event="done", attempt=attempt, rank=rank, step=step)
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
