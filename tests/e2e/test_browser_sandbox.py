"""A prompt-injected browser run: what it reaches through Chromium and @playwright/mcp.

@playwright/mcp blocks ``file://`` in ``browser_navigate``, but ``browser_run_code_unsafe``
(capability "core": always offered) runs any JavaScript in the server's node, with the
Playwright ``page``: ``page.goto('file://...')`` has Chromium read a file, node's ``fs``
reads it directly, a CDP session moves Chromium's downloads, a page opens sockets to the
daemon's ports. The run's sandbox is what must hold, for node, Chromium and its helpers.

The daemon runs in-process (sandbox required, state dir under /tmp, a root runner's
private /tmp hiding it, and under /var/lib, where Landlock alone keeps it out); session A's
browser turn leaves a profile, then session B's turn probes, its results read from the
tool's own output. And the grants a browser run gets for its tools: node's binary, not
the directory two levels above it (a node kept at ``~/.local/bin/node`` opened all of
``~/.local`` to every browser run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.tools.browser_setup import DEBIAN_CHROMIUM
from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests import browser_support as bs
from tests import conftest
from tests.e2e.test_sandbox import Daemon, own_view
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture
from tests.e2e.test_sandbox import state_dir as state_dir  # noqa: F401 - the fixture

pytestmark = pytest.mark.chromium

SECRET = "agentd-browser-probe-secret-61b2"  # a sandbox_protect file holds it
# Bounds one scenario (seconds): two browser runs on 2 shared cores.
SCENARIO_S = 150.0

# Run by the server's node with the run's Playwright page (``T``: what to try). Returns
# one string per probe: what was read, or the error.
PROBE_JS = r"""
async (page) => {
  const T = %TARGETS%;
  const out = {};
  const proc = page.constructor.constructor('return process')();
  const fs = proc.getBuiltinModule('fs');
  const err = (e) => 'ERR:' + (e.code || String(e.message).split('\n')[0].slice(0, 160));
  // A failed load goes on to Chromium's error page, which would interrupt the next goto:
  // each file in a tab of its own, and a goto that is interrupted anyway tried again.
  const go = async (u) => {
    for (let i = 0; ; i++) {
      try { return await page.goto(u, {timeout: 5000}); }
      catch (e) { if (i > 2 || !/interrupted by another navigation/.test(e.message)) throw e; }
      await page.waitForLoadState('load', {timeout: 5000}).catch(() => {});
    }
  };
  for (const [k, p] of Object.entries(T.files)) {
    try { out['node_' + k] = 'READ:' + (p.endsWith('/') ? fs.readdirSync(p).join(',') : fs.readFileSync(p).toString('latin1')); }
    catch (e) { out['node_' + k] = err(e); }
    const tab = await page.context().newPage();
    try {
      await tab.goto('file://' + p, {timeout: 5000});
      out['chromium_' + k] = 'PAGE:' + await tab.evaluate(() => document.documentElement.innerText);
    } catch (e) { out['chromium_' + k] = 'NOPAGE:' + err(e); }
    await tab.close();
  }
  const sockets = async () => page.evaluate(async (T) => {
    const r = {};
    for (const [k, u] of Object.entries({dashboard: T.dashboard, dashboard_api: T.dashboard + 'api/session', control: T.control_http})) {
      try { const x = await fetch(u); r[k] = 'STATUS:' + x.status + ':' + (await x.text()).slice(0, 300); } catch (e) { r[k] = 'ERR:' + e; }
    }
    r.control_ws = await new Promise((res) => {
      const ws = new WebSocket(T.control_ws);
      ws.onopen = () => res('OPEN');
      ws.onclose = (e) => res('closed:' + e.code);
      setTimeout(() => res('no answer'), 5000);
    });
    return r;
  }, T);
  await go(T.site);
  out.from_another_origin = JSON.stringify(await sockets());
  fs.writeFileSync('probe.html', '<html><body>probe</body></html>');  // the server's cwd: the run's
  await go('file://' + proc.cwd() + '/probe.html');
  out.from_a_file_page = JSON.stringify(await sockets());
  await go(T.site);
  const click = (name) => page.evaluate((name) => {
    const a = document.createElement('a');
    a.href = URL.createObjectURL(new Blob(['downloaded-bytes']));
    a.download = name;
    document.body.appendChild(a);
    a.click();
  }, name);
  try {
    const [d] = await Promise.all([page.waitForEvent('download', {timeout: 5000}), click('a.txt')]);
    out.download_path = await d.path();
    try { await d.saveAs(T.planted); out.download_saved = 'SAVED'; } catch (e) { out.download_saved = err(e); }
  } catch (e) { out.download_path = err(e); }
  try {
    const cdp = await page.context().newCDPSession(page);
    await cdp.send('Browser.setDownloadBehavior', {behavior: 'allow', downloadPath: T.state, eventsEnabled: true});
    const done = new Promise((res) => {
      cdp.on('Browser.downloadProgress', (e) => { if (e.state !== 'inProgress') res(e.state); });
      setTimeout(() => res('no end'), 5000);
    });
    await click(T.cdp_name);
    out.cdp_download = await done;
  } catch (e) { out.cdp_download = err(e); }
  return out;
}
"""


class BrowserDaemon(Daemon):
    def __init__(self, manager: RunManager, config: Config, info: dict[str, Any]) -> None:
        super().__init__(manager, config, info)
        self.dashboard_url = str(info["dashboard_url"])


@pytest.fixture
async def daemon(state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[BrowserDaemon]:  # noqa: F811
    bs.require_browser()
    conftest.require(bs.runner_available(), "subagent.runner")
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    (tmp_path / "secret.txt").write_text(SECRET + "\n")
    config = Config.load(
        state_dir=state_dir, runner_python=sys.executable, grace_s=3, environ={}, sandbox="required", zygote="off",
        sandbox_protect=(str(tmp_path / "secret.txt"),),
    )  # fmt: skip
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield BrowserDaemon(info["manager"], config, info)
        stop.set()


def browser_spec(turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "task": "probe",
        "model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}},
        "builtin_tools": [],
        "browser": True,
        "limits": {"max_steps": 6},
    }


def run_code(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "browser_run_code_unsafe", "arguments": {"code": code}}]}


def code_result(status: dict[str, Any]) -> dict[str, str]:
    """The object the run's code returned, from its tool output (``### Result``)."""
    [call] = status["result"]["tool_calls"]
    out = str(call.get("output"))
    assert "### Result" in out, out[:2000]
    found: dict[str, str] = json.loads(out.split("### Result", 1)[1].split("###", 1)[0])
    return found


async def test_a_browser_run_reaches_nothing_of_the_daemon_or_another_session(
    daemon: BrowserDaemon, tmp_path: Path
) -> None:
    d = daemon
    state = d.state
    with bs.LocalSite({"/": "<!doctype html><html><body>a page</body></html>"}) as site, trio.fail_after(SCENARIO_S):
        first = await d.m.spawn(
            browser_spec([{"tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/"}}]}]),
            session_id="session-a",
        )
        assert (await d.m.wait_terminal(first["run_id"]))["state"] == "completed"
        [cookies] = list((state / "sessions").glob("session-a-*/browser-profile/Default/Cookies"))
        targets = {
            "files": {
                "token": str(state / "token"),
                "journal": str(state / "agentd.sqlite3"),
                "endpoint": str(state / "daemon.json"),
                "state": str(state) + "/",
                "sessions": str(state / "sessions") + "/",
                "other_cookies": str(cookies),
                "other_profile": str(cookies.parent) + "/",
                "protected": str(tmp_path / "secret.txt"),
                "shadow": "/etc/shadow",
                "daemon_environ": f"/proc/{os.getpid()}/environ",
                "daemon_cmdline": f"/proc/{os.getpid()}/cmdline",
            },
            "site": site.url + "/",
            "dashboard": d.dashboard_url.rstrip("/") + "/",
            "control_http": f"http://127.0.0.1:{d.port}/",
            "control_ws": f"ws://127.0.0.1:{d.port}/",
            "planted": str(state / "planted-by-saveas"),
            "state": str(state),
            "cdp_name": "planted-by-cdp.txt",
        }
        r = await d.m.spawn(
            browser_spec([run_code(PROBE_JS.replace("%TARGETS%", json.dumps(targets)))]), session_id="session-b"
        )
        st = await d.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st
    found = code_result(st)
    everything = json.dumps(found)
    # Nothing of the daemon's, the other session's or a protected file was read, by node or Chromium.
    for secret in (d.token, SECRET, "SQLite format 3", "PATH=", '"pid"', first["run_id"]):
        assert secret not in everything, (secret, found)
    for key in targets["files"]:
        if key not in ("state", "sessions"):
            assert found[f"node_{key}"].startswith("ERR:"), (key, found)
            assert found[f"chromium_{key}"].startswith("NOPAGE:"), (key, found)
    # The state dir and its sessions dir as the run sees them: its own session's profile at most.
    for key in ("state", "sessions"):
        seen = found[f"node_{key}"] + found[f"chromium_{key}"]
        assert "session-a" not in seen and "token" not in seen and "agentd.sqlite3" not in seen, (key, found)
    # The daemon's ports from the run's browser: no control connection, no dashboard session.
    for origin in ("from_another_origin", "from_a_file_page"):
        seen = json.loads(found[origin])
        assert seen["control_ws"] != "OPEN", seen
        assert "secret" not in seen["dashboard_api"] and "token" not in seen["dashboard_api"].lower(), seen
    # Downloads stay in what the run may write: Playwright's copy to the state dir is
    # refused, Chromium's own (told by CDP to save there) does not land there.
    if not own_view(state, st["sandbox"]):  # (else the path is the run's own private /tmp's)
        assert found["download_saved"].startswith("ERR:"), found
        assert found["cdp_download"] != "completed", found
    assert not (state / "planted-by-saveas").exists()
    assert not (state / "planted-by-cdp.txt").exists()


@pytest.mark.parametrize("state_dir", ["tmp"], indirect=True)
async def test_a_browser_run_reads_no_more_of_nodes_home_than_node(
    daemon: BrowserDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node kept in the daemon user's ~/.local/bin (a tarball unpacked there): the run was
    # granted all of ~/.local (its prefix) and read whatever the user keeps there.
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "share").mkdir()
    note = home / ".local" / "share" / "note"
    note.write_text(SECRET + "\n")
    node = home / ".local" / "bin" / "node"
    found_node = shutil.which("node")
    conftest.require(found_node is not None, "node on PATH")
    shutil.copy2(os.path.realpath(str(found_node)), node)
    monkeypatch.setenv("AGENTD_NODE", str(node))
    targets = {"files": {"note": str(note)}}
    code = PROBE_JS.split("  const sockets")[0].replace("%TARGETS%", json.dumps(targets)) + "  return out;\n}\n"
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(browser_spec([run_code(code)]))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st  # the browser starts with node's binary granted alone
    found = code_result(st)
    assert SECRET not in json.dumps(found), found
    assert found["node_note"].startswith("ERR:") and found["chromium_note"].startswith("NOPAGE:"), found
    read = st["sandbox"]["read"]
    assert str(node) in read and not any(Path(p) in (home, home / ".local", home / ".local" / "bin") for p in read)


@pytest.mark.parametrize("state_dir", ["tmp"], indirect=True)
@pytest.mark.parametrize("where", ["", "Downloads/chrome-linux"], ids=["home", "in_home"])
async def test_a_browser_run_whose_chromium_is_kept_in_a_home_reads_chromium_not_the_home(
    daemon: BrowserDaemon, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # A Chromium unpacked straight into the daemon user's home (``executable_path``
    # naming ``~/chromium``): its directory, granted for its resources, was the whole home;
    # or into a directory in it (``~/Downloads/chrome-linux``): that directory was granted
    # whole, with whatever else lies there. A home of the test's own in the real one (out
    # of the run's private /tmp: Landlock alone keeps it out), holding Debian's Chromium as
    # hard links (its resources beside it).
    conftest.require(os.access(DEBIAN_CHROMIUM.parent, os.R_OK), "Debian's Chromium in /usr/lib/chromium")
    home = Path(tempfile.mkdtemp(prefix="agentd-test-home-", dir=Path.home()))
    chrome = home / where
    try:
        chrome.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-al", f"{DEBIAN_CHROMIUM.parent}/.", str(chrome)], check=True, timeout=60)
        (home / ".bash_history").write_text(f"export TOKEN={SECRET}\n")
        (home / "notes.txt").write_text(SECRET + "\n")
        (chrome / "beside.txt").write_text(SECRET + "\n")  # downloaded with it, say
        monkeypatch.setenv("HOME", str(home))
        files = {"history": home / ".bash_history", "notes": home / "notes.txt", "beside": chrome / "beside.txt"}
        targets = {"files": {k: str(p) for k, p in files.items()}}
        code = PROBE_JS.split("  const sockets")[0].replace("%TARGETS%", json.dumps(targets)) + "  return out;\n}\n"
        spec = {**browser_spec([run_code(code)]), "browser": {"executable_path": str(chrome / "chromium")}}
        with trio.fail_after(SCENARIO_S):
            r = await daemon.m.spawn(spec)
            st = await daemon.m.wait_terminal(r["run_id"])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert st["state"] == "completed", st  # Chromium started from its binary and files alone
    found = code_result(st)
    assert SECRET not in json.dumps(found), found
    for key in files:
        assert found[f"node_{key}"].startswith("ERR:") and found[f"chromium_{key}"].startswith("NOPAGE:"), found
    read = st["sandbox"]["read"]
    assert str(home) not in read and str(chrome) not in read, read
    assert str(chrome / "chromium") in read and str(chrome / "resources.pak") in read, read
    notes = [p for p in st["sandbox"].get("problems", []) if str(chrome) in p and "Chromium" in p]
    assert notes and "home directory" in notes[0], st["sandbox"]
