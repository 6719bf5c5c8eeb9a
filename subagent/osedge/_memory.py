"""A forking parent's memory, prepared once: malloc's free space returned, the rest in huge pages.

What a process that forks many children (the runner zygote) does before its first fork,
so that each child costs the kernel less. A fork copies the page table entries of every
anonymous page the parent has, and the child's exit takes them down again, one entry per
4 KiB page: ~25,000 of them for a zygote with 100 MiB of anonymous memory, a few
milliseconds each way. A 2 MiB huge page is one entry. ``MADV_COLLAPSE`` (Linux 6.1)
makes huge pages of memory already there, synchronously, whatever the system's THP
mode (``madvise`` or ``always``; not ``never``); a child that writes to one gets its own
copy of that 4 KiB page only (the kernel splits the shared mapping first), so what a
child does not share does not grow. The ranges are not marked ``MADV_HUGEPAGE``: memory
a child (or the parent) touches later still comes 4 KiB at a time.

Everything here is best effort: on a kernel or libc without the call, or with no huge
page to spare, it does nothing and says so. Stdlib only.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["Prepared", "anonymous_chunks", "fill_small_object_holes", "prepare_for_forks"]

MADV_COLLAPSE: Final = 25
_PAGE: Final = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# A chunk is collapsed when at least this share of its pages is already there: the rest
# is filled with zeros (memory the parent then holds, shared by every child).
MIN_PRESENT: Final = 0.5


@dataclass(frozen=True)
class Prepared:
    """What ``prepare_for_forks`` did: bytes malloc gave back, huge-page chunks made
    (and tried), and why it stopped early, if it did."""

    trimmed: bool
    chunks: int
    collapsed: int
    skipped_sparse: int
    error: str | None = None

    @property
    def collapsed_bytes(self) -> int:
        return self.collapsed * huge_page_size()


def huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


def anonymous_chunks(maps: str, huge: int) -> list[tuple[int, int]]:
    """The huge-page-aligned parts of every writable private anonymous mapping (the heap
    and unnamed ones: malloc's and Python's arenas) in ``/proc/self/maps`` text."""
    out: list[tuple[int, int]] = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        perms = parts[1]
        name = parts[5].strip() if len(parts) > 5 else ""
        if "w" not in perms or "p" not in perms or name not in ("", "[heap]"):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        a = (start + huge - 1) & ~(huge - 1)
        b = end & ~(huge - 1)
        out.extend((x, x + huge) for x in range(a, b, huge))
    return out


def _present(pagemap: int, start: int, size: int) -> int | None:
    """How many pages of [start, start + size) are in memory (``/proc/self/pagemap``)."""
    n = size // _PAGE
    try:
        raw = os.pread(pagemap, 8 * n, (start // _PAGE) * 8)
    except OSError:
        return None
    if len(raw) != 8 * n:
        return None
    return sum(1 for (e,) in struct.iter_unpack("<Q", raw) if e >> 63)


Madvise = Callable[[int, int, int], int]  # (address, length, advice) -> 0, or -errno


def _libc_madvise() -> Madvise | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int

    def madvise(addr: int, length: int, advice: int) -> int:
        if fn(addr, length, advice) == 0:
            return 0
        return -ctypes.get_errno()

    return madvise


def _malloc_trim() -> bool:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def _pymalloc_avail() -> dict[int, int] | None:
    """CPython's small-object allocator: free blocks per size class in its used pools
    (``sys._debugmallocstats``, which writes to the C stderr: read through a memfd)."""
    stats = getattr(sys, "_debugmallocstats", None)
    if stats is None or not hasattr(os, "memfd_create"):
        return None
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        return None  # no stderr to borrow
    try:
        fd = os.memfd_create("mallocstats", os.MFD_CLOEXEC)
    except OSError:
        os.close(saved)
        return None
    try:
        os.dup2(fd, 2)
        try:
            stats()
        finally:
            os.dup2(saved, 2)
        text = os.pread(fd, 1 << 20, 0).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)
        os.close(saved)
    avail: dict[int, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5 and all(p.isdigit() for p in parts):
            avail[int(parts[1])] = int(parts[4])
    return avail or None


def fill_small_object_holes(keep: list[object]) -> int:
    """Take every free block of the small-object allocator's used pools (into ``keep``),
    so that a forked child's new objects go to fresh pools instead of into holes among
    the parent's objects: each such allocation would copy a 4 KiB page the child shares
    with its parent for one small object. Returns the blocks taken (0 when unknown).
    The 16-byte class is left (no object that size to fill it with)."""
    avail = _pymalloc_avail()
    if not avail:
        return 0
    taken = 0
    for size, n in sorted(avail.items()):
        if n <= 0:
            continue
        if size == 32:
            # an int of one digit (28 bytes), never a cached small one
            keep.extend((1 << 29) + i for i in range(n))
        elif size >= 48:
            keep.extend(bytes(size - 33) for _ in range(n))  # 33 + len bytes
        else:
            continue
        taken += n
    return taken


def prepare_for_forks(*, madvise: Madvise | None = None, collapse: bool = True) -> Prepared:
    """Return malloc's free memory to the kernel, then put this process's anonymous
    memory in huge pages where it is mostly there already. Never raises for want of
    support: the result says what was done. Call it single-threaded, after the imports
    and ``gc.freeze()``, before the first fork (it takes 50-150 ms for ~100 MiB)."""
    trimmed = _malloc_trim()
    if not collapse or not os.path.exists("/proc/self/maps"):
        return Prepared(trimmed, 0, 0, 0, None if collapse else "collapse off")
    advise = madvise or _libc_madvise()
    if advise is None:
        return Prepared(trimmed, 0, 0, 0, "no madvise")
    huge = huge_page_size()
    try:
        with open("/proc/self/maps") as f:
            chunks = anonymous_chunks(f.read(), huge)
    except OSError as exc:
        return Prepared(trimmed, 0, 0, 0, f"maps: {exc}")
    try:
        pagemap: int | None = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        pagemap = None
    collapsed = sparse = 0
    error: str | None = None
    try:
        for start, end in chunks:
            if pagemap is not None:
                present = _present(pagemap, start, end - start)
                if present is not None and present < MIN_PRESENT * (end - start) // _PAGE:
                    sparse += 1
                    continue
            rc = advise(start, end - start, MADV_COLLAPSE)
            if rc == 0:
                collapsed += 1
            elif rc in (-errno.EINVAL, -errno.ENOSYS, -errno.EPERM):
                error = f"MADV_COLLAPSE: {os.strerror(-rc)}"  # not this kernel, or THP off
                break
            # else EAGAIN / ENOMEM / EBUSY: no huge page now for this chunk; go on
    finally:
        if pagemap is not None:
            os.close(pagemap)
    return Prepared(trimmed, len(chunks), collapsed, sparse, error)
