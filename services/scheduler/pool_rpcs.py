"""The spare pools' RPCs of the Scheduler service (CreatePool, ListPools, DeletePool), mixed into SchedulerServicer
(servicer.py) so that module stays small. CreatePool and DeletePool are admin-only with authentication on
(services.common.auth.ADMIN_METHODS); bad input is refused before anything is written (pools.CreatePool checks it
against the view in the cycle, before its write)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx.api.v1 import scheduler_pb2
from phalanx.core.pools import MAX_POOL_NAME
from services.common.auth import SCHEDULER as SCHEDULER_PREFIX
from services.common.auth import audit_admin
from services.common.errors import InvalidArgument, NotFound
from services.common.rpc import unary

from .pools import CreatePool, DeletePool, pool_status, pool_statuses


def pool_to_proto(status: Mapping[str, Any]) -> scheduler_pb2.SparePool:
    msg = scheduler_pb2.SparePool(
        name=status["name"], tier=status["tier"], per_domain=status["per_domain"], created_at=status["created_at"]
    )
    for d in status["domains"]:
        row = msg.domains.add(domain=d["domain"], booked=d["booked"], missing=d["missing"])
        for node, jobs in sorted(d["lent"].items()):
            row.lent.add(node=node, jobs=jobs)
    return msg


class PoolRpcs:
    service: Any

    @unary
    async def CreatePool(self, request, context):
        if request.per_domain < 1:
            raise InvalidArgument(
                f"invalid pool: per_domain must be at least 1 node per domain, got {request.per_domain}"
            )
        pool = await self.service.execute(CreatePool(request.name, request.tier, request.per_domain))
        audit_admin(SCHEDULER_PREFIX + "CreatePool", f"pool/{pool.name}", f"tier {pool.tier}, {pool.per_domain}/domain")
        return pool_to_proto(pool_status(self.service.state, pool, self.service.settings.fabric.tiers))

    @unary
    async def ListPools(self, request, context):
        found = pool_statuses(self.service.state, self.service.settings.fabric.tiers, request.name)
        if request.name and not found:
            raise NotFound(f"no pool {request.name[:MAX_POOL_NAME]!r}")
        return scheduler_pb2.ListPoolsResponse(pools=[pool_to_proto(p) for p in found])

    @unary
    async def DeletePool(self, request, context):
        if not request.name or len(request.name) > MAX_POOL_NAME:
            raise NotFound(f"no pool {request.name[:MAX_POOL_NAME]!r}")
        await self.service.execute(DeletePool(request.name))
        audit_admin(SCHEDULER_PREFIX + "DeletePool", f"pool/{request.name}")
        return scheduler_pb2.DeletePoolResponse()
