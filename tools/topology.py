"""nodecomm topo: the node's GPUs, how they connect, and which paths each pair can use.

GPUs come from the CUDA runtime (UUID, PCI address, peer-access attributes); links from sysfs
(PCIe generation and width, NUMA node, the bridges between a GPU and its root complex). Each pair
gets the relation `nvidia-smi topo -m` would print for PCIe: PIX (one switch between them), PXB
(several switches), PHB (the same root complex), NODE (different root complexes on one NUMA
node), SYS (different NUMA nodes).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass, field

SYSFS_PCI = "/sys/bus/pci/devices"

# PCIe generation by the per-lane rate sysfs reports.
_GENERATIONS = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_bytes: int
    numa_node: int | None = None
    current_link: str | None = None  # e.g. "Gen5 x8"; None where sysfs does not say
    max_link: str | None = None
    root_complex: str | None = None  # the host bridge, e.g. "pci0000:40"
    bridges: list[str] = field(default_factory=list)  # PCI addresses from the root port down

    @property
    def link(self) -> str:
        return f"{self.current_link} (max {self.max_link})" if self.current_link else "unknown"

    @property
    def downtrained(self) -> bool:
        return self.current_link is not None and self.current_link != self.max_link


def read_text(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def link_generation(speed: str | None) -> str:
    """'32.0 GT/s PCIe' -> 'Gen5'."""
    if not speed:
        return "?"
    return f"Gen{_GENERATIONS[speed.split()[0]]}" if speed.split()[0] in _GENERATIONS else speed


def pci_ancestry(bus_id: str, sysfs: str = SYSFS_PCI) -> tuple[str | None, list[str]]:
    """(host bridge, the PCI functions from the root port down to `bus_id`, exclusive): the
    bridges and switch ports a transfer crosses. (None, []) when sysfs does not know the device."""
    link = os.path.join(sysfs, bus_id)
    if not os.path.exists(link):
        return None, []
    parts = os.path.realpath(link).split(os.sep)
    hosts = [p for p in parts if p.startswith("pci") and p.count(":") == 1]
    functions = [p for p in parts if p.count(":") == 2 and "." in p]
    if not hosts or not functions or functions[-1] != bus_id:
        return None, []
    return hosts[-1], functions[:-1]


def describe_gpu(index: int, info: dict, sysfs: str = SYSFS_PCI) -> Gpu:
    bus_id = info["pci_bus_id"]
    base = os.path.join(sysfs, bus_id)
    numa = read_text(os.path.join(base, "numa_node"))

    def link(which: str) -> str | None:
        speed, width = (read_text(os.path.join(base, f"{which}_link_{part}")) for part in ("speed", "width"))
        return f"{link_generation(speed)} x{width}" if speed and width else None

    root_complex, bridges = pci_ancestry(bus_id, sysfs)
    return Gpu(
        index=index,
        uuid=info["uuid"],
        name=info["name"],
        pci_bus_id=bus_id,
        memory_bytes=info["memory_bytes"],
        numa_node=int(numa) if numa not in (None, "-1") else None,
        current_link=link("current"),
        max_link=link("max"),
        root_complex=root_complex,
        bridges=bridges,
    )


def pair_relation(a: Gpu, b: Gpu) -> str:
    if a.index == b.index:
        return "X"
    if a.root_complex is None or b.root_complex is None:
        return "?"
    if a.root_complex != b.root_complex:
        return "SYS" if a.numa_node != b.numa_node else "NODE"
    shared = 0
    for x, y in zip(a.bridges, b.bridges, strict=False):
        if x != y:
            break
        shared += 1
    if shared == 0:
        return "PHB"  # different root ports: through the host bridge
    # Ports crossed below the lowest common one: a single switch is its two downstream ports.
    crossed = len(a.bridges) + len(b.bridges) - 2 * shared
    return "PIX" if crossed <= 2 else "PXB"


def pair_paths(access: bool) -> list[str]:
    """The nodecomm paths a pair can carry: every path but NCCL maps the peer's memory, so
    without peer access the group's check fails and only NCCL remains."""
    return ["oneshot", "twoshot", "dma", "nccl"] if access else ["nccl"]


@dataclass
class Topology:
    gpus: list[Gpu]
    relations: list[list[str]]
    peer_access: list[list[bool]]
    paths: list[list[list[str]]]
    warnings: list[str]
    iommu: bool

    def to_json(self) -> dict:
        return {
            "gpus": [asdict(g) for g in self.gpus],
            "relations": self.relations,
            "peer_access": self.peer_access,
            "paths": self.paths,
            "iommu": self.iommu,
            "warnings": self.warnings,
        }


def node_topology(
    devices: list[dict], links: list[list[tuple]], sysfs: str = SYSFS_PCI, environ=os.environ
) -> Topology:
    gpus = [describe_gpu(i, info, sysfs) for i, info in enumerate(devices)]
    n = len(gpus)
    relations = [[pair_relation(a, b) for b in gpus] for a in gpus]
    access = [[bool(links[i][j][0]) for j in range(n)] for i in range(n)]
    paths = [[pair_paths(access[i][j]) if i != j else [] for j in range(n)] for i in range(n)]
    iommu = bool(os.listdir("/sys/class/iommu")) if os.path.isdir("/sys/class/iommu") else False
    warnings = []
    blocked = [(i, j) for i in range(n) for j in range(i + 1, n) if not (access[i][j] and access[j][i])]
    if blocked:
        pairs = ", ".join(f"{i}-{j}" for i, j in blocked)
        cause = (
            "an IOMMU is on (ACS or IOMMU translation can block peer traffic)" if iommu else "check ACS and the BIOS"
        )
        warnings.append(f"no peer access between GPUs {pairs}: groups spanning them run on NCCL only; {cause}")
    crossing = [(i, j) for i in range(n) for j in range(i + 1, n) if relations[i][j] in ("NODE", "SYS")]
    if crossing:
        pairs = ", ".join(f"{i}-{j}" for i, j in crossing)
        warnings.append(f"GPUs {pairs} sit behind different root complexes: peer writes cross the CPU interconnect")
        if "NCCL_P2P_LEVEL" not in environ:
            warnings.append(
                "NCCL_P2P_LEVEL is not set: NCCL will not use peer-to-peer between GPUs behind different root "
                "complexes; set it (e.g. SYS) only where measurement shows it helps"
            )
    slow = [g.index for g in gpus if g.downtrained]
    if slow:
        warnings.append(
            f"GPUs {slow} run below their maximum PCIe link (idle GPUs downclock the link; check under load)"
        )
    return Topology(gpus, relations, access, paths, warnings, iommu)


def why_no_gpu(with_cuda: bool) -> str:
    """Which of the three reasons leaves nodecomm without GPUs: its build, the driver, the devices."""
    if not with_cuda:
        return "this build of nodecomm has no CUDA transport (built with NODECOMM_CPU_ONLY=1 or without a CUDA toolkit)"
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return (
            "no NVIDIA driver: libcuda.so.1 does not load (none installed, or a container started without the "
            "NVIDIA runtime)"
        )
    count = ctypes.c_int(0)
    result = driver.cuInit(0)
    if result == 0:
        result = driver.cuDeviceGetCount(ctypes.byref(count))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    return (
        f"the driver sees no GPU (cuInit/cuDeviceGetCount: CUresult {result}, {count.value} devices; "
        f"CUDA_VISIBLE_DEVICES {shown}; in a container, were the GPUs passed in?)"
    )


def format_topology(topology: Topology, no_gpu_reason: str = "") -> str:
    if not topology.gpus:
        return f"no GPUs visible: {no_gpu_reason or 'none found'}; CPU groups only"
    lines = [f"{'gpu':<4} {'uuid':<41} {'pci':<13} {'numa':>4}  {'link':<26} name"]
    for g in topology.gpus:
        numa = "-" if g.numa_node is None else str(g.numa_node)
        lines.append(f"{g.index:<4} {g.uuid:<41} {g.pci_bus_id:<13} {numa:>4}  {g.link:<26} {g.name}")
    lines += ["", "relation (PIX/PXB: PCIe switch, PHB: same root complex, NODE/SYS: across root complexes); "
              "P2P: peer access"]  # fmt: skip
    n = len(topology.gpus)
    lines.append("      " + " ".join(f"{'gpu' + str(j):>9}" for j in range(n)))
    for i in range(n):
        cells = []
        for j in range(n):
            relation = topology.relations[i][j]
            cells.append(
                f"{relation:>9}" if i == j else f"{relation + ('/P2P' if topology.peer_access[i][j] else ''):>9}"
            )
        lines.append(f"gpu{i:<3}" + "".join(" " + c for c in cells))
    lines += ["", "paths per pair:"]
    for i in range(n):
        for j in range(i + 1, n):
            lines.append(f"  {i}-{j}: {', '.join(topology.paths[i][j])}")
    lines += [f"warning: {w}" for w in topology.warnings]
    return "\n".join(lines)
