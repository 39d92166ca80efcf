"""Keep a replica's resident memory to what serving needs (Linux + glibc; a no-op elsewhere).

Three kinds of pages stay resident after start-up although serving never reads them again:
  - heap pages the loader freed (dequantized copies, unfused weights): glibc keeps them until
    malloc_trim hands them back (~60 MB for SmolLM2's GGUF);
  - pages of shared libraries touched only while starting: importing torch alone faults in
    ~135 MB of libtorch_cpu.so (static initializers registering every operator). They are clean
    file-backed pages, so MADV_PAGEOUT drops them at no risk (the kernel would drop them under
    pressure anyway); the ~35 MB that serving uses fault back in on first use (read back from
    disk if the page cache let them go: tens of ms, spread over the first requests). Pages a
    process has written (relocations, globals) are anonymous copies: PAGEOUT leaves them alone
    without swap. Pages another process maps too (a second replica on the host) are shared
    and stay: each process's RSS counts them, its PSS splits them.
  - freed activations: glibc's mmap threshold starts at 128 KB and rises (to 32 MB) each time a
    large block is freed, after which step-sized tensors (logits of a 64-sequence batch: 12 MB)
    come from the heap and stay resident, fragmented, after the step. A fixed 1 MB threshold
    keeps every large tensor in its own mapping, returned to the OS when freed (one mmap and
    its page faults per large tensor: an interleaved A/B of SmolLM2 batch-64 decode steps,
    1 MB vs 32 MB threshold, measured 186 vs 188 ms median, i.e. no cost above noise).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

MADV_PAGEOUT = 21  # linux/mman-common.h, Linux >= 5.4


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")  # runs ldconfig: once per process
    return ctypes.CDLL(name, use_errno=True) if name else None


M_TRIM_THRESHOLD = -1  # malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 4 << 20


def bound_heap_retention() -> bool:
    """Fix glibc's mmap threshold at 1 MB and trim the heap top past 4 MB of free space; turn off
    MKL's buffer pool (MKL_DISABLE_FAST_MM: its per-thread cache of freed GEMM buffers, ~5 MB,
    unless the user set it). Call before importing torch. False where the C library has no
    mallopt (not glibc)."""
    os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD_BYTES))


def return_freed_heap() -> None:
    """malloc_trim(0): give the heap's free pages back to the OS."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None  # glibc only
    if trim is not None:
        trim(0)


def page_out_file_mappings() -> int:
    """Ask the kernel to reclaim this process's resident pages of file-backed mappings (shared
    libraries, model files). Returns the bytes of mappings advised (0 where unsupported)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = _libc()
    if libc is None:
        return 0
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):  # anonymous, [heap], [stack], [vdso]...
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
        elif ctypes.get_errno() == 22:  # EINVAL: kernel without MADV_PAGEOUT; nothing else will work
            return advised
    return advised
