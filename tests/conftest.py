"""Suite-wide guards.

Every test runs with a fresh ``AGENTD_TEST_MARK`` in its environment. Everything it
starts inherits the mark (the runner passes ``AGENTD_*`` variables on to MCP servers and
commands), so after the test we can find every process it left behind, wherever it was
reparented, fail the test, and end those processes by PID.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import psutil
import pytest

MARK_VAR = "AGENTD_TEST_MARK"

# How long a test's processes may take to die after the test body returns. Orphans are
# reaped by PID 1 only every ~1.8 s here, but a zombie already counts as dead.
LEFTOVER_DEADLINE_S = 5.0


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


# Chromium's helper processes reuse their environment area for the process title, so
# they show no mark; they are recognised by their command line instead.
UNMARKABLE = (b"/usr/lib/chromium/", b"chrome_crashpad_handler", b"/chrome-linux/chrome")


def marked_processes(mark: str, since: float | None = None) -> list[psutil.Process]:
    """Processes carrying the mark, and (with ``since``) unmarkable ones born since then."""
    me = os.getpid()
    found: list[psutil.Process] = []
    needle = f"{MARK_VAR}={mark}".encode()
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle not in env:
            if since is None or MARK_VAR.encode() in env or not _unmarkable_since(pid, since):
                continue
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        found.append(p)
    return found


def _unmarkable_since(pid: int, since: float) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        return any(u in cmd for u in UNMARKABLE) and psutil.Process(pid).create_time() >= since
    except (OSError, psutil.Error):
        return False


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]!r}")
        except psutil.Error:
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


@pytest.fixture(autouse=True)
def no_process_left_behind(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK_VAR, mark)
    since = time.time() - 0.05
    yield mark
    deadline = time.monotonic() + LEFTOVER_DEADLINE_S
    left = marked_processes(mark, since)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = marked_processes(mark, since)
    if left:
        text = describe(left)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"processes left behind by this test: {text}")


def require(condition: bool, what: str) -> None:
    """Skip when a prerequisite is missing, except in CI, where the suite must run whole."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"prerequisite missing in CI: {what}")
    pytest.skip(f"prerequisite missing: {what}")
