"""The hand-off of a run to its node when the node's daemon stalls in the middle of it
(SIGSTOP), or the front is killed then: the record stays honest and no run runs
unsupervised. Agent side: ``HandOffs`` against a stand-in daemon (threads, no Ray).
Front side: ``FleetFront`` with Ray and the index faked inline, as in test_fleet_units."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.control._wsclient import ConnectionLost
from supervisor.fleet import SLOTS
from supervisor.fleet._index import Index

WAIT_S = 10.0  # a deadline, never a pause: every wait below ends on an event first

# ------------------------------------------------------------------ the agent's side


class _StallableDaemon:
    """A node daemon: a spawn it gets is journaled and answered at once, or, while it is
    stalled (SIGSTOP), when it resumes (what a real daemon does with its socket's buffer).
    A spawn's key is journaled with its run; one whose key has a run gets that run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = 1000
        self.stalled = False
        self.journal: list[dict[str, Any]] = []
        self.spawns_received = 0
        self.held: list[tuple[_Conn, dict[str, Any]]] = []
        self.conns: list[_Conn] = []
        self._ids = itertools.count(1)

    # _Daemon
    def endpoint(self) -> dict[str, Any]:
        return {"url": "ws://127.0.0.1:1/", "token": "t", "pid": self.pid}

    def serving(self, pid: int | None) -> bool:
        return pid == self.pid

    def stopping(self) -> bool:
        return False

    def open(self, endpoint: dict[str, Any]) -> _Conn:
        conn = _Conn(self)
        self.conns.append(conn)
        return conn

    def find(self, endpoint: dict[str, Any], key: str) -> str | None:
        with self.lock:
            return next((r["id"] for r in self.journal if r.get("key") == key), None)

    def journal_held(self, index: int, run_id: str) -> None:
        """The daemon journals the ``index``th spawn it holds (stalled) as ``run_id``,
        and dies before it answers it."""
        _conn, request = self.held[index]
        self.journal.append(
            {
                "id": run_id,
                "created_at": time.time(),
                "session_id": request.get("session_id"),
                "spec": {**request["spec"], "run_id": run_id},
                "key": request.get("key"),
            }
        )

    # the daemon's own side
    def receive(self, conn: _Conn, request: dict[str, Any]) -> None:
        with self.lock:
            self.spawns_received += 1
            if self.stalled:
                self.held.append((conn, request))
                return
        self._serve(conn, request)

    def _serve(self, conn: _Conn, request: dict[str, Any]) -> None:
        with self.lock:
            key = request.get("key")
            run_id = next((r["id"] for r in self.journal if key is not None and r.get("key") == key), None)
            if run_id is None:
                run_id = f"r-{next(self._ids)}"
                self.journal.append(
                    {
                        "id": run_id,
                        "created_at": time.time(),
                        "session_id": request.get("session_id"),
                        "spec": {**request["spec"], "run_id": run_id},
                        "key": key,
                    }
                )
        conn.replies.put(
            json.dumps({"id": request["id"], "ok": True, "result": {"run_id": run_id, "state": "starting"}})
        )

    def resume(self) -> None:
        with self.lock:
            self.stalled, held, self.held = False, self.held, []
        for conn, request in held:
            self._serve(conn, request)

    def die(self) -> None:
        """The daemon process exits (what it had journaled stays); its agent starts another."""
        with self.lock:
            self.stalled, self.held = False, []
            self.pid += 1
        for conn in self.conns:
            conn.replies.put(None)


class _Conn:
    def __init__(self, daemon: _StallableDaemon) -> None:
        self.daemon = daemon
        self.closed = False
        self.replies: queue.Queue[str | None] = queue.Queue()

    def send_text(self, text: str) -> None:
        self.daemon.receive(self, json.loads(text))

    def recv_text(self, timeout_s: float | None) -> str:
        try:
            reply = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ConnectionLost("timed out waiting for the daemon") from None
        if reply is None:
            self.closed = True
            raise ConnectionLost("the daemon closed the connection")
        return reply

    def close(self) -> None:
        self.closed = True


def _hand_offs(tmp_path: Path, daemon: _StallableDaemon, answer_s: float = 0.05) -> Any:
    from supervisor.fleet._agent import HandOffs, _SpawnMap

    return HandOffs(_SpawnMap(tmp_path / "spawns.sqlite3"), daemon, answer_s=answer_s, poll_s=0.01)


def _until(predicate: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)  # polling a condition another thread sets, under a deadline


def test_a_spawn_a_stalled_daemon_has_not_answered_is_unknown_then_the_run_it_started(tmp_path: Path) -> None:
    # It was {"ok": False} (the client's 30 s timeout): the front recorded the run failed,
    # refused by its node, and freed its lease; the daemon ran it once it resumed.
    daemon = _StallableDaemon()
    daemon.stalled = True
    hand_offs = _hand_offs(tmp_path, daemon)
    first = hand_offs.spawn("f-1", {"task": "t"}, None, None)
    assert first["ok"] is False and first["unknown"] is True and first["error"]["code"] == "spawn_unknown"
    daemon.resume()
    _until(lambda: hand_offs.spawn("f-1", {"task": "t"}, None, None)["ok"])
    again = hand_offs.spawn("f-1", {"task": "t"}, None, None)
    assert again["node_run_id"] == "r-1" and daemon.spawns_received == 1 and len(daemon.journal) == 1


def test_one_fleet_run_asked_twice_while_its_hand_off_is_in_flight_is_one_node_run(tmp_path: Path) -> None:
    # The map was read before the daemon call and written after it: a restarted front's
    # repeat, while the first was in flight, spawned a second run.
    daemon = _StallableDaemon()
    daemon.stalled = True
    hand_offs = _hand_offs(tmp_path, daemon, answer_s=WAIT_S)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(hand_offs.spawn, "f-1", {"task": "t"}, None, None)
        _until(lambda: daemon.spawns_received == 1)
        second = pool.submit(hand_offs.spawn, "f-1", {"task": "t"}, None, None)
        daemon.resume()
        replies = [first.result(WAIT_S), second.result(WAIT_S)]
    assert [r["node_run_id"] for r in replies] == ["r-1", "r-1"]
    assert daemon.spawns_received == 1 and len(daemon.journal) == 1


def test_a_spawn_whose_daemon_died_unanswered_is_found_in_its_journal_or_handed_again(tmp_path: Path) -> None:
    daemon = _StallableDaemon()
    hand_offs = _hand_offs(tmp_path, daemon)
    # Journaled, then the daemon died before its answer went out: that run is the one.
    daemon.stalled = True
    assert hand_offs.spawn("f-1", {"task": "a"}, None, None)["unknown"] is True
    _until(lambda: daemon.held)
    daemon.journal_held(0, "r-a")
    daemon.die()
    _until(lambda: hand_offs.spawn("f-1", {"task": "a"}, None, None)["ok"])
    assert hand_offs.spawn("f-1", {"task": "a"}, None, None)["node_run_id"] == "r-a"
    # Not journaled when the daemon died: it never started, and goes to the next daemon.
    daemon.stalled = True
    assert hand_offs.spawn("f-2", {"task": "a"}, None, None)["unknown"] is True
    _until(lambda: daemon.held)
    daemon.die()
    _until(lambda: hand_offs.spawn("f-2", {"task": "a"}, None, None)["ok"])
    again = hand_offs.spawn("f-2", {"task": "a"}, None, None)
    assert again["node_run_id"] == "r-1" and [r["id"] for r in daemon.journal] == ["r-a", "r-1"]


def test_two_alike_runs_of_one_session_with_lost_answers_each_get_their_own_node_run(tmp_path: Path) -> None:
    # The lost answers were found by matching the journal on task, session and time: the
    # oldest unclaimed alike run went to whichever fleet id asked first, so two alike runs
    # of one session journaled in the other order were swapped between their fleet ids.
    daemon = _StallableDaemon()
    hand_offs = _hand_offs(tmp_path, daemon)
    daemon.stalled = True
    assert hand_offs.spawn("f-1", {"task": "a"}, "s", None)["unknown"] is True
    _until(lambda: len(daemon.held) == 1)
    assert hand_offs.spawn("f-2", {"task": "a"}, "s", None)["unknown"] is True
    _until(lambda: len(daemon.held) == 2)
    daemon.journal_held(1, "r-for-f-2")  # journaled in the other order than they were sent
    daemon.journal_held(0, "r-for-f-1")
    daemon.die()
    _until(lambda: hand_offs.spawn("f-1", {"task": "a"}, "s", None)["ok"])
    _until(lambda: hand_offs.spawn("f-2", {"task": "a"}, "s", None)["ok"])
    assert hand_offs.spawn("f-1", {"task": "a"}, "s", None)["node_run_id"] == "r-for-f-1"
    assert hand_offs.spawn("f-2", {"task": "a"}, "s", None)["node_run_id"] == "r-for-f-2"
    assert daemon.spawns_received == 2 and len(daemon.journal) == 2


def test_a_hand_off_sends_its_fleet_run_id_as_the_spawns_idempotency_key(tmp_path: Path) -> None:
    daemon = _StallableDaemon()
    daemon.stalled = True
    hand_offs = _hand_offs(tmp_path, daemon)
    hand_offs.spawn("f-1", {"task": "a"}, None, None)
    _until(lambda: daemon.held)
    assert daemon.held[0][1]["key"] == "f-1"
    daemon.resume()


def test_settling_a_run_that_never_reached_the_node_keeps_it_from_ever_starting(tmp_path: Path) -> None:
    daemon = _StallableDaemon()
    hand_offs = _hand_offs(tmp_path, daemon)
    settled = hand_offs.settle("f-1")
    late = hand_offs.spawn("f-1", {"task": "t"}, None, None)  # a dead front's spawn, arriving late
    assert settled["ok"] is False and settled["never"] is True and "unknown" not in settled
    assert late["ok"] is False and late["never"] is True and daemon.spawns_received == 0
    # One that did reach it is the node run to stop.
    assert hand_offs.spawn("f-2", {"task": "t"}, None, None)["node_run_id"] == "r-1"
    assert hand_offs.settle("f-2")["node_run_id"] == "r-1"


# ------------------------------------------------------------------ the front's side


class Ref:
    """A Ray object ref already resolved to ``value`` (what the front awaits: its future)."""

    def __init__(self, value: object) -> None:
        self.value = value

    def future(self) -> concurrent.futures.Future[object]:
        f: concurrent.futures.Future[object] = concurrent.futures.Future()
        f.set_result(self.value)
        return f


class _Agent:
    """A node's agent as the front calls it: each call answers the next canned reply."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.replies = replies
        agent = self

        class Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: object) -> Ref:
                agent.calls.append((self.name, args))
                return Ref(agent.replies.pop(0) if len(agent.replies) > 1 else agent.replies[0])

        self.spawn = Method("spawn")
        self.settle = Method("settle")


def _front(
    tmp_path: Path, *, alive: list[str], lease_node: str, agents: dict[str, _Agent], row: dict[str, Any] | None = None
) -> tuple[Any, Index, list[str]]:
    """A front with run f-1 in its index (``row``'s columns set), Ray faked: ``alive`` nodes,
    the lease placed on ``lease_node``, each node's agent; the index written inline."""
    import ray

    from supervisor.config import Config
    from supervisor.fleet._agent import AGENT_PREFIX, alive_nodes
    from supervisor.fleet._front import FleetFront, _lease, _lease_node

    index = Index(tmp_path / "index.sqlite3")
    index.create("f-1", session_id=None, spec={"task": "t"}, bundle={SLOTS: 1.0}, created_at=1.0, timeout_s=None)
    row = row or {}
    if row.get("node_id"):
        index.set_node("f-1", row["node_id"])
    if row.get("cancel_reason"):
        index.request_cancel("f-1", row["cancel_reason"])
    front = FleetFront(Config.load(state_dir=tmp_path / "front", environ={}, grace_s=1), index)
    front._nodes = {n: {"ip": "10.0.0.7", "resources": {SLOTS: 4.0}} for n in alive}
    freed: list[str] = []

    class Lease:
        def ready(self) -> Ref:
            return Ref(None)

    async def ray_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is _lease:
            return Lease()
        if fn is _lease_node:
            return lease_node
        if fn is alive_nodes:
            return [{"node_id": n, "ip": "10.0.0.7", "resources": {SLOTS: 4.0}} for n in alive]
        assert fn is ray.get_actor
        node = args[0][len(AGENT_PREFIX) :]
        if node not in agents:
            raise ValueError(f"no agent on {node}")
        return agents[node]

    async def db(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    async def free_lease(run: Any) -> None:
        freed.append(run.id)

    front._ray = ray_call  # type: ignore[method-assign]
    front._db = db  # type: ignore[method-assign]
    front._free_lease = free_lease  # type: ignore[method-assign]
    return front, index, freed


async def _resumed(front: Any) -> Any:
    """Run f-1 as a restarted front resumes it from its index (its drive not started)."""
    started: list[Any] = []

    async def drive(run: Any) -> None:
        started.append(run)

    front._drive = drive
    async with trio.open_nursery() as nursery:
        front._nursery = nursery
        for row in front.index.live():
            front._resume(row)
    (run,) = started
    return run


async def test_a_spawn_its_node_has_not_answered_is_asked_again_never_failed_with_its_lease_freed(
    tmp_path: Path, autojump_clock: Any
) -> None:
    unknown = {"ok": False, "unknown": True, "error": {"code": "spawn_unknown", "message": "no answer yet"}}
    agent = _Agent([unknown, unknown, {"ok": True, "node_run_id": "r-9", "state": "starting"}])
    front, index, freed = _front(tmp_path, alive=["n1"], lease_node="n1", agents={"n1": agent})
    run = await _resumed(front)
    with trio.fail_after(60):
        handed = await front._place_and_hand_off(run)
    row = index.get("f-1")
    index.close()
    assert handed is True and run.node_run_id == "r-9" and freed == []
    assert row is not None and not row["terminal"] and row["node_run_id"] == "r-9"
    assert [c[0] for c in agent.calls] == ["spawn"] * 3 and {c[1][0] for c in agent.calls} == {"f-1"}


async def test_a_run_whose_recorded_node_died_is_lost_not_handed_to_where_its_lease_moved(tmp_path: Path) -> None:
    # A front killed mid-hand-off to n1, then n1 died and Ray moved the lease to n2: the
    # restarted front handed the run to n2 with n1 on its record; n1's death then made it
    # lost and freed its lease, while it ran on n2.
    n2 = _Agent([{"ok": True, "node_run_id": "r-2", "state": "starting"}])
    front, index, freed = _front(tmp_path, alive=["n2"], lease_node="n2", agents={"n2": n2}, row={"node_id": "n1"})
    run = await _resumed(front)
    with trio.fail_after(WAIT_S):
        handed = await front._place_and_hand_off(run)
    row = index.get("f-1")
    index.close()
    assert handed is False and n2.calls == []
    assert row is not None and (row["state"], row["reason"], row["node_id"]) == ("lost", "node_lost", "n1")
    assert freed == ["f-1"]


@pytest.mark.parametrize("handed_over", [True, False])
async def test_a_cancel_answered_starting_then_a_front_restart_asks_the_node_not_never_started(
    tmp_path: Path, handed_over: bool
) -> None:
    # The front said "starting" (handed over), saved the cancel and was killed before the
    # node's answer: restarted, it recorded "cancelled while queued: never started" while
    # the run ran on the node.
    settled = (
        {"ok": True, "node_run_id": "r-1", "state": None, "again": True}
        if handed_over
        else {"ok": False, "never": True, "error": {"code": "never_started", "message": "cancelled before"}}
    )
    agent = _Agent([settled])
    front, index, freed = _front(
        tmp_path, alive=["n1"], lease_node="n1", agents={"n1": agent}, row={"node_id": "n1", "cancel_reason": "user"}
    )
    run = await _resumed(front)
    with trio.fail_after(WAIT_S):
        handed = await front._place_and_hand_off(run)
    row = index.get("f-1")
    index.close()
    assert agent.calls == [("settle", ("f-1",))]
    assert row is not None
    if handed_over:  # the node run, whose stop the mirror sends (a cancelled token, not yet sent)
        assert handed is True and run.node_run_id == "r-1" and not run.cancel_sent and run.token.cancelled
        assert not row["terminal"] and row["node_run_id"] == "r-1" and freed == []
    else:  # the node settled it: it never starts there now
        assert handed is False and (row["state"], row["reason"]) == ("cancelled", "user")
        assert freed == ["f-1"]


async def test_a_real_daemon_stopped_mid_hand_off_runs_the_spawn_once_it_resumes_and_the_agent_says_which(
    tmp_path: Path,
) -> None:
    # What the stand-in daemon above models, against agentd's own daemon: SIGSTOP while a
    # spawn is sent; the agent says `unknown` (not refused), a repeat waits on the same
    # hand-off; SIGCONT: the daemon starts it from its socket's buffer, once, and the
    # agent's next answer is that run.
    import os
    import signal
    import types

    from supervisor.control.client import Client
    from supervisor.fleet._agent import HandOffs, _NodeDaemon, _SpawnMap
    from tests.supervisor.real_daemon import real_daemon

    async with real_daemon(tmp_path / "node") as daemon:
        endpoint = {"url": daemon.url, "token": daemon.token, "pid": daemon.pid}
        agent = types.SimpleNamespace(
            _wait_ready=lambda _timeout: endpoint, _stopping=threading.Event(), state_dir=tmp_path / "node"
        )
        hand_offs = HandOffs(_SpawnMap(tmp_path / "spawns.sqlite3"), _NodeDaemon(agent), answer_s=0.5, poll_s=0.05)
        spec = {"task": "stalled hand-off"}
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            first, second = [await trio.to_thread.run_sync(hand_offs.spawn, "f-1", spec, None, None) for _ in range(2)]
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        with trio.fail_after(WAIT_S):
            while not (reply := await trio.to_thread.run_sync(hand_offs.spawn, "f-1", spec, None, None))["ok"]:
                assert reply["unknown"] is True
        with Client(daemon.url, daemon.token, state_dir=tmp_path / "node") as client:
            runs = await trio.to_thread.run_sync(client.list_runs)
            await trio.to_thread.run_sync(lambda: client.cancel(reply["node_run_id"]))
        agent._stopping.set()
    assert first["unknown"] is True and second["unknown"] is True
    assert [r["id"] for r in runs if r["spec"]["task"] == "stalled hand-off"] == [reply["node_run_id"]]
