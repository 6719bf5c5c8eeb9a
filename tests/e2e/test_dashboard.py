"""The web dashboard, in real Chromium (Python Playwright, sync API) against a real `agentd serve`.

One daemon and one browser for the module; each test has its own browser context, signed
in through the link `agentd dashboard` prints. Runs are real runners with the scripted
model; a run is held at a known point by a command that waits for a gate file, so nothing
here sleeps to synchronise. A small script added to every page (``TEST_HOOKS``, the test's
own, not the product's) records the frames the page sends and can drop the page's
websocket, keep it from reconnecting, or hold back pushed events: how a test makes a
connection drop, or a Stop arrive late, on purpose.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from subagent.events import fold_snapshot
from supervisor._lookalikes import SCAN_MAX_CHARS, TWINS, find_lookalikes, scan_lookalikes
from supervisor.control.client import Client
from tests import conftest
from tests.browser_support import CHROMIUM, LocalSite
from tests.conftest import require

pytestmark = pytest.mark.chromium

AGENTD = str(Path(sys.executable).with_name("agentd"))
CHILDREN = Path(__file__).resolve().parent.parent / "children"
# Grace of the module's daemon: a stop that must wait for a command (today's runner lets a
# running tool finish) ends at the grace; kept short for the suite's time.
GRACE_S = 3
# Bound on any one wait in these tests (seconds); a wait is for an event, never a sleep.
WAIT_S = 30

TEST_HOOKS = """
(() => {
  const Native = window.WebSocket;
  const t = (window.__agentdTest = { sockets: [], sent: [], block: false, hold: false, held: [] });
  const pushed = (e) => { try { const m = JSON.parse(e.data); return m.op === "event" || m.op === "end"; } catch { return false; } };
  class TestSocket extends Native {
    constructor(url, protocols) {
      // Blocked: the dashboard's own port, which is no websocket: refused at once.
      super(t.block ? location.origin.replace("http", "ws") + "/no-socket-here" : url, protocols);
      t.sockets.push(this);
    }
    send(data) { t.sent.push(String(data)); return super.send(data); }
    set onmessage(fn) {
      super.onmessage = (e) => {
        if ((t.hold || t.held.length) && pushed(e)) t.held.push(() => fn.call(this, e));
        else fn.call(this, e);
      };
    }
    get onmessage() { return super.onmessage; }
  }
  t.release = () => { t.hold = false; const q = t.held; t.held = []; for (const f of q) f(); };
  t.drop = () => { for (const s of t.sockets) if (s.readyState <= 1) s.close(); };
  t.sentOps = (op) => t.sent.map((s) => JSON.parse(s)).filter((m) => m.op === op);
  window.WebSocket = TestSocket;
})();
"""


@dataclass
class Daemon:
    state_dir: Path
    env: dict[str, str]
    dashboard_url: str
    control_url: str
    log: list[str] = field(default_factory=list)

    def agentd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([AGENTD, *args], env=self.env, capture_output=True, text=True, timeout=WAIT_S)
        if check:
            assert r.returncode == 0, f"agentd {args}: {r.returncode} {r.stderr}"
        return r

    def login_url(self) -> str:
        return self.agentd("dashboard").stdout.strip()

    def status(self, run_id: str) -> dict[str, Any]:
        return json.loads(self.agentd("--json", "status", run_id).stdout)

    def journal_seqs(self, run_id: str) -> list[int]:
        with Client(state_dir=self.state_dir) as c:
            return [e["seq"] for e in c.events(run_id, after_seq=0, limit=10000)]

    def wait_for(self, run_id: str, pred: Any) -> dict[str, Any]:
        """Follow the run's events until ``pred(event)``; returns that event."""
        with Client(state_dir=self.state_dir) as c:
            for ev in c.follow(run_id):
                if pred(ev):
                    return ev
        raise AssertionError(f"run {run_id} ended before the awaited event")


def _tool_running(needle: str) -> Any:
    def pred(ev: dict[str, Any]) -> bool:
        rec = ev["data"].get("record") if ev["kind"] == "tool_call" else None
        return bool(rec and needle in rec["arguments"] + rec["name"] and rec["state"] == "running")

    return pred


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    require(CHROMIUM.is_file(), "chromium (apt-get install chromium)")
    state = tmp_path_factory.mktemp("dashboard") / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "AGENTD_TEST_MARK")}
    env.update(AGENTD_STATE_DIR=str(state), AGENTD_GRACE_S=str(GRACE_S))
    # A session's history comes in pages of this much: a long session's costs few turns.
    env.update(AGENTD_HISTORY_REPLY_BYTES=str(HISTORY_PAGE_BYTES))
    proc = subprocess.Popen([AGENTD, "serve"], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    log: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if "agentd listening on" in line:
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        assert ready.wait(WAIT_S) and proc.poll() is None, "".join(log)
        info = json.loads((state / "daemon.json").read_text())
        # Its parked spare runners are its own, forked again after each test's spawns.
        with conftest.owned_by_fixture(lambda: _spare_pids(state)):
            yield Daemon(state, env, info["dashboard_url"], info["url"], log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()
    assert code == 0, "".join(log[-30:])


def _spare_pids(state: Path) -> set[int]:
    """The pids of the daemon's parked spare runners (``status``)."""
    with Client(state_dir=state) as c:
        zygote = c.status().get("summary", {}).get("zygote", {})
    return set(zygote.get("spares", {}).get("pids", []))


@pytest.fixture(autouse=True)
def no_run_left_live(daemon: Daemon) -> Iterator[None]:
    """A test that fails midway still leaves no run behind: its live runs are cancelled."""
    yield
    with Client(state_dir=daemon.state_dir) as c:
        live = [r["id"] for r in c.status()["live_runs"]]
        for run_id in live:
            c.cancel(run_id, reason="test teardown")
        for run_id in live:
            for _ in c.follow(run_id, after_seq=2**62):
                pass


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    require(CHROMIUM.is_file(), "chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    # Its temp dirs in the test's own (Chromium left org.chromium.Chromium.* in /tmp).
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chromium-tmp"))}
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, chromium_sandbox=False, env=env)
        try:
            # Chromium starts its GPU, network and storage helpers with the first page and
            # keeps them for its life: start them now, so no test is blamed for them.
            warm = b.new_context()
            warm.new_page().goto("about:blank")
            warm.close()
            yield b
        finally:
            b.close()
    finally:
        pw.stop()


@dataclass
class Tab:
    context: Any
    page: Any
    errors: list[str]
    requests: list[str]


def _open_tab(browser: Any) -> Tab:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_init_script(TEST_HOOKS)
    page = context.new_page()
    page.set_default_timeout(WAIT_S * 1000)
    tab = Tab(context, page, [], [])
    page.on("pageerror", lambda e: tab.errors.append(f"pageerror: {e}"))
    page.on(
        "console",
        lambda m: tab.errors.append(f"console: {m.text} ({m.location.get('url', '')})") if m.type == "error" else None,
    )
    page.on("request", lambda r: tab.requests.append(r.url))
    page.on("websocket", lambda w: tab.requests.append(w.url))
    return tab


@pytest.fixture
def tab(browser: Any, daemon: Daemon) -> Iterator[Tab]:
    """A signed-in page on the runs list."""
    t = _open_tab(browser)
    try:
        t.page.goto(daemon.login_url())
        t.page.wait_for_selector("#conn[data-state=open]")
        yield t
        own = (daemon.dashboard_url, daemon.dashboard_url.replace("http:", "ws:"), daemon.control_url)
        foreign = [u for u in t.requests if not u.startswith(own)]
        assert foreign == [], "the page fetched something not its own"
        assert [e for e in t.errors if "/no-socket-here" not in e] == []
    finally:
        t.context.close()


def gated_script(tmp_path: Path, *gates: str, final: str = "All done.") -> Path:
    """A script whose turn i runs a command that waits for the file ``gates[i]``."""
    turns = [
        {
            "text": f"Waiting for {g}.",
            "tool_calls": [
                {
                    "name": "run_command",
                    "arguments": {"command": f"while [ ! -f {tmp_path / g} ]; do sleep 0.02; done; echo passed {g}"},
                }
            ],
        }
        for g in gates
    ]
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"turns": turns, "final": final}))
    return path


def granted(tmp_path: Path) -> list[str]:
    """``--spec`` granting the run this test's dir (its gates and records live there):
    a run's sandbox reaches only its own dir and what its spec grants."""
    path = tmp_path / "grant.json"
    path.write_text(json.dumps({"sandbox": {"write": [str(tmp_path)]}}))
    return ["--spec", str(path)]


def open_gate(tmp_path: Path, gate: str) -> None:
    (tmp_path / gate).write_text("go\n")


def dom_seqs(page: Any) -> list[int]:
    return page.eval_on_selector_all("#events li", "els => els.map(li => Number(li.dataset.seq))")


def fmt_duration(s: float) -> str:
    """The page's own formatting (dom.js fmtDuration), for comparing with the receipt."""
    s = max(0.0, s)
    if s < 1:
        return f"{round(s * 1000)} ms"
    if s < 10:
        return f"{float(f'{s:.2f}'):g} s"
    if s < 60:
        return f"{float(f'{s:.1f}'):g} s"
    return f"{int(s // 60)} min {int(s % 60)} s"


def assert_nothing_left(status: dict[str, Any]) -> None:
    """The run's runner and every process group it reported are gone."""
    pid = status.get("pid")
    assert pid, status
    try:
        p = psutil.Process(pid)
        assert p.create_time() != status.get("pid_start_time") or p.status() == psutil.STATUS_ZOMBIE, "runner alive"
    except psutil.NoSuchProcess:
        pass
    pgids = {pid} | {g["pgid"] for g in status.get("groups", [])}
    left = [p.pid for p in psutil.process_iter() if _pgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes of the run left: {left}"
    assert (status["receipt"].get("path_b") or {}).get("survivors") == []


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# ------------------------------------------------------------------------------ runs list


def test_a_run_spawned_from_the_cli_appears_within_a_second_and_its_steps_stream_in(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    page = tab.page
    script = gated_script(tmp_path, "gate1", "gate2")
    run_id = daemon.agentd(
        "spawn", "list me", "--script", str(script), "--session", "s-list", *granted(tmp_path)
    ).stdout.strip()
    row = page.locator(f"tr[data-run-id='{run_id}']")
    row.wait_for(timeout=1000)  # the acceptance: on the page within 1 s
    daemon.wait_for(run_id, _tool_running("gate1"))
    page.wait_for_function(
        "id => { const r = document.querySelector(`tr[data-run-id='${id}']`); return r && /run_command/.test(r.cells[6].textContent) }",
        arg=run_id,
    )
    cells = row.locator("td").all_inner_texts()
    assert cells[0] == run_id and cells[1] == "running" and cells[2] == "s-list" and cells[3] == "list me"
    assert cells[5] == "1" and cells[6].startswith('run_command {"command":"while')
    assert cells[7] in ("cgroup", "subreaper+sweep", "group")
    # Filters: by state and by session, kept in the address.
    page.get_by_label("State", exact=True).select_option("completed")
    row.wait_for(state="detached")
    assert "state=completed" in page.url
    page.get_by_label("State", exact=True).select_option("running")
    row.wait_for()
    page.get_by_label("Session", exact=True).fill("another-session")
    row.wait_for(state="detached")
    page.get_by_label("Session", exact=True).fill("s-list")
    row.wait_for()
    # Into the run: its steps stream in as they happen.
    page.get_by_role("link", name=run_id).click()
    page.get_by_role("heading", name=f"Run {run_id}").wait_for()
    page.locator("#events li[data-kind=tool_call]", has_text="gate1").first.wait_for()
    assert page.locator("#events li[data-kind=step_started]").count() == 1
    open_gate(tmp_path, "gate1")
    page.locator("#events li[data-kind=step_started]", has_text="Step 2").wait_for()
    page.locator("#events li[data-kind=assistant_text]", has_text="Waiting for gate2.").wait_for()
    # The partial result so far is all the run said: the page folds each snapshot's delta
    # (the text said since the last one) into what it shows.
    page.locator("#result", has_text="Waiting for gate1.").filter(has_text="Waiting for gate2.").wait_for()
    open_gate(tmp_path, "gate2")
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    # The last model turn's snapshot shows "All done." as a partial result first; the
    # terminal status then turns it into the result.
    page.locator("#result-title", has_text=re.compile(r"^Result$")).wait_for()
    page.locator("#result", has_text="All done.").wait_for()
    assert dom_seqs(page) == daemon.journal_seqs(run_id)
    assert page.get_by_role("button", name="Stop").is_disabled()  # nothing to stop


# ------------------------------------------------------------------------------ stop


def test_stop_inside_a_command_goes_to_stopping_at_once_then_shows_the_receipt_the_cli_agrees_with(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    page = tab.page
    script = tmp_path / "sleep.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    {
                        "text": "Sleeping.",
                        "tool_calls": [
                            {
                                "name": "run_command",
                                "arguments": {"command": "echo started; sleep 300 & sleep 300; wait"},
                            }
                        ],
                    }
                ],
                "final": "never",
            }
        )
    )
    run_id = daemon.agentd("spawn", "stop me", "--script", str(script), *granted(tmp_path)).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#events li[data-kind=process_group]", has_text="sleep 300").wait_for()
    stop = page.get_by_role("button", name="Stop")
    assert stop.is_enabled()
    # Pressed twice in one go: at once a disabled "Stopping…", and one cancel sent.
    label, disabled = page.evaluate(
        "() => { const b = document.getElementById('stop'); b.click(); const r = [b.textContent, b.disabled]; b.click(); return r; }"
    )
    assert (label, disabled) == ("Stopping…", True)
    assert page.get_by_role("button", name="Stopping…").is_disabled()
    page.locator("#stop-steps li", has_text="Stop sent to the runner (reason: user)").wait_for()
    page.locator("#stop[data-phase=done]").wait_for()
    assert page.evaluate("() => __agentdTest.sentOps('cancel').length") == 1
    text = page.locator("#stop-status").inner_text()

    status = daemon.status(run_id)
    assert status["state"] == "cancelled" and status["reason"] == "user"
    receipt = status["receipt"]
    took = fmt_duration(receipt["cancel_to_tree_dead_s"])
    if receipt["path_b"]["escalated"]:
        assert text.startswith(f"Cancelled at the grace ({took}) · escalated to SIGKILL"), text
    else:
        assert text.startswith(f"Stopped in {took}"), text
    assert text.endswith("· 0 left"), text
    # A count of processes ended only when the receipt has one (its pid lists are not all).
    assert bool(re.search(r"· \d+ process(es)? ended ·", text)) == ("processes_ended" in receipt), text
    # The page shows the receipt itself, every field of it.
    page.locator("#receipt-details summary").click()
    details = page.locator("#receipt").inner_text()
    for key in ("cancel_reason", "cancel_to_tree_dead_s", "path_b", "escalated", "survivors", "signals"):
        assert key in details
    assert page.locator("#receipt-summary").inner_text() == text
    assert page.locator("#run-facts").inner_text().split("\n")[1].startswith("cancelled")
    assert_nothing_left(status)
    # One stop: the daemon journaled one "cancelling".
    with Client(state_dir=daemon.state_dir) as c:
        cancelling = [e for e in c.events(run_id) if e["kind"] == "state" and e["data"]["state"] == "cancelling"]
    assert len(cancelling) == 1


def test_stop_on_a_destructive_tool_shows_it_finishing_then_the_final_state(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    page = tab.page
    servers = tmp_path / "mcp.json"
    servers.write_text(
        json.dumps(
            {"mcpServers": {"writer": {"command": sys.executable, "args": [str(CHILDREN / "mcp_write_server.py")]}}}
        )
    )
    record, gate = tmp_path / "record.txt", tmp_path / "write-gate"
    script = tmp_path / "write.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    {
                        "text": "Writing the record.",
                        "tool_calls": [{"name": "commit_write", "arguments": {"path": str(record), "gate": str(gate)}}],
                    }
                ],
                "final": "Written.",
            }
        )
    )
    run_id = daemon.agentd(
        "spawn", "write it", "--script", str(script), "--mcp-config", str(servers), *granted(tmp_path)
    ).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#events li[data-kind=tool_call]", has_text="commit_write").first.wait_for()
    # The call is announced before it runs: stop once the server has started the write.
    started, deadline = Path(str(record) + ".started"), time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the write never started"
        time.sleep(0.02)
    page.get_by_role("button", name="Stop").click()
    # The write is allowed to finish: the page says so while it runs.
    page.locator("#stop-steps li", has_text="commit_write is still running").wait_for()
    page.locator("#stop-status", has_text="Waiting for commit_write").wait_for()
    assert page.get_by_role("button", name="Stopping…").is_disabled()
    assert not record.exists()
    gate.write_text("go\n")
    page.locator("#stop[data-phase=done]").wait_for()
    text = page.locator("#stop-status").inner_text()
    status = daemon.status(run_id)
    assert status["state"] == "cancelled", status["state"]
    (call,) = [c for c in status["tool_calls"] if c["name"] == "commit_write"]
    assert call["state"] == "succeeded"  # it finished after the stop: recorded as it was
    assert record.read_text() == "written\n"  # cancel is not rollback
    assert text.startswith("Stopped · the commit_write call finished first ("), text
    page.locator("#stop-steps li", has_text="commit_write finished after the stop (succeeded").wait_for()
    page.locator("#tools li[data-state=succeeded]", has_text="commit_write").wait_for()
    assert_nothing_left(status)


def test_a_late_stop_says_the_run_had_already_ended(daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    page = tab.page
    run_id = daemon.agentd(
        "spawn", "finish first", "--script", str(gated_script(tmp_path, "gate")), *granted(tmp_path)
    ).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#events li[data-kind=tool_call]", has_text="gate").first.wait_for()
    # The page stops hearing events; meanwhile the run completes.
    page.evaluate("() => { __agentdTest.hold = true; }")
    open_gate(tmp_path, "gate")
    with Client(state_dir=daemon.state_dir) as c:
        for _ in c.follow(run_id):  # to the run's end
            pass
    assert daemon.status(run_id)["state"] == "completed"
    page.get_by_role("button", name="Stop").click()
    page.locator("#stop-status", has_text="The run had already ended (completed): nothing to stop").wait_for()
    page.evaluate("() => __agentdTest.release()")
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    page.locator("#stop[data-phase=done]").wait_for()
    assert page.locator("#stop-status").inner_text() == "The run had already ended (completed): nothing to stop"
    assert daemon.status(run_id)["state"] == "completed"


# ------------------------------------------------------------------------------ steering


def test_steering_from_the_page_shows_whether_it_was_applied(daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    page = tab.page
    run_id = daemon.agentd(
        "spawn", "steer me", "--script", str(gated_script(tmp_path, "g1", "g2")), *granted(tmp_path)
    ).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#events li[data-kind=tool_call]", has_text="g1").first.wait_for()
    page.get_by_label("Extra input for the running turn").fill("also count the hidden files")
    page.get_by_role("button", name="Send").click()
    item = page.locator("#steer-list li", has_text="also count the hidden files")
    item.locator(".tag", has_text="queued for the next step").wait_for()
    open_gate(tmp_path, "g1")
    item.locator(".tag", has_text="applied at step 2").wait_for()
    page.get_by_label("Extra input for the running turn").fill("never mind")
    page.get_by_role("button", name="Send").click()
    page.locator("#steer-list li", has_text="never mind").locator(".tag", has_text="queued").wait_for()
    page.get_by_role("button", name="Stop").click()
    page.locator("#stop-steps li", has_text="The runner got the stop").wait_for()
    open_gate(tmp_path, "g2")  # the running command ends; the runner reports what it never applied
    page.locator("#steer-list li", has_text="never mind").locator(".tag", has_text="never applied").wait_for()
    page.locator("#stop[data-phase=done]").wait_for()
    assert page.locator("#steer-form").is_hidden()  # an ended run takes no more input


# ------------------------------------------------------------------------------ reconnects


def test_reload_and_a_dropped_connection_resume_without_gap_or_duplicate_and_closing_never_stops(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    page = tab.page
    run_id = daemon.agentd(
        "spawn", "resume me", "--script", str(gated_script(tmp_path, "g1", "g2", "g3")), *granted(tmp_path)
    ).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#events li[data-kind=tool_call]", has_text="g1").first.wait_for()
    # Reload mid-run: the events shown are the journal's, each once.
    page.reload()
    page.locator("#events li[data-kind=tool_call]", has_text="g1").first.wait_for()
    journal = daemon.journal_seqs(run_id)
    page.wait_for_function("n => document.querySelectorAll('#events li').length >= n", arg=len(journal))
    assert dom_seqs(page) == journal == list(range(1, len(journal) + 1))
    # Drop the connection and keep it down while the run moves on.
    last_seen = dom_seqs(page)[-1]
    page.evaluate("() => { __agentdTest.block = true; __agentdTest.drop(); }")
    page.locator("#conn[data-state=reconnecting]").wait_for()
    open_gate(tmp_path, "g1")
    daemon.wait_for(run_id, _tool_running("g2"))
    assert dom_seqs(page)[-1] == last_seen  # the page has not seen what happened meanwhile
    page.evaluate("() => { __agentdTest.block = false; }")
    page.locator("#conn[data-state=open]").wait_for()
    page.locator("#events li[data-kind=tool_call]", has_text="g2").first.wait_for()
    journal = daemon.journal_seqs(run_id)
    page.wait_for_function("n => document.querySelectorAll('#events li').length >= n", arg=len(journal))
    assert dom_seqs(page) == journal
    resumed = page.evaluate(
        "id => __agentdTest.sentOps('subscribe').filter(m => m.run_id === id).map(m => m.after_seq)", run_id
    )
    assert resumed[-1] == last_seen and 0 in resumed
    # Closing the page never stops the run.
    page.close()
    with Client(state_dir=daemon.state_dir) as c:
        deadline = time.monotonic() + WAIT_S
        while c.status()["daemon"]["connections"] > 1:  # the page's socket is gone (ours is 1)
            assert time.monotonic() < deadline, "the page's connection never closed"
            c.ping()
        assert c.status(run_id)["state"] == "running"
    open_gate(tmp_path, "g2")
    daemon.wait_for(run_id, _tool_running("g3"))
    open_gate(tmp_path, "g3")
    with Client(state_dir=daemon.state_dir) as c:
        for _ in c.follow(run_id):
            pass
    assert daemon.status(run_id)["state"] == "completed"


# ------------------------------------------------------------------------------ access


def test_no_or_wrong_or_used_login_tokens_are_refused_and_the_session_is_no_cookie(
    daemon: Daemon, browser: Any
) -> None:
    t = _open_tab(browser)
    try:
        page = t.page
        page.goto(daemon.dashboard_url)  # never signed in: the page sends it to /signed-out
        page.get_by_role("heading", name="Not signed in").wait_for()
        for url in (f"{daemon.dashboard_url}login?t=v1.9999999999.x.y", f"{daemon.dashboard_url}login"):
            resp = page.goto(url)
            assert resp is not None and resp.status == 401, url
            assert page.get_by_role("heading", name="Not signed in").is_visible()
        link = daemon.login_url()
        page.goto(link)
        page.wait_for_selector("#conn[data-state=open]")
        assert page.url == daemon.dashboard_url  # the link left the address bar
        # The secret is in this origin's storage (scoped to its port), never in a cookie,
        # which the browser would send to any other server on 127.0.0.1.
        assert t.context.cookies() == []
        secret = page.evaluate("() => localStorage.getItem('agentd_session')")
        assert secret and secret not in link
        other = _open_tab(browser)
        try:
            resp = other.page.goto(link)  # the same link, a second time
            assert resp is not None and resp.status == 401
        finally:
            other.context.close()
        # Another tab of the same browser shares the secret (localStorage) and is connected.
        second = t.context.new_page()
        second.goto(daemon.dashboard_url)
        second.wait_for_selector("#conn[data-state=open]")
        # Sign out from the page: the session ends, for the page's secret too, and the
        # other tab's open socket is closed (it then finds itself signed out).
        page.get_by_role("button", name="Sign out").click()
        page.get_by_role("heading", name="Not signed in").wait_for()
        second.wait_for_selector("#conn[data-state=signed-out]")
        assert page.evaluate("() => localStorage.getItem('agentd_session')") is None
        status = page.evaluate(
            "async (s) => (await fetch('/api/session', { headers: { 'X-Agentd-Session': s } })).status", secret
        )
        assert status == 401
    finally:
        t.context.close()


def _handshake_status(control_url: str, headers: dict[str, str]) -> int:
    """The HTTP status a raw websocket handshake to the control socket gets."""
    host, port = control_url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
    lines = [
        "GET / HTTP/1.1",
        f"Host: {host}:{port}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            assert chunk, data
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_what_the_browser_would_send_another_port_does_not_open_the_control_socket(daemon: Daemon, tab: Tab) -> None:
    # A non-browser client (another server on 127.0.0.1 that got the browser's cookies)
    # forges the dashboard's Origin: a cookie with the session in it is no credential.
    secret = tab.page.evaluate("() => localStorage.getItem('agentd_session')")
    origin = daemon.dashboard_url.rstrip("/")
    port = origin.rsplit(":", 1)[1]
    for name in ("agentd_session", f"agentd_session_{port}"):
        cookie = {"Origin": origin, "Cookie": f"{name}={secret}"}
        assert _handshake_status(daemon.control_url, cookie) == 403, name
    # The page's own way in (the secret offered as a subprotocol) is the credential.
    offered = {"Origin": origin, "Sec-WebSocket-Protocol": f"agentd-dashboard, agentd-session.{secret}"}
    assert _handshake_status(daemon.control_url, offered) == 101


def test_a_login_link_from_a_page_of_another_origin_signs_in_and_a_head_request_does_not_use_it_up(
    daemon: Daemon, browser: Any
) -> None:
    with LocalSite({"/": "<!doctype html><title>elsewhere</title>"}) as site:
        port = site.url.rsplit(":", 1)[1]
        for origin in (site.url, f"http://localhost:{port}"):  # same site other port; cross site
            link = daemon.login_url()
            # A link preview (chat app, mail scanner) asks with HEAD first.
            head = urllib.request.Request(link, method="HEAD")
            with urllib.request.urlopen(head, timeout=WAIT_S) as resp:
                assert resp.status == 200
            site.pages["/from"] = f'<!doctype html><title>elsewhere</title><a id="go" href="{link}">dashboard</a>'
            t = _open_tab(browser)
            try:
                t.page.goto(f"{origin}/from")
                t.page.click("#go")
                t.page.wait_for_selector("#conn[data-state=open]")
                assert t.page.url == daemon.dashboard_url, origin
            finally:
                t.context.close()


def test_a_foreign_origin_and_a_cross_site_post_are_refused(daemon: Daemon, tab: Tab) -> None:
    page = tab.page
    evil = f"""<!doctype html><html><body><h1>evil</h1>
<form id="f" method="post" action="{daemon.dashboard_url}logout"><button>go</button></form>
<script>
  const ws = new WebSocket("{daemon.control_url}");
  ws.onopen = () => {{ document.title = "ws open"; }};
  ws.onclose = () => {{ document.title = "ws refused"; }};
</script></body></html>"""
    with LocalSite({"/evil": evil}) as site:
        port = site.url.rsplit(":", 1)[1]
        # Same site (127.0.0.1), other origin, and cross site (localhost): the page has no
        # session to offer (it is in the dashboard origin's storage) and its Origin is wrong.
        for origin in (site.url, f"http://localhost:{port}"):
            page.goto(f"{origin}/evil")
            page.wait_for_function("() => document.title.startsWith('ws ')")
            assert page.title() == "ws refused", origin
            with page.expect_navigation() as nav:
                page.click("#f button")
            resp = nav.value
            assert resp is not None and resp.status == 403, origin
    # What the evil pages fetched, and the errors they met, are not the dashboard's doing.
    tab.requests.clear()
    tab.errors.clear()
    page.goto(daemon.dashboard_url)
    page.wait_for_selector("#conn[data-state=open]")  # still signed in: the POSTs did nothing
    tab.errors[:] = [e for e in tab.errors if site.url not in e and f"localhost:{port}" not in e]


# ------------------------------------------------------------------------------ the CLI


# A fake browser ($BROWSER): records its argv, what it was given to open, and what the
# link in it does once and twice against the daemon. argv: the page's URL; OUT in the source.
FAKE_BROWSER = r"""
import html, json, os, re, sys, urllib.error, urllib.parse, urllib.request
rec = {"argv": sys.argv, "cmdline": open(f"/proc/{os.getpid()}/cmdline").read()}
json.dump(rec, open(OUT, "w"))
path = urllib.parse.unquote(urllib.parse.urlparse(sys.argv[1]).path)
st = os.stat(path)
link = html.unescape(re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', open(path).read()).group(1))
get = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def status(url):
    try:
        return get.open(url, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code
rec.update(path=path, mode=st.st_mode & 0o777, dir_mode=os.stat(os.path.dirname(path)).st_mode & 0o777,
           uid=st.st_uid, link=link, first=status(link), second=status(link))
json.dump(rec, open(OUT, "w"))
"""


def test_agentd_dashboard_prints_a_one_time_link_and_opens_it_with_the_users_browser(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The browser is given a private page that sends it on to the link, not the link: a
    browser's argv is in /proc/<pid>/cmdline, where any process that sees it (a run without a
    /proc of its own) read the link before the browser used it. The page is gone afterwards."""
    record = tmp_path / "browser.json"
    fake = tmp_path / "fake-browser"
    fake.write_text(f"#!{sys.executable}\nOUT = {str(record)!r}\n{FAKE_BROWSER}")
    fake.chmod(0o755)
    env = {**daemon.env, "BROWSER": str(fake)}
    r = subprocess.run(
        [AGENTD, "--json", "dashboard", "--open"], env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["url"].startswith(f"{daemon.dashboard_url}login?t=v1.")
    rec = json.loads(record.read_text())
    secret = out["url"].split("?t=", 1)[1]
    assert not any(secret in a or "login?t=" in a for a in rec["argv"]), rec["argv"]
    assert secret not in rec["cmdline"] and "login?t=" not in rec["cmdline"], rec["cmdline"]
    assert out["opened"] is True, (r.stderr, rec)
    assert rec["link"] == out["url"], rec
    assert (rec["mode"], rec["dir_mode"], rec["uid"]) == (0o600, 0o700, os.getuid()), rec
    assert Path(rec["path"]).parent.parent == daemon.state_dir, rec  # as private as the token beside it
    assert (rec["first"], rec["second"]) == (200, 401), rec  # the link works once
    assert not os.path.exists(rec["path"]) and not os.path.exists(os.path.dirname(rec["path"]))
    assert not [p for p in daemon.state_dir.iterdir() if p.name.startswith("dashboard-login-")]
    token = (daemon.state_dir / "token").read_text().strip()
    assert token not in out["url"]
    r = subprocess.run(
        [AGENTD, "--state-dir", str(tmp_path / "nothing-here"), "dashboard"],
        env=daemon.env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3 and r.stderr.startswith("error: no agentd daemon")


# ------------------------------------------------------------------------------ the page's logic


JS_CASES = r"""
async () => {
  const { stopSummary, processesEnded } = await import("/static/js/receipt.js");
  const { StopModel } = await import("/static/js/stop.js");
  const { SteerModel } = await import("/static/js/steer.js");
  const { fmtDuration } = await import("/static/js/dom.js");
  const { toolLine, foldSnapshot } = await import("/static/js/events.js");
  const out = {};
  // The runner counts progress_at in code points (as the daemon's fold does), not UTF-16 units.
  let snap = null;
  for (const d of [{ progress_at: 0, progress_added: "ok \u{1F600}", snapshot_n: 1, step: 1 },
                   { progress_at: 4, progress_added: " next \u{1F600}\u{1F600}", snapshot_n: 2, step: 2 },
                   { progress_at: 10, progress_added: " \u00e9", snapshot_n: 3, step: 3 }]) snap = foldSnapshot(snap, d);
  out.folded = snap.progress;
  const pb = (extra) => ({ escalated: false, leader: "exited", pid: 10, killed: [], reaped: [], survivors: [], ...extra });
  out.fast = stopSummary({ state: "cancelled", receipt: { cancel_to_tree_dead_s: 0.043, processes_ended: 7, path_b: pb({}) } });
  out.counted = stopSummary({ state: "cancelled", receipt: { cancel_to_tree_dead_s: 0.2,
    path_b: pb({ leader: "killed", killed: [{ pid: 10 }, { pid: 11 }], reaped: [11, 12] }) } });
  out.grace = stopSummary({ state: "cancelled", receipt: { cancel_to_tree_dead_s: 10.02,
    path_b: pb({ escalated: true, survivors: [{ pid: 99, cmdline: "stuck" }] }) } });
  out.finished = stopSummary({ state: "cancelled", receipt: { cancel_to_tree_dead_s: 1.3, path_b: pb({}) } },
    { finishedFirst: [{ name: "write", afterS: 1.2 }] });
  out.queued = stopSummary({ state: "cancelled", receipt: { note: "cancelled while queued: never started" } });
  out.completed = stopSummary({ state: "completed", receipt: { path_b: pb({}) } }, { pressed: true });
  out.unknownCount = processesEnded({ path_b: { leader: "gone" } });
  // The cgroup ended a tree of 4: the receipt names none of them, nor how many.
  out.cgroupKilled = stopSummary({ state: "cancelled", receipt: { cancel_to_tree_dead_s: 0.05, containment: "cgroup",
    path_b: pb({ cgroup: "/sys/fs/cgroup/agentd-1/t1" }) } });
  out.cgroupCount = processesEnded({ path_b: pb({ cgroup: "/sys/fs/cgroup/agentd-1/t1", killed: [{ pid: 11 }] }) });
  // A stop as a later daemon may tell it: interrupted tool, an event kind not known today.
  const m = new StopModel();
  const ev = (seq, kind, data, ts) => ({ seq, kind, data, ts });
  m.feed(ev(1, "tool_call", { record: { id: "c1", name: "run_command", state: "running", arguments: "{}" } }, 100.0));
  m.feed(ev(2, "stop_requested", { reason: "signal", during: "tool" }, 100.001));
  m.feed(ev(3, "state", { state: "cancelling", reason: "user" }, 100.002));
  m.feed(ev(4, "tool_call", { record: { id: "c1", name: "run_command", state: "cancelled", reason: "interrupted by the stop after 40 ms", arguments: "{}" } }, 100.041));
  m.feed(ev(5, "stop_escalated", { message: "SIGKILL to 2 processes at the grace" }, 110.0));
  m.feed(ev(6, "state", { state: "cancelled" }, 110.01));
  out.steps = m.steps.map((s) => s.text);
  // A stop that ends a wait for approval.
  const a = new StopModel();
  a.feed(ev(1, "tool_call", { record: { id: "c9", name: "deploy", state: "running", approval: "pending", arguments: "{}" } }, 200.0));
  a.feed(ev(2, "state", { state: "cancelling", reason: "user" }, 200.001));
  a.feed(ev(3, "approval_answered", { call_id: "c9", decision: "rejected", reason: "user" }, 200.002));
  out.approvalSteps = a.steps.map((s) => s.text);
  out.rejectedLine = toolLine({ id: "c9", name: "deploy", state: "rejected", arguments: "{}" });
  out.sentLine = toolLine({ id: "c8", name: "read", state: "running", arguments: "{}", sent_at: 300.5 });
  out.unsentLine = toolLine({ id: "c8", name: "read", state: "running", arguments: "{}" });
  out.firstAt = m.steps[0].atS;
  const s = new SteerModel();
  for (const [k, d] of [["steer_sent", { text: "a" }], ["steer_sent", { text: "a" }], ["steering", { state: "queued", text: "a", step: 1 }],
                        ["steering", { state: "applied", text: "a", step: 2 }], ["steering", { state: "queued", text: "a", step: 2 }],
                        ["steering", { state: "unapplied", text: "a", step: 2 }],
                        ["steer_sent", { text: "b" }], ["steer_unsent", { text: "b", why: "w" }]]) s.feed({ kind: k, data: d });
  out.steer = s.items.map((i) => `${i.state}@${i.step}${i.why ? `:${i.why}` : ""}`);
  out.durations = [0.0434, 0.9996, 1.2, 2, 2.034, 12.34, 75, 4000].map(fmtDuration);
  return out;
}
"""


def test_the_pages_stop_logic_tells_the_truth_and_reads_fields_it_does_not_know_yet(
    daemon: Daemon, browser: Any
) -> None:
    t = _open_tab(browser)
    try:
        t.page.goto(f"{daemon.dashboard_url}signed-out")  # signed out is fine: the modules are the page's own files
        out = t.page.evaluate(JS_CASES)
    finally:
        t.context.close()
    assert out["fast"] == "Stopped in 43 ms · 7 processes ended · 0 left"
    # Without the receipt's count, no count (the pids it lists are not all that ended).
    assert out["counted"] == "Stopped in 200 ms · 0 left"
    assert out["grace"] == "Cancelled at the grace (10 s) · escalated to SIGKILL · 1 process could not be confirmed"
    assert out["finished"] == "Stopped · the write call finished first (1.2 s) · 0 left"
    assert out["cgroupKilled"] == "Stopped in 50 ms · 0 left"
    assert out["cgroupCount"] is None
    assert out["queued"] == "Cancelled before it started · nothing was running"
    assert out["completed"] == "Completed before the stop took effect"
    assert out["unknownCount"] is None
    assert out["approvalSteps"][1] == "deploy was awaiting approval: the stop ended the wait; it never ran (user)"
    assert "{" not in " ".join(out["approvalSteps"])
    assert out["rejectedLine"].startswith("⊘ deploy rejected")
    assert (out["sentLine"], out["unsentLine"]) == ("▶ read {} · sent", "▶ read {}")
    whole: dict[str, Any] | None = None
    for d in [
        {"progress_at": 0, "progress_added": "ok \U0001f600", "snapshot_n": 1, "step": 1},
        {"progress_at": 4, "progress_added": " next \U0001f600\U0001f600", "snapshot_n": 2, "step": 2},
        {"progress_at": 10, "progress_added": " \u00e9", "snapshot_n": 3, "step": 3},
    ]:
        whole = fold_snapshot(whole, d)
    assert whole is not None and out["folded"] == whole["progress"] == "ok \U0001f600 next  \u00e9", out["folded"]
    assert out["steps"] == [
        "Stop sent to the runner (reason: user)",
        "The runner got the stop during a tool call",
        "run_command is still running: waiting for it",
        "run_command interrupted: interrupted by the stop after 40 ms",
        "stop_escalated: SIGKILL to 2 processes at the grace",
        "Run cancelled (outcome recorded)",
    ]
    assert out["firstAt"] == 0
    # A steer journaled, then not written into the runner's input: refused, and why.
    assert out["steer"] == ["applied@2", "unapplied@2", "refused@null:w"]
    assert out["durations"] == ["43 ms", "1000 ms", "1.2 s", "2 s", "2.03 s", "12.3 s", "1 min 15 s", "1 h 6 min"]
    assert [fmt_duration(x) for x in (0.0434, 1.2, 2, 2.034, 12.34, 75)] == [
        out["durations"][i] for i in (0, 2, 3, 4, 5, 6)
    ]


# ------------------------------------------------------------------------------ approvals, sessions


def approval_spec(tmp_path: Path) -> list[str]:
    """``--spec`` for a run whose two commands each wait for a person's OK; grants tmp_path."""
    turns = [
        {
            "text": "Writing the first.",
            "tool_calls": [
                {"name": "run_command", "id": "call_one", "arguments": {"command": f"echo one > {tmp_path / 'first'}"}}
            ],
        },
        {
            "text": "Writing the second.",
            "tool_calls": [
                {"name": "run_command", "id": "call_two", "arguments": {"command": f"echo two > {tmp_path / 'second'}"}}
            ],
        },
    ]
    spec = {
        "task": "write two files",
        "model": {"provider": "scripted", "script": {"turns": turns, "final": "Last I heard: {{last_output}}"}},
        "approval": {"commands": ["echo *"]},
        "sandbox": {"write": [str(tmp_path)]},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return ["--spec", str(path)]


TIMED_OUT_REQUEST = r"""
async () => {
  const { Connection, RequestError } = await import("/static/js/conn.js");
  const { StopControl } = await import("/static/js/stop.js");
  const t = window.__agentdTest;
  const conn = new Connection(null, { requestTimeoutMs: 300 });
  const state = (want) => new Promise((res) => {
    if (conn.state === want) return res();
    const off = conn.onState((s) => { if (s === want) { off(); res(); } });
  });
  conn.start();
  await state("open");
  t.block = true; // reconnects fail until unblocked
  t.drop();
  await state("reconnecting");
  const err = await conn.request("cancel", { run_id: "r-timed-out", reason: "test" }).then(() => null, (e) => e);
  t.block = false;
  await state("open");
  await conn.request("ping"); // answered: whatever was queued went before it
  // What the Stop button says of each failure.
  const said = {};
  for (const code of ["not_sent", "timeout", "unauthorized"]) {
    const [button, status, steps] = ["button", "p", "ol"].map((n) => document.createElement(n));
    const c = new StopControl(button, status, steps, { cancel: () => Promise.reject(new RequestError(code, "why")) });
    c.setState("running");
    c.press();
    await new Promise((res) => setTimeout(res, 0));
    said[code] = status.textContent;
  }
  return { code: err && err.code, message: err && err.message, cancels: t.sentOps("cancel").length, said };
}
"""


def test_a_request_that_timed_out_waiting_for_the_connection_is_never_sent_after_it_comes_back(tab: Tab) -> None:
    # A Stop the page reported as failed must not be sent minutes later on the reconnect.
    out = tab.page.evaluate(TIMED_OUT_REQUEST)
    assert out["code"] == "not_sent", out
    assert out["cancels"] == 0, out
    assert "not sent" in out["said"]["not_sent"] and "refused" not in out["said"]["not_sent"]
    assert "refused" not in out["said"]["timeout"] and "whether it arrived" in out["said"]["timeout"]
    assert "refused" in out["said"]["unauthorized"]


def test_an_address_with_a_malformed_escape_shows_the_runs_list_and_connects(daemon: Daemon, tab: Tab) -> None:
    page = tab.page
    page.goto("about:blank")
    page.goto(f"{daemon.dashboard_url}#/run/%E0%A4%A")
    page.wait_for_selector("#conn[data-state=open]")
    assert page.locator("#runs-view").is_visible()


REFUSED_FINAL_STATUS = r"""
async () => {
  const { RunView } = await import("/static/js/run.js");
  const { RequestError } = await import("/static/js/conn.js");
  let runStatusCalls = 0;
  let subscribed;
  const gotSub = new Promise((res) => { subscribed = res; });
  // A connection to a daemon that restarted between the run's end and the page's last
  // status request: that request is refused.
  const conn = {
    request(op, args) {
      if (op === "status" && args.run_id) {
        runStatusCalls += 1;
        return runStatusCalls === 1
          ? Promise.resolve({ run_id: "r-restart", state: "running" })
          : Promise.reject(new RequestError("not_found", "no run r-restart"));
      }
      if (op === "status") return Promise.resolve({ summary: { grace_s: 3 } });
      if (op === "cancel") return Promise.resolve({ was_active: true, state: "cancelling" });
      return Promise.reject(new RequestError("unsupported", op));
    },
    subscribe(runId, handlers) { subscribed(handlers); return { close() {} }; },
  };
  const view = new RunView(conn);
  view.mount("r-restart");
  const h = await gotSub;
  document.getElementById("stop").click();
  const ts = Date.now() / 1000;
  h.onEvent({ seq: 1, kind: "stop_requested", data: { reason: "user" }, ts });
  h.onEvent({ seq: 2, kind: "state", data: { state: "cancelling" }, ts });
  h.onEvent({ seq: 3, kind: "state", data: { state: "cancelled" }, ts });
  await h.onEnd({ op: "end", run_id: "r-restart", state: "cancelled" });
  const stop = document.getElementById("stop");
  const out = { phase: stop.dataset.phase, text: stop.textContent, calls: runStatusCalls };
  view.unmount();
  return out;
}
"""


def test_a_run_page_whose_last_status_is_refused_ends_its_stop_on_the_state_the_events_showed(tab: Tab) -> None:
    out = tab.page.evaluate(REFUSED_FINAL_STATUS)
    assert out["calls"] == 2, out
    assert out["phase"] == "done" and out["text"] != "Stopping…", out


def test_approve_and_deny_from_the_page(daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    page = tab.page
    run_id = daemon.agentd("spawn", *approval_spec(tmp_path)).stdout.strip()
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    box = page.get_by_role("region", name="Awaiting approval")
    box.get_by_text("call call_one").wait_for()
    assert "echo one" in box.inner_text() and not (tmp_path / "first").exists()
    # The state event follows the approval's (a watcher sees what is asked, then the state
    # it puts the run in): waited for, not read at once.
    page.locator("#run-facts").get_by_text("awaiting_approval").wait_for()
    assert page.locator("#run-facts").get_by_text("awaiting_approval").count() == 1
    box.get_by_role("button", name="Approve").click()
    # The call ran: its record says so, its file is there; then the second one asks.
    page.locator("#tools li[data-id=call_one][data-state=succeeded]").wait_for()
    assert (tmp_path / "first").read_text() == "one\n"
    box.get_by_text("call call_two").wait_for()
    box.get_by_role("textbox", name="Reason to deny run_command").fill("not the second")
    box.get_by_role("button", name="Deny").click()
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    assert box.is_hidden()
    page.locator("#result", has_text="Last I heard: denied by the user: not the second").wait_for()
    assert page.locator("#tools li[data-id=call_two]").get_attribute("data-state") == "rejected"
    assert not (tmp_path / "second").exists()
    sent = tab.page.evaluate(
        "() => window.__agentdTest.sent.map(s => JSON.parse(s)).filter(m => m.op === 'approve' || m.op === 'deny')"
    )
    assert [(m["op"], m["call_id"], m.get("reason")) for m in sent] == [
        ("approve", "call_one", None),
        ("deny", "call_two", "not the second"),
    ]


# Where each character of an element's text is drawn, in reading order (line, then left to
# right): the logical indices of the characters in the order a person reads them.
READING_ORDER = """
(el) => {
  const node = el.firstChild;
  const text = node.data;
  const seen = [];
  for (let i = 0; i < text.length; i++) {
    if (/\\s/.test(text[i])) continue;
    const r = document.createRange();
    r.setStart(node, i);
    r.setEnd(node, i + 1);
    const b = r.getBoundingClientRect();
    seen.push({ i, top: Math.round(b.top + b.height / 2), left: b.left, width: b.width });
  }
  seen.sort((a, b) => a.top - b.top || a.left - b.left);
  return { order: seen.map((s) => s.i), zeroWidth: seen.filter((s) => s.width === 0).map((s) => s.i) };
}
"""


def open_approval(daemon: Daemon, tab: Tab, tmp_path: Path, task: str, turns: list[dict[str, Any]]) -> tuple[Any, Any]:
    """A scripted run of ``turns`` whose ``run_command`` needs approval, its page open at
    the approval box of its first call: (the page, the box)."""
    spec = {
        "task": task,
        "model": {"provider": "scripted", "script": {"turns": turns, "final": "{{last_output}}"}},
        "approval": {"tools": ["run_command"]},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_id = daemon.agentd("spawn", "--spec", str(tmp_path / "spec.json")).stdout.strip()
    page = tab.page
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    box = page.get_by_role("region", name="Awaiting approval")
    box.get_by_text(f"call {turns[0]['tool_calls'][0]['id']}").wait_for()
    return page, box


def test_an_approval_shows_its_arguments_as_they_run_bidi_and_invisible_characters_marked(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    # The model's arguments, as raw JSON with literal characters: a right-to-left override
    # (what follows is drawn reversed: "~ fr- mr ; #" read "# ; rm -rf ~"), an isolate, a
    # zero-width space, a no-break space and Hebrew letters with digits (which the bidi
    # algorithm reorders by themselves). The person must see them in the order they run.
    command = "echo safe \u202e ~ fr- mr ; # \u2066hid\u2069\u200b x\u00a0y \u05e9\u05dc 1 2 /"
    raw = json.dumps({"command": command}, ensure_ascii=False)
    turns = [{"text": "asking", "tool_calls": [{"name": "run_command", "id": "call_bidi", "arguments": raw}]}]
    page, box = open_approval(daemon, tab, tmp_path, "bidi", turns)
    args = box.locator("code.args")
    shown = args.text_content()
    assert shown == (
        '{"command": "echo safe ⟦U+202E⟧ ~ fr- mr ; # ⟦U+2066⟧hid⟦U+2069⟧⟦U+200B⟧ x⟦U+00A0⟧y \u05e9\u05dc 1 2 /"}'
    )
    # Drawn in the order it is stored: the n-th character read is the n-th that runs. Read
    # once it is laid out (its characters have widths: the box may be drawn again, with
    # the same text, as the run's state arrives), a frame at a time, bounded.
    for _ in range(300):
        where = args.evaluate(READING_ORDER)
        if not where["zeroWidth"]:
            break
        page.evaluate("() => new Promise((done) => requestAnimationFrame(() => done(null)))")
    assert where["order"] == sorted(where["order"]) and where["zeroWidth"] == []
    # The call's line in the page's tool list shows it the same way.
    tool = page.locator("#tools li[data-id=call_bidi] .reason .literal")
    assert "⟦U+202E⟧ ~ fr- mr" in (tool.text_content() or "")
    box.get_by_role("button", name="Deny").click()
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    # The page's helper, on what must stay as it is (plain text, a joined emoji) and what not.
    marks = page.evaluate(
        """async () => { const { reveal } = await import("/static/js/dom.js");
        return [reveal("ls -la\\tx"), reveal("a\\u2028b\\u00adc\\ufeffd\\u{E0041}"), reveal("\\u{1F468}\\u200d\\u{1F469}"), reveal(null)]; }"""
    )
    assert marks == [
        "ls -la⟦U+0009⟧x",
        "a⟦U+2028⟧b⟦U+00AD⟧c⟦U+FEFF⟧d⟦U+E0041⟧",
        "\U0001f468⟦U+200D⟧\U0001f469",
        "",
    ]


def test_an_approval_marks_look_alike_characters_and_names_them_but_not_plain_foreign_text(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    # A model driven by injected text asks to approve a host with a Cyrillic "а" (read
    # "paypal", it is not) and a fullwidth "ｒｍ" (read "rm"). Then a call in plain Russian
    # and Chinese: one script per word, nothing to mark. Raw JSON with literal characters.
    spoofed = json.dumps({"command": "curl https://p\u0430ypal.com/login; \uff52\uff4d -rf /tmp/x"}, ensure_ascii=False)
    plain = json.dumps({"command": "echo Привет, мир; echo 你好，世界"}, ensure_ascii=False)
    turns = [
        {"text": "asking", "tool_calls": [{"name": "run_command", "id": "call_spoof", "arguments": spoofed}]},
        {"text": "again", "tool_calls": [{"name": "run_command", "id": "call_plain", "arguments": plain}]},
    ]
    page, box = open_approval(daemon, tab, tmp_path, "look-alikes", turns)
    args = box.locator("code.args")
    assert args.text_content() == spoofed  # marked, not hidden nor changed
    marks = args.locator("mark.lookalike")
    assert marks.all_text_contents() == ["p\u0430ypal", "\uff52\uff4d"]
    host, command = (m.get_attribute("title") or "" for m in marks.all())
    assert "U+0430 Cyrillic" in host and "mixed scripts (Latin, Cyrillic)" in host, host
    assert 'read "rm"' in command and 'U+FF52 fullwidth "r"' in command and 'U+FF4D fullwidth "m"' in command, command
    assert marks.first.evaluate("(el) => getComputedStyle(el).backgroundColor") not in (
        "rgba(0, 0, 0, 0)",
        "transparent",
    )
    note = box.get_by_role("note").text_content() or ""
    assert note.startswith("Look-alike characters: ") and "U+0430 Cyrillic" in note and "U+FF52" in note, note
    box.get_by_role("button", name="Deny").click()
    # The call's line in the page's tool list marks them too.
    page.locator("#tools li[data-id=call_spoof][data-state=rejected]").wait_for()
    assert page.locator("#tools li[data-id=call_spoof] .reason mark.lookalike").count() == 2
    asked = box.locator("li[data-call=call_plain]")
    asked.wait_for()
    assert asked.locator("code.args").text_content() == plain
    assert asked.locator("mark").count() == 0 and asked.get_by_role("note").count() == 0
    asked.get_by_role("button", name="Deny").click()
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    # The page's rule on what else is (not) marked: mathematical letters, Greek mixed with
    # Latin, Cyrillic in a path; a Russian file name, Latin with Han, an ellipsis, a lone
    # Greek letter are not.
    texts = [
        "\U0001d42b\U0001d426 /",
        "\u0391\u03b2c",
        "rm -rf /srv/\u0440\u0433\u043eject",
        "\u0444\u0430\u0439\u043b.txt",
    ]
    texts += ["tokyo\u6771\u4eac", "wait\u2026", "\u0394", ""]
    found = page.evaluate(
        """async (texts) => { const { lookalikes } = await import("/static/js/lookalike.js");
        return texts.map((t) => lookalikes(t).map((f) => f.token)); }""",
        texts,
    )
    assert found == [["\U0001d42b\U0001d426"], ["\u0391\u03b2c"], ["\u0440\u0433\u043eject"], [], [], [], [], []]


# "apple", "scope" written in Cyrillic letters that each have a Latin twin.
APPLE, SCOPE = "\u0430\u0440\u0440\u04cf\u0435", "\u0455\u0441\u043e\u0440\u0435"


def test_a_running_calls_line_in_the_runs_list_the_events_and_the_tool_list_marks_look_alikes_but_not_prose(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    # A command with a host in Cyrillic look-alikes ("apple") and a word mixing scripts,
    # held running by a gate; then one with Russian (an all-twin word among its words),
    # Greek and Chinese prose. Raw JSON with literal characters, look-alikes first so
    # that the runs list's 40 characters of arguments hold them.
    def args(command: str) -> str:
        return json.dumps({"command": command}, ensure_ascii=False, separators=(",", ":"))

    wait = "while [ ! -f {} ]; do sleep 0.02; done"
    spoof = args(f"echo {APPLE}.com p\u0430ypal; " + wait.format(tmp_path / "gate1"))
    plain = args("echo 'Привет, ухо болит' 'Καλημέρα κόσμε' '你好，世界'; " + wait.format(tmp_path / "gate2"))
    turns = [
        {"text": "a", "tool_calls": [{"name": "run_command", "id": "call_spoof", "arguments": spoof}]},
        {"text": "b", "tool_calls": [{"name": "run_command", "id": "call_plain", "arguments": plain}]},
    ]
    (tmp_path / "script.json").write_text(json.dumps({"turns": turns, "final": "done"}))
    run_id = daemon.agentd(
        "spawn", "look-alikes", "--script", str(tmp_path / "script.json"), *granted(tmp_path)
    ).stdout.strip()
    page = tab.page
    daemon.wait_for(run_id, _tool_running("gate1"))
    # The runs list: the running call's cell, as stored, its two tokens marked and named.
    cell = page.locator(f"tr[data-run-id='{run_id}'] td").nth(6)
    cell.locator("mark.lookalike").nth(1).wait_for()
    assert cell.text_content() == f"run_command {spoof[:39]}…"
    assert cell.locator("mark.lookalike").all_text_contents() == [APPLE, "p\u0430ypal"]
    title = cell.locator("mark.lookalike").first.get_attribute("title") or ""
    assert 'all Cyrillic, read "apple"' in title and 'U+04CF Cyrillic "l"' in title, title
    # The run's page: the call's line in the events and in the tool list while it runs.
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    event = page.locator("#events li[data-kind=tool_call] .what", has_text="gate1").first
    event.wait_for()
    assert event.locator("mark.lookalike").all_text_contents() == [APPLE, "p\u0430ypal"]
    running = page.locator("#tools li[data-id=call_spoof][data-state=running] .literal").first
    running.wait_for()
    assert running.locator("mark.lookalike").all_text_contents() == [APPLE, "p\u0430ypal"]
    assert (running.text_content() or "").startswith(f"▶ run_command {spoof[:40]}")
    # The command's process group, named by its command line (cut), in the events.
    group = page.locator("#events li[data-kind=process_group] .what", has_text=".com").first
    group.wait_for()
    assert group.locator("mark.lookalike").all_text_contents() == [APPLE, "p\u0430ypal"]
    open_gate(tmp_path, "gate1")
    daemon.wait_for(run_id, _tool_running("gate2"))
    page.locator("#tools li[data-id=call_plain][data-state=running]").wait_for()
    page.locator("#events li[data-kind=tool_call] .what", has_text="gate2").first.wait_for()
    page.goto(f"{daemon.dashboard_url}#/")
    plain_cell = page.locator(f"tr[data-run-id='{run_id}'] td").nth(6)
    plain_cell.get_by_text("Привет", exact=False).wait_for()
    assert plain_cell.locator("mark").count() == 0
    page.goto(f"{daemon.dashboard_url}#/run/{run_id}")
    page.locator("#tools li[data-id=call_plain][data-state=running]").wait_for()
    page.locator("#events li[data-kind=tool_call] .what", has_text="gate2").first.wait_for()
    assert page.locator("#tools li[data-id=call_plain] mark").count() == 0
    page.locator("#events li[data-kind=process_group] .what", has_text="Привет").first.wait_for()
    lines = page.locator("#events li .what", has_text="Привет").all()
    assert len(lines) >= 2  # the call's line and its process group's
    for line in lines:
        assert line.locator("mark").count() == 0, line.text_content()
    open_gate(tmp_path, "gate2")
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    # The page's rule is the CLI's (supervisor/_lookalikes.py): the same table, the same
    # tokens found in a host, a path, an argument among ASCII ones, and none in prose.
    texts = [
        f"curl https://{APPLE}.com/login",
        f"cat /srv/{SCOPE}/x",
        f'{{"host":"{APPLE}"}}',
        f"ssh {SCOPE}",
        "ping \u03bf\u03c1\u03b1.example",
        f"curl https://{APPLE}.com -d Привет",
        "echo привет",
        "дом",
        "ухо болит",
        '{"text": "ухо болит"}',
        "Καλημέρα κόσμε",
        "ΤΟ ΚΑΙ ΤΟ",
        "echo 你好，世界",
    ]
    found, twins = page.evaluate(
        """async (texts) => { const { lookalikes, TWINS } = await import("/static/js/lookalike.js");
        return [texts.map((t) => lookalikes(t).map((f) => f.token)), Object.fromEntries(TWINS)]; }""",
        texts,
    )
    expected = [[f.token for f in find_lookalikes(t)] for t in texts]
    assert expected[:6] == [[APPLE], [SCOPE], [APPLE], [SCOPE], ["\u03bf\u03c1\u03b1"], [APPLE]]
    assert expected[6:] == [[]] * 7
    assert found == expected and twins == TWINS


def test_the_pages_look_alike_check_is_bounded_as_the_clis_and_says_what_it_did_not_check(tab: Tab) -> None:
    # ~1 MiB of arguments a run can send: a 200,000-character fullwidth token is named cut
    # with its length, its two code points once each with a count; Russian prose past the
    # bound (a look-alike after it) is checked as far as the CLI checks, and the legend and
    # the shown text say so. The same tokens and bound as supervisor/_lookalikes.py.
    fullwidth = "\uff52\uff4d" * 100_000
    prose = "curl https://p\u0430ypal.com " + "Привет, мир. " * 25_000 + "p\u0430ypal"
    out = tab.page.evaluate(
        """async ([fullwidth, prose]) => {
          const { check, literal, lookalikeNote, SCAN_MAX } = await import("/static/js/lookalike.js");
          const [f] = check(fullwidth).found;
          const p = check(prose);
          const shown = literal(prose).filter((n) => n instanceof Element && n.classList.contains("lookalike-unchecked"));
          const note = lookalikeNote("run_command", prose).textContent;
          return { notes: f.notes, title: literal(fullwidth, 40)[0].title, SCAN_MAX, checked: p.checked,
                   length: p.length, tokens: p.found.map((x) => x.token), shown: shown.map((n) => n.textContent),
                   cut: literal(prose, 80).some((n) => n instanceof Element && n.classList.contains("lookalike-unchecked")),
                   note, again: check(prose) === p };
        }""",
        [fullwidth, prose],
    )
    (note,) = out["notes"]
    assert len(note) < 400 and "(200,000 characters)" in note, note
    assert 'U+FF52 fullwidth "r" ×100,000, U+FF4D fullwidth "m" ×100,000' in note
    assert len(out["title"]) < 500 and out["title"].startswith('"' + "ｒｍ" * 20 + '…" (200,000 characters): ')
    python = scan_lookalikes(prose)
    assert out["SCAN_MAX"] == SCAN_MAX_CHARS == python.checked == out["checked"] < out["length"] == len(prose)
    assert out["tokens"] == [f.token for f in python.found] == ["p\u0430ypal"]
    said = f"look-alike check: first {SCAN_MAX_CHARS:,} of {len(prose):,} characters only"
    assert out["shown"] == [f" [{said}]"] and not out["cut"]  # a cut view shows only checked text
    assert out["note"].endswith(said) and len(out["note"]) < 500, out["note"]
    assert out["again"]  # a re-render does not check the same text again


def test_a_sessions_transcript_and_a_new_turn_from_the_page(daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    page = tab.page
    script = gated_script(tmp_path, "gate1")
    first = daemon.agentd(
        "spawn", "first task", "--script", str(script), "--session", "s-page", *granted(tmp_path)
    ).stdout.strip()
    daemon.wait_for(first, _tool_running("gate1"))
    page.goto(f"{daemon.dashboard_url}#/run/{first}")
    transcript = page.get_by_role("region", name="Session transcript")
    transcript.get_by_text("first task").wait_for()
    # One turn is live: a new one is refused, and the page says why.
    page.get_by_label("New turn").fill("second task")
    transcript.get_by_role("button", name="Start turn").click()
    transcript.get_by_text("One turn of a session is live at a time").wait_for()
    # Stop the live one first: the new turn starts once it has ended, and the page goes there.
    page.get_by_label("Stop the live turn first").check()
    transcript.get_by_role("button", name="Start turn").click()
    page.wait_for_url(re.compile(r".*#/run/r-(?!" + first[2:] + r")[0-9a-f]{16}$"))
    second = page.url.rsplit("/", 1)[1]
    page.locator("#events li[data-kind=state][data-state=completed]").wait_for()
    turns = transcript.locator("li.turn")
    turns.nth(1).wait_for()
    assert [turns.nth(i).get_attribute("data-run") for i in range(2)] == [first, second]
    assert turns.nth(0).get_attribute("data-state") == "cancelled"
    assert "The user stopped this turn before it finished." in turns.nth(0).inner_text()
    assert "second task" in turns.nth(1).inner_text()
    assert daemon.status(first)["state"] == "cancelled"


HISTORY_PAGE_BYTES = 64 * 1024
LONG_ANSWER_CHARS = 40_000  # an answer's turn is over half a page: one turn a page


def test_a_long_sessions_transcript_shows_its_newest_turns_and_loads_the_earlier_ones(
    daemon: Daemon, tab: Tab, tmp_path: Path
) -> None:
    runs = []
    for i in range(3):
        script = tmp_path / f"script{i}.json"
        script.write_text(json.dumps({"turns": [], "final": f"answer {i} " + "a" * LONG_ANSWER_CHARS}))
        run_id = daemon.agentd(
            "spawn", f"long task {i}", "--script", str(script), "--session", "s-long", *granted(tmp_path)
        ).stdout.strip()
        daemon.wait_for(run_id, lambda e: e["kind"] == "state" and e["data"]["state"] == "completed")
        runs.append(run_id)
    page = tab.page
    page.goto(f"{daemon.dashboard_url}#/run/{runs[-1]}")
    transcript = page.get_by_role("region", name="Session transcript")
    turns = transcript.locator("li.turn")
    transcript.get_by_text("long task 2").wait_for()
    assert turns.count() == 1 and "Turn 3" in turns.nth(0).inner_text()
    more = transcript.get_by_role("button", name=re.compile(r"^Load earlier turns"))
    assert more.inner_text() == "Load earlier turns (2 more)"
    more.click()
    transcript.get_by_text("long task 1").wait_for()
    more.click()
    transcript.get_by_text("long task 0").wait_for()
    assert [turns.nth(i).get_attribute("data-run") for i in range(turns.count())] == runs
    assert [f"Turn {n}" in turns.nth(n - 1).inner_text() for n in (1, 2, 3)] == [True] * 3
    assert more.count() == 0


def test_scripts_screenshot_writes_the_readme_image(tmp_path: Path) -> None:
    require(CHROMIUM.is_file(), "chromium (apt-get install chromium)")
    out = tmp_path / "dashboard.png"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [str(root / "scripts" / "screenshot"), "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) == (1280, 1000)
