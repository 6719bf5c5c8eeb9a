"""The fleet's pure parts, and the promise that a single-machine agentd never loads Ray."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from subagent.events import SnapshotDeltas
from supervisor.errors import SpawnError
from supervisor.fleet import BROWSER, SLOTS, node_resources, split_demand
from supervisor.fleet._index import Index


def test_the_single_machine_cli_and_daemon_modules_never_import_ray(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import supervisor, supervisor.cli, supervisor.daemon, supervisor.core.runs, supervisor.fleet\n"
        "from click.testing import CliRunner\n"
        "from supervisor.cli import cli\n"
        f"r = CliRunner().invoke(cli, ['--state-dir', {str(tmp_path)!r}, 'status'])\n"
        "assert r.exit_code == 3, r.output\n"
        "r = CliRunner().invoke(cli, ['fleet', 'resources', '--no-browser', '--max-concurrent', '3'])\n"
        "assert r.exit_code == 0 and '\"agentd_slots\": 3.0' in r.output, r.output\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_node_advertises_slots_and_browsers_only_where_it_has_one() -> None:
    assert node_resources(8, browser=True) == {SLOTS: 8.0, BROWSER: 8.0}
    assert node_resources(8, browser=False) == {SLOTS: 8.0, BROWSER: 0.0}
    with pytest.raises(ValueError):
        node_resources(0, browser=True)


def test_a_spec_maps_to_a_bundle_and_loses_its_fleet_only_key() -> None:
    spec, bundle = split_demand({"task": "t", "browser": True, "resources": {"cpu": 0.5, "memory_mb": 256}})
    assert spec == {"task": "t", "browser": True}
    assert bundle == {SLOTS: 1.0, BROWSER: 1.0, "CPU": 0.5, "memory": 256.0 * 1024 * 1024}
    assert split_demand({"task": "t"}) == ({"task": "t"}, {SLOTS: 1.0})
    for bad in ({"gpu": 1}, {"cpu": -1}, {"cpu": True}, "lots"):
        with pytest.raises(SpawnError):
            split_demand({"task": "t", "resources": bad})


def test_the_index_folds_a_nodes_snapshot_deltas_into_the_whole_partial_result(tmp_path: Path) -> None:
    index = Index(tmp_path / "fleet.sqlite3")
    index.create("f-1", session_id=None, spec={"task": "t"}, bundle={SLOTS: 1.0}, created_at=1.0, timeout_s=None)
    index.set_node("f-1", "n1")
    index.set_node_run("f-1", "r-1")
    deltas = SnapshotDeltas()
    a0, a1 = {"id": "a", "state": "not_started"}, {"id": "a", "state": "succeeded"}
    sent = [
        deltas.next(step=1, progress="first", records=[a0]),
        deltas.next(step=1, progress="first", records=[a1]),
        deltas.next(step=2, progress="first\n\nsecond", records=[a1, {"id": "b", "state": "not_started"}]),
    ]
    events = [
        {"seq": i, "ts": float(i), "kind": "step_snapshot", "data": {**d, "_id": "r-1"}} for i, d in enumerate(sent, 1)
    ]
    index.add_events("f-1", events[:2])
    index.add_events("f-1", events[1:])  # the mirror resumes one event back: none folded twice
    # Another runner's snapshot (its _id is not this run's node run): not this run's.
    stray = {**deltas.next(step=3, progress="first\n\nsecond\n\nstray", records=[]), "_id": "r-other"}
    index.add_events("f-1", [{"seq": 4, "ts": 4.0, "kind": "step_snapshot", "data": stray}])
    row = index.get("f-1")
    assert row is not None
    assert row["partial_snapshot"] == {
        "step": 2,
        "progress": "first\n\nsecond",
        "tool_calls": [a1, {"id": "b", "state": "not_started"}],
        "_id": "r-1",
        "snapshot_n": 3,
    }
    index.close()


def test_the_index_writes_a_terminal_fact_once_and_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "fleet.sqlite3"
    index = Index(path)
    index.create("f-1", session_id=None, spec={"task": "t"}, bundle={SLOTS: 1.0}, created_at=1.0, timeout_s=None)
    index.set_node("f-1", "n1")
    index.set_node_run("f-1", "r-1")
    index.add_events("f-1", [{"seq": 1, "ts": 1.0, "kind": "state", "data": {"state": "running"}}])
    index.add_events("f-1", [{"seq": 2, "ts": 2.0, "kind": "step_snapshot", "data": {"step": 1, "progress": "p"}}])
    assert (
        index.finish(
            "f-1",
            "lost",
            reason="node_lost",
            ended_at=3.0,
            result={"progress": "p"},
            partial=True,
            event={"kind": "state", "data": {"state": "lost"}},
        )
        is True
    )
    assert index.finish("f-1", "cancelled", reason="user", ended_at=4.0) is False
    index.close()
    index = Index(path)
    row = index.get("f-1")
    assert row is not None
    assert (row["state"], row["reason"], row["node_id"], row["node_run_id"], row["last_seq"]) == (
        "lost",
        "node_lost",
        "n1",
        "r-1",
        3,
    )
    assert row["partial_snapshot"] == {"step": 1, "progress": "p"} and row["partial"] is True
    assert [e["seq"] for e in index.events_after("f-1", 0, 10)] == [1, 2, 3]
    assert index.terminal_event_count("f-1") == 1
    assert index.live() == []
    index.close()


class _FakeLink:
    """A node's socket as the front uses it: requests recorded, canned replies."""

    def __init__(self, replies: dict[str, object]) -> None:
        self.requests: list[tuple[str, dict[str, object]]] = []
        self.replies = replies

    async def request(self, op: str, **args: object) -> object:
        self.requests.append((op, args))
        return self.replies.get(op, {})


async def test_the_front_routes_conversations_and_approvals_to_the_sessions_node(tmp_path: Path) -> None:
    import trio

    from supervisor.config import Config
    from supervisor.errors import ControlProtocolError
    from supervisor.fleet._front import NODE_AFFINITY, FleetFront

    index = Index(tmp_path / "index.sqlite3")
    front = FleetFront(Config.load(state_dir=tmp_path / "front", environ={}, grace_s=1), index)
    front._nodes = {"n1": {"ip": "10.0.0.7", "resources": {SLOTS: 4.0, "node:10.0.0.7": 1.0}}}
    history = {
        "session_id": "s",
        "live_run": None,
        "turns": [{"run_id": "r-node1", "state": "cancelled", "messages": []}],
        "messages": [],
    }
    link = _FakeLink(
        {
            "approve": {"run_id": "r-node1", "call_id": "c1", "decision": "approved", "state": "running"},
            "history": history,
        }
    )
    placed: list[object] = []

    async def drive(run: object) -> None:  # Ray's part: placed on n1 at once
        placed.append(run)
        index.set_node(run.id, "n1")  # type: ignore[attr-defined]
        index.set_node_run(run.id, f"r-node{len(placed)}")  # type: ignore[attr-defined]
        run.node_id, run.node_run_id = "n1", f"r-node{len(placed)}"  # type: ignore[attr-defined]
        await trio.sleep_forever()

    async def cancel(run_id: str, *, reason: str = "user") -> dict[str, object]:
        run = front._live.pop(run_id)
        run.done.set()
        return {"run_id": run_id, "was_active": True, "reason": reason}

    async def get_link(node_id: str) -> _FakeLink:
        assert node_id == "n1"
        return link

    front._drive = drive  # type: ignore[method-assign]
    front.cancel = cancel  # type: ignore[method-assign]
    front._link = get_link  # type: ignore[method-assign,assignment]
    async with trio.open_nursery() as nursery:
        front._nursery, front._accepting = nursery, True
        first = await front.spawn({"task": "one"}, session_id="s")
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ControlProtocolError) as busy:
            await front.spawn({"task": "two"}, session_id="s")
        approved = await front.approve(first["run_id"], "c1")
        second = await front.spawn({"task": "two"}, session_id="s", interrupt=True)
        await trio.testing.wait_all_tasks_blocked()
        shown = await front.history("s")
        listed = await front.list_sessions()
        nursery.cancel_scope.cancel()
    index.close()
    assert busy.value.code == "session_busy" and first["run_id"] in str(busy.value)
    assert link.requests[0] == ("approve", {"run_id": "r-node1", "call_id": "c1"})
    assert approved["run_id"] == first["run_id"] and approved["decision"] == "approved"
    # The next turn goes where the session's history and profile are: pinned to n1.
    assert placed[1].bundle == {SLOTS: 1.0, "node:10.0.0.7": NODE_AFFINITY}  # type: ignore[attr-defined]
    assert placed[0].bundle == {SLOTS: 1.0}  # type: ignore[attr-defined]
    assert ("history", {"session_id": "s"}) in link.requests
    assert shown["turns"][0]["run_id"] == first["run_id"] and shown["turns"][0]["node_run_id"] == "r-node1"
    (row,) = listed["sessions"]
    assert row["session_id"] == "s" and row["turns"] == 2 and row["live_run"] == second["run_id"]


async def test_the_fronts_session_cancel_naming_its_turn_stops_that_turn_or_nothing(tmp_path: Path) -> None:
    import trio

    from supervisor.config import Config
    from supervisor.errors import ControlProtocolError, RunNotFound
    from supervisor.fleet._front import FleetFront

    index = Index(tmp_path / "index.sqlite3")
    front = FleetFront(Config.load(state_dir=tmp_path / "front", environ={}, grace_s=1), index)
    front._nodes = {"n1": {"ip": "10.0.0.7", "resources": {SLOTS: 4.0, "node:10.0.0.7": 1.0}}}
    link = _FakeLink({"cancel": {"run_id": "r-node2", "was_active": True, "state": "cancelling"}})
    placed: list[object] = []

    async def drive(run: object) -> None:  # Ray's part: placed on n1 at once, runs until stopped
        placed.append(run)
        index.set_node(run.id, "n1")  # type: ignore[attr-defined]
        index.set_node_run(run.id, f"r-node{len(placed)}")  # type: ignore[attr-defined]
        run.node_id, run.node_run_id = "n1", f"r-node{len(placed)}"  # type: ignore[attr-defined]
        await trio.sleep_forever()

    async def get_link(node_id: str) -> _FakeLink:
        return link

    front._drive = drive  # type: ignore[method-assign]
    front._link = get_link  # type: ignore[method-assign,assignment]
    async with trio.open_nursery() as nursery:
        front._nursery, front._accepting = nursery, True
        first = (await front.spawn({"task": "one"}, session_id="s"))["run_id"]
        await trio.testing.wait_all_tasks_blocked()
        ended = front._live.pop(first)  # turn 1 completes (its fact mirrored from n1)
        ended.token.retire()
        index.finish(first, "completed", reason=None, ended_at=2.0, error=None, event={"kind": "state", "data": {}})
        ended.done.set()
        second = (await front.spawn({"task": "two"}, session_id="s"))["run_id"]
        other = (await front.spawn({"task": "three"}, session_id="o"))["run_id"]
        await trio.testing.wait_all_tasks_blocked()
        late = await front.cancel_session("s", turn=first)
        with pytest.raises(ControlProtocolError) as foreign:
            await front.cancel_session("s", turn=other)
        with pytest.raises(RunNotFound):
            await front.cancel_session("s", turn="f-never")
        sent_before = [r for r in link.requests if r[0] == "cancel"]
        meant = await front.cancel_session("s", turn=second)
        nursery.cancel_scope.cancel()
    index.close()
    turn1 = {"run_id": first, "was_active": False, "state": "completed", "node": "n1"}
    assert late == {"session_id": "s", "was_active": False, "runs": [turn1], "live_run": second}, late
    assert foreign.value.code == "bad_args" and "not a turn of session 's'" in str(foreign.value)
    assert sent_before == []  # nothing reached a node: turn 2 and the other session's run go on
    assert [r for r in link.requests if r[0] == "cancel"] == [("cancel", {"run_id": "r-node2", "reason": "user"})]
    assert meant["was_active"] is True and [r["run_id"] for r in meant["runs"]] == [second], meant


def _front_with_a_placed_run(tmp_path: Path, link_failure: type[Exception]) -> tuple[Any, Any, Index, list[float]]:
    """A front (grace 1 s) with run f-1 placed on n1 as r-1 (running, one snapshot mirrored);
    every attempt to reach n1 fails with ``link_failure`` (its time recorded), Ray still
    lists n1, and the index is written inline (no thread: the autojump clock stays put)."""
    import trio

    from supervisor.config import Config
    from supervisor.core.token import CancelToken
    from supervisor.fleet._front import FleetFront, _Run

    index = Index(tmp_path / "index.sqlite3")
    index.create("f-1", session_id=None, spec={"task": "t"}, bundle={SLOTS: 1.0}, created_at=1.0, timeout_s=None)
    index.set_node("f-1", "n1")
    index.set_node_run("f-1", "r-1")
    index.add_events("f-1", [{"seq": 1, "ts": 1.0, "kind": "state", "data": {"state": "running"}}])
    index.add_events("f-1", [{"seq": 2, "ts": 2.0, "kind": "step_snapshot", "data": {"step": 1, "progress": "p"}}])
    front = FleetFront(Config.load(state_dir=tmp_path / "front", environ={}, grace_s=1), index)
    run = _Run(
        id="f-1", session_id=None, spec={"task": "t"}, bundle={SLOTS: 1.0}, timeout_s=None,
        token=CancelToken("f-1"), state="running", node_id="n1", node_run_id="r-1", last_seq=2,
    )  # fmt: skip
    front._live[run.id] = run
    attempts: list[float] = []

    async def db(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    async def link(node_id: str) -> Any:
        attempts.append(trio.current_time())
        raise link_failure(f"node {node_id}: down")

    async def node_dead_now(node_id: str) -> bool:
        return False

    async def free_lease(r: Any) -> None:  # Ray's part: no lease here
        pass

    front._db = db  # type: ignore[method-assign]
    front._link = link  # type: ignore[method-assign,assignment]
    front._node_dead_now = node_dead_now  # type: ignore[method-assign]
    front._free_lease = free_lease  # type: ignore[method-assign]
    return front, run, index, attempts


async def test_a_run_whose_node_lost_its_agent_for_good_turns_lost_after_the_bound_not_retried_forever(
    tmp_path: Path, autojump_clock: Any
) -> None:
    import trio

    from supervisor.fleet._front import AGENT_GONE_MARGIN_S, RELINK_BACKOFF_S, AgentGone

    front, run, index, attempts = _front_with_a_placed_run(tmp_path, AgentGone)
    send, receive = trio.open_memory_channel[Any](10)
    run.subscribers.add(send)
    start = trio.current_time()
    with trio.fail_after(10 * front.agent_gone_s):  # virtual time: fails, never hangs, without the bound
        await front._drive(run)
    ended = trio.current_time() - start
    async with receive:
        events = [m async for m in receive]
    row = index.get("f-1")
    terminal = index.terminal_event_count("f-1")
    index.close()
    assert front.agent_gone_s == 1 + AGENT_GONE_MARGIN_S
    # Retried through the bound, then ended: not sooner, and not much later.
    assert front.agent_gone_s <= ended <= front.agent_gone_s + max(RELINK_BACKOFF_S)
    assert len(attempts) > len(RELINK_BACKOFF_S)
    assert row is not None and (row["state"], row["reason"]) == ("lost", "agent_gone")
    assert row["error"]["code"] == "agent_gone" and "no agentd agent" in row["error"]["message"]
    assert row["partial"] is True and row["partial_snapshot"] == {"step": 1, "progress": "p"}
    assert terminal == 1 and run.done.is_set() and "f-1" not in front._live
    # Its subscribers saw the terminal fact, then their end.
    assert [(e["seq"], e["data"]["state"], e["data"]["reason"]) for e in events] == [(3, "lost", "agent_gone")]


async def test_a_node_whose_agent_is_there_but_its_daemon_is_unreachable_is_retried_past_that_bound(
    tmp_path: Path, autojump_clock: Any
) -> None:
    # The agent restarts its daemon (and Ray restarts an agent that crashed): the run's
    # fact will come from the node's journal, so the front waits for it.
    import trio

    from supervisor.fleet._nodelink import LinkDown

    front, run, index, attempts = _front_with_a_placed_run(tmp_path, LinkDown)
    with trio.move_on_after(10 * front.agent_gone_s):
        await front._drive(run)
    row = index.get("f-1")
    index.close()
    assert row is not None and row["state"] == "running" and not run.done.is_set()
    assert attempts[-1] - attempts[0] >= 9 * front.agent_gone_s


async def test_a_node_link_closed_by_its_daemon_closes_its_socket_and_leaks_nothing() -> None:
    # The daemon ends the connection (its shutdown): the link fails its pending requests
    # and closes its TCP socket itself (trio-websocket's client leaves it to the garbage
    # collector after a server-initiated close: an "unclosed socket" ResourceWarning).
    import gc
    import warnings

    import trio
    from trio_websocket import WebSocketRequest, serve_websocket

    from supervisor.fleet._nodelink import LinkDown, NodeLink

    async def close_at_once(request: WebSocketRequest) -> None:
        ws = await request.accept()
        await ws.get_message()  # the link's first request
        await ws.aclose(1001, "going away")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, close_at_once, "127.0.0.1", 0, None)
            link = NodeLink("n1", f"ws://127.0.0.1:{server.port}/", "token")
            await nursery.start(link.run)
            with trio.fail_after(10), pytest.raises(LinkDown):
                await link.request("ping")
            with trio.fail_after(10):
                await link.closed.wait()
            del link
            nursery.cancel_scope.cancel()
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []


async def test_a_run_whose_node_told_its_end_then_died_keeps_that_end_not_lost_after_it(tmp_path: Path) -> None:
    # The node stopped the run (its daemon was going away) and the front mirrored its
    # `cancelled`; asking the node for the details failed, and the node was then found
    # dead: `lost` was written after `cancelled`, two terminal facts.
    front, run, index, _attempts = _front_with_a_placed_run(tmp_path, ConnectionError)
    final = {"seq": 3, "ts": 3.0, "kind": "state", "data": {"state": "cancelled", "reason": "shutdown"}}
    await front._on_event(run, {"op": "event", **final})
    await front._finish_lost(run, "n1")
    row = index.get("f-1")
    terminal = index.terminal_event_count("f-1")
    index.close()
    assert row is not None and (row["state"], row["reason"]) == ("cancelled", "shutdown")
    assert terminal == 1 and run.done.is_set() and "f-1" not in front._live


async def test_a_spawn_with_its_own_model_key_is_refused_by_the_front_not_an_internal_error(tmp_path: Path) -> None:
    from supervisor.errors import ControlProtocolError

    front, _run, index, _attempts = _front_with_a_placed_run(tmp_path, ConnectionError)
    with pytest.raises(ControlProtocolError) as refused:
        await front.spawn({"task": "t"}, model_key=object())
    index.close()
    assert refused.value.code == "unsupported" and "OPENAI_API_KEY" in str(refused.value)


@contextlib.contextmanager
def socket_pair_port() -> Iterator[int]:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def test_fleet_commands_give_up_on_an_address_nothing_answers_at() -> None:
    # ray.init retried such an address for ever: `agentd fleet up` hung.
    from supervisor.fleet.cli import _reachable

    with socket_pair_port() as port:
        assert _reachable(f"127.0.0.1:{port}") is None
    assert "nothing answers there" in str(_reachable("127.0.0.1:1"))
    assert _reachable("auto") is None and _reachable("ray://head:10001") is None


async def test_a_cancel_while_the_lease_is_read_keeps_the_run_from_its_node(tmp_path: Path) -> None:
    # The cancel's reply says "queued" (never started); it came after the lease was placed
    # and before the hand-off, which then went to the node all the same.
    import ray

    from supervisor.fleet._front import _lease, _lease_node
    from tests.fleet.test_fleet_handoff import Ref

    front, run, index, _attempts = _front_with_a_placed_run(tmp_path, ConnectionError)
    run.node_id = run.node_run_id = None
    front._nodes = {"n1": {"ip": "10.0.0.7", "resources": {SLOTS: 4.0}}}
    spawned: list[object] = []

    class Lease:
        def ready(self) -> Ref:
            return Ref(None)

    class Agent:
        class spawn:  # noqa: N801 - Ray's actor method shape
            @staticmethod
            def remote(*args: object) -> Ref:
                spawned.append(args)
                return Ref({"ok": True, "node_run_id": "r-9"})

    replies: list[dict[str, Any]] = []

    async def ray_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is _lease:
            return Lease()
        if fn is _lease_node:
            return "n1"
        assert fn is ray.get_actor
        replies.append(await front.cancel(run.id))  # the cancel arrives now
        return Agent()

    front._ray = ray_call  # type: ignore[method-assign]
    handed = await front._place_and_hand_off(run)
    row = index.get(run.id)
    index.close()
    assert handed is False and spawned == []
    assert replies[0]["was_active"] is True and replies[0]["state"] != "starting"  # not handed over yet
    assert row is not None and row["state"] == "cancelled"
