"""Device memory crosses processes as a descriptor: the daemon's half allocates and exports, a
rank's half imports and maps, and both see each other's writes."""

import multiprocessing as mp
import os
import tempfile

import pytest

import descriptor_passing
from nodecomm import _native

pytestmark = pytest.mark.gpu


class _DeviceBytes:
    """A raw device range as torch sees it (through __cuda_array_interface__)."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}


def as_tensor(address: int, size: int):
    import torch

    return torch.as_tensor(_DeviceBytes(address, size), device="cuda")


def _importer(path: str, size: int, results) -> None:
    import torch

    (address,) = descriptor_passing.receive_and_map(path, 1, size, 0, results)
    view = as_tensor(address, size)
    seen = int(view[: size // 2].sum().item())  # the exporter's half, filled with 1s
    view[size // 2 :].fill_(2)
    torch.cuda.synchronize()
    _native.cuda_vmm_unmap(address, size)
    results.put(seen)


def test_allocation_exported_as_descriptor_is_shared_between_processes():
    import torch

    size = _native.cuda_vmm_rounded_size(0, 3 << 20)
    assert size >= 3 << 20
    fd, address, size = _native.cuda_vmm_allocate(0, size)
    mine = as_tensor(address, size)
    assert int(mine.sum().item()) == 0  # allocations start zeroed
    mine[: size // 2].fill_(1)
    torch.cuda.synchronize()

    context = mp.get_context("spawn")
    results = context.Queue()
    path = os.path.join(tempfile.mkdtemp(), "fd.sock")
    child = context.Process(target=_importer, args=(path, size, results))
    child.start()
    try:
        assert results.get(timeout=60) == "listening"
        descriptor_passing.send(path, [fd])
        assert results.get(timeout=60) == size // 2
        child.join(timeout=60)
        assert child.exitcode == 0
        torch.cuda.synchronize()
        assert int(mine[size // 2 :].sum().item()) == 2 * (size - size // 2)
    finally:
        if child.is_alive():
            child.kill()
        os.close(fd)
        _native.cuda_vmm_unmap(address, size)


def test_device_uuids_are_stable_names():
    uuids = _native.cuda_device_uuids()
    assert uuids and all(u.startswith("GPU-") and len(u) == 40 for u in uuids)
