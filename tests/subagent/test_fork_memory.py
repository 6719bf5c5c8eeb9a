"""A forking parent's memory preparation (``subagent.osedge._memory``) and the zygote with
and without it: best effort, never a failure of the zygote."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from subagent.osedge import _memory
from subagent.zygote import PREPARE_VAR, decode, encode
from tests import conftest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory maps")

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

MAPS = """\
55d0a0000000-55d0a0400000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000700000 rw-p 00000000 00:00 0
7f0000700000-7f0000900000 r--p 00000000 00:00 0
7f0000a00000-7f0000c00000 rw-s 00000000 00:01 42                         /dev/zero (deleted)
7f0001000000-7f0001400000 rw-p 00001000 08:01 1234                       /usr/lib/libpython3.11.so
7fff00000000-7fff00400000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_writable_private_anonymous_memory_is_chosen_in_whole_huge_pages() -> None:
    chunks = _memory.anonymous_chunks(MAPS, 2 * MIB)
    assert chunks == [
        (0x55D0A0000000, 0x55D0A0200000),  # the heap: two whole huge pages
        (0x55D0A0200000, 0x55D0A0400000),
        (0x7F0000200000, 0x7F0000400000),  # 1 MiB .. 7 MiB: the aligned 2-6 MiB part
        (0x7F0000400000, 0x7F0000600000),
    ]


def test_a_kernel_without_madvise_collapse_is_left_alone() -> None:
    calls: list[tuple[int, int, int]] = []

    def refuses(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        return -errno.EINVAL

    got = _memory.prepare_for_forks(madvise=refuses)
    assert got.collapsed == 0 and got.error is not None and "MADV_COLLAPSE" in got.error
    assert len(calls) <= 1  # the first refusal ends it: no point asking again
    assert all(advice == _memory.MADV_COLLAPSE for _a, _l, advice in calls)


def test_no_huge_page_to_spare_skips_that_chunk_and_goes_on() -> None:
    calls: list[int] = []

    def busy(addr: int, length: int, advice: int) -> int:
        calls.append(addr)
        return -errno.EAGAIN

    got = _memory.prepare_for_forks(madvise=busy)
    assert got.error is None and got.collapsed == 0
    assert len(calls) == got.chunks - got.skipped_sparse  # every dense chunk was tried


PROBE_COLLAPSE = """
import json, mmap
from subagent.osedge import _memory
buf = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(buf), 4096):
    buf[i] = 1                                    # every page there: dense chunks
sparse = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
sparse[0] = 1                                     # one page: left alone
got = _memory.prepare_for_forks()
thp = sum(int(l.split()[1]) for l in open("/proc/self/smaps") if l.startswith("AnonHugePages:"))
print(json.dumps({"collapsed": got.collapsed, "sparse": got.skipped_sparse, "error": got.error, "thp_kib": thp}))
"""


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "none"
    return text[text.index("[") + 1 : text.index("]")]


def _probe(code: str) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (its own allocator and mappings); its JSON line."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_dense_anonymous_memory_becomes_huge_pages_where_the_kernel_can() -> None:
    got = _probe(PROBE_COLLAPSE)
    assert got["sparse"] >= 7  # the one-page mapping's chunks were not filled in
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2] if x.isdigit())
    conftest.require(
        _thp_mode() != "never" and release >= (6, 1) and not got["error"],
        f"MADV_COLLAPSE (got {got['error'] or _thp_mode()})",
    )
    assert got["collapsed"] >= 7 and got["thp_kib"] >= 14 * 1024, got


PROBE_FILL = """
import json
from subagent.osedge import _memory
junk = [bytes(15) for _ in range(100000)]
del junk[::3]                                     # holes in the 48-byte class's pools
before = _memory._pymalloc_avail()
keep = []
taken = _memory.fill_small_object_holes(keep)
print(json.dumps({"before": before[48], "taken": taken, "kept": len(keep), "after": _memory._pymalloc_avail()[48]}))
"""


def test_the_small_object_allocators_holes_are_taken() -> None:
    got = _probe(PROBE_FILL)
    assert got["before"] >= 30000 and got["taken"] == got["kept"] >= got["before"]
    assert got["after"] < 1000  # what is left: the pool the filling itself started


ZYGOTE = textwrap.dedent(
    """
    import json, os, sys
    from subagent import runner, zygote
    from subagent.osedge import _memory
    if os.environ.get("BREAK_PREPARATION"):
        def broken(**kw):
            raise OSError("no /proc here")
        _memory.prepare_for_forks = broken
    def fake_start(args):
        os.write(1, json.dumps({"fillers": len(zygote._FILLERS), "argv": args}).encode())
        os._exit(0)
    runner.start = fake_start
    runner.preload = lambda: None
    sys.exit(zygote.main())
    """
)


@pytest.mark.parametrize("prepare, broken", [("1", False), ("0", False), ("1", True)])
def test_the_zygote_forks_runners_with_without_and_despite_its_preparation(
    tmp_path: Path, prepare: str, broken: bool
) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{PREPARE_VAR: prepare})
    if broken:
        env["BREAK_PREPARATION"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=b.fileno(), env=env, cwd=tmp_path)
    b.close()
    try:
        a.settimeout(30)
        assert (decode(a.recv(1 << 20)) or {}).get("ready") is True
        r0, w0 = os.pipe()
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        r3, w3 = os.pipe()
        os.write(w3, b"{}")
        os.close(w3)
        req = {"id": 1, "args": ["--x"], "cwd": str(tmp_path), "tree_id": "t-1", "cgroup_procs": None}
        socket.send_fds(a, [encode(req)], [r0, w1, w2, r3])
        for fd in (r0, w1, w2, r3):
            os.close(fd)
        while "pid" not in (reply := decode(a.recv(1 << 20)) or {}) and "error" not in reply:
            pass
        assert "pid" in reply, reply
        out = b""
        while chunk := os.read(r1, 4096):
            out += chunk
        got = json.loads(out)
        for fd in (w0, r1, r2):
            os.close(fd)
    finally:
        a.close()
        proc.wait(timeout=30)
    assert got["argv"] == ["--x"]
    # the allocator's holes were taken when (and only when) the preparation ran
    assert (got["fillers"] > 0) == (prepare == "1")
