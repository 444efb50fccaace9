"""A machine's fingerprint: what a calibration measured on, so that a daemon reuses a stored one
only on the same machine (CPU model and count; GPUs, their links and the native build)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform

from nodecomm import _native
from nodecomm.capabilities import DeviceKind


def cpu_fingerprint() -> dict[str, object]:
    """What a CPU calibration depends on: the processor, how many of them, the native build."""
    model = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "device_kind": DeviceKind.CPU.value,
        "machine": platform.machine(),
        "cpu_model": model,
        "cpus": os.cpu_count(),
        "native": native_build(),
    }


def cuda_fingerprint(devices: list[dict], links: list[list[tuple]]) -> dict[str, object]:
    """What a CUDA calibration depends on: which GPUs (model, PCI address, UUID), how they reach
    each other, and the native build. `devices` and `links` as _native.cuda_devices() and
    _native.cuda_peer_links() give them."""
    return {
        "device_kind": DeviceKind.CUDA.value,
        "gpus": [f"{d['name']} {d['pci_bus_id']} {d['uuid']}" for d in devices],
        "peer_links": [[list(cell) for cell in row] for row in links],
        "native": native_build(),
    }


@functools.cache
def native_build() -> str:
    """A digest of the native module's file: a rebuilt or upgraded transport is measured anew."""
    digest = hashlib.sha256()
    with open(_native.__file__, "rb") as module:
        for block in iter(lambda: module.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def fingerprint_key(fingerprint: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
