"""One NVML scenario through whatever `pynvml` is first on sys.path (tests/unit/test_nvml_bindings.py runs it under the
oldest and the newest nvidia-ml-py of the pinned range): discovery of a GB200 tray with a fabric and a MIG-mode
GPU, a MIG instance made and destroyed through the agent's manager, one health poll. Prints one JSON line."""

from __future__ import annotations

import json
import tempfile

import pynvml
from structlog.testing import capture_logs

from phalanx.profiles import load_profile
from phalanx.simhost.nvml import SimulatedHost, bind
from phalanx.simhost.sysfs import build_fake_sysfs
from services.node_agent.discovery import discover_topology
from services.node_agent.health import HealthMonitor, NvmlHealthSource
from services.node_agent.mig_manager import MigManager, NvmlMigBackend
from services.node_agent.topology import topology_to_json

CLUSTER = "4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f"


def main() -> None:
    prof = load_profile("gb200-nvl72-tray")
    host = SimulatedHost.from_dump(
        prof.dump,
        gpu_model=prof.gpu_model,
        memory_mib=prof.memory_mib,
        node_name="n1",
        mig_enabled={0},
        fabric_cluster_uuid=CLUSTER,
        fabric_clique=4,
    )
    nv = bind(host)
    with tempfile.TemporaryDirectory() as root, capture_logs() as logs:
        build_fake_sysfs(root, prof.dump, host.pci_bus_ids)
        topo = discover_topology("n1", use_nvidia_smi=False, nvml=nv, sysfs_root=root)
        m = MigManager(NvmlMigBackend.for_topology(topo, nv), topo)
        got = m.acquire("j/1/0", [{"gpu": 0, "profile": "3g.93gb", "start": 4, "size": 4}])
        listed = [(i.profile, i.start, i.size, i.gi_id, i.ci_id, i.uuid) for i in m.backend.list_instances(0)]
        m.release("j/1/0", got)
        mon = HealthMonitor(NvmlHealthSource(nv, event_timeout_ms=10), len(topo.gpus))
        health, _ = mon.check()
        mon.close()
    print(
        json.dumps(
            {
                "binding": pynvml.__file__,
                "topology": topology_to_json(topo),
                "fabric": [topo.fabric_cluster_uuid, topo.fabric_clique],
                "mig": listed,
                "after_release": [i.start for i in m.backend.list_instances(0)],
                "health": health.state,
                "warnings": sorted(e["probe"] for e in logs if e.get("event") == "nvml_probe_failed"),
                "errors": host.errors,
            },
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
