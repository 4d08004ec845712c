"""Large buffers from the operating system and back to it, at once.

glibc serves an allocation above its mmap threshold with a mapping of its own, returned to the
system when freed; but each such free raises the threshold to the freed size (up to 32 MiB),
after which buffers that size come from the heap, and the heap keeps what is freed. A streamed
conversion makes one tensor, writes it and lets it go, so its peak memory grew with every
tensor size it met (a mapped Llama conversion: 131 MB above the imports for a 33 MB largest
tensor) instead of holding one group. A fixed threshold keeps every large buffer a mapping of
its own (37 MB above the imports there). Stdlib only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["return_large_buffers"]

_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
_THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed


def return_large_buffers() -> bool:
    """Fix glibc's mmap threshold for this process (once, at the command line's start); False
    where the C library is not glibc or refuses, and nothing changes."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError):
        return False
