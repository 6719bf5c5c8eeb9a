"""One inotify descriptor per Trio run for stopping trees' cgroup.events (supervisor/trees/_cgroup_events.py).

Real inotify on real files (a cgroup.events file changes the same way: a modification).
"""

from __future__ import annotations

import os
from pathlib import Path

import trio

from supervisor.trees._cgroup_events import CgroupEvents


def inotify_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                n += 1
        except OSError:
            continue
    return n


async def test_many_waiters_share_one_descriptor_and_each_sees_its_own_file(tmp_path: Path) -> None:
    before = inotify_fds()
    events = CgroupEvents.current()
    assert events is not None and CgroupEvents.current() is events  # one per Trio run
    files = [tmp_path / f"t-{i}.events" for i in range(20)]
    for f in files:
        f.write_text("populated 1\n")
    waiters = [events.watch(f) for f in files]
    assert all(w is not None for w in waiters)
    assert inotify_fds() == before + 1
    with trio.fail_after(10):
        files[3].write_text("populated 0\n")
        assert await waiters[3].changed(10) is True  # type: ignore[union-attr]
        assert await waiters[4].changed(0.05) is False  # type: ignore[union-attr]  # its file did not change
        assert await waiters[3].changed(0.05) is False  # type: ignore[union-attr]  # one event, seen once
    for w in waiters:
        w.close()  # type: ignore[union-attr]
    assert inotify_fds() == before + 1  # closing a watch is not closing the descriptor


async def test_two_waiters_on_one_file_both_wake_and_the_watch_outlives_the_first_close(tmp_path: Path) -> None:
    events = CgroupEvents.current()
    assert events is not None
    f = tmp_path / "cgroup.events"
    f.write_text("populated 1\n")
    a, b = events.watch(f), events.watch(f)
    assert a is not None and b is not None and a.wd == b.wd  # the kernel's one watch for the file
    with trio.fail_after(10):
        f.write_text("populated 0\n")
        assert await a.changed(10) and await b.changed(10)
        a.close()
        f.write_text("populated 1\n")
        assert await b.changed(10)  # still watched
        b.close()


async def test_a_deleted_file_wakes_its_waiter(tmp_path: Path) -> None:
    # A tree's cgroup directory removed under a stop: the waiter looks again at once.
    events = CgroupEvents.current()
    assert events is not None
    f = tmp_path / "cgroup.events"
    f.write_text("populated 1\n")
    w = events.watch(f)
    assert w is not None
    with trio.fail_after(10):
        f.unlink()
        assert await w.changed(10) is True
    w.close()


async def test_a_path_that_cannot_be_watched_gives_no_waiter(tmp_path: Path) -> None:
    events = CgroupEvents.current()
    assert events is not None and events.watch(tmp_path / "gone" / "cgroup.events") is None
