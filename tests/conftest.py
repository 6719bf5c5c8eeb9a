"""Suite-wide guards.

The leak check finds a test's processes by what the test started, never by guessing:

- descent: the suite runs under a child subreaper of its own (``tests/_reaper.py``; a
  bare ``pytest`` re-executes itself under it), so everything a test starts, however it
  double-forks or ``setsid()``s, stays a descendant of the reaper. A descendant born during
  the test (pid + start time, compared with a snapshot taken before it) is the test's;
- its own marker: every test runs with a fresh ``AGENTD_TEST_MARK`` in its environment,
  which everything it starts inherits (the runner passes ``AGENTD_*`` on).

Processes in another PID namespace (a booted test container) are that container's
business: its fixture ends them all with the namespace. After the test, leftovers are
waited for (bounded), then the test fails and they are killed through a pidfd opened on
the very process that was found (no pid reuse race). Nothing else is ever signalled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests._reaper import REAPER_VAR

MARK_VAR = "AGENTD_TEST_MARK"

# How long a test's processes may take to die after the test body returns. A zombie
# already counts as dead.
LEFTOVER_DEADLINE_S = 5.0
# Set to 1 to run without re-executing under the reaper (the check then sees descendants
# of pytest itself and marked processes only).
NO_REAPER_VAR = "AGENTD_TEST_NO_REAPER"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _under_reaper() -> bool:
    return os.environ.get(REAPER_VAR) == str(os.getppid())


def pytest_configure(config: pytest.Config) -> None:
    """Re-execute a bare ``pytest`` under the suite's own subreaper (Linux only)."""
    if _under_reaper() or os.environ.get(NO_REAPER_VAR) or not sys.platform.startswith("linux"):
        return
    if hasattr(config, "workerinput"):  # an xdist worker: its controller decides
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, "-m", "tests._reaper", "--", sys.executable, "-m", "pytest", *sys.argv[1:]]
    env = dict(os.environ)
    root = str(config.rootpath)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    os.chdir(config.invocation_params.dir)
    os.execve(sys.executable, argv, env)


def root_pid() -> int:
    """The process whose descendants are the suite's: the reaper, else pytest itself."""
    return os.getppid() if _under_reaper() else os.getpid()


@dataclass(frozen=True, slots=True)
class ProcId:
    """A process as it was found: pid and kernel start time (clock ticks since boot)."""

    pid: int
    start: int


def _read_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) from /proc/<pid>/stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    rest = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(rest[1]), int(rest[19]), rest[0].decode()
    except (IndexError, ValueError):
        return None


_MY_PIDNS: str | None = None


def _same_pidns(pid: int) -> bool:
    global _MY_PIDNS
    try:
        if _MY_PIDNS is None:
            _MY_PIDNS = os.readlink("/proc/self/ns/pid")
        return os.readlink(f"/proc/{pid}/ns/pid") == _MY_PIDNS
    except OSError:
        return True


def descendants(root: int) -> dict[ProcId, str]:
    """Every live descendant of ``root`` in our PID namespace, with its state letter."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _read_stat(int(name))
            if st is not None:
                table[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _start, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[ProcId, str] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        ppid, start, state = table[pid]
        if _same_pidns(pid):
            out[ProcId(pid, start)] = state
        todo.extend(children.get(pid, ()))
    return out


def marked_processes(mark: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose environment carries ``AGENTD_TEST_MARK=mark``."""
    me = os.getpid()
    found: list[psutil.Process] = []
    needle = b"\0" + f"{MARK_VAR}={mark}".encode() + b"\0"
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if needle not in env:
            continue
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found


# Sources of pids a longer-lived fixture owns though they may be born during a test (a
# module-scoped daemon's parked spare runners, forked again after each spawn): not that
# test's leftovers. The fixture still answers for them (its teardown, the session check).
_OWNED_BY_FIXTURES: list[Callable[[], set[int]]] = []


@contextlib.contextmanager
def owned_by_fixture(pids: Callable[[], set[int]]) -> Iterator[None]:
    """While this lasts, the processes ``pids()`` names are not a test's leftovers."""
    _OWNED_BY_FIXTURES.append(pids)
    try:
        yield
    finally:
        _OWNED_BY_FIXTURES.remove(pids)


def _owned_by_fixtures() -> set[int]:
    owned: set[int] = set()
    for source in _OWNED_BY_FIXTURES:
        try:
            owned |= source()
        except Exception as exc:  # noqa: BLE001 - the check goes on: every process counts
            sys.stderr.write(f"owned_by_fixture source failed: {exc!r}\n")
    return owned


def leftovers(mark: str, before: set[ProcId]) -> list[ProcId]:
    """The test's live processes: descendants born since ``before``, and marked ones
    (less what a longer-lived fixture owns: ``owned_by_fixture``)."""
    me = os.getpid()
    owned = _owned_by_fixtures()
    found = {
        p
        for p, state in descendants(root_pid()).items()
        if p not in before and state != "Z" and p.pid != me and p.pid not in owned
    }
    for proc in marked_processes(mark):
        st = _read_stat(proc.pid)
        if st is not None and st[2] != "Z":
            found.add(ProcId(proc.pid, st[1]))
    return sorted(found, key=lambda p: p.pid)


def describe(procs: list[ProcId]) -> str:
    out = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{p.pid} {cmd[:120]!r}")
        except OSError:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


def kill_exactly(p: ProcId) -> None:
    """SIGKILL this very process: through a pidfd, after checking its start time."""
    try:
        fd = os.pidfd_open(p.pid)
    except OSError:
        return
    try:
        st = _read_stat(p.pid)
        if st is not None and st[1] == p.start:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every async test runs under ``run_trio``, as the daemon and the runner do.

    With a bare ``trio.run``, a SIGCHLD that lands while Trio closes its wake-up socket is
    written to the closed descriptor and reported as an unraisable error, failing whatever
    test was closing (a daemon earlier in the session leaves a Python SIGCHLD handler).
    Added before pytest-trio's own mark, so it is the one pytest-trio finds first.
    """
    import inspect

    from subagent.osedge import run_trio

    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.add_marker(pytest.mark.trio(run=run_trio))


@pytest.fixture(autouse=True)
def no_process_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_VAR, mark)
    before = set(descendants(root_pid()))
    yield mark
    deadline = time.monotonic() + LEFTOVER_DEADLINE_S
    left = leftovers(mark, before)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leftovers(mark, before)
    if left:
        text = describe(left)
        for p in left:
            kill_exactly(p)
        pytest.fail(f"processes left behind by this test: {text}")


def _name_unwaited_children() -> None:
    """Name every Popen still running (a hygiene note: the session check ends the process)."""
    import gc
    import subprocess

    for obj in gc.get_objects():
        if not isinstance(obj, subprocess.Popen) or getattr(obj, "pid", None) is None:
            continue  # (one whose start failed, a NUL in its arguments, say: no process)
        if obj.returncode is None and obj.poll() is None:
            st = _read_stat(obj.pid)
            sys.stderr.write(f"\nunwaited child {obj.pid} {obj.args!r} (stat {st})\n")


atexit.register(_name_unwaited_children)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """What outlived every fixture (a module-scoped fixture's leak) fails the session."""
    me = os.getpid()
    deadline = time.monotonic() + LEFTOVER_DEADLINE_S
    left = [p for p, st in descendants(root_pid()).items() if st != "Z" and p.pid != me]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p, st in descendants(root_pid()).items() if st != "Z" and p.pid != me]
    _name_unwaited_children()
    if left:
        sys.stderr.write(f"\nprocesses left behind by the session: {describe(left)}\n")
        for p in left:
            kill_exactly(p)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def require(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except in CI, where the suite must run whole."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"prerequisite missing in CI: {what}")
    pytest.skip(f"prerequisite missing: {what}")


@contextlib.contextmanager
def mounted_tmpfs(tmp_path: Path, size_mib: int, *, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB (and ``inodes`` files at most, if given) mounted at
    ``tmp_path/tmpfs`` (root only), unmounted after."""
    import subprocess

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    require(os.geteuid() == 0, "root, to mount a tmpfs")
    options = f"size={size_mib}m,mode=0700" + (f",nr_inodes={inodes}" if inodes is not None else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True)
    require(done.returncode == 0, f"mount -t tmpfs ({done.stderr.decode().strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
