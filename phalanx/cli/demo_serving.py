"""The demo's serving step: a service of two replicas with a readiness probe, its endpoints, a rolling update that
never takes a ready replica down before its replacement is ready (max-surge 1, max-unavailable 0), then its
deletion. Through the SDK, as a user would."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

# A model server stand-in: it "loads" for half a second, then says it is ready (the probe tests the file) and serves.
SERVER_PROGRAM = (
    "import os, pathlib, time\n"
    "time.sleep(0.5)\n"
    "pathlib.Path('ready').write_text(os.environ.get('MODEL_VERSION', '1'))\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def demo_service(client, say: Callable[[str], None], stopper, timeout: float = 60.0) -> bool:
    """Run the serving step; True when every stage was reached in time."""
    from phalanx.client import ReadyProbe, ServiceSpec

    spec = ServiceSpec(
        "chat",
        replicas=2,
        nodes_per_replica=1,
        gpus_per_node=8,
        command=[sys.executable, "-c", SERVER_PROGRAM],
        procs_per_node=1,
        port=8000,
        ready_probe=ReadyProbe(command=["sh", "-c", "test -f ready"], period_s=0.2),
        max_surge=1,
        max_unavailable=0,
    )
    say("Serving: a service of 2 replicas (each a gang of 1 node x 8 GPUs), ready once its probe passes")
    client.create_service(spec)
    lowest = [2]

    def settled(revision: int):
        svc = client.get_service("chat")
        live = [r for r in svc.replicas if r.state != "FAILED"]
        if revision > 1:
            lowest[0] = min(lowest[0], svc.ready_replicas)
        done = len(live) == 2 and all(r.ready and r.revision == revision for r in live)
        return svc if done else None

    svc = _wait(lambda: settled(1), timeout, stopper)
    if svc is None:
        say("  the service's replicas did not become ready in time")
        return False
    say(f"  ready: {svc.ready_replicas}/2; endpoints " + ", ".join(f"#{e.replica} {e.address}" for e in svc.endpoints))
    client.update_service("chat", replace(spec, env={"MODEL_VERSION": "2"}))
    say("  rolling out revision 2 (max-surge 1, max-unavailable 0): a new replica first, then an old one goes")
    svc = _wait(lambda: settled(2), timeout, stopper)
    if svc is None:
        say("  the rolling update did not finish in time")
        return False
    say(f"  revision 2 on both replicas; at least {lowest[0]} of 2 were ready at every look during the rollout")
    client.delete_service("chat")
    say("  service chat deleted: its replicas stopped")
    return lowest[0] >= 2


def _wait(check, timeout: float, stopper):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopper.event.is_set():
            raise KeyboardInterrupt
        got = check()
        if got:
            return got
        time.sleep(0.1)
    return None
