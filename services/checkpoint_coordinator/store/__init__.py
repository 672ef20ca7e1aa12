"""Checkpoint ledger operations: pure, synchronous database functions (no gRPC), one transaction each.

The servicer validates nothing itself; everything here raises `services.common.errors` exceptions.

The commit protocol (docs/design.md, "Checkpoints"): a checkpoint is PENDING from its begin (`begin_checkpoint`,
or implicitly the first `report_shard`) until all `world_size` ranks reported, when the same transaction marks
it COMMITTED. `abort_expired` marks ABORTED the PENDING ones past their deadline or of a superseded attempt.
Every write first locks the job row and reads `jobs.attempt` (fencing): a request of another attempt raises
FailedPrecondition, and any refusal raises before anything is written, so the transaction rolls back whole.

No number a client sends about the gang is believed: the world size is the number of ranks of the job's current
attempt in the ledger (`ledger_world_size`), a request's `world_size` only a cross-check (0: the ledger's); a
checkpoint commits with exactly one shard of each rank 0..N-1. Restores read only complete COMMITTED checkpoints
whose files retention did not delete (`latest_checkpoint`, `list_checkpoints`; retention.py), and `report_restore`
records what a rank restored from, checked against the ledger (`get_restore` reads it back with its one-line message).

Step agreement (`get_request` with a rank's step): while a request is outstanding, every rank reports the step it
has just completed at each poll (`checkpoint_step_reports`, one row per rank of the attempt); once every rank
0..N-1 has reported for the request, its target step is max(reported) + 1 (`checkpoint_requests.target_step`), the
step every rank checkpoints at (the argument: proto/phalanx/api/v1/checkpoint.proto, GetCheckpointRequest).

`checkpoint_policy` (and `get_request`, for the ranks' polls) measures the cluster's node failures and the
checkpoint cost and returns the job's Young/Daly interval (phalanx.core.checkpoint_policy; docs/design.md,
"Checkpoint interval policy").

The store is a package, one module per concern; every name is importable from `services.checkpoint_coordinator.store`
as before:
- `_records`: states, limits, the checkpoint and shard records (imports nothing of the store);
- `jobs`: the job row (owner, current attempt, the write fence, the ledger's world size);
- `restore_points`: the complete committed checkpoints, newest first, and the reads over them;
- `commits`: the commit protocol and the sweep of expired PENDING checkpoints;
- `requests`: checkpoint requests and the ranks' step agreement;
- `policy`: the checkpoint interval policy and its caches (set `policy.CLUSTER_FIGURES_TTL_S` there, not here);
- `restores`: restore reports;
- `endpoint`: where the coordinator is reached.
"""

from __future__ import annotations

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

from ._records import (
    ABORTED,
    COMMITTED,
    DEFAULT_DEADLINE_S,
    DEFAULT_PAGE_SIZE,
    MAX_CHECKPOINT_ID,
    MAX_CHECKSUM,
    MAX_DEADLINE_S,
    MAX_JOB_ID,
    MAX_PAGE_SIZE,
    MAX_REASON,
    MAX_SKIPPED,
    MAX_WORLD_SIZE,
    PENDING,
    CheckpointRecord,
    ShardRecord,
    new_checkpoint_id,
)
from .commits import (
    abort_expired,
    begin_checkpoint,
    record_checkpoint,
    report_shard,
    validate,
)
from .endpoint import (
    COORDINATOR_ENDPOINT,
    advertise,
)
from .jobs import (
    JobOwner,
    job_owner,
    ledger_world_size,
)
from .policy import (
    CLUSTER_FIGURES_TTL_S,
    FATAL,
    POLL_POLICY_CACHE_MAX,
    checkpoint_policy,
)
from .requests import (
    MAX_REPORTED_STEP,
    RequestRecord,
    get_request,
    request_checkpoint,
)
from .restore_points import (
    latest_checkpoint,
    list_checkpoints,
)
from .restores import (
    RestoreRecord,
    RestoreStateRecord,
    SkippedRecord,
    get_restore,
    report_restore,
)

__all__ = [
    "ABORTED",
    "CLUSTER_FIGURES_TTL_S",
    "COMMITTED",
    "COORDINATOR_ENDPOINT",
    "CheckpointRecord",
    "DEFAULT_DEADLINE_S",
    "DEFAULT_PAGE_SIZE",
    "FATAL",
    "FailedPrecondition",
    "InvalidArgument",
    "JobOwner",
    "MAX_CHECKPOINT_ID",
    "MAX_CHECKSUM",
    "MAX_DEADLINE_S",
    "MAX_JOB_ID",
    "MAX_PAGE_SIZE",
    "MAX_REASON",
    "MAX_REPORTED_STEP",
    "MAX_SKIPPED",
    "MAX_WORLD_SIZE",
    "NotFound",
    "PENDING",
    "POLL_POLICY_CACHE_MAX",
    "RequestRecord",
    "RestoreRecord",
    "RestoreStateRecord",
    "ShardRecord",
    "SkippedRecord",
    "abort_expired",
    "advertise",
    "begin_checkpoint",
    "checkpoint_policy",
    "get_request",
    "get_restore",
    "job_owner",
    "latest_checkpoint",
    "ledger_world_size",
    "list_checkpoints",
    "new_checkpoint_id",
    "record_checkpoint",
    "report_restore",
    "report_shard",
    "request_checkpoint",
    "validate",
]
