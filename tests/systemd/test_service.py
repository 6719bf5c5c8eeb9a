"""Acceptance 2 and 3 (issue 5): the real daemon under a real systemd, with the unit as
installed by scripts/install-systemd.

- `systemctl start agentd` turns active only after READY=1: the daemon is held at
  interpreter start-up (a sitecustomize gate on PYTHONPATH, for the daemon process only)
  and the unit must stay "activating" until it is let go; when start returns, the control
  socket answers.
- `systemctl stop` during a running run (a scripted model running `sleep 600` through
  run_command): the run ends `cancelled` in the store, no run process is left, the unit is
  inactive with Result=success within TimeoutStopSec, and systemd had nothing left to kill
  (the daemon ended every tree itself).
- With WatchdogSec=1s the service stays up over three periods, pinging every 0.5 s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.systemd.container import CHECKOUT, Container, python_in_container

pytestmark = pytest.mark.systemd

INSTALL = str(CHECKOUT / "scripts" / "install-systemd")
CLIENT = str(CHECKOUT / "tests" / "systemd" / "control_client.py")
STATE_DIR = "/var/lib/agentd"
UNIT = "agentd.service"
GRACE_S = 5  # install-systemd --grace 5: TimeoutStopSec=25s
TIMEOUT_STOP_S = GRACE_S + 20

GATE_DIR = "/run/agentd-test-gate"
GATE = f"""\
import os
if not os.environ.get("AGENTD_TEST_GATE_PASSED"):
    os.environ["AGENTD_TEST_GATE_PASSED"] = "1"  # children (runners) go straight through
    with open("{GATE_DIR}/started", "w") as f:
        f.write(str(os.getpid()))
    with open("{GATE_DIR}/go") as f:
        f.read()
"""

LONG_RUN_SPEC: dict[str, Any] = {
    "task": "sleep for a long time",
    "model": {
        "provider": "scripted",
        "script": {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 600"}}]}]},
    },
}


def daemon_landed() -> bool:
    return (CHECKOUT / "supervisor" / "cli.py").exists()


@pytest.fixture(scope="module")
def agentd(container: Container) -> Container:
    if not daemon_landed():
        pytest.skip("agentd serve has not landed yet (supervisor/cli.py)")
    c = container
    c.run([INSTALL, "--grace", str(GRACE_S)])
    return c


@pytest.fixture
def service(agentd: Container) -> Iterator[Container]:
    """The container with agentd installed; the service is stopped after the test."""
    yield agentd
    agentd.systemctl("stop", UNIT, check=False, timeout_s=TIMEOUT_STOP_S + 10)
    agentd.systemctl("reset-failed", UNIT, check=False)


def call(c: Container, op: str, **args: Any) -> dict[str, Any]:
    r = c.run([python_in_container(), CLIENT, "call", STATE_DIR, op, json.dumps(args)])
    reply = json.loads(r.stdout)
    assert reply.get("ok") is True, reply
    return reply["result"]


def stored_run(c: Container, run_id: str) -> dict[str, Any]:
    return json.loads(c.run([python_in_container(), CLIENT, "run", STATE_DIR, run_id]).stdout)


def container_processes(c: Container, *needles: str) -> list[str]:
    """Command lines of processes inside the container that contain any of the needles."""
    out = c.run(["ps", "-eo", "pid=,args="]).stdout.splitlines()
    return [line.strip() for line in out if any(n in line for n in needles) and "ps -eo" not in line]


def poll(what: str, fn: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_start_is_active_only_after_ready(service: Container) -> None:
    c = service
    c.sh(f"rm -rf {GATE_DIR}; mkdir -p {GATE_DIR}; mkfifo {GATE_DIR}/started {GATE_DIR}/go")
    c.write(f"{GATE_DIR}/sitecustomize.py", GATE)
    c.write(f"/run/systemd/system/{UNIT}.d/50-gate.conf",
            f"[Service]\nEnvironment=PYTHONPATH={GATE_DIR}\n")
    c.systemctl("daemon-reload")
    try:
        c.systemctl("start", "--no-block", UNIT)
        gated_pid = int(c.run(["cat", f"{GATE_DIR}/started"], timeout_s=30).stdout)
        s = c.show(UNIT, "ActiveState", "SubState", "MainPID", "StatusText")
        assert (s["ActiveState"], s["SubState"]) == ("activating", "start")
        assert int(s["MainPID"]) == gated_pid  # the daemon itself, held before main()
        assert s["StatusText"] == ""
        assert c.run(["test", "-e", f"{STATE_DIR}/daemon.json"], check=False).returncode != 0

        c.sh(f"echo go >{GATE_DIR}/go")
        c.systemctl("start", UNIT, timeout_s=60)  # returns when the start job is done
        s = c.show(UNIT, "ActiveState", "SubState", "MainPID", "StatusText", "Type")
        assert (s["Type"], s["ActiveState"], s["SubState"]) == ("notify", "active", "running")
        assert int(s["MainPID"]) == gated_pid
        assert "live runs" in s["StatusText"]
        # What READY=1 promises holds the moment start returns: the control socket answers.
        pong = call(c, "ping")
        assert pong["pong"] is True
    finally:
        c.run(["rm", "-f", f"/run/systemd/system/{UNIT}.d/50-gate.conf"])
        c.systemctl("daemon-reload")


def test_stop_during_a_run_cancels_it_and_leaves_nothing(service: Container) -> None:
    c = service
    c.systemctl("start", UNIT, timeout_s=60)
    assert c.show(UNIT, "TimeoutStopUSec")["TimeoutStopUSec"] == f"{TIMEOUT_STOP_S}s"
    run_id = call(c, "spawn", spec=LONG_RUN_SPEC)["run_id"]

    # Seen running: the store says so and the tool's command is a live process.
    poll("the run to be running", lambda: call(c, "status", run_id=run_id)["state"] == "running")
    poll("sleep 600 to start", lambda: container_processes(c, "sleep 600"))
    status = call(c, "status")
    assert [r["id"] for r in status["live_runs"]] == [run_id]
    poll("STATUS= to count the run",
         lambda: "1 live run" in c.show(UNIT, "StatusText")["StatusText"], timeout_s=15)

    t0 = time.monotonic()
    c.systemctl("stop", UNIT, timeout_s=TIMEOUT_STOP_S + 10)
    took = time.monotonic() - t0

    s = c.show(UNIT, "ActiveState", "Result", "ExecMainStatus", "ExecMainCode")
    assert (s["ActiveState"], s["Result"], s["ExecMainStatus"]) == ("inactive", "success", "0"), (
        s, c.journal(UNIT))
    assert took < TIMEOUT_STOP_S
    run = stored_run(c, run_id)
    assert run["state"] == "cancelled", run
    assert container_processes(c, "sleep 600", "subagent.runner", "agentd serve") == []
    journal = c.journal(UNIT)
    # KillMode=mixed: systemd SIGKILLs what the daemon left behind, and says so.
    assert "Killing process" not in journal, journal
    assert "left-over process" not in journal, journal


def test_watchdog_keeps_the_service_up_over_three_periods(service: Container) -> None:
    c = service
    c.run([INSTALL, "--watchdog", "1"])
    try:
        c.systemctl("start", UNIT, timeout_s=60)
        assert c.show(UNIT, "WatchdogUSec")["WatchdogUSec"] == "1s"
        seen: set[str] = set()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.2:
            s = c.show(UNIT, "ActiveState", "WatchdogTimestampMonotonic", "NRestarts", "Result")
            assert (s["ActiveState"], s["NRestarts"], s["Result"]) == ("active", "0", "success"), (
                s, c.journal(UNIT))
            seen.add(s["WatchdogTimestampMonotonic"])
            time.sleep(0.1)
        assert len(seen) >= 5, seen  # WATCHDOG=1 every 0.5 s
        c.systemctl("stop", UNIT, timeout_s=TIMEOUT_STOP_S + 10)
        assert c.show(UNIT, "Result")["Result"] == "success"
    finally:
        c.run([INSTALL, "--watchdog", "0"])
