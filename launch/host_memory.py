"""Keep freed host memory in the process, so a CPU training step does not page it in again each step.

Public names: `retain_freed_host_memory`.

glibc's `malloc` serves each large block (above a threshold that adapts up to 32 MiB) with its own
`mmap` and unmaps it on `free`, and returns the free top of its heap to the OS. A training step
allocates and frees the same large buffers (activations, gradients, optimizer temporaries) every
iteration, so it pays a page fault and a zeroed page for every 4 KiB of them, every step (BENCHMARKS.md
has the measured cost). Keeping freed memory costs the peak footprint, which a training process
reaches every step anyway. `launch/train.py` and `launch/bench.py` call this at
start; it is a process-wide setting, so a library never calls it on its own.

Example:
    >>> import platform
    >>> retain_freed_host_memory() == (platform.libc_ver()[0] == "glibc")  # first thing in a training script
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["retain_freed_host_memory"]

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1  # mallopt takes an int


@functools.lru_cache(maxsize=1)
def retain_freed_host_memory() -> bool:
    """Make glibc keep freed blocks under 2 GiB in its heap and never trim the heap.

    Returns:
        True where the setting was applied (glibc), False elsewhere (musl, macOS, Windows), where
        the allocator is left as it is.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has a mallopt that does nothing)
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST)) and bool(mallopt(_M_TRIM_THRESHOLD, _LARGEST))
