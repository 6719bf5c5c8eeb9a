"""The unit's hardening does not break Chromium: browser runs under a real systemd.

The test image has no Chromium (adding it to the debootstrap costs minutes and a GB), so the
service runs chrooted (RootDirectory=/hostroot, a drop-in) into a throw-away overlay of the
host's own root, where the host's Chromium, node, @playwright/mcp and venv are. Everything
else is the installed unit: NoNewPrivileges, ProtectSystem=strict, ProtectHome=read-only,
PrivateTmp, PrivateDevices, the address-family and capability limits, Delegate=yes,
KillMode=mixed all apply inside that root.

- A scripted browser run (navigate to a page, snapshot it, answer from it) completes.
- `systemctl stop` while a browser is open ends the run `cancelled`, with no Chromium or node
  left and nothing for systemd to SIGKILL.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import browser_support as bs
from tests.systemd.agentd_support import (
    TIMEOUT_STOP_S,
    UNIT,
    cli,
    container_processes,
    install,
    poll,
    require_daemon,
    stop_and_check,
    stored_run,
)
from tests.systemd.conftest import boot, require_container_tools
from tests.systemd.container import HOSTROOT, Container, hostroot_args, image_root

pytestmark = [pytest.mark.systemd, pytest.mark.chromium]

PAGE = "data:text/html,<title>agentd</title><p>The password is tangerine-42.</p>"
BROWSER_PROCESSES = ("chromium", "playwright", "cli.js")


@pytest.fixture(scope="module")
def hostroot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    require_container_tools()
    require_daemon()
    bs.require_browser()
    node = shutil.which("node")
    extra = [Path(node).resolve().parent] if node else []
    c = Container(
        image_root(), tmp_path_factory.mktemp("nspawn"), extra_args=hostroot_args([bs.CHROMIUM.parent, *extra])
    )
    boot(c)
    try:
        install(c)
        c.write(
            f"/etc/systemd/system/{UNIT}.d/50-hostroot.conf", f"[Service]\nRootDirectory={HOSTROOT}\nMountAPIVFS=yes\n"
        )
        c.systemctl("daemon-reload")
        yield c
    finally:
        c.shutdown()


@pytest.fixture
def service(hostroot: Container) -> Iterator[Container]:
    yield hostroot
    hostroot.systemctl("stop", UNIT, check=False, timeout_s=TIMEOUT_STOP_S + 10)
    hostroot.systemctl("reset-failed", UNIT, check=False)


def spawn(c: Container, spec: dict[str, object]) -> str:
    c.write("/run/agentd-test/spec.json", json.dumps(spec))
    return cli(c, "spawn", "--spec", "/run/agentd-test/spec.json")["run_id"]


def test_browser_run_completes_under_the_hardening(service: Container) -> None:
    c = service
    c.systemctl("start", UNIT, timeout_s=60)
    run_id = spawn(c, bs.scripted_browser_spec(PAGE))
    status = poll(
        "the browser run to end",
        lambda: (s := cli(c, "status", run_id))["state"] not in {"queued", "starting", "running"} and s,
        timeout_s=90,
        every_s=0.25,
    )
    assert status["state"] == "completed", status
    assert "tangerine-42" in (status["result"] or {}).get("final_text", ""), status["result"]
    calls = [(t["name"], t["state"]) for t in status["tool_calls"]]
    assert calls == [("browser_navigate", "succeeded"), ("browser_snapshot", "succeeded")], calls
    # The run is uid 65000 in its own user namespace (the unit allows it, and the user, PID
    # and network namespaces Chromium's sandbox makes inside it): Chromium ran with its own
    # sandbox (--sandbox), inside the run's Landlock domain.
    sandbox = status["sandbox"]
    assert sandbox["mode"] == "landlock" and sandbox["browser_sandbox"] is True, sandbox
    assert "own user namespace" in sandbox["identity"], sandbox
    stop_and_check(c)
    assert container_processes(c, *BROWSER_PROCESSES) == []


def test_stop_with_a_browser_open_cancels_and_leaves_no_chromium(service: Container) -> None:
    c = service
    c.systemctl("start", UNIT, timeout_s=60)
    # Navigate, snapshot, then the model hangs: the run is live with Chromium up.
    run_id = spawn(c, bs.scripted_browser_spec(PAGE, then=[{"hang": True}]))
    poll("Chromium to run", lambda: container_processes(c, "chromium"), timeout_s=60, every_s=0.25)
    poll(
        "the snapshot to be taken",
        lambda: any(
            t["name"] == "browser_snapshot" and t["state"] == "succeeded"
            for t in cli(c, "status", run_id)["tool_calls"]
        ),
        timeout_s=60,
        every_s=0.25,
    )
    stop_and_check(c)
    run = stored_run(c, run_id)
    assert run["state"] == "cancelled", run
    assert container_processes(c, *BROWSER_PROCESSES, "subagent.runner") == []
