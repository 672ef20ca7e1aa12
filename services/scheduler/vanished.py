"""GPUs that vanished: a node whose agent registers again with fewer GPUs than it had (a GPU fell off the bus and
the agent restarted). The scheduler takes the hardware as it is and tears down the gangs that held a GPU now gone
(commands.Register calls this once the node's new record is in the view)."""

from __future__ import annotations

import structlog

from phalanx.core.capacity import vanished_gpus

from . import ledger
from .state import NodeRecord, attempt_key
from .transitions import Cycle, teardown

log = structlog.get_logger()


def tear_down_on_vanished(cycle: Cycle, node: NodeRecord, had: int, live: frozenset[str]) -> None:
    """`node` registered again with fewer GPUs than the `had` it had (a GPU fell off the bus, its agent restarted):
    the hardware is what it is. Every gang holding a GPU that is gone (whole, a MIG instance or a share) is torn down
    whole, as on a fatal GPU error, and requeued per its restart policy; its rows (a split GPU's hold row with its
    last part) are released. Whole GPUs that stay held for the clean handover are free at once when the agent has no
    process of the attempt left (not in `live`), as registration frees any other such attempt."""
    for job in cycle.state.running_on(node.name):
        gone = vanished_gpus(job.replica_placements(), node.name, node.gpus)
        if not gone:
            continue
        attempt = job.attempt
        what = f"GPU {gone[0]}" if len(gone) == 1 else f"GPUs {', '.join(map(str, gone))}"
        message = f"{what} of {node.name} vanished at re-registration (it has {node.gpus} GPU(s) now, had {had})"
        log.warning("gpus_vanished", node=node.name, job=job.id, attempt=attempt, gpus=gone, had=had, now=node.gpus)
        teardown(cycle, job, cause="GPU_FAILED", message=message)
        key = attempt_key(job.id, attempt)
        held = node.releasing.get(key)
        if held is not None and key not in live:
            del node.releasing[key]
            cycle.work.write(ledger.release_attempt_on_node, node.id, job.id, attempt, cycle.now)
            cycle.state.capacity.release(node.name, set(held) - node.held_gpus)
            use = node.releasing_use.pop(key, None)
            if use is not None:
                cycle.state.capacity.release_use(node.name, *use)
