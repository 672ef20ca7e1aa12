"""Each scheduling cycle binds its id into the structlog context: every line it logs carries `cycle`."""

from __future__ import annotations

import structlog
from structlog.testing import capture_logs

from phalanx.core.quota import FlavorQuota, QueueSpec
from services.scheduler.commands import SetQueue
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings


def test_the_log_lines_of_a_cycle_carry_its_id_and_the_next_cycle_has_another(db_url):
    service = SchedulerService(SchedulerSettings(db_url=db_url))
    try:
        with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
            service._cycle_once([SetQueue(QueueSpec("a", {"*": FlavorQuota(gpus=1)}))])
            service._cycle_once([SetQueue(QueueSpec("b", {"*": FlavorQuota(gpus=2)}))])
            structlog.get_logger().info("outside_any_cycle")
    finally:
        service._close_writer_connection()
        service.engine.dispose()
        service.read_engine.dispose()
    sets = {e["queue"]: e for e in logs if e["event"] == "queue_set"}
    assert set(sets) == {"a", "b"}
    assert isinstance(sets["a"]["cycle"], int) and sets["b"]["cycle"] == sets["a"]["cycle"] + 1
    assert sets["b"]["cycle"] == service.cycle_id
    (outside,) = [e for e in logs if e["event"] == "outside_any_cycle"]
    assert "cycle" not in outside  # unbound when the cycle ends
