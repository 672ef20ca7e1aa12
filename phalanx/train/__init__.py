"""Rank-side checkpoint library: restore, save and should_checkpoint for a rank of a Phalanx gang.

    from phalanx import train

    restored = train.restore()                 # (step, state) of this rank, or None
    step, state = restored if restored else (0, init_state())
    while step < total:
        state = train_step(state); step += 1
        if train.should_checkpoint(step):
            train.save(step, state)            # JSON in PHALANX_CHECKPOINT_DIR, reported to the coordinator

A torch state_dict (a Mapping holding torch.Tensors) is saved with torch.distributed.checkpoint instead, when torch
is installed (phalanx.train.torch_dcp); restore it in place into a template: `train.restore(into=state_dict)`.
Any other state is JSON (tensors and numpy arrays as raw bytes after it: phalanx.train.state_format); nothing is
pickled, and a restore refuses the pickles of older versions unless passed `allow_pickle=True`.

`restore()` checks the shards of the newest committed checkpoint against the size and sha256 the coordinator
committed, and falls back to the next older intact one when a shard is missing or damaged; it logs that, and
reports what it restored to the coordinator (ReportRestore; GetRestore shows it), see `Checkpointer.restore`.

Configuration comes from the environment: RANK, WORLD_SIZE, PHALANX_JOB_ID, PHALANX_ATTEMPT (set by the
scheduler), PHALANX_CHECKPOINT_ADDR and PHALANX_CHECKPOINT_DIR (to be set by the scheduler/agent), and the
policy PHALANX_CHECKPOINT_EVERY / PHALANX_CHECKPOINT_INTERVAL_S / PHALANX_CHECKPOINT_POLL_S /
PHALANX_CHECKPOINT_POLICY. Use :class:`Checkpointer` directly to pass another environment or a
:class:`CheckpointStore` (an object store).

When the job sets neither PHALANX_CHECKPOINT_EVERY (steps) nor PHALANX_CHECKPOINT_INTERVAL_S (seconds), its own
policy, `should_checkpoint` follows the coordinator's suggested interval, learned from the request polls: the
Young/Daly interval sqrt(2 x MTBF x cost), from the cluster's measured node failure rate (with a prior of a
6,000 h node MTBF), the nodes the gang spans and the measured cost of its recent checkpoints (docs/design.md,
"Checkpoint interval policy"). It is measured from the last save, or from the Checkpointer's start.
PHALANX_CHECKPOINT_POLICY=off (default auto) disables it. A checkpoint request (user, preemption) applies always.

Elastic gangs (`phalanx submit --replicas MIN:MAX`): `world_size()` is the current world size, `elastic_range()` the
gang's (MIN, MAX); after a grow or shrink each rank restores the data-parallel state of the old world's rank R modulo
its size (see `Checkpointer.restore`).

Call `should_checkpoint(step)` at every step on every rank: every rank of the gang checkpoints at the same step
(a checkpoint commits only with one shard of each rank for one step). The every-N-steps policy is the same step
everywhere; a request, or a time policy (which, when it fires, asks the coordinator for a checkpoint rather than
checkpointing alone), is seen by each rank at its own step, so the coordinator agrees the step with the ranks:
while a request is outstanding each rank reports its step with its polls, and once all have, every rank's
`should_checkpoint` is True exactly at the highest reported step + 1 (docs/design.md, "Checkpoints"). No
broadcast from rank 0 is needed.
"""

from ._checkpointer import (
    Checkpointer,
    RestoreResult,
    SaveResult,
    SkippedCheckpoint,
    default,
    elastic_range,
    reset,
    restore,
    save,
    should_checkpoint,
    world_size,
)
from .errors import (
    CheckpointConfigError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointPickleError,
    CheckpointRejectedError,
)
from .store import CheckpointStore, LocalStore, sha256_checksum

__all__ = [
    "CheckpointConfigError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointPickleError",
    "CheckpointRejectedError",
    "CheckpointStore",
    "Checkpointer",
    "LocalStore",
    "RestoreResult",
    "SaveResult",
    "SkippedCheckpoint",
    "default",
    "elastic_range",
    "reset",
    "restore",
    "save",
    "sha256_checksum",
    "should_checkpoint",
    "world_size",
]
