"""Helpers for the tests that run the real daemon as agentd.service inside the container."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tests.conftest import require
from tests.systemd.container import CHECKOUT, Container, python_in_container

T = TypeVar("T")

INSTALL = str(CHECKOUT / "scripts" / "install-systemd")
AGENTD = str(CHECKOUT / ".venv" / "bin" / "agentd")
CLIENT = str(CHECKOUT / "tests" / "systemd" / "control_client.py")
STATE_DIR = "/var/lib/agentd"
UNIT = "agentd.service"
GRACE_S = 5  # install-systemd --grace 5: TimeoutStopSec=25s
TIMEOUT_STOP_S = GRACE_S + 20


def require_daemon() -> None:
    """The daemon's CLI (`agentd serve`) is in the checkout the container sees."""
    require((CHECKOUT / "supervisor" / "cli.py").exists(), f"agentd's CLI in {CHECKOUT} (supervisor/cli.py)")


def install(c: Container, *args: str) -> None:
    c.run([INSTALL, "--grace", str(GRACE_S), *args])


def call(c: Container, op: str, **args: Any) -> dict[str, Any]:
    """One request on the daemon's control socket, from inside the container."""
    r = c.run([python_in_container(), CLIENT, "call", STATE_DIR, op, json.dumps(args)])
    reply = json.loads(r.stdout)
    assert reply.get("ok") is True, reply
    return reply["result"]


def cli(c: Container, *args: str, input: str | None = None) -> Any:
    """`agentd --json ARGS` inside the container (the checkout's venv); its JSON output."""
    r = c.run([AGENTD, "--json", *args], input=input, env={"AGENTD_STATE_DIR": STATE_DIR})
    return json.loads(r.stdout)


def stored_run(c: Container, run_id: str) -> dict[str, Any]:
    """The run's record read from the store (works with the daemon stopped)."""
    return json.loads(c.run([python_in_container(), CLIENT, "run", STATE_DIR, run_id]).stdout)


def container_processes(c: Container, *needles: str) -> list[str]:
    """`pid args` of processes inside the container whose command line has a needle."""
    out = c.run(["ps", "-eo", "pid=,args="]).stdout.splitlines()
    return [line.strip() for line in out if any(n in line for n in needles) and "ps -eo" not in line]


def poll(what: str, fn: Callable[[], T], timeout_s: float = 30.0, every_s: float = 0.1) -> T:
    """Call fn until it returns something true; fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def stop_and_check(c: Container, *, while_stopping: Callable[[], None] | None = None) -> float:
    """`systemctl stop agentd`; assert a clean stop (inactive, Result=success, exit 0, and
    nothing left for systemd's final SIGKILL); return how long it took. ``while_stopping``
    runs after the stop is queued, while the daemon winds down."""
    t0 = time.monotonic()
    cursor = c.cursor()  # this stop's lines only: an earlier test may have killed on purpose
    if while_stopping is not None:
        c.systemctl("stop", "--no-block", UNIT)
        while_stopping()
    c.systemctl("stop", UNIT, timeout_s=TIMEOUT_STOP_S + 10)  # waits for the queued job
    took = time.monotonic() - t0
    s = c.show(UNIT, "ActiveState", "Result", "ExecMainStatus")
    assert (s["ActiveState"], s["Result"], s["ExecMainStatus"]) == ("inactive", "success", "0"), (s, c.journal(UNIT))
    assert took < TIMEOUT_STOP_S
    journal = c.journal(UNIT, after=cursor)
    # KillMode=mixed: systemd SIGKILLs whatever the daemon left in the cgroup, and says so.
    assert "Killing process" not in journal, journal
    assert "left-over process" not in journal, journal
    return took
