"""The node agent's simulated host is injected (AgentConfig.nvml / simulated_nvml; phalanx-agent --simulate in
main.py): the agent's modules never load phalanx.simhost's NVML nor services.node_agent.simulated themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.node_agent.agent import AgentConfig, NodeAgent, SimulatedHostError
from services.node_agent.simulated import nvml_for_topology, simulated_topology

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_agent_loads_no_simulated_host():
    code = (
        "import sys, services.node_agent.agent\n"
        "bad = sorted(m for m in sys.modules if m.startswith('phalanx.simhost') or m == 'services.node_agent.simulated')\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_a_simulated_topology_needs_its_bindings_given(tmp_path):
    topo = simulated_topology("node-i", "dgx-h100")
    with pytest.raises(SimulatedHostError, match="simulated_nvml"):
        NodeAgent(AgentConfig(scheduler="x:1", node_name="node-i", topology=topo, state_dir=tmp_path / "a"))
    made: list[Path] = []

    def factory(topology, state_dir):
        made.append(state_dir)
        return nvml_for_topology(topology, state_dir)

    agent = NodeAgent(
        AgentConfig(
            scheduler="x:1", node_name="node-i", topology=topo, state_dir=tmp_path / "b", simulated_nvml=factory
        )
    )
    assert made == [(tmp_path / "b").resolve()] and agent.nvml is not None
    assert agent.mig.backend._nv is agent.nvml and agent.mig.backend.kind == "nvml-simulated"
