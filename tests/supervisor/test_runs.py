"""The run manager with real runner children (a stand-in runner speaking the wire format).

The daemon runs in-process (``serve`` with a ``stop`` event) on a real SQLite file and
real processes; the stand-in runner lets each test pick the child's behaviour.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.config import Config
from supervisor.core.runs import RunManager
from supervisor.core.sessions import SessionNotFound
from supervisor.daemon import serve
from supervisor.errors import RunNotFound, SpawnError
from supervisor.trees._handles import Tree

CHILDREN = Path(__file__).parent.parent / "children"
FAKE = [sys.executable, str(CHILDREN / "fake_runner.py")]


def task(**behaviour: Any) -> dict[str, Any]:
    return {"task": json.dumps(behaviour)}


def tree_alive(tree_id: str) -> list[int]:
    needle = f"AGENTD_TREE={tree_id}".encode()
    found = []
    for pid in psutil.pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
        except (OSError, psutil.Error):
            continue
    return found


class Daemon:
    def __init__(self, manager: RunManager, config: Config) -> None:
        self.m = manager
        self.config = config


@pytest.fixture
async def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, environ={})
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield Daemon(info["manager"], config)
        stop.set()


async def test_a_run_that_finishes_is_completed_with_the_runners_result(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(wait=False, snapshots=2))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed"
    assert st["result"]["final_text"] == "done"
    assert not st["partial"]
    events = await daemon.m.events_after(r["run_id"], 0)
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    kinds = [e["kind"] for e in events]
    assert kinds.count("step_snapshot") == 2
    assert [e["data"]["state"] for e in events if e["kind"] == "state"] == [
        "queued",
        "starting",
        "running",
        "completed",
    ]


async def test_a_child_that_ignores_sigterm_is_killed_at_the_grace_and_keeps_its_snapshot(
    daemon: Daemon,
) -> None:
    with trio.fail_after(15):
        r = await daemon.m.spawn(task(ignore_term=True, snapshots=3))
        await _wait_event(daemon, r["run_id"], "step_snapshot", count=3)
        c = await daemon.m.cancel(r["run_id"])
        assert c["was_active"] is True
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled"
    assert st["partial"] is True
    assert st["result"]["progress"] == "step 1 done. step 2 done. step 3 done. "
    receipt = st["receipt"]["path_b"]
    assert receipt["escalated"] is True
    # One stop, one SIGTERM: path A sent it, path B only waited the grace and killed.
    assert [x["result"] for x in receipt["signals"] if x["signal"] == "SIGTERM"] == ["sent by path A"]
    assert st["receipt"]["path_a"] and st["receipt"]["path_a"][0].startswith("SIGTERM group")
    assert tree_alive(st["tree_id"]) == []


async def test_cancel_ends_a_tree_with_group_setsid_and_double_forked_descendants(
    daemon: Daemon,
) -> None:
    with trio.fail_after(15):
        r = await daemon.m.spawn(task(tree=True))
        await _wait_event(daemon, r["run_id"], "log")
        st0 = await daemon.m.status(r["run_id"])
        with trio.fail_after(5):
            while len(tree_alive(st0["tree_id"])) < 5:  # runner, child, 3 descendants
                await trio.sleep(0.02)
        await daemon.m.cancel(r["run_id"])
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled"
    assert st["result"]["status"] == "cancelled"  # the runner answered SIGTERM itself
    assert tree_alive(st["tree_id"]) == []


async def test_five_cancels_at_once_give_one_terminal_fact_and_spare_the_next_turn(
    daemon: Daemon,
) -> None:
    with trio.fail_after(15):
        r = await daemon.m.spawn(task(snapshots=1), session_id="s-1")
        await _wait_event(daemon, r["run_id"], "step_snapshot")
        replies: list[dict[str, Any]] = []

        async def press() -> None:
            replies.append(await daemon.m.cancel(r["run_id"]))

        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(press)
        # One turn of a session is live at a time: the next waits for this one's end.
        nxt = await daemon.m.spawn(task(snapshots=1), session_id="s-1", interrupt=True)
        st = await daemon.m.wait_terminal(r["run_id"])
        late = await daemon.m.cancel(r["run_id"])
        await _wait_event(daemon, nxt["run_id"], "step_snapshot")
        nxt_status = await daemon.m.status(nxt["run_id"])
        assert nxt_status["state"] == "running"
        await daemon.m.cancel(nxt["run_id"])
        await daemon.m.wait_terminal(nxt["run_id"])
    assert all(x["was_active"] for x in replies)
    assert st["state"] == "cancelled"
    assert late == {"run_id": r["run_id"], "was_active": False, "state": "cancelled"}
    events = await daemon.m.events_after(r["run_id"], 0)
    terminal = [
        e for e in events if e["kind"] == "state" and e["data"]["state"] in {"cancelled", "completed", "failed", "lost"}
    ]
    assert len(terminal) == 1


async def test_cancel_after_completion_reports_inactive_and_changes_nothing(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(wait=False))
        await daemon.m.wait_terminal(r["run_id"])
        c = await daemon.m.cancel(r["run_id"])
    assert c["was_active"] is False
    assert c["state"] == "completed"
    assert (await daemon.m.status(r["run_id"]))["state"] == "completed"


async def test_a_descendant_holding_stdout_open_does_not_hang_the_run(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(wait=False, hold_stdout=True))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed"
    assert tree_alive(st["tree_id"]) == []


async def test_garbage_on_stderr_is_recorded_and_the_run_goes_on(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(wait=False, garbage=True))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed"
    events = await daemon.m.events_after(r["run_id"], 0)
    bad = [e for e in events if e["kind"] == "stderr"]
    assert bad and bad[0]["data"]["problem"] == "not json"


async def test_a_runner_that_dies_without_a_result_fails_with_its_last_snapshot(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(wait=False, no_result=True, exit_code=5, snapshots=2))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "failed"
    assert st["partial"] is True
    assert st["result"]["step"] == 2
    assert st["error"]["code"] == "model_error"


async def test_a_timeout_is_a_cancel_with_reason_timeout(daemon: Daemon) -> None:
    with trio.fail_after(10):
        r = await daemon.m.spawn(task(), timeout_s=0.3)
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled"
    assert st["reason"] == "timeout"


async def test_a_specs_deadline_holds_for_a_runner_that_cannot_keep_it(daemon: Daemon) -> None:
    # limits.deadline_s was the runner's alone: a runner that could not act (here one
    # that ignores its stop and waits for ever) ran past it until a stop by hand.
    from supervisor.core.runs import DEADLINE_BACKSTOP_MARGIN_S

    spec = {**task(wait=True, ignore_term=True), "limits": {"deadline_s": 0.2}}
    with trio.fail_after(30):
        r = await daemon.m.spawn(spec)
        st = await daemon.m.wait_terminal(r["run_id"])
    assert (st["state"], st["reason"]) == ("cancelled", "timeout"), st
    assert st["timeout_s"] == pytest.approx(0.2 + DEADLINE_BACKSTOP_MARGIN_S)
    with trio.fail_after(10):  # an earlier timeout of its own stays
        r = await daemon.m.spawn({**task(), "limits": {"deadline_s": 600}}, timeout_s=0.3)
        assert (await daemon.m.wait_terminal(r["run_id"]))["timeout_s"] == 0.3


async def test_unknown_run_ids_are_a_clear_error(daemon: Daemon) -> None:
    with pytest.raises(RunNotFound):
        await daemon.m.cancel("r-nope")
    with pytest.raises(RunNotFound):
        await daemon.m.status("r-nope")


async def test_cancelling_a_queued_run_never_starts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(
        state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, max_concurrent=1, environ={}
    )
    stop = trio.Event()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            first = await m.spawn(task())
            queued = await m.spawn(task())
            await _wait_event(Daemon(m, config), first["run_id"], "step_snapshot")
            assert (await m.status(queued["run_id"]))["state"] == "queued"
            c = await m.cancel(queued["run_id"])
            st = await m.wait_terminal(queued["run_id"])
            await m.cancel(first["run_id"])
            await m.wait_terminal(first["run_id"])
            stop.set()
    assert c["was_active"] is True
    assert st["state"] == "cancelled"
    assert st["pid"] is None


async def test_daemon_shutdown_cancels_every_live_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, environ={})
    stop = trio.Event()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            ids = [(await m.spawn(task()))["run_id"] for _ in range(3)]
            for rid in ids:
                await _wait_event(Daemon(m, config), rid, "step_snapshot")
            stop.set()
    from supervisor.store.journal import Journal

    j = await Journal.open(config.journal_path)
    try:
        states = [(await j.get_run(rid))["state"] for rid in ids]
    finally:
        await j.aclose()
    assert states == ["cancelled"] * 3


async def _wait_event(d: Daemon, run_id: str, kind: str, count: int = 1) -> None:
    """Wait (bounded by the caller's fail_after) until the run has ``count`` events of a kind."""
    async with d.m.subscribe(run_id) as live:
        # One read: an event journaled between two reads would be in neither count (too
        # late for the first, at or below the second's last seq, so skipped when it comes live).
        journaled = await d.m.events_after(run_id, 0)
        seen = [e for e in journaled if e["kind"] == kind]
        last = max([0] + [e["seq"] for e in journaled])
        n = len(seen)
        if n >= count:
            return
        async for msg in live:
            if msg["seq"] > last and msg["kind"] == kind:
                n += 1
                if n >= count:
                    return
    raise AssertionError(f"run {run_id} ended before {count} {kind!r} events")


async def test_a_warm_pool_hands_out_prespawned_runners_and_ends_them_at_shutdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, pool_size=2, environ={})
    stop = trio.Event()
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            pool = m._pool
            assert pool is not None
            while pool.ready < 2:
                await trio.sleep(0.01)
            warm_pids = {w.tree.pid for w in pool._ready}
            r = await m.spawn(task(wait=False))
            st = await m.wait_terminal(r["run_id"])
            assert st["state"] == "completed"
            assert st["pid"] in warm_pids
            while pool.ready < 2:  # refilled
                await trio.sleep(0.01)
            stop.set()
    assert not any((tmp_path / "state" / "runs").iterdir())


async def test_a_second_daemon_on_the_same_state_dir_is_refused(daemon: Daemon) -> None:
    from supervisor.errors import DaemonAlreadyRunning

    with pytest.raises(DaemonAlreadyRunning, match="already using state dir"):
        await serve(daemon.config, stop=trio.Event())


async def test_a_second_daemon_is_refused_even_once_the_lock_file_is_removed(daemon: Daemon) -> None:
    # A "stale" daemon.lock removed by hand: the state dir itself is still locked (two
    # daemons used to supervise the same runs, and a cancel ended `failed`).
    from supervisor.errors import DaemonAlreadyRunning

    (daemon.config.state_dir / "daemon.lock").unlink()
    with pytest.raises(DaemonAlreadyRunning, match="already using state dir"):
        await serve(daemon.config, stop=trio.Event())


async def test_a_journal_removed_under_the_daemon_is_put_back_and_it_goes_on(daemon: Daemon) -> None:
    # It said the journal was writable and acknowledged spawns written to an unlinked
    # file (a restart found none of them); then it refused every call until a restart,
    # which found no journal at all.
    with trio.fail_after(15):
        first = await daemon.m.spawn(task(wait=False))
        await daemon.m.wait_terminal(first["run_id"])
        for f in daemon.config.state_dir.glob("agentd.sqlite3*"):
            f.unlink()
        r = await daemon.m.spawn(task(wait=False))
        assert (await daemon.m.wait_terminal(r["run_id"]))["state"] == "completed"
    journal = (await daemon.m.summary())["journal"]
    assert journal["writable"] is True, journal
    assert [x["found"] for x in journal["restored"]] == ["missing"], journal
    from supervisor.store._read import JournalReader

    with JournalReader(daemon.config.state_dir / "agentd.sqlite3") as reader:  # where a restart reads
        assert [reader.run_state(run["run_id"]) for run in (first, r)] == ["completed", "completed"]


async def test_a_spec_whose_limits_are_over_their_bounds_is_refused_at_spawn_naming_limit_and_bound(
    daemon: Daemon,
) -> None:
    # limits.max_steps had no upper bound (2**63 - 1 passed: no bound on a run's model
    # turns); deadlines and command timeouts took 1e308 s.
    for limits, said in (
        ({"max_steps": 1001}, "limits.max_steps: expected an integer <= 1000"),
        ({"deadline_s": 1e308}, "limits.deadline_s: expected a number <= 2592000"),
        ({"command_timeout_s": 1e12}, "limits.command_timeout_s: expected a number <= 2592000"),
    ):
        with pytest.raises(SpawnError, match=f"invalid run spec: {said}"):
            await daemon.m.spawn({**task(wait=False), "limits": limits})
    assert await daemon.m.list_runs() == []  # nothing was created


async def test_a_spec_session_id_is_held_to_the_requests_limits(daemon: Daemon) -> None:
    # A session that could never be closed, read or cancelled by its id is refused at spawn.
    for bad in ("S" * 257, "  ", 5):
        with pytest.raises(SpawnError, match="session_id"):
            await daemon.m.spawn({**task(wait=False), "session_id": bad})


async def test_a_spawn_repeated_with_its_key_returns_its_run_and_starts_nothing(daemon: Daemon) -> None:
    with trio.fail_after(15):
        first = await daemon.m.spawn(task(), session_id="s", key="k-1")
        assert "existing" not in first
        await _wait_event(daemon, first["run_id"], "step_snapshot")
        # Live, in a session with a live turn: the repeat is that turn, not session_busy.
        again = await daemon.m.spawn(task(), session_id="s", key="k-1")
        assert again == {"run_id": first["run_id"], "state": "running", "session_id": "s", "existing": True}
        await daemon.m.cancel(first["run_id"])
        await daemon.m.wait_terminal(first["run_id"])
        # Ended: still that run, whatever its state now (a different spec is not compared).
        ended = await daemon.m.spawn(task(wait=False), key="k-1")
        assert ended["run_id"] == first["run_id"] and ended["state"] == "cancelled" and ended["existing"] is True
        assert [r["id"] for r in await daemon.m.list_runs()] == [first["run_id"]]
        assert [r["id"] for r in await daemon.m.list_runs(key="k-1")] == [first["run_id"]]
        assert await daemon.m.list_runs(key="k-2") == []
        assert daemon.m._key_locks == {}
    for bad in ("K" * 257, "  ", 5):
        with pytest.raises(SpawnError, match="spawn key"):
            await daemon.m.spawn(task(wait=False), key=bad)  # type: ignore[arg-type]


async def test_concurrent_spawns_with_one_key_start_one_run(daemon: Daemon) -> None:
    replies: list[dict[str, Any]] = []

    async def one() -> None:
        replies.append(await daemon.m.spawn(task(wait=False), key="k-same"))

    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            for _ in range(8):
                n.start_soon(one)
        assert len({r["run_id"] for r in replies}) == 1
        assert sum(1 for r in replies if not r.get("existing")) == 1
        await daemon.m.wait_terminal(replies[0]["run_id"])
        assert len(await daemon.m.list_runs()) == 1
    assert daemon.m._key_locks == {}


async def test_a_spawn_key_holds_across_a_daemon_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, environ={})
    replies = []
    with trio.fail_after(30):
        for _ in range(2):
            stop = trio.Event()
            async with trio.open_nursery() as n:
                info = await n.start(functools.partial(serve, config, stop=stop))
                m: RunManager = info["manager"]
                replies.append(await m.spawn(task(wait=False), key="k-durable"))
                await m.wait_terminal(replies[-1]["run_id"])
                runs = await m.list_runs()
                stop.set()
    assert replies[1] == {**replies[0], "state": "completed", "existing": True}
    assert [r["id"] for r in runs] == [replies[0]["run_id"]]


async def test_requests_naming_sessions_that_never_were_leave_no_lock_behind(daemon: Daemon) -> None:
    for n in range(50):
        with pytest.raises(SessionNotFound):
            await daemon.m.close_session(f"never-{n}")
    r = await daemon.m.spawn(task(wait=False), session_id="real")
    await daemon.m.wait_terminal(r["run_id"])
    assert daemon.m.session_desk._locks == {}


async def test_cancelling_a_session_that_never_was_is_not_found_and_one_with_no_live_turn_is_empty(
    daemon: Daemon,
) -> None:
    # A mistyped session id is not "no live run": the user would think the stop was done.
    with pytest.raises(SessionNotFound):
        await daemon.m.cancel_session("never-was")
    r = await daemon.m.spawn(task(wait=False), session_id="real")
    await daemon.m.wait_terminal(r["run_id"])
    assert await daemon.m.cancel_session("real") == {
        "session_id": "real",
        "was_active": False,
        "runs": [],
        "live_run": None,
    }


async def test_a_state_dir_that_cannot_take_the_token_stops_the_start_before_any_run_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk at a restart: the runs a previous daemon left must stay as they are
    # (the next start re-adopts them), not be found again and then ended on the way out.
    import errno

    from supervisor.control import _statefiles
    from supervisor.errors import ConfigError

    def full(path: Any, token: Any = None) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    recovered: list[bool] = []

    async def run(self: RunManager, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        recovered.append(True)
        task_status.started()

    monkeypatch.setattr(_statefiles, "write_token", full)
    monkeypatch.setattr(RunManager, "run", run)
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), environ={})
    with pytest.raises(ConfigError, match="cannot write the control token .*No space left on device"):
        await serve(config, stop=trio.Event())
    assert recovered == []


@pytest.mark.parametrize("fault", ["port", "dashboard_port", "endpoint"])
async def test_a_start_that_fails_at_its_sockets_or_endpoint_touches_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    # A busy port or a full disk at a restart, after the token: the runs were found again
    # first, then ended on the way out.
    import errno
    import socket

    from supervisor.control import _statefiles
    from supervisor.errors import ConfigError, ListenError

    recovered: list[bool] = []

    async def run(self: RunManager, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        recovered.append(True)
        task_status.started()

    monkeypatch.setattr(RunManager, "run", run)
    with socket.create_server(("127.0.0.1", 0)) as holder:
        busy = holder.getsockname()[1]
        settings: dict[str, Any] = {fault: busy} if fault != "endpoint" else {}
        if fault == "endpoint":

            def full(*args: Any, **kwargs: Any) -> Any:
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(_statefiles, "write_endpoint", full)
        config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), environ={}, **settings)
        expected = ListenError if fault != "endpoint" else ConfigError
        with pytest.raises(expected, match="cannot listen|cannot write the endpoint file"):
            await serve(config, stop=trio.Event())
    assert recovered == []
    assert not config.endpoint_path.exists()


async def test_a_start_removes_the_trees_a_killed_daemon_left_that_no_run_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon killed -9 leaves its spares' (and warm runners') run directories and their
    # answer channels behind, every time: the next start removes them, and nothing else.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, environ={})
    root = config.run_root
    root.mkdir(parents=True)
    left = root / "t-0123456789abcdef"
    (left / "tmp").mkdir(parents=True)
    os.mkfifo(root / "t-0123456789abcdef.answers")
    (root / "t-fedcba9876543210.result.json").write_text("{}")
    (root / "t-00000000000000aa.stop").write_text("")  # a stop marker, its tree gone already
    others = [root / "notes.txt", root / "t-short"]
    for p in others:
        p.write_text("not a tree")
    stop = trio.Event()
    async with trio.open_nursery() as n:
        await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        stop.set()
    names = sorted(p.name for p in root.iterdir())
    assert names == ["notes.txt", "t-short"], names


async def test_status_read_as_the_run_ends_has_its_result_with_its_end(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # status read the journal's row, and meanwhile the run's end was written and its state
    # set in memory: the state laid over the older row said "cancelled" (or "completed")
    # with no result and no end time. A probe polling status saw it in ~1 run of 10.
    m = daemon.m
    journal_read, end_written, status_done = trio.Event(), trio.Event(), trio.Event()
    armed: list[str] = []
    real_get_run, real_record = m.journal.get_run, m.book.record

    async def slow_get_run(run_id: str) -> Any:
        record = await real_get_run(run_id)
        if armed and run_id == armed[0]:
            armed.clear()
            journal_read.set()
            await end_written.wait()  # the end is written while this read is in flight
        return record

    async def record(run: Any, kind: str, data: dict[str, Any], ts: float | None = None) -> int | None:
        if kind == "state" and data.get("state") == "cancelled":
            end_written.set()  # the terminal row is in the journal and run.state is set
            await status_done.wait()
        return await real_record(run, kind, data, ts)

    monkeypatch.setattr(m.journal, "get_run", slow_get_run)
    monkeypatch.setattr(m.book, "record", record)
    with trio.fail_after(20):
        r = await m.spawn(task(snapshots=1))
        run_id = r["run_id"]
        async with m.subscribe(run_id) as live:
            async for e in live:
                if e["kind"] == "state" and e["data"]["state"] == "running":
                    break
        armed.append(run_id)
        seen: list[dict[str, Any]] = []
        async with trio.open_nursery() as n:

            async def read_status() -> None:
                seen.append(await m.status(run_id))
                status_done.set()

            n.start_soon(read_status)
            await journal_read.wait()
            n.start_soon(m.cancel, run_id)
        st = await m.wait_terminal(run_id)
    (during,) = seen
    assert during["state"] == "cancelled" and during["live"] is True
    assert during["result"] is not None and during["ended_at"] is not None
    assert st["state"] == "cancelled"


async def test_status_says_the_daemon_is_stopping_once_its_shutdown_began(daemon: Daemon) -> None:
    # It said running (and the CLI "agentd ... running") while systemd showed the unit
    # deactivating and every run was being stopped.
    assert (await daemon.m.summary())["stopping"] is False
    with trio.fail_after(15):
        await daemon.m.shutdown()
    summary = await daemon.m.summary()
    assert summary["stopping"] is True and summary["accepting"] is False


async def test_a_cancel_that_comes_after_the_runner_ended_by_itself_does_not_make_its_failure_a_cancel(
    daemon: Daemon,
) -> None:
    # The runner dies without a result (exit 5); a process it left holds its stdout and
    # ignores SIGTERM, so its tree is ended over the grace. A cancel then (the run still
    # live, was_active true) turned the crash into "cancelled (user)", its calls' records
    # "grace_ran_out": the stop came after the end and ended nothing.
    with trio.fail_after(15):
        r = await daemon.m.spawn(task(wait=False, no_result=True, exit_code=5, hold_stdout_scrubbed=True))
        run = daemon.m._live[r["run_id"]]
        await _wait_event(daemon, r["run_id"], "runner_started")
        assert isinstance(run.tree, Tree)
        await run.tree.process.wait()  # the runner has ended by itself
        assert run.token.cancelled is False and not run.done.is_set()  # its tree is being ended
        c = await daemon.m.cancel(r["run_id"])
        assert c["was_active"] is True
        st = await daemon.m.wait_terminal(r["run_id"])
    assert (st["state"], st["reason"]) == ("failed", "runner_died"), st
    assert st["error"]["code"] == "model_error"
    assert st["receipt"]["cancel_reason"] == "user"  # the stop asked is still on the record


async def test_an_interrupt_that_cannot_start_its_turn_does_not_stop_the_live_one_for_nothing(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The journal cannot be written (a full disk): a spawn with interrupt stopped the live
    # turn, then was refused ("no new runs"): the session lost its turn and got none.
    from supervisor.errors import JournalUnavailable

    real = daemon.m.journal.create_run

    async def full(*a: Any, **k: Any) -> Any:
        raise JournalUnavailable("database or disk is full")

    with trio.fail_after(15):
        first = (await daemon.m.spawn(task(), session_id="s"))["run_id"]
        await _wait_event(daemon, first, "step_snapshot")
        monkeypatch.setattr(daemon.m.journal, "create_run", full)
        # Its first failing write is this spawn's: the live turn was stopped, and it says so.
        with pytest.raises(JournalUnavailable, match=f"the live turn '{first}' was stopped first"):
            await daemon.m.spawn(task(wait=False), session_id="s", interrupt=True)
        assert (await daemon.m.wait_terminal(first))["state"] == "cancelled"
        monkeypatch.setattr(daemon.m.journal, "create_run", real)
        second = (await daemon.m.spawn(task(), session_id="s"))["run_id"]
        await _wait_event(daemon, second, "step_snapshot")
        monkeypatch.setattr(daemon.m.journal, "create_run", full)
        with pytest.raises(JournalUnavailable):
            await daemon.m.spawn(task(wait=False))  # the daemon knows: degraded
        with pytest.raises(JournalUnavailable, match=f"the live turn '{second}' goes on"):
            await daemon.m.spawn(task(wait=False), session_id="s", interrupt=True)
        st = await daemon.m.status(second)
        assert st["state"] == "running" and st.get("cancel_reason") is None, st
        monkeypatch.setattr(daemon.m.journal, "create_run", real)
        await daemon.m.cancel(second)
        await daemon.m.wait_terminal(second)


async def test_a_failure_the_runner_decided_before_the_stop_reached_it_stays_a_failure(daemon: Daemon) -> None:
    # A cancel that raced the runner's own failure (the model failed; the SIGTERM came as it
    # wrote its result) made it "cancelled (user)": the runner says its failure came first.
    with trio.fail_after(15):
        r = await daemon.m.spawn(task(failed_before_stop=True))
        await _wait_event(daemon, r["run_id"], "step_snapshot")
        assert (await daemon.m.cancel(r["run_id"]))["was_active"] is True
        st = await daemon.m.wait_terminal(r["run_id"])
    assert (st["state"], st["reason"], st["error"]["code"]) == ("failed", "model_error", "model_error"), st
