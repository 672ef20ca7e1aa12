"""gRPC face of the checkpoint coordinator: proto <-> store records; database work runs off the event loop."""

from __future__ import annotations

import asyncio

import structlog
from sqlalchemy import Engine

from phalanx.api.v1 import checkpoint_pb2, checkpoint_pb2_grpc
from services.common.rpc import unary

from . import store

log = structlog.get_logger(service="checkpointd")

SERVICE_NAME = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointCoordinator"].full_name


def to_proto(record: store.CheckpointRecord) -> checkpoint_pb2.Checkpoint:
    return checkpoint_pb2.Checkpoint(
        id=record.id,
        job_id=record.job_id,
        attempt=record.attempt,
        step=record.step,
        committed_at=record.committed_at,
        shards=[
            checkpoint_pb2.Shard(rank=s.rank, uri=s.uri, size_bytes=s.size_bytes, checksum=s.checksum)
            for s in record.shards
        ],
    )


class CheckpointCoordinatorServicer(checkpoint_pb2_grpc.CheckpointCoordinatorServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @unary
    async def RecordCheckpoint(self, request, context):
        shards = [store.ShardRecord(s.rank, s.uri, s.size_bytes, s.checksum) for s in request.shards]
        record = await asyncio.to_thread(
            store.record_checkpoint, self.engine, request.job_id, request.attempt, request.step, shards
        )
        log.info("checkpoint_committed", checkpoint_id=record.id, job_id=record.job_id, step=record.step,
                 attempt=record.attempt, shards=len(record.shards))
        return to_proto(record)

    @unary
    async def GetLatestCheckpoint(self, request, context):
        record = await asyncio.to_thread(store.latest_checkpoint, self.engine, request.job_id)
        return to_proto(record)
