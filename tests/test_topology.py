"""nodecomm topo: pair relations, paths and warnings from a sysfs tree laid out like a real
two-socket PCIe machine, and the command itself on this machine."""

import ctypes
import json
import os
import subprocess
import sys

from nodecomm import _native
from nodecomm.tools.topology import format_topology, node_topology
from test_cli import nodecomm_cli

# Socket 0 (NUMA 0): root complex pci0000:00, GPUs 0 and 1 behind one switch, GPU 2 behind a second
# switch hanging off the first. Socket 1 (NUMA 1): root complex pci0000:80, GPU 3 on its own root port.
GPU_PATHS = {
    "0000:03:00.0": "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
    "0000:04:00.0": "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:04:00.0",
    "0000:07:00.0": "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:05:00.0/0000:06:00.0/0000:07:00.0",
    "0000:81:00.0": "pci0000:80/0000:80:01.0/0000:81:00.0",
}
NUMA = {"0000:03:00.0": 0, "0000:04:00.0": 0, "0000:07:00.0": 0, "0000:81:00.0": 1}


def make_sysfs(root):
    devices, bus = root / "devices", root / "bus"
    bus.mkdir(parents=True)
    for bus_id, path in GPU_PATHS.items():
        node = devices / path
        node.mkdir(parents=True)
        (node / "numa_node").write_text(f"{NUMA[bus_id]}\n")
        (node / "current_link_speed").write_text("32.0 GT/s PCIe\n")
        (node / "current_link_width").write_text("16\n" if bus_id != "0000:81:00.0" else "8\n")
        (node / "max_link_speed").write_text("32.0 GT/s PCIe\n")
        (node / "max_link_width").write_text("16\n")
        os.symlink(node, bus / bus_id)
    return str(bus)


def devices():
    return [
        {
            "uuid": f"GPU-{i}",
            "name": "RTX PRO 6000",
            "pci_bus_id": bus_id,
            "multiprocessors": 188,
            "memory_bytes": 96 << 30,
        }
        for i, bus_id in enumerate(GPU_PATHS)
    ]


def links(blocked=()):
    n = len(GPU_PATHS)
    return [[((i, j) not in blocked and (j, i) not in blocked, False, 0) for j in range(n)] for i in range(n)]


def test_relations_paths_and_warnings(tmp_path):
    topology = node_topology(devices(), links(blocked={(0, 3)}), sysfs=make_sysfs(tmp_path), environ={})
    assert [g.root_complex for g in topology.gpus] == ["pci0000:00"] * 3 + ["pci0000:80"]
    assert [g.numa_node for g in topology.gpus] == [0, 0, 0, 1]
    assert topology.relations == [
        ["X", "PIX", "PXB", "SYS"],
        ["PIX", "X", "PXB", "SYS"],
        ["PXB", "PXB", "X", "SYS"],
        ["SYS", "SYS", "SYS", "X"],
    ]
    assert topology.gpus[3].link == "Gen5 x8 (max Gen5 x16)"
    assert topology.paths[0][1] == ["oneshot", "twoshot", "dma", "nccl"]
    assert topology.paths[0][3] == ["nccl"]
    text = "\n".join(topology.warnings)
    assert "no peer access between GPUs 0-3" in text
    assert "GPUs 0-3, 1-3, 2-3 sit behind different root complexes" in text
    assert "NCCL_P2P_LEVEL is not set" in text
    assert "GPUs [3] run below their maximum PCIe link" in text
    shown = format_topology(topology)
    assert "PIX/P2P" in shown and "warning: no peer access" in shown

    quiet = node_topology(devices()[:2], links(), sysfs=make_sysfs(tmp_path / "again"), environ={})
    assert quiet.warnings == [] and quiet.relations[0][1] == "PIX"


def test_the_command_on_this_machine():
    result = nodecomm_cli("topo", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    keys = {"gpus", "relations", "peer_access", "paths", "iommu", "warnings"}
    assert set(document) == (keys if document["gpus"] else keys | {"no_gpu_reason"})
    assert len(document["relations"]) == len(document["gpus"])


def test_no_gpu_says_which_of_the_three_causes():
    """The build, the driver or the devices: the command names the one that holds here."""
    shown = subprocess.run(
        [sys.executable, "-c", "import sys; from nodecomm.tools.cli import main; sys.exit(main())", "topo"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    ).stdout  # fmt: skip
    try:
        ctypes.CDLL("libcuda.so.1")
        driver = True
    except OSError:
        driver = False
    if not _native.WITH_CUDA:
        assert "this build of nodecomm has no CUDA transport" in shown, shown
    elif not driver:
        assert "no NVIDIA driver: libcuda.so.1 does not load" in shown, shown
    else:
        assert "the driver sees no GPU" in shown and "CUDA_VISIBLE_DEVICES ''" in shown, shown
    assert shown.startswith("no GPUs visible: ") and shown.rstrip().endswith("CPU groups only")
    assert format_topology(node_topology([], []), "why") == "no GPUs visible: why; CPU groups only"
