"""Cancel-all (issue 15): many runs stopped at once, side by side, each recorded; real processes.

The daemon runs in-process (``serve``); every run is the real runner with the scripted
model, waiting in a ``run_command`` that a stop interrupts (the default policy). "Nothing
survives" is checked without the daemon's bookkeeping: no live process carries a run's
tree marker.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.config import Config
from supervisor.control import server as server_mod
from supervisor.control._conn_limits import Limits
from supervisor.control.client import Client
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests.supervisor.test_stop_tools import command_alive, scripted, start_daemon, tree_members, wait_event

RUNS = 6


def waiting() -> dict[str, Any]:
    return scripted([{"name": "run_command", "arguments": {"command": "sleep 600"}}])


async def live_runs(m: RunManager, n: int) -> list[str]:
    ids = [(await m.spawn(waiting()))["run_id"] for _ in range(n)]
    for run_id in ids:
        await wait_event(m, run_id, command_alive)  # past its gate: a stop interrupts it
    return ids


async def test_a_cancel_of_many_runs_records_every_one_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with start_daemon(tmp_path, monkeypatch, grace_s=10.0) as m:
        with trio.fail_after(60):
            ids = await live_runs(m, RUNS)
            trees = {run_id: (await m.status(run_id))["tree_id"] for run_id in ids}
            out = await m.cancel_many([*ids, "r-missing"], reason="user")
            assert [o["run_id"] for o in out] == [*ids, "r-missing"]
            assert all(o["was_active"] for o in out[:RUNS])
            assert out[RUNS]["error"]["code"] == "not_found"
            asked = set()
            for run_id in ids:
                st = await m.wait_terminal(run_id)
                assert (st["state"], st["reason"], st["cancel_reason"]) == ("cancelled", "user", "user")
                assert st["stop_deadline"] is not None  # the stop was journaled before the reply
                asked.add((st["cancel_requested_at"], st["stop_deadline"]))
                receipt = st["receipt"]
                assert any(s.startswith("SIGTERM group") for s in receipt["path_a"])
                assert [t["effect"] for t in receipt["tools"]] == ["interrupted"]
                assert receipt["path_b"]["escalated"] is False  # each runner ended in its grace
                assert st["result"]["tool_calls"][0]["state"] == "cancelled"
                assert tree_members(trees[run_id]) == []
            assert len(asked) == 1  # asked at once: every run's grace ends at the same time


async def test_every_stop_is_under_way_before_any_is_journaled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Through the control socket, as a user's cancel-all goes. A connection's requests are
    # served a few at a time (here 2): one request for every run, not one per run, is
    # what puts every stop under way before any journal write.
    monkeypatch.setattr(server_mod, "Limits", functools.partial(Limits, in_flight=2))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = Config.load(state_dir=tmp_path / "state", environ={}, grace_s=10.0)
    stop = trio.Event()
    async with trio.open_nursery() as daemon:
        info = await daemon.start(lambda task_status: serve(cfg, stop=stop, task_status=task_status))
        m: RunManager = info["manager"]
        with trio.fail_after(60):
            ids = await live_runs(m, RUNS)
            commands = []
            for run_id in ids:
                group = await wait_event(
                    m, run_id, lambda e: e["kind"] == "process_group" and e["data"].get("kind") == "command"
                )
                commands.append(os.pidfd_open(int(group["data"]["pgid"])))
            held, release = threading.Event(), threading.Event()

            def hold(store: Any) -> None:  # the journal's worker can write nothing meanwhile
                held.set()
                assert release.wait(30)

            replies: list[dict[str, Any]] = []

            def cancel_all() -> None:
                with Client(info["url"], info["token"], timeout_s=30) as c:
                    replies.append(c.cancel_many(ids))

            try:
                async with trio.open_nursery() as n:
                    n.start_soon(m.journal._call, hold)
                    await trio.to_thread.run_sync(held.wait, 30)
                    n.start_soon(trio.to_thread.run_sync, cancel_all)
                    # Path A reached every run's interruptible command: each one is dead
                    # while no stop is journaled yet (the reply waits for that).
                    for fd in commands:
                        await trio.lowlevel.wait_readable(fd)
                    assert replies == []
                    assert all(m._live[run_id].path_a for run_id in ids)
                    release.set()
            finally:
                release.set()
                for fd in commands:
                    os.close(fd)
            assert [r["was_active"] for r in replies[0]["runs"]] == [True] * RUNS
            for run_id in ids:
                assert (await m.wait_terminal(run_id))["state"] == "cancelled"
        stop.set()


async def test_path_b_counts_the_grace_from_the_cancel_not_from_when_it_got_to_run(autojump_clock: Any) -> None:
    # A thousand runs cancelled at once on two cores: a run's path B may start late; its
    # tree is still killed at the end of the grace the stop journaled, not a grace later.
    from supervisor.core._lifecycle import Lifecycle
    from supervisor.core._run import Run
    from supervisor.core.token import CancelToken

    config = Config.load(environ={}, grace_s=10.0)
    life = Lifecycle(config, None, None, None, cancel=None)  # type: ignore[arg-type]
    run = Run(run_id="r-1", session_id=None, spec={}, timeout_s=None, token=CancelToken("r-1"))
    assert life._grace(run) == 10.0  # no stop asked: the runner ended by itself
    run.token.cancel("user")
    run.cancel_at = trio.current_time()
    await trio.sleep(3.0)  # path B gets to run 3 s after the cancel
    assert life._grace(run) == 7.0
    await trio.sleep(20.0)
    assert life._grace(run) == 0.0


async def test_a_cancel_naming_thousands_of_ended_or_unknown_runs_asks_the_journal_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One query for every id that is not live (a hostile 10,000-id cancel once made 10,000
    # journal round trips, and the stops of others waited behind them).
    async with start_daemon(tmp_path, monkeypatch, grace_s=10.0) as m:
        with trio.fail_after(60):
            (ended,) = await live_runs(m, 1)
            await m.cancel(ended)
            await m.wait_terminal(ended)
            calls: list[int] = []
            states = m.journal.run_states

            async def counted(run_ids: Any) -> dict[str, str]:
                calls.append(len(list(run_ids)))  # noqa: B023 - the loop runs once
                return await states(run_ids)  # noqa: B023

            async def one_by_one(run_id: str) -> Any:
                raise AssertionError("a journal round trip per id")

            monkeypatch.setattr(m.journal, "run_states", counted)
            monkeypatch.setattr(m.journal, "get_run", one_by_one)
            unknown = [f"r-unknown-{i}" for i in range(10_000)]
            out = await m.cancel_many([ended, *unknown], reason="user")
    assert calls == [10_001]
    assert out[0] == {"run_id": ended, "was_active": False, "state": "cancelled"}
    assert {o["error"]["code"] for o in out[1:]} == {"not_found"} and len(out) == 10_001
