"""Acceptance 2 and 3 (issue 5): the real daemon under a real systemd, with the unit as
installed by scripts/install-systemd.

- `systemctl start agentd` turns active only after READY=1: the daemon is held at
  interpreter start-up (a sitecustomize gate on PYTHONPATH, for the daemon process only)
  and the unit must stay "activating" until it is let go; when start returns, the control
  socket answers.
- `systemctl stop` during a running run (a scripted model running `sleep 600` through
  run_command, which its spec lets finish): the run ends `cancelled` in the store, no run
  process is left, the unit is inactive with Result=success within TimeoutStopSec, and
  systemd had nothing left to kill (the daemon ended every tree itself).
- `systemctl stop` during a run inside a command a stop interrupts (the default, issue 9):
  the daemon is gone well before the run's grace.
- With WatchdogSec=1s the service stays up over three periods, pinging every 0.5 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.systemd.agentd_support import (
    GRACE_S,
    INSTALL,
    STATE_DIR,
    TIMEOUT_STOP_S,
    UNIT,
    call,
    cli,
    container_processes,
    install,
    poll,
    require_daemon,
    stop_and_check,
    stored_run,
)
from tests.systemd.container import Container

pytestmark = pytest.mark.systemd

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

LONG_RUN_SPEC = {
    "task": "sleep for a long time",
    "model": {
        "provider": "scripted",
        "script": {"turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": "sleep 600"}}]}]},
    },
    # Let the command finish: the daemon then waits out the run's grace while stopping.
    "stop_policy": {"run_command": "finish"},
}
# The same run with the default policy: a stop interrupts the command at once.
INTERRUPTIBLE_RUN_SPEC = {k: v for k, v in LONG_RUN_SPEC.items() if k != "stop_policy"}


def start_with_a_long_run(c: Container) -> str:
    """Start the service and a run waiting in a command its stop lets finish; its id."""
    c.systemctl("start", UNIT, timeout_s=60)
    c.write("/run/agentd-test/long-run.json", json.dumps(LONG_RUN_SPEC))
    run_id = str(cli(c, "spawn", "--spec", "/run/agentd-test/long-run.json")["run_id"])
    poll("sleep 600 to start", lambda: container_processes(c, "sleep 600"))
    return run_id


@pytest.fixture(scope="module")
def agentd(container: Container) -> Container:
    require_daemon()
    install(container)
    return container


@pytest.fixture
def service(agentd: Container) -> Iterator[Container]:
    """The container with agentd installed; the service is stopped after the test."""
    yield agentd
    agentd.systemctl("stop", UNIT, check=False, timeout_s=TIMEOUT_STOP_S + 10)
    agentd.systemctl("reset-failed", UNIT, check=False)


def test_start_is_active_only_after_ready(service: Container) -> None:
    c = service
    c.sh(f"rm -rf {GATE_DIR}; mkdir -p {GATE_DIR}; mkfifo {GATE_DIR}/started {GATE_DIR}/go")
    c.write(f"{GATE_DIR}/sitecustomize.py", GATE)
    c.write(f"/run/systemd/system/{UNIT}.d/50-gate.conf", f"[Service]\nEnvironment=PYTHONPATH={GATE_DIR}\n")
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
    c.write("/run/agentd-test/long-run.json", json.dumps(LONG_RUN_SPEC))
    run_id = cli(c, "spawn", "--spec", "/run/agentd-test/long-run.json")["run_id"]

    # Seen running: the daemon says so (CLI and control socket) and the tool's command is a
    # live process.
    poll("the run to be running", lambda: cli(c, "status", run_id)["state"] == "running")
    poll("sleep 600 to start", lambda: container_processes(c, "sleep 600"))
    status = call(c, "status")
    assert [r["id"] for r in status["live_runs"]] == [run_id]
    # Delegate=yes, and no hardening option takes /sys/fs/cgroup away: the run has its own
    # cgroup under the service's.
    run = cli(c, "status", run_id)
    assert run["containment"] == "cgroup", run
    assert "/system.slice/agentd.service/" in run["cgroup"], run
    # The daemon keeps the notify socket to itself: its runners do not inherit it.
    runner_env = c.run(["cat", f"/proc/{run['pid']}/environ"]).stdout.split("\0")
    assert any(v.startswith("AGENTD_TREE=") for v in runner_env), " ".join(runner_env)
    assert not [v for v in runner_env if v.startswith(("NOTIFY_SOCKET=", "WATCHDOG_"))]
    poll("STATUS= to count the run", lambda: "1 live run" in c.show(UNIT, "StatusText")["StatusText"], timeout_s=15)

    def stopping() -> None:
        # STOPPING=1 and its STATUS= arrive while the daemon waits out the run's grace.
        s = poll(
            "STATUS= to say the daemon is stopping",
            lambda: (s := c.show(UNIT, "ActiveState", "StatusText"))["StatusText"].startswith("stopping") and s,
            timeout_s=GRACE_S,
        )
        assert s["ActiveState"] == "deactivating", s

    stop_and_check(c, while_stopping=stopping)
    run = stored_run(c, run_id)
    assert run["state"] == "cancelled", run
    assert container_processes(c, "sleep 600", "subagent.runner", "agentd serve") == []


def test_stop_with_a_run_inside_a_command_is_not_held_by_the_grace(service: Container) -> None:
    c = service
    c.systemctl("start", UNIT, timeout_s=60)
    c.write("/run/agentd-test/interruptible-run.json", json.dumps(INTERRUPTIBLE_RUN_SPEC))
    run_id = cli(c, "spawn", "--spec", "/run/agentd-test/interruptible-run.json")["run_id"]
    poll("sleep 600 to start", lambda: container_processes(c, "sleep 600"))
    took = stop_and_check(c)
    assert took < GRACE_S, f"systemctl stop took {took:.1f} s: the run's grace ({GRACE_S} s) was waited out"
    run = stored_run(c, run_id)
    assert run["state"] == "cancelled", run
    assert container_processes(c, "sleep 600", "subagent.runner", "agentd serve") == []


def test_watchdog_keeps_the_service_up_over_three_periods(service: Container) -> None:
    c = service
    c.run([INSTALL, "--watchdog", "1"])
    try:
        c.systemctl("start", UNIT, timeout_s=60)
        assert c.show(UNIT, "WatchdogUSec")["WatchdogUSec"] == "1s"
        seen = c.watch_watchdog(UNIT, periods=3)  # WATCHDOG=1 every 0.5 s
        assert len(seen) >= 3, seen
        assert seen[-1] - seen[0] >= 2_000_000, seen
        c.systemctl("stop", UNIT, timeout_s=TIMEOUT_STOP_S + 10)
        assert c.show(UNIT, "Result")["Result"] == "success"
    finally:
        c.run([INSTALL, "--watchdog", "0"])


def test_a_hung_daemon_is_restarted_and_its_runs_end_lost(service: Container) -> None:
    """The watchdog's point: a daemon whose event loop stops (here: SIGSTOP) is killed with
    everything in its cgroup and restarted; the new daemon finds the run's process gone and
    records it `lost`."""
    c = service
    c.run([INSTALL, "--watchdog", "1"])
    c.write(f"/run/systemd/system/{UNIT}.d/50-abort.conf", "[Service]\nTimeoutAbortSec=2s\n")
    c.systemctl("daemon-reload")
    try:
        run_id = start_with_a_long_run(c)
        first = int(c.show(UNIT, "MainPID")["MainPID"])
        c.run(["kill", "-STOP", str(first)])
        s = poll(
            "the restart",
            lambda: (
                (s := c.show(UNIT, "NRestarts", "ActiveState", "MainPID"))["NRestarts"] == "1"
                and s["ActiveState"] == "active"
                and s
            ),
            timeout_s=30,
            every_s=0.2,
        )
        assert int(s["MainPID"]) != first
        assert "Watchdog timeout" in c.journal(UNIT)
        assert container_processes(c, "sleep 600", "subagent.runner") == []
        run = poll(
            "the run's terminal state",
            lambda: (r := cli(c, "status", run_id))["state"] != "running" and r,
            timeout_s=15,
        )
        assert run["state"] == "lost", run
    finally:
        c.run(["rm", "-f", f"/run/systemd/system/{UNIT}.d/50-abort.conf"])
        c.run([INSTALL, "--watchdog", "0"])


def test_install_enable_now_and_uninstall(service: Container) -> None:
    c = service
    c.run([INSTALL, "--enable", "--now"])
    assert c.systemctl("is-enabled", UNIT).stdout.strip() == "enabled"
    assert c.systemctl("is-active", UNIT).stdout.strip() == "active"
    assert call(c, "ping")["pong"] is True
    c.run([INSTALL, "--uninstall"])
    s = c.show(UNIT, "LoadState", "ActiveState")
    assert s == {"LoadState": "not-found", "ActiveState": "inactive"}, s
    assert (
        c.run(["test", "-e", "/etc/systemd/system/multi-user.target.wants/agentd.service"], check=False).returncode != 0
    )
    assert container_processes(c, "agentd serve") == []
    install(c)  # as the module found it


def test_a_configuration_error_fails_the_unit_once_and_says_so_as_an_error(service: Container) -> None:
    """Exit 2 is a configuration error: the unit restarted it every 2 s for ever (the start
    limit never reached), and journald filed each line as info."""
    c = service
    drop_in = f"/run/systemd/system/{UNIT}.d/60-bad-grace.conf"
    c.write(drop_in, "[Service]\nEnvironment=AGENTD_GRACE_S=abc\n")
    c.systemctl("daemon-reload")
    try:
        c.systemctl("start", UNIT, check=False, timeout_s=60)
        s = poll(
            "the unit to stay failed",
            lambda: (s := c.show(UNIT, "ActiveState", "NRestarts", "ExecMainStatus"))["ActiveState"] == "failed" and s,
            timeout_s=30,
        )
        assert (s["NRestarts"], s["ExecMainStatus"]) == ("0", "2"), s
        errors = c.run(["journalctl", "-u", UNIT, "-p", "err", "--no-pager", "-o", "cat"], check=False).stdout
        assert "error: config grace_s: bad value 'abc'" in errors, errors
    finally:
        c.run(["rm", "-f", drop_in])
        c.systemctl("daemon-reload")
        c.systemctl("reset-failed", UNIT, check=False)


def test_a_grace_longer_than_the_units_stop_timeout_still_stops_cleanly(service: Container) -> None:
    """The grace and TimeoutStopSec are set apart (the grace in agentd.env, which the unit
    does not see): the stop outlasted TimeoutStopSec and systemd SIGKILLed everything. The
    daemon now tells systemd how long its stop may take (EXTEND_TIMEOUT_USEC)."""
    c = service
    drop_in = f"/run/systemd/system/{UNIT}.d/70-short-stop.conf"
    c.write(drop_in, "[Service]\nTimeoutStopSec=2s\n")  # below the grace (GRACE_S)
    c.systemctl("daemon-reload")
    try:
        run_id = start_with_a_long_run(c)
        took = stop_and_check(c)  # Result=success, nothing left for systemd to kill
        assert took >= 2, took  # the run's grace was waited out, past TimeoutStopSec
        run = stored_run(c, run_id)
        assert run["state"] == "cancelled", run
    finally:
        c.run(["rm", "-f", drop_in])
        c.systemctl("daemon-reload")
