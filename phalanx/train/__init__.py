"""Rank-side checkpoint library: restore, save and should_checkpoint for a rank of a Phalanx gang.

    from phalanx import train

    restored = train.restore()                 # (step, state) of this rank, or None
    step, state = restored if restored else (0, init_state())
    while step < total:
        state = train_step(state); step += 1
        if train.should_checkpoint(step):
            train.save(step, state)            # pickled to PHALANX_CHECKPOINT_DIR, reported to the coordinator

Configuration comes from the environment: RANK, WORLD_SIZE, PHALANX_JOB_ID, PHALANX_ATTEMPT (set by the
scheduler), PHALANX_CHECKPOINT_ADDR and PHALANX_CHECKPOINT_DIR (to be set by the scheduler/agent), and the
policy PHALANX_CHECKPOINT_EVERY / PHALANX_CHECKPOINT_INTERVAL_S / PHALANX_CHECKPOINT_POLL_S. Use
:class:`Checkpointer` directly to pass another environment or a :class:`CheckpointStore` (an object store).
"""

from ._checkpointer import Checkpointer, SaveResult, default, reset, restore, save, should_checkpoint
from .errors import CheckpointConfigError, CheckpointCorruptError, CheckpointError, CheckpointRejectedError
from .store import CheckpointStore, LocalStore, sha256_checksum

__all__ = [
    "CheckpointConfigError", "CheckpointCorruptError", "CheckpointError", "CheckpointRejectedError",
    "CheckpointStore", "Checkpointer", "LocalStore", "SaveResult", "default", "reset", "restore", "save",
    "sha256_checksum", "should_checkpoint",
]
