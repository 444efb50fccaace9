"""What each device kind runs, from the native module's one record (native/capabilities.h): its
all-reduce paths, those that carry compressed wires, its world sizes and those of its top-k
exchanges. The daemon checks Joins against it; a rank's dispatch picks among its paths."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from enum import Enum

from nodecomm import _native
from nodecomm.thresholds import Path


class DeviceKind(str, Enum):
    """What a group runs on: host shared memory or GPUs (the proto's device_kind strings)."""

    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Capabilities:
    paths: frozenset[Path]
    wire_paths: frozenset[Path]
    world_sizes: frozenset[int]
    topk_world_sizes: frozenset[int]


def shown_sizes(sizes: frozenset[int]) -> str:
    """World sizes as runs: {1, ..., 8, 16} as "1-8 or 16"."""
    runs: list[list[int]] = []
    for size in sorted(sizes):
        if runs and size == runs[-1][-1] + 1:
            runs[-1].append(size)
        else:
            runs.append([size])
    shown = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]


def _record(fields: dict) -> Capabilities:
    return Capabilities(
        paths=frozenset(Path.from_proto(int(code)) for code in fields["paths"]),
        wire_paths=frozenset(Path.from_proto(int(code)) for code in fields["wire_paths"]),
        world_sizes=frozenset(fields["world_sizes"]),
        topk_world_sizes=frozenset(fields["topk_world_sizes"]),
    )


# By device kind (CUDA in a CUDA build only).
CAPABILITIES: dict[DeviceKind, Capabilities] = {
    DeviceKind(kind): _record(fields) for kind, fields in _native.CAPABILITIES.items()
}


def path_names(kind: str) -> list[str]:
    """The names of `kind`'s all-reduce paths in Path order (none for a kind this build lacks)."""
    capabilities = CAPABILITIES.get(kind)
    return [path.value for path in Path if capabilities is not None and path in capabilities.paths]


def has_rank_environment() -> bool:
    """Whether torch, and nodecomm's module built against it, are installed here (not a daemon-only
    install): what rank processes need (the client, the bench's ranks, a calibration's probe)."""
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("nodecomm._c10d") is not None
