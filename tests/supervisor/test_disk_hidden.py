"""A run that hides the space it fills from the disk guard's descriptor count.

``deleted_held`` counted the deleted files a run's processes hold in their descriptor
tables. A file stays whole on its filesystem as long as anything holds it: a memory
mapping of a piece of it (its descriptor closed: ``/proc/PID/fd`` no longer shows it), a
descriptor in flight in a unix socket's queue (``SCM_RIGHTS``: in no table until it is
received). Seen: a run's command wrote the disk full, mapped one page of the file, closed
and deleted it; the guard found nothing held ("the space went elsewhere"), stopped
nobody, and the journal stayed unwritable for as long as the run lived.

End to end as ``test_disk_full``: a daemon's state dir on a small tmpfs, real runners.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import trio

from subagent.osedge import LINUX
from supervisor.config import Config
from supervisor.core.diskguard import DISK_FULL_REASON
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests.supervisor.test_disk_full import MiB, _gone, _journal_writable, scripted, until
from tests.supervisor.test_disk_full import disk as disk  # noqa: F401 - the fixture
from tests.supervisor.test_stop_tools import command_alive, wait_event

# Fill the disk through a file deleted first, then keep only a one-page mapping of it: no
# descriptor and no path lead to the file, yet all its blocks stay taken.
FILL_MAPPED = (
    "python3 -c 'import ctypes, os, time\n"
    'p = os.environ["TMPDIR"] + "/fill"\n'
    "fd = os.open(p, os.O_RDWR | os.O_CREAT); os.unlink(p)\n"  # (a look meanwhile sees it by its fd)
    "try:\n"
    '    while True: os.write(fd, b"x" * 65536)\n'
    "except OSError: pass\n"
    "libc = ctypes.CDLL(None, use_errno=True); libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
    "assert libc.mmap(None, 4096, 1, 1, fd, 0) != ctypes.c_void_p(-1).value\n"  # PROT_READ, MAP_SHARED
    "os.close(fd)\n"
    'print("filled", flush=True); time.sleep(600)\''
)


@pytest.mark.parametrize("fill", [FILL_MAPPED], ids=["mapped"])
async def test_a_run_that_hides_its_full_disk_in_a_mapping_is_stopped(
    disk: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    fill: str,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = Config.load(state_dir=disk / "state", grace_s=2, disk_min_free_mib=2, disk_min_free_percent=0, environ={})
    stop = trio.Event()
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            call = {"name": "run_command", "arguments": {"command": fill}}
            filler = (await m.spawn(scripted({"turns": [{"tool_calls": [call]}], "final": "never"})))["run_id"]
            await wait_event(m, filler, command_alive)
            filler_dir = Path((await m.status(filler))["run_dir"])
            with trio.fail_after(30):
                st = await m.wait_terminal(filler)
            assert st["state"] == "cancelled" and st["reason"] == DISK_FULL_REASON, st
            detail = st["receipt"]["stop_detail"]
            assert 10 * MiB < detail["held_deleted_bytes"] <= detail["held_bytes"] < 24 * MiB, detail
            await until(lambda: _gone(filler_dir))
            await until(lambda: _journal_writable(m))
            stop.set()


def test_a_deleted_file_held_only_by_a_mapping_is_counted(tmp_path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    path = tmp_path / "mapped"
    path.write_bytes(os.urandom(2 * MiB))
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: one page of it
    assert addr != ctypes.c_void_p(-1).value, ctypes.get_errno()
    try:
        os.close(fd)
        path.unlink()
        found = LINUX.deleted_files(os.getpid())
        assert found is not None
        assert found.get((st.st_dev, st.st_ino), 0) >= 2 * MiB, found  # the whole file, not its page
    finally:
        libc.munmap(addr, 4096)
    assert (st.st_dev, st.st_ino) not in (LINUX.deleted_files(os.getpid()) or {})
