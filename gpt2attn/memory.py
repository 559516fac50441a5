"""Handing memory back to the system: the heap's free pages, and the pages of a file's memory map
that a tensor need not keep resident.

A model loaded from a checkpoint reads its tensors through private maps of the file
(formats.state_dict.mapped_bytes): a page, once read, is this process's resident memory until the
map goes. Where a tensor stays but its pages are no longer needed at once (a tied embedding after
quantize() has packed the head from it: lookups read a few rows a token; a tensor a writer has
just written out), `release_file_pages` unmaps them; the file's contents stay in the system's page
cache (memory the system takes back when it needs it), and a page used again is mapped again from
there. Linux only; elsewhere these do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys

import numpy as np
from torch import Tensor

MADV_DONTNEED = 4  # Linux's madvise advice: unmap these pages now
# /proc/self/pagemap, one 64-bit entry a page: bit 63, the page is in memory; bit 61, it is a
# file's page (or shared memory's), which a private map holds only while it is unchanged: a page
# written since it was mapped is a private copy, without bit 61, which MADV_DONTNEED would lose
PRESENT, FILE_PAGE = 1 << 63, 1 << 61


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): the fp32 weights and
    the temporaries quantize() frees are otherwise kept by malloc for reuse, and counted in the
    process's resident memory. A no-op where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def release_file_pages(t: Tensor) -> None:
    """Unmap the pages of t (its whole pages only) that hold a file's unchanged contents, as
    /proc/self/pagemap marks them: madvise(MADV_DONTNEED) on each run of them. Pages of memory of
    no file, and pages written since they were mapped, stay. t is one run of bytes in any order of
    its dimensions (a transposed weight too); nothing for a view with gaps between its elements,
    or where pagemap cannot be read. (A page another thread writes between the read of pagemap and
    the advice would lose that write: nothing here writes a tensor while it is released.)"""
    libc = _libc()
    if not sys.platform.startswith("linux") or libc is None:
        return
    if 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) != t.numel():
        return  # its first element to its last spans more than its own: other tensors' bytes between
    page = mmap.PAGESIZE
    first = -(-t.data_ptr() // page)  # page numbers: t's first whole page, and the one after its last
    end = (t.data_ptr() + t.numel() * t.element_size()) // page
    if end <= first:
        return
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            entries = np.frombuffer(os.pread(fd, (end - first) * 8, first * 8), dtype=np.uint64)
        finally:
            os.close(fd)
    except OSError:
        return
    if entries.size != end - first:
        return
    wanted = np.uint64(PRESENT | FILE_PAGE)
    unchanged = np.concatenate(([0], (entries & wanted) == wanted, [0])).astype(np.int8)  # (n + 2,)
    edges = np.flatnonzero(np.diff(unchanged)).tolist()  # where each run of such pages starts and ends
    for start, stop in zip(edges[::2], edges[1::2]):
        libc.madvise(ctypes.c_void_p((first + start) * page), ctypes.c_size_t((stop - start) * page),
                     ctypes.c_int(MADV_DONTNEED))


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except (OSError, TypeError):  # Windows: no process-wide C library handle (CDLL(None) is refused)
        return None
