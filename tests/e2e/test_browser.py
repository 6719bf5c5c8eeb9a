"""Acceptance for browser runs through the daemon: real runner, @playwright/mcp, Chromium.

The daemon runs in-process (``serve`` with a ``stop`` event) on a temp state dir; each run
is a scripted sub-agent that opens a page this test serves on 127.0.0.1, snapshots it and
then heads for ``/slow``, a page the server holds, so "cancelled while the browser is open"
is a known moment, not a sleep. "Zero processes left" is checked independently of the
daemon's own bookkeeping: the test's env mark, the sessions of marked processes (Chromium's
helpers lose the mark from /proc/PID/environ) and any process whose command line names the
run's directory or its browser temp dir.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from subagent.tools import browser
from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests import browser_support as bs
from tests import conftest

pytestmark = pytest.mark.chromium

# Between the daemon's SIGTERM and SIGKILL of a run's tree: short, so the SIGSTOP and
# wedged-browser cases escalate quickly (seconds).
GRACE_S = 2.0
# How long after the terminal fact the run dir may take to disappear (seconds).
RUN_DIR_GONE_S = 10.0
# Bounds one whole scenario, browser start-ups included (seconds; 2 cores, 5 browsers).
SCENARIO_S = 120.0


class Daemon:
    def __init__(self, manager: RunManager, config: Config) -> None:
        self.m = manager
        self.config = config

    async def run_dir(self, run_id: str) -> Path:
        """The run's own directory, as the daemon recorded it (named by run or tree id)."""
        status = await self.m.status(run_id)
        assert status.get("run_dir"), f"no run dir recorded yet: {status!r}"
        return Path(status["run_dir"])


@pytest.fixture(params=["auto"])
def cgroups(request: pytest.FixtureRequest) -> str:
    """The daemon's containment: "auto" (a cgroup where it can make one) or "off"."""
    return str(request.param)


@pytest.fixture(params=[0])
def pool(request: pytest.FixtureRequest) -> int:
    """Warm runners the daemon keeps pre-spawned (0: none, each run starts its runner)."""
    return int(request.param)


@pytest.fixture
async def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cgroups: str, pool: int) -> AsyncIterator[Daemon]:
    bs.require_browser()
    conftest.require(bs.runner_available(), "subagent.runner")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    config = Config.load(
        state_dir=tmp_path / "state",
        runner_python=sys.executable,
        grace_s=GRACE_S,
        cgroups=cgroups,
        environ={},
        pool_size=pool,
    )
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield Daemon(info["manager"], config)
        stop.set()


def _slow_turn(site: bs.LocalSite) -> dict[str, Any]:
    return {
        "text": "Now the slow page.",
        "tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/slow"}}],
    }


def _browser_processes_of(run_dir: Path) -> list[psutil.Process]:
    """The run's Chromium processes: their command lines name its browser temp dir."""
    frags = (str(run_dir), str(browser.browser_tmpdir(run_dir)))
    out = []
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = " ".join(p.info.get("cmdline") or ())
        if "chrom" in (p.info.get("name") or "") and any(f in cmd for f in frags):
            out.append(p)
    return out


async def _assert_nothing_left(daemon: Daemon, run_ids: list[str]) -> None:
    """Nothing of these runs is alive: no process with their tree marker, none in those
    processes' sessions, none naming their run dirs; and the run dirs are gone. (Idle warm
    runners of a pool are the daemon's, not the runs': the test's own mark is checked for
    everything once the daemon has stopped, by the suite's conftest.)"""
    frags: list[str] = []
    env: list[str] = []
    run_dirs = []
    for run_id in run_ids:
        st = await daemon.m.status(run_id)
        d = Path(st["run_dir"])
        run_dirs.append(d)
        frags += [str(d) + "/", str(browser.browser_tmpdir(d)) + "/"]
        env.append(f"AGENTD_TREE={st['tree_id']}")
    await trio.to_thread.run_sync(lambda: bs.wait_no_browser_left(None, frags, env=env))
    # The daemon writes the terminal fact first, then removes the run dir.
    with trio.move_on_after(RUN_DIR_GONE_S):
        while any(d.exists() for d in run_dirs):
            await trio.sleep(0.05)
    for d in run_dirs:
        assert not d.exists(), f"run dir {d} is still there: {sorted(p.name for p in d.rglob('*'))[:20]}"
        link = browser.browser_tmpdir(d)
        if link != d / "browser" / "tmp":  # a deep run dir: Chromium got a short link
            assert not link.is_symlink(), f"the daemon did not release the short TMPDIR link {link}"


def _partial_text(status: dict[str, Any]) -> str:
    return json.dumps({k: status.get(k) for k in ("result", "partial_snapshot")}, default=str)


async def test_a_scripted_run_reads_a_local_page_and_completes(daemon: Daemon) -> None:
    with bs.LocalSite() as site:
        with trio.fail_after(SCENARIO_S):
            r = await daemon.m.spawn(bs.scripted_browser_spec(site.url + "/"))
            st = await daemon.m.wait_terminal(r["run_id"])
            seen = await trio.to_thread.run_sync(bs.read_with_own_browser, site.url + "/", "#secret")
    assert st["state"] == "completed", st
    assert not st["partial"]
    # What the run answered is what the page says, as read by a browser of our own.
    password = seen.removeprefix("The password is ").rstrip(".")
    assert password == "tangerine-42"
    assert st["result"]["final_text"] == f"The page says the password is {password}."
    await _assert_nothing_left(daemon, [r["run_id"]])


@pytest.mark.parametrize("pool", [0, 2], indirect=True)
async def test_cancelled_while_the_browser_is_open(daemon: Daemon) -> None:
    with bs.LocalSite() as site:
        spec = bs.scripted_browser_spec(site.url + "/", then=[_slow_turn(site)])
        with trio.fail_after(SCENARIO_S):
            r = await daemon.m.spawn(spec)
            assert await trio.to_thread.run_sync(site.wait_for_request, "/slow", 60)
            run_dir = await daemon.run_dir(r["run_id"])
            assert _browser_processes_of(run_dir), "the browser should be open now"
            c = await daemon.m.cancel(r["run_id"])
            assert c["was_active"] is True
            st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled", st
    assert "tangerine-42" in _partial_text(st), "what was read before the stop is lost"
    await _assert_nothing_left(daemon, [r["run_id"]])
    again = await daemon.m.cancel(r["run_id"])
    assert again["was_active"] is False


@pytest.mark.parametrize("cgroups", ["auto", "off"], indirect=True)
@pytest.mark.parametrize("fault", ["browser_sigstopped", "runner_sigkilled"])
async def test_cancel_after_a_fault_still_leaves_nothing(daemon: Daemon, fault: str) -> None:
    with bs.LocalSite() as site:
        spec = bs.scripted_browser_spec(site.url + "/", then=[_slow_turn(site)])
        with trio.fail_after(SCENARIO_S):
            r = await daemon.m.spawn(spec)
            assert await trio.to_thread.run_sync(site.wait_for_request, "/slow", 60)
            run_dir = await daemon.run_dir(r["run_id"])
            procs = _browser_processes_of(run_dir)
            assert procs
            if fault == "browser_sigstopped":
                # Every Chromium process of the run, helpers included: a wedged browser.
                stopped = await trio.to_thread.run_sync(
                    bs.stop_sessions_of, lambda: [p.pid for p in _browser_processes_of(run_dir)]
                )
                assert len(stopped) >= 4
            else:
                status = await daemon.m.status(r["run_id"])
                os.kill(status["pid"], signal.SIGKILL)
            await daemon.m.cancel(r["run_id"])
            st = await daemon.m.wait_terminal(r["run_id"])
    if daemon.config.cgroups == "off":
        assert st.get("containment") != "cgroup", st.get("containment")
    if fault == "browser_sigstopped":
        assert st["state"] == "cancelled", st
    else:
        # The runner's death may reach the daemon before the cancel does.
        assert st["state"] in ("cancelled", "failed"), st
    assert "tangerine-42" in _partial_text(st), "the last step snapshot is the run's partial result"
    await _assert_nothing_left(daemon, [r["run_id"]])


async def test_five_browser_runs_cancelled_together(daemon: Daemon) -> None:
    n = 5
    with bs.LocalSite() as site:
        spec = bs.scripted_browser_spec(site.url + "/", then=[_slow_turn(site)])
        with trio.fail_after(SCENARIO_S):
            ids = [(await daemon.m.spawn(spec))["run_id"] for _ in range(n)]
            assert await trio.to_thread.run_sync(lambda: site.wait_for_request("/slow", 90, count=n))
            results: dict[str, dict[str, Any]] = {}
            async with trio.open_nursery() as nursery:
                for run_id in ids:
                    nursery.start_soon(daemon.m.cancel, run_id)
            async with trio.open_nursery() as nursery:

                async def wait(run_id: str) -> None:
                    results[run_id] = await daemon.m.wait_terminal(run_id)

                for run_id in ids:
                    nursery.start_soon(wait, run_id)
    assert sorted(results) == sorted(ids)
    assert {st["state"] for st in results.values()} == {"cancelled"}, results
    # Terminal facts are in the journal, not only in memory.
    for run_id in ids:
        row = await daemon.m.journal.get_run(run_id)
        assert row is not None and row["state"] == "cancelled"
    await _assert_nothing_left(daemon, ids)


async def test_a_browser_run_without_chromium_is_refused_at_spawn_naming_what_to_install(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor.errors import SpawnError

    monkeypatch.setenv("AGENTD_CHROMIUM", str(tmp_path / "no-chromium-here"))
    with pytest.raises(SpawnError) as info:
        await daemon.m.spawn(bs.scripted_browser_spec("http://127.0.0.1:9/"))
    assert "apt-get install chromium" in str(info.value)
    assert await daemon.m.list_runs() == []
