"""Production discovery (services.node_agent.discovery) run through the real nvidia-ml-py bindings over the simulated
NVML library (phalanx.simhost.nvml) and a simulated sysfs, built from real `nvidia-smi topo -m` dumps
(../shared/data/topologies) and the shipped profiles: the matrix must round-trip.

What round-trips: every GPU-GPU, GPU-NIC and NIC-NIC cell present in the dump. Cells a dump does not hold (the
partial HGX B200 dump has rows GPU0-4 only and no NIC rows) are not compared; discovery still reports them, derived
from the fake's answers (unknown PCIe relations come out SYS, or NODE on one NUMA node).
"""

from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path

import pytest
import structlog
from conftest import SHARED_DATA
from helpers.required import data_missing, need

from phalanx.api.v1 import agent_pb2
from phalanx.core.topo_dump import TopoDump, is_nvlink, parse_topo
from phalanx.profiles import list_profiles, load_profile, load_profile_file
from phalanx.simhost.nvml import SimulatedHost, bind
from phalanx.simhost.sysfs import build_fake_sysfs, natural_key
from services.node_agent import main as agent_main
from services.node_agent.discovery import (
    DiscoveryError,
    PciDevice,
    discover_topology,
    pci_relation,
)
from services.node_agent.mig_manager import NvmlMigBackend
from services.node_agent.simulated import fake_gpu_uuid, fake_pci_bus_id, simulated_topology
from services.node_agent.topology import topology_to_json

TOPOLOGIES = SHARED_DATA / "topologies"
DUMP_FILES = sorted(TOPOLOGIES.glob("*.txt")) if TOPOLOGIES.is_dir() else []
# Profiles with their own matrix (gb200-nvl72 is the gb200-nvl72-tray matrix, `# base:`).
PROFILES = list_profiles()


def _needs_dumps():
    need("data", None if DUMP_FILES else data_missing(TOPOLOGIES / "*.txt", "real topology dumps"))


def fake_nvml(dump: TopoDump, **fake):
    """The real pynvml (a private instance) over a simulated host built from `dump`; `nv.simulated_host` is it."""
    return bind(SimulatedHost.from_dump(dump, **fake))


def discover(tmp_path: Path, dump: TopoDump, **fake):
    nv = fake_nvml(dump, **fake)
    sysfs = build_fake_sysfs(tmp_path, dump, nv.simulated_host.pci_bus_ids)
    topo = discover_topology(nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False)
    # Discovery names NICs NIC<k> in natural order of their InfiniBand device names (as nvidia-smi does).
    order = sorted(sysfs.ib.values(), key=natural_key)
    names = {n: f"NIC{order.index(sysfs.ib[n])}" for n in dump.nics} | {g: g for g in dump.gpus}
    return topo, names, nv


def mismatches(dump: TopoDump, topo: agent_pb2.HostTopology, names: dict[str, str]) -> list:
    bad = []
    for a in dump.devices:
        for b in dump.devices:
            expected = dump.cell(a, b)
            if a == b or expected is None:
                continue
            got = topo.matrix[names[a]].cells.get(names[b]) if names[a] in topo.matrix else None
            if got != expected:
                bad.append((a, b, expected, got))
    return bad


def check_round_trip(tmp_path: Path, dump: TopoDump, **fake) -> agent_pb2.HostTopology:
    topo, names, _ = discover(tmp_path, dump, **fake)
    assert [f"GPU{g.index}" for g in topo.gpus] == dump.gpus
    # The device minor numbers come from nvmlDeviceGetMinorNumber (the agent's device rules name /dev/nvidia<minor>).
    assert all(g.HasField("minor_number") and g.minor_number == g.index for g in topo.gpus)
    assert mismatches(dump, topo, names) == []
    # NUMA nodes (the dump's NUMA affinity) and NIC device names come back.
    assert [g.numa_node for g in topo.gpus] == [dump.numa_node(g) for g in dump.gpus]
    assert {n.device for n in topo.nics} == {dump.nic_device(n) or n for n in dump.nics} or not dump.nic_devices
    # Each GPU's NIC is a PIX NIC whenever it has one (the dump's pairing).
    for g in topo.gpus:
        pix = [names[n] for n in dump.nics if dump.cell(f"GPU{g.index}", n) == "PIX"]
        if pix:
            assert g.nic in pix
    return topo


# ------------------------------------------------------------------------------------------------ round trips


_NO_DUMPS = pytest.param(None, id="no-dumps")  # one case without the dumps, for need("data") to skip or fail


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in DUMP_FILES] or [_NO_DUMPS])
def test_real_dump_round_trips(tmp_path, path):
    _needs_dumps()
    check_round_trip(tmp_path, parse_topo(path.read_text()))


def test_real_dumps_present():
    _needs_dumps()
    assert len(DUMP_FILES) >= 5


@pytest.mark.parametrize("name", PROFILES)
def test_profile_round_trips(tmp_path, name):
    prof = load_profile(name)
    topo = check_round_trip(tmp_path, prof.dump, gpu_model=prof.gpu_model, memory_mib=prof.memory_mib)
    assert {g.name for g in topo.gpus} == {prof.gpu_model}
    assert {g.memory_mib for g in topo.gpus} == {prof.memory_mib}


FULL_DUMPS = [p for p in DUMP_FILES if "partial" not in p.name]


@pytest.mark.parametrize("name", PROFILES + [str(p) for p in FULL_DUMPS], ids=PROFILES + [p.stem for p in FULL_DUMPS])
def test_simulated_equals_discovered(tmp_path, name):
    """The simulated host (topology_from_dump) and discovery over the fake NVML/sysfs agree on every field both set.

    Partial dumps are left out: a simulated host keeps their missing rows missing, discovery fills them in."""
    if name in PROFILES:
        prof, sim = load_profile(name), simulated_topology("n1", profile=name)
    else:
        prof, sim = load_profile_file(name), simulated_topology("n1", dump_file=name)
    n = prof.gpu_count
    found, names, _ = discover(
        tmp_path,
        prof.dump,
        gpu_model=prof.gpu_model,
        memory_mib=prof.memory_mib,
        uuids=[fake_gpu_uuid("n1", i) for i in range(n)],
        pci_bus_ids=[fake_pci_bus_id(i, n) for i in range(n)],
        fabric_cluster_uuid=sim.fabric_cluster_uuid,
        fabric_clique=sim.fabric_clique,
    )
    assert all(names[k] == k for k in names)  # shipped profiles list NICs in device order

    def gpu(g):
        return (g.index, g.uuid, g.name, g.memory_mib, g.pci_bus_id, g.numa_node, g.nic, g.compute_capability)

    assert [gpu(g) for g in found.gpus] == [gpu(g) for g in sim.gpus]
    # A dump without a NIC Legend names no devices; the fake sysfs calls them mlx5_<k>.
    assert [(x.name, x.device, x.nearest_gpu) for x in found.nics] == [
        (x.name, x.device or f"mlx5_{k}", x.nearest_gpu) for k, x in enumerate(sim.nics)
    ]
    assert {r: dict(found.matrix[r].cells) for r in found.matrix} == {r: dict(sim.matrix[r].cells) for r in sim.matrix}
    assert (found.fabric_cluster_uuid, found.fabric_clique) == (sim.fabric_cluster_uuid, sim.fabric_clique)


def test_dgx_a100_rails(tmp_path):
    """Two GPUs PXB to the same two NICs: one GPU per NIC, in order (GPU0 -> NIC0, GPU1 -> NIC1)."""
    topo, _, _ = discover(tmp_path, load_profile("dgx-a100").dump)
    assert [g.nic for g in topo.gpus] == [f"NIC{i}" for i in range(8)]
    assert [n.nearest_gpu for n in topo.nics] == list(range(8)) + [-1, -1]  # storage NICs: SYS to every GPU
    assert topo.matrix["GPU0"].cells["NIC1"] == "PXB" and topo.matrix["NIC8"].cells["NIC9"] == "PIX"


def test_reversed_pairing_vm(tmp_path):
    _needs_dumps()
    dump = parse_topo((TOPOLOGIES / "hgx_h20_8gpu_vm_nccl-tests321.txt").read_text())
    topo, _, _ = discover(tmp_path, dump)
    assert [g.nic for g in topo.gpus] == [f"NIC{7 - i}" for i in range(8)]


def test_phb_is_not_a_gpus_nic(tmp_path):
    """`nic` is PIX or PXB only: a NIC behind the host bridge (PHB) is not a GPU's own."""
    topo, _, _ = discover(tmp_path, load_profile("pcie-2numa").dump)
    assert [g.nic for g in topo.gpus] == ["NIC0", "NIC0", "", "", "NIC1", "NIC1", "", ""]
    assert topo.matrix["GPU2"].cells["NIC0"] == "NODE" and topo.matrix["GPU2"].cells["GPU4"] == "SYS"


# ------------------------------------------------------------------------------------------------ NVLink model


def _with_cells(dump: TopoDump, gpu: str, cells: dict[str, str]) -> TopoDump:
    matrix = {r: dict(row) for r, row in dump.matrix.items()}
    for other, value in cells.items():
        matrix[gpu][other] = matrix[other][gpu] = value
    return TopoDump(
        devices=list(dump.devices),
        matrix=matrix,
        extras=dump.extras,
        extra_columns=dump.extra_columns,
        nic_devices=dump.nic_devices,
    )


def test_nvswitch_links_go_to_switches(tmp_path):
    dump = load_profile("dgx-h100").dump
    nv = fake_nvml(dump)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    remotes = {nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId for link in range(18)}
    assert remotes.isdisjoint(nv.simulated_host.pci_bus_ids)  # NVSwitches, not GPUs
    assert {nv.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) for link in range(18)} == {
        nv.NVML_NVLINK_DEVICE_TYPE_SWITCH
    }
    assert nv.nvmlDeviceGetNvLinkState(h, 17) == nv.NVML_FEATURE_ENABLED
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetNvLinkState(h, 18)  # an H100 has 18 links


def test_nvlink_down_gpu_has_no_nv_cells(tmp_path):
    """A GPU of an NVSwitch box whose links are down: NODE/SYS to every peer, links present but disabled."""
    base = load_profile("dgx-h100").dump
    down = _with_cells(base, "GPU2", {f"GPU{j}": ("NODE" if j < 4 else "SYS") for j in range(8) if j != 2})
    topo = check_round_trip(tmp_path, down)
    cells = topo.matrix["GPU2"].cells
    assert not any(is_nvlink(cells[f"GPU{j}"]) for j in range(8) if j != 2)
    assert topo.matrix["GPU0"].cells["GPU1"] == "NV18"
    nv = fake_nvml(down)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(2)
    assert {nv.nvmlDeviceGetNvLinkState(h, link) for link in range(18)} == {nv.NVML_FEATURE_DISABLED}


HYBRID_CUBE_MESH = """\
        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    CPU Affinity    NUMA Affinity
GPU0     X      NV1     NV1     NV2     NV2     SYS     SYS     SYS     0-19    0
GPU1    NV1      X      NV2     NV1     SYS     NV2     SYS     SYS     0-19    0
GPU2    NV1     NV2      X      NV2     SYS     SYS     NV1     SYS     0-19    0
GPU3    NV2     NV1     NV2      X      SYS     SYS     SYS     NV1     0-19    0
GPU4    NV2     SYS     SYS     SYS      X      NV1     NV1     NV2     20-39   1
GPU5    SYS     NV2     SYS     SYS     NV1      X      NV2     NV1     20-39   1
GPU6    SYS     SYS     NV1     SYS     NV1     NV2      X      NV2     20-39   1
GPU7    SYS     SYS     SYS     NV1     NV2     NV1     NV2      X      20-39   1
"""


def test_hybrid_cube_mesh_links_go_to_peer_gpus(tmp_path):
    """DGX-1 (V100): direct NVLinks, NV1/NV2 per pair, no NVSwitch."""
    dump = parse_topo(HYBRID_CUBE_MESH)
    check_round_trip(tmp_path, dump, gpu_model="Tesla V100-SXM2-16GB", memory_mib=16160)
    nv = fake_nvml(dump, gpu_model="Tesla V100-SXM2-16GB")
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    remotes = [nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId for link in range(6)]
    buses = nv.simulated_host.pci_bus_ids
    assert sorted(remotes) == sorted([buses[1], buses[2], buses[3], buses[3], buses[4], buses[4]])


def test_pcie_only_gpus_have_no_nvlink():
    _needs_dumps()
    dump = parse_topo((TOPOLOGIES / "pcie_8x_rtx4090_2nic_go-gpuallocator17.txt").read_text())
    nv = fake_nvml(dump, gpu_model="NVIDIA GeForce RTX 4090", memory_mib=24564)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetNvLinkState(h, 0)
    assert nv.nvmlDeviceGetTopologyCommonAncestor(h, nv.nvmlDeviceGetHandleByIndex(1)) == nv.NVML_TOPOLOGY_SYSTEM
    with pytest.raises(nv.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h)


# ------------------------------------------------------------------------------------------------ other fields


def test_compute_capability_and_fabric(tmp_path):
    prof = load_profile("gb200-nvl72-tray")
    cluster = "4e1f3c2a-9b7d-4c11-8e2f-0a1b2c3d4e5f"
    topo, _, _ = discover(
        tmp_path,
        prof.dump,
        gpu_model=prof.gpu_model,
        memory_mib=prof.memory_mib,
        fabric_cluster_uuid=cluster,
        fabric_clique=3,
    )
    assert {g.compute_capability for g in topo.gpus} == {"10.0"}
    assert (topo.fabric_cluster_uuid, topo.fabric_clique) == (cluster, "3")
    assert topo.profile == "nvml"
    assert {g.nic for g in topo.gpus} == {""}  # every NIC of a GB200 tray is SYS to the GPUs


def test_no_fabric_without_fabric_info(tmp_path):
    topo, _, _ = discover(tmp_path, load_profile("dgx-h100").dump)
    assert (topo.fabric_cluster_uuid, topo.fabric_clique) == ("", "")
    assert {g.compute_capability for g in topo.gpus} == {"9.0"}
    assert {g.mig_mode for g in topo.gpus} == {agent_pb2.GpuInfo.MIG_MODE_DISABLED}


def test_mig_instances_discovered_and_one_fake_serves_the_mig_backend(tmp_path):
    dump = load_profile("dgx-h100").dump
    nv = fake_nvml(dump, mig_enabled=[True, False] + [False] * 6)
    backend = NvmlMigBackend({0: ("NVIDIA H100 80GB HBM3", 81559)}, nvml=nv)
    made = backend.create_instance(0, "3g.40gb", 4)
    uuid = made.uuid
    nv.simulated_host.add_mig_instance(0, "1g.10gb", 0, ci=False)  # made by an administrator
    build_fake_sysfs(tmp_path, dump, nv.simulated_host.pci_bus_ids)
    topo = discover_topology(nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False)
    g0, g1 = topo.gpus[0], topo.gpus[1]
    assert g0.mig_mode == agent_pb2.GpuInfo.MIG_MODE_ENABLED and g1.mig_mode == agent_pb2.GpuInfo.MIG_MODE_DISABLED
    assert [(m.profile, m.start, m.size, m.uuid) for m in g0.mig_instances] == [
        ("1g.10gb", 0, 1, ""),
        ("3g.40gb", 4, 4, uuid),
    ]
    assert [(m.gpu_instance_id, m.compute_instance_id) for m in g0.mig_instances] == [(2, -1), (made.gi_id, 0)]
    assert uuid.startswith("MIG-") and not g1.mig_instances


def test_nvml_errors_have_the_real_style(tmp_path):
    nv = fake_nvml(load_profile("dgx-h100").dump)
    nv.simulated_host.init_error = nv.NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(DiscoveryError, match="Driver Not Loaded.*--simulate"):
        discover_topology(nvml=nv, sysfs_root=tmp_path)
    nv.simulated_host.init_error = None
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()
    nv.nvmlInit()
    with pytest.raises(nv.NVMLError_InvalidArgument):
        nv.nvmlDeviceGetHandleByIndex(8)
    buf = (nv.c_nvmlGpuInstance_t * 1)()
    count = ctypes.c_uint(0)
    with pytest.raises(nv.NVMLError_InvalidArgument):  # MIG disabled
        nv.nvmlDeviceGetGpuInstances(nv.nvmlDeviceGetHandleByIndex(0), 9, buf, ctypes.byref(count))


def test_no_sysfs_nics_and_no_nvidia_smi(tmp_path):
    dump = load_profile("dgx-h100").dump
    nv = fake_nvml(dump)
    topo = discover_topology(nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False)  # an empty tree
    assert not topo.nics and [g.numa_node for g in topo.gpus] == [-1] * 8 and {g.nic for g in topo.gpus} == {""}
    assert topo.matrix["GPU0"].cells["GPU7"] == "NV18"


def test_pci_relation_words():
    def dev(*chain, numa=0):
        return PciDevice(bdf=chain[-1], chain=("pci0000:00", *chain), numa=numa)

    gpu = dev("rp1", "us", "ds1", "lus", "lds1", "gpu")
    assert pci_relation(gpu, dev("rp1", "us", "ds1", "lus", "lds2", "nic")) == "PIX"
    assert pci_relation(gpu, dev("rp1", "us", "ds2", "nic")) == "PXB"  # upper switch + leaf switch
    assert pci_relation(dev("rp1", "us", "ds1", "a"), dev("rp1", "us", "ds2", "b")) == "PIX"  # one switch
    assert pci_relation(gpu, dev("rp2", "nic")) == "PHB"
    other_root = PciDevice(bdf="nic", chain=("pci0000:80", "rp", "nic"), numa=0)
    assert pci_relation(gpu, other_root) == "NODE"
    assert pci_relation(gpu, PciDevice(bdf="nic", chain=("pci0000:80", "rp", "nic"), numa=1)) == "SYS"
    assert pci_relation(gpu, PciDevice(bdf="nic", chain=None, numa=-1)) == "SYS"


# ------------------------------------------------------------------------------------------------ --discover


def test_discover_json_through_main(tmp_path, monkeypatch, capsys):
    """`phalanx-agent --discover --json` on a (fake) NVML host: the JSON shape the issue asks for."""
    dump = load_profile("dgx-a100").dump
    nv = fake_nvml(dump, gpu_model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
    build_fake_sysfs(tmp_path, dump, nv.simulated_host.pci_bus_ids)
    monkeypatch.setattr(
        agent_main,
        "discover_topology",
        functools.partial(discover_topology, nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False),
    )
    # main() would point structlog at the captured stderr, which is closed after this test.
    monkeypatch.setattr(agent_main, "configure_logging", lambda *a, **k: structlog.get_logger())
    assert agent_main.main(["--discover", "--json", "--node-name", "n1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"gpus", "nics", "matrix"}
    assert len(data["gpus"]) == 8 and len(data["nics"]) == 10
    for i, g in enumerate(data["gpus"]):
        assert {"index", "uuid", "name", "memory_mib", "pci_bus_id", "numa_node", "nic"} <= set(g)
        assert g["index"] == i and g["name"] == "NVIDIA A100-SXM4-80GB" and g["memory_mib"] == 81920
        assert g["numa_node"] == [3, 1, 7, 5][i // 2] and g["nic"] == f"NIC{i}"
        assert g["compute_capability"] == "8.0" and g["mig_mode"] == "disabled"
    assert [(n["name"], n["nearest_gpu"]) for n in data["nics"]] == [(f"NIC{i}", i if i < 8 else -1) for i in range(10)]
    devices = [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(10)]
    assert set(data["matrix"]) == set(devices)
    for row in devices:
        assert set(data["matrix"][row]) == set(devices) - {row}
        for col in devices:
            if col != row:
                assert data["matrix"][row][col] == dump.cell(row, col)
    assert data == topology_to_json(discover_topology(nvml=nv, sysfs_root=tmp_path, use_nvidia_smi=False))

    assert agent_main.main(["--discover", "--node-name", "n1"]) == 0
    table = capsys.readouterr().out
    assert "GPU0" in table and "NV12" in table and "NIC Legend" in table and "mlx5_9" in table
    assert parse_topo(table).matrix["NIC8"]["NIC9"] == "PIX"
