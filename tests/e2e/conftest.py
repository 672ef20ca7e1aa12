"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from phalanx.cli.cluster import LocalCluster


@pytest.fixture
def cluster_factory(tmp_path, monkeypatch):
    """`make(nodes, **LocalCluster options)`: a local cluster of real processes under tmp_path, started, and stopped
    at the test's end; no 8-GPU node has a GPU in MIG mode unless `mig_gpus` is given (gangs here need whole nodes)."""
    monkeypatch.delenv("PHALANX_SCHEDULER", raising=False)
    monkeypatch.delenv("PHALANX_DB", raising=False)
    started: list[LocalCluster] = []
    messages: list[str] = []

    def make(nodes: int, **kw) -> LocalCluster:
        kw.setdefault("mig_gpus", 0)
        cluster = LocalCluster(
            nodes=nodes,
            state_dir=tmp_path / "cluster",
            port=0,
            log=messages.append,
            ready_timeout=60,
            restart_agents=False,
            **kw,
        )
        started.append(cluster)
        cluster.start()
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
