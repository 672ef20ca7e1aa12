"""Checkpoint coordinator (`phalanx-checkpointd`): records committed checkpoints and answers the latest one."""

from .main import serve

__all__ = ["serve"]
