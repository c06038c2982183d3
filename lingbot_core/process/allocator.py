"""Keep freed memory in the process instead of handing it back to the OS after every block.

PyTorch's CPU tensors come from the C library's malloc. glibc serves a request above its mmap threshold
(128 KiB, rising with use up to 32 MiB) with a fresh mmap and unmaps it on free, and it trims the heap top
back to the OS once more than 128 KiB lie free there. A block allocates and frees the same large
activations (attention, VAE feature maps) hundreds of times, so each of them was mapped, zero-filled page
by page by the kernel (one minor fault a 4 KiB page) and unmapped again: on a 2-core AVX2 EPYC the offline
command took 4.5 million minor faults and 16 s of system time for 3 blocks (benchmarks/bench_block.py
prints the figures). Raising the thresholds keeps those pages mapped and reused.

`keep_freed_memory()` sets them with mallopt before the first large allocation; lingbot_core calls it
when it is imported, so the app, the offline command, the examples and the benchmarks all get it without an
environment variable. Values the user set with glibc's own MALLOC_*_ variables or GLIBC_TUNABLES win.
Elsewhere (macOS, musl, Windows) it does nothing and says so. The cost is resident memory: freed
buffers stay in the process up to the model's peak working set, which the engine's admission already
leaves room for (it budgets only half of the free memory by default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# mallopt takes an int, so 2 GiB - 1 is its largest value. Buffers up to that size come from the heap and
# are reused; glibc releases before 2.35 refuse a threshold above 32 MiB (HEAP_MAX_SIZE / 2): then 32 MiB.
MMAP_THRESHOLD_BYTES = 2**31 - 1
MMAP_THRESHOLD_FALLBACK_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2**31 - 1  # never give the heap top back while under 2 GiB free there
TOP_PAD_BYTES = 2**30  # grow the heap in 1 GiB steps of address space (pages count only once touched)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def keep_freed_memory(environ=os.environ) -> str:
    """Set glibc malloc to keep freed memory; returns what was done, for the start-up log."""
    if not sys.platform.startswith("linux"):
        return f"allocator left as it is ({sys.platform} is not glibc)"
    user = [name for name in USER_SETTINGS if name in environ]
    if user:
        return f"allocator left as set by {', '.join(user)}"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "allocator left as it is (no glibc mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    threshold = MMAP_THRESHOLD_BYTES
    if not mallopt(M_MMAP_THRESHOLD, threshold):
        threshold = MMAP_THRESHOLD_FALLBACK_BYTES
        mallopt(M_MMAP_THRESHOLD, threshold)
    if not (mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) and mallopt(M_TOP_PAD, TOP_PAD_BYTES)):
        return "allocator: glibc refused the trim threshold or the top pad"
    return (f"allocator: glibc malloc keeps freed memory (buffers up to {threshold / 2**20:.0f} MiB from the heap, "
            f"heap not trimmed, grown in {TOP_PAD_BYTES >> 20} MiB steps)")


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_freed_memory() -> bool:
    """Give the allocator's freed memory back to the system now (glibc malloc_trim over every arena).

    `keep_freed_memory` keeps freed buffers for the model's next block; a burst of large start pictures
    would otherwise stay resident after their decode (a 40 MP picture frees about 300 MiB). The model's own
    buffers are freed too and are faulted in again by its next block (a few ms of system time on a CPU),
    so callers trim only after work that grew the process (`resident_bytes`). Returns whether anything was
    released."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(libc.malloc_trim(0))

