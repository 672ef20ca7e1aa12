"""Where this coordinator is reached: the service endpoint row a scheduler started without
--checkpoint-coordinator reads.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from db.models import (
    ServiceEndpoint,
)

COORDINATOR_ENDPOINT = "checkpoint-coordinator"


def advertise(
    engine: Engine,
    address: str,
    checkpoint_dir: str = "",
    *,
    name: str = COORDINATOR_ENDPOINT,
    now: float | None = None,
) -> None:
    """Record where this coordinator is reached (and the checkpoint directory it serves), for a scheduler started
    without --checkpoint-coordinator. The last one to start wins."""

    values = dict(
        address=address, detail={"checkpoint_dir": checkpoint_dir}, updated_at=time.time() if now is None else now
    )
    with engine.begin() as conn:
        dialect_insert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(
            dialect_insert(ServiceEndpoint)
            .values(name=name, **values)
            .on_conflict_do_update(index_elements=["name"], set_=values)
        )
