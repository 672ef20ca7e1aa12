"""Checkpoints committed the way a gang's ranks commit them, without running the ranks (service tests whose agents
are LiteAgents: nothing of the gang runs to save one)."""

from __future__ import annotations

from db.engine import make_engine
from services.checkpoint_coordinator import store


def commit_checkpoint(db_url: str, job_id: str, attempt: int, step: int, world: int) -> None:
    """What every rank's phalanx.train.save does: one shard each; the last one commits."""
    engine = make_engine(db_url)
    try:
        for rank in range(world):
            store.report_shard(
                engine,
                job_id,
                attempt,
                step,
                world,
                store.ShardRecord(rank, f"file:///ckpt/{job_id}/{step}/{rank}", 10, f"sha256:{rank}"),
            )
    finally:
        engine.dispose()
