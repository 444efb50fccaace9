"""memfd segments and raw mappings of them, for the daemon (creates) and ranks (map what they claim).

Mappings are made with libc's mmap so that callers get a plain address to hand to the native
module, and can unmap at a time of their choosing, without Python buffer exports pinning them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

# Seals keep a holder of the descriptor from shrinking a segment under its peers (which would turn
# their accesses into SIGBUS).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_segment(name: str, size_bytes: int) -> int:
    """A sealed memfd of exactly `size_bytes`, its pages reserved now (ENOMEM/ENOSPC -> MemoryError)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        if size_bytes:
            os.posix_fallocate(fd, 0, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError as error:
        os.close(fd)
        if error.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
            raise MemoryError(f"cannot reserve {size_bytes} bytes of host shared memory: {error.strerror}") from None
        raise
    return fd


def map_segment(fd: int, size_bytes: int) -> int:
    """Map the whole segment read-write and shared; returns its address."""
    address = _libc.mmap(None, size_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, f"mmap of {size_bytes} bytes failed: {os.strerror(code)}")
    return address


def unmap_segment(address: int, size_bytes: int) -> None:
    if _libc.munmap(address, size_bytes) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"munmap failed: {os.strerror(code)}")


def segment_size(fd: int) -> int:
    return os.fstat(fd).st_size
