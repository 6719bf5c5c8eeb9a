"""Node agents: one detached Ray actor per node, pinned there, supervising its agentd daemon.

The agent owns no run: it starts ``agentd serve`` (through ``_bound``, so the daemon gets
SIGTERM, its cancel-everything stop, when the agent dies or its node is lost) with a
node-local state dir, restarts it if it exits on its own, and hands a run's spec to it
on the front's behalf. That hand-off is idempotent per fleet run id (a node-local map in
SQLite): a front that restarts mid-spawn asks again and gets the same node run, never a
second one. ``fleet_up``/``fleet_down`` are the driver side (``agentd fleet up/down``).

Size: the agent's two jobs share one actor's state and are kept together: the daemon it
supervises, and the hand-off to that daemon (``HandOffs``: a spawn in flight is reserved,
a stalled daemon's answer is "unknown" and awaited, a lost answer is looked up in the
daemon by its key, the fleet run id), which is most of the length and is what must not be
split from the spawn map.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final, Protocol

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from subagent.osedge import LINUX
from supervisor.config import ENDPOINT_FILE, TOKEN_FILE, default_state_dir
from supervisor.control._statefiles import read_endpoint, read_token
from supervisor.control._wsclient import ConnectionLost
from supervisor.errors import AgentdError
from supervisor.fleet._resources import BROWSER, SLOTS

__all__ = [
    "NAMESPACE",
    "NodeAgent",
    "agent_name",
    "connect",
    "alive_nodes",
    "ensure_agents",
    "list_agents",
    "fleet_down",
]

logger = logging.getLogger(__name__)

NAMESPACE: Final = "agentd"
AGENT_PREFIX: Final = "agentd-node-"
# Bounds a node daemon's start (interpreter, journal, socket) before the agent gives up.
DAEMON_READY_TIMEOUT_S: Final = 60.0
# Poll period while waiting for a daemon to publish its endpoint.
READY_POLL_S: Final = 0.05
# Between restarts of a daemon that exited on its own (the state dir may still be locked
# by the one before, finishing its stop).
RESTART_BACKOFF_S: Final = (0.2, 0.5, 1.0, 2.0, 5.0)
# fleet down: how long an agent waits for its daemon's stop (grace + margin of a
# daemon's shutdown, and more) before it kills it.
STOP_TIMEOUT_S: Final = 60.0
# Threads serving the front's calls on one agent (spawns of a burst run side by side).
AGENT_CONCURRENCY: Final = 32
# How long one spawn call waits for the daemon's answer before it says the outcome is
# not known yet (the hand-off goes on waiting for it; the front asks again).
SPAWN_ANSWER_S: Final = 30.0
# While a spawn's answer is awaited: how often the hand-off looks up from its socket (the
# agent stopping), and asks a daemon whose connection broke for the run its key made.
SPAWN_POLL_S: Final = 1.0


def _parent_of(pid: int) -> int | None:
    p = LINUX.stat(pid)
    return p.ppid if p is not None else None


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id


class _SpawnMap:
    """fleet run id -> node run id, durable on the node: what makes a hand-off idempotent.

    Beside the hand-offs done it keeps those in flight (``pending``: sent to the daemon,
    whose answer has not come: the daemon may yet start the run) and those settled as
    never started (``refused``: a later spawn of that fleet id is refused, so a run the
    front recorded as never started never starts)."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS spawns (fleet_run_id TEXT PRIMARY KEY, node_run_id TEXT NOT NULL, at REAL)"
        )
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS pending (fleet_run_id TEXT PRIMARY KEY, daemon_pid INTEGER, sent_at REAL,"
            " spec TEXT NOT NULL, session_id TEXT, timeout_s REAL)"
        )
        self._db.execute("CREATE TABLE IF NOT EXISTS refused (fleet_run_id TEXT PRIMARY KEY, why TEXT, at REAL)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, fleet_run_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT node_run_id FROM spawns WHERE fleet_run_id = ?", (fleet_run_id,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, fleet_run_id: str, node_run_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR IGNORE INTO spawns VALUES (?, ?, ?)", (fleet_run_id, node_run_id, time.time()))
            self._db.execute("DELETE FROM pending WHERE fleet_run_id = ?", (fleet_run_id,))

    def pend(
        self, fleet_run_id: str, daemon_pid: int | None, spec: dict[str, Any], session_id: str | None,
        timeout_s: float | None,
    ) -> None:  # fmt: skip
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?, ?, ?)",
                (fleet_run_id, daemon_pid, time.time(), json.dumps(spec), session_id, timeout_s),
            )

    def pending(self, fleet_run_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(
                "SELECT daemon_pid, sent_at, spec, session_id, timeout_s FROM pending WHERE fleet_run_id = ?",
                (fleet_run_id,),
            ).fetchone()
        if row is None:
            return None
        return {
            "daemon_pid": row[0], "sent_at": row[1], "spec": json.loads(row[2]), "session_id": row[3],
            "timeout_s": row[4],
        }  # fmt: skip

    def unpend(self, fleet_run_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pending WHERE fleet_run_id = ?", (fleet_run_id,))

    def refuse(self, fleet_run_id: str, why: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO refused VALUES (?, ?, ?)", (fleet_run_id, why, time.time()))

    def refused(self, fleet_run_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT why FROM refused WHERE fleet_run_id = ?", (fleet_run_id,)).fetchone()
        return None if row is None else str(row[0])


class _Conn(Protocol):
    """A websocket to the node's daemon (``supervisor.control._wsclient.WebSocket``)."""

    closed: bool

    def send_text(self, text: str) -> None: ...

    def recv_text(self, timeout_s: float | None) -> str: ...

    def close(self) -> None: ...


class _Daemon(Protocol):
    """What the hand-off needs of the node's daemon (the agent's, or a test's)."""

    def endpoint(self) -> dict[str, Any]:
        """Where the daemon listens: ``{"url", "token", "pid"}``, waiting for it to be ready
        (``AgentdError`` if it is not)."""
        ...

    def serving(self, pid: int | None) -> bool:
        """Whether the daemon process ``pid`` may still act on what it was sent."""
        ...

    def stopping(self) -> bool: ...

    def open(self, endpoint: dict[str, Any]) -> _Conn: ...

    def find(self, endpoint: dict[str, Any], key: str) -> str | None:
        """The run a spawn with this idempotency key made, from the daemon's journal (None:
        no spawn with it made one)."""
        ...


class _Pending:
    """One hand-off in flight: every call for its fleet id waits on this one answer."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: dict[str, Any] | None = None


def _unknown(fleet_run_id: str, waited_s: float) -> dict[str, Any]:
    return {
        "ok": False,
        "unknown": True,
        "error": {
            "code": "spawn_unknown",
            "message": f"run {fleet_run_id}: the node's daemon has not answered its spawn within {waited_s:.0f} s"
            " (it may yet start it): ask again",
        },
    }


def _refused(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}


class HandOffs:
    """The hand-off of runs to the node's daemon, once per fleet run id.

    A fleet id is reserved while its spawn is in flight: a repeat (a restarted front
    asking again) waits for, and gets, the first one's answer. A spawn the daemon has
    been sent is answered ``unknown`` while no answer has come (``{"ok": False,
    "unknown": True}``: the daemon may yet start it, never "refused"); the answer is
    still awaited on its connection, and a later call gets it. The spawn carries the
    fleet run id as its idempotency key (the daemon journals it with the run it makes, in
    one transaction). Where that connection breaks (the daemon died, or the agent did)
    the daemon is asked for the run of that key: found, it is the run (exactly that
    one: two alike runs of one session are never swapped); not found once the daemon that
    was sent it is gone, it never started.
    ``settle`` is the front's question for a run it would cancel: the node run, if it
    was handed over, else the fleet id is refused for good (it never starts here).
    """

    def __init__(
        self, spawn_map: _SpawnMap, daemon: _Daemon, *, answer_s: float = SPAWN_ANSWER_S, poll_s: float = SPAWN_POLL_S
    ) -> None:
        self._map = spawn_map
        self._daemon = daemon
        self._answer_s = answer_s
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._inflight: dict[str, _Pending] = {}

    def spawn(
        self, fleet_run_id: str, spec: dict[str, Any], session_id: str | None, timeout_s: float | None
    ) -> dict[str, Any]:
        return self._ask(fleet_run_id, (spec, session_id, timeout_s))

    def settle(self, fleet_run_id: str) -> dict[str, Any]:
        return self._ask(fleet_run_id, None)

    def _ask(self, fleet_run_id: str, spawn: tuple[dict[str, Any], str | None, float | None] | None) -> dict[str, Any]:
        with self._lock:
            known = self._map.get(fleet_run_id)
            if known is not None:
                return {"ok": True, "node_run_id": known, "state": None, "again": True}
            why = self._map.refused(fleet_run_id)
            if why is not None:
                return {**_refused("never_started", why), "never": True}
            pending = self._inflight.get(fleet_run_id)
            if pending is None:
                pending = self._inflight[fleet_run_id] = _Pending()
                sent = self._map.pending(fleet_run_id)
                if sent is not None:  # sent by an agent before this one: what came of it?
                    work = functools.partial(self._recover, fleet_run_id, pending, sent, again=spawn is not None)
                elif spawn is not None:
                    work = functools.partial(self._hand_off, fleet_run_id, pending, *spawn)
                else:  # never sent: it never starts here now
                    self._map.refuse(fleet_run_id, "cancelled before it reached the node")
                    del self._inflight[fleet_run_id]
                    return {**_refused("never_started", "cancelled before it reached the node"), "never": True}
                threading.Thread(target=work, name=f"hand-off {fleet_run_id}", daemon=True).start()
        if pending.done.wait(self._answer_s):
            assert pending.reply is not None
            return pending.reply
        return _unknown(fleet_run_id, self._answer_s)

    def _answer(self, fleet_run_id: str, pending: _Pending, reply: dict[str, Any]) -> None:
        with self._lock:
            self._inflight.pop(fleet_run_id, None)
            pending.reply = reply
            pending.done.set()

    def _hand_off(
        self,
        fleet_run_id: str,
        pending: _Pending,
        spec: dict[str, Any],
        session_id: str | None,
        timeout_s: float | None,
    ) -> None:
        from supervisor import protocol

        try:
            endpoint = self._daemon.endpoint()
            conn = self._daemon.open(endpoint)
        except (OSError, AgentdError) as exc:  # nothing was sent
            code, _message = protocol.error_code_for(exc) if isinstance(exc, AgentdError) else ("refused", "")
            self._answer(fleet_run_id, pending, _refused(str(getattr(exc, "code", code)), str(exc)))
            return
        # Durable before it is sent: from here the daemon may start the run.
        self._map.pend(fleet_run_id, endpoint.get("pid"), spec, session_id, timeout_s)
        try:
            try:
                conn.send_text(
                    protocol.encode_request(
                        1, "spawn", spec=spec, session_id=session_id, timeout_s=timeout_s, key=fleet_run_id
                    )
                )
            except ConnectionLost as exc:  # not (wholly) sent: the daemon cannot act on it
                self._map.unpend(fleet_run_id)
                self._answer(fleet_run_id, pending, _refused(str(exc.code), str(exc)))
                return
            while True:
                try:
                    text = conn.recv_text(self._poll_s)
                except ConnectionLost:
                    if conn.closed:
                        break  # the daemon went away: its journal says what came of it
                    if self._daemon.stopping():
                        self._answer(fleet_run_id, pending, _unknown(fleet_run_id, self._answer_s))
                        return
                    continue  # no answer yet (a daemon stopped, or slow): keep waiting for it
                try:
                    msg = protocol.decode_server_message(text)
                except AgentdError:
                    continue
                if msg.get("id") != 1 or "ok" not in msg:
                    continue
                if msg["ok"] is True:
                    result = msg.get("result") or {}
                    node_run_id = str(result["run_id"])
                    self._map.put(fleet_run_id, node_run_id)
                    self._answer(
                        fleet_run_id, pending, {"ok": True, "node_run_id": node_run_id, "state": result.get("state")}
                    )
                else:  # the daemon refused it: nothing started
                    self._map.unpend(fleet_run_id)
                    error = msg.get("error") or {}
                    self._answer(
                        fleet_run_id, pending, _refused(str(error.get("code", "refused")), str(error.get("message")))
                    )
                return
        finally:
            conn.close()
        sent = self._map.pending(fleet_run_id)
        assert sent is not None
        self._recover(fleet_run_id, pending, sent, again=True)

    def _recover(self, fleet_run_id: str, pending: _Pending, sent: dict[str, Any], *, again: bool) -> None:
        """What came of a spawn whose answer was lost with its connection: the daemon's
        run of its key (the fleet run id)."""
        while not self._daemon.stopping():
            gone = not self._daemon.serving(sent["daemon_pid"])  # before the key is looked up
            try:
                endpoint = self._daemon.endpoint()
                found = self._daemon.find(endpoint, fleet_run_id)
            except (OSError, AgentdError) as exc:
                logger.info("run %s: cannot ask the daemon for it yet: %r", fleet_run_id, exc)
            else:
                if found is not None:
                    self._map.put(fleet_run_id, found)
                    self._answer(
                        fleet_run_id, pending, {"ok": True, "node_run_id": found, "state": None, "again": True}
                    )
                    return
                if gone:  # that daemon is gone, and no daemon since has the run: it never started
                    self._map.unpend(fleet_run_id)
                    if again:
                        self._hand_off(fleet_run_id, pending, sent["spec"], sent["session_id"], sent["timeout_s"])
                    else:
                        why = "cancelled before it reached the node (its daemon died before it started it)"
                        self._map.refuse(fleet_run_id, why)
                        self._answer(fleet_run_id, pending, {**_refused("never_started", why), "never": True})
                    return
            time.sleep(self._poll_s)
        self._answer(fleet_run_id, pending, _unknown(fleet_run_id, self._answer_s))


class _NodeDaemon:
    """The agent's daemon as ``HandOffs`` sees it."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def endpoint(self) -> dict[str, Any]:
        return dict(self._agent._wait_ready(DAEMON_READY_TIMEOUT_S))

    def serving(self, pid: int | None) -> bool:
        # The daemon sent it may act on it while that process lives (a stopped one too).
        return pid is not None and LINUX.stat(pid) is not None

    def stopping(self) -> bool:
        return bool(self._agent._stopping.is_set())

    def open(self, endpoint: dict[str, Any]) -> _Conn:
        from supervisor.control._wsclient import WebSocket
        from supervisor.control.client import CONNECT_TIMEOUT_S

        return WebSocket.connect(endpoint["url"], {"Authorization": f"Bearer {endpoint['token']}"}, CONNECT_TIMEOUT_S)

    def find(self, endpoint: dict[str, Any], key: str) -> str | None:
        from supervisor.control.client import Client

        with Client(endpoint["url"], endpoint["token"], state_dir=self._agent.state_dir) as client:
            runs = client.list_runs(key=key, limit=1)
        return str(runs[0]["id"]) if runs else None


# Ray's keyword overload of remote() is typed for tasks; max_concurrency is an actor option.
@ray.remote(num_cpus=0, max_concurrency=AGENT_CONCURRENCY, max_restarts=-1)  # type: ignore[call-overload]
class NodeAgent:
    """Supervises this node's agentd daemon. Methods run in the actor's thread pool."""

    def __init__(self, node_root: str | None) -> None:
        ctx = ray.get_runtime_context()
        self.node_id: str = ctx.get_node_id()
        self.ip: str = ray.util.get_node_ip_address()
        mine = next((n for n in ray.nodes() if n["NodeID"] == self.node_id), None)
        resources: dict[str, float] = dict(mine["Resources"]) if mine else {}
        self.slots = int(resources.get(SLOTS, 0))
        self.browser = int(resources.get(BROWSER, 0))
        root = Path(node_root) if node_root else default_state_dir() / "fleet-nodes"
        self.state_dir = root / f"node-{self.node_id[:16]}"
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._map = _SpawnMap(self.state_dir / "fleet-spawns.sqlite3")
        self._stopping = threading.Event()
        self._changed = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._endpoint: dict[str, Any] | None = None
        self._failure: str | None = None
        self._restarts = 0
        self._thread = threading.Thread(target=self._supervise, name="agentd-daemon", daemon=True)
        self._thread.start()
        self._hand_offs = HandOffs(self._map, _NodeDaemon(self))
        self._wait_ready(DAEMON_READY_TIMEOUT_S)

    # -------------------------------------------------------------- the daemon

    def _argv(self) -> list[str]:
        cmd = [sys.executable, "-m", "supervisor", "--state-dir", str(self.state_dir), "serve", "--host", self.ip]
        if self.slots > 0:
            cmd += ["--max-concurrent", str(self.slots)]
        # The babysitter's death signal is armed for the thread that forks it: this one,
        # which lives as long as the agent supervises.
        return [sys.executable, "-m", "supervisor.fleet._bound", str(os.getpid()), "--", *cmd]

    def _supervise(self) -> None:
        backoff = iter(RESTART_BACKOFF_S)
        while not self._stopping.is_set():
            log = open(self.state_dir / "daemon.log", "ab")
            try:
                proc = subprocess.Popen(
                    self._argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                )
            finally:
                log.close()
            with self._changed:
                self._proc = proc
                self._endpoint = None
                self._changed.notify_all()
            endpoint = self._await_endpoint(proc)
            with self._changed:
                self._endpoint = endpoint
                if endpoint is None and proc.poll() is not None:
                    self._failure = (
                        f"agentd serve exited with code {proc.returncode} (see {self.state_dir / 'daemon.log'})"
                    )
                self._changed.notify_all()
            if endpoint is not None:
                backoff = iter(RESTART_BACKOFF_S)
            code = proc.wait()
            with self._changed:
                self._endpoint = None
                self._changed.notify_all()
            if self._stopping.is_set():
                return
            self._restarts += 1
            delay = next(backoff, RESTART_BACKOFF_S[-1])
            logger.warning("node %s: agentd daemon exited with %s; restarting in %.1f s", self.node_id[:8], code, delay)
            if self._stopping.wait(delay):
                return

    def _await_endpoint(self, proc: subprocess.Popen[bytes]) -> dict[str, Any] | None:
        deadline = time.monotonic() + DAEMON_READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping.is_set():
            if proc.poll() is not None:
                return None
            try:
                info = read_endpoint(self.state_dir / ENDPOINT_FILE)
                pid = info.get("pid")
                # The daemon is the babysitter's child (see _bound).
                if isinstance(pid, int) and _parent_of(pid) == proc.pid:
                    return {"url": info["url"], "token": read_token(self.state_dir / TOKEN_FILE), "pid": pid}
            except (OSError, ValueError):
                pass
            time.sleep(READY_POLL_S)  # a file another process writes: nothing to wait on
        return None

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._endpoint is None:
                if self._failure is not None and self._restarts == 0:
                    raise AgentdError(f"node {self.node_id[:8]}: {self._failure}")
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    raise AgentdError(f"node {self.node_id[:8]}: agentd daemon not ready within {timeout_s} s")
                self._changed.wait(min(left, 1.0))
            return dict(self._endpoint)

    # -------------------------------------------------------------- the front's calls

    def info(self) -> dict[str, Any]:
        """Where this node's daemon listens, its token and what the node offers."""
        endpoint = self._wait_ready(DAEMON_READY_TIMEOUT_S)
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "state_dir": str(self.state_dir),
            "slots": self.slots,
            "browser": self.browser,
            "agent_pid": os.getpid(),
            "restarts": self._restarts,
            **endpoint,
        }

    def spawn(
        self, fleet_run_id: str, spec: dict[str, Any], session_id: str | None, timeout_s: float | None
    ) -> dict[str, Any]:
        """Hand a run to this node's daemon, once per fleet run id (see ``HandOffs``).

        Returns ``{"ok": True, "node_run_id", "state"}``, ``{"ok": False, "error": {code,
        message}}`` (it never started here), or ``{"ok": False, "unknown": True, ...}``: the
        daemon was sent it and has not answered yet; ask again (errors as values: they
        cross Ray intact).
        """
        return self._hand_offs.spawn(fleet_run_id, spec, session_id, timeout_s)

    def settle(self, fleet_run_id: str) -> dict[str, Any]:
        """For a run the front would cancel: its node run if it was handed to the daemon
        (``ok``), else ``{"ok": False, "never": True}`` and the fleet id is refused here
        from now on, or ``unknown`` while a hand-off's answer is awaited."""
        return self._hand_offs.settle(fleet_run_id)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """Stop the daemon the way ``systemctl stop`` does: SIGTERM, and wait for its exit."""
        self._stopping.set()
        with self._changed:
            proc = self._proc
            self._changed.notify_all()
        if proc is None:
            return {"node_id": self.node_id, "exit_code": None}
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("node %s: agentd daemon ignored SIGTERM for %.0f s; killing it", self.node_id[:8], timeout_s)
            proc.kill()
            code = proc.wait()
        self._thread.join(5.0)
        return {"node_id": self.node_id, "exit_code": code, "pid": proc.pid}


# ------------------------------------------------------------------ the driver side


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (Ray's forms: ``auto``, ``host:port``, ...) as a driver."""
    if ray.is_initialized():
        return
    ray.init(
        address=address or "auto",
        namespace=NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
        include_dashboard=False,
    )


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's live nodes: ``{"node_id", "ip", "resources"}``."""
    return [
        {"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"), "resources": dict(n.get("Resources") or {})}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def agent_for(node_id: str, node_root: str | None) -> Any:
    """The node's agent, started (pinned to that node, detached) if it has none."""
    return NodeAgent.options(  # type: ignore[attr-defined]
        name=agent_name(node_id),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_root)


# In Ray's own key-value store (the cluster's, as the agents are): set by `fleet down`,
# cleared by `fleet up`. While it is set a front starts no agent and takes no run.
_DOWN_KEY: Final = b"fleet-down"


def mark_down(down: bool) -> None:
    """Say (in the cluster) that the fleet was taken down, or is up again."""
    if down:
        internal_kv._internal_kv_put(_DOWN_KEY, str(time.time()).encode(), overwrite=True, namespace=NAMESPACE)
    else:
        internal_kv._internal_kv_del(_DOWN_KEY, namespace=NAMESPACE)


def down_since() -> float | None:
    """When `fleet down` took the fleet down (wall clock), or None while it is up."""
    value = internal_kv._internal_kv_get(_DOWN_KEY, namespace=NAMESPACE)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return 0.0


def ensure_agents(node_root: str | None = None, *, timeout_s: float = DAEMON_READY_TIMEOUT_S) -> list[dict[str, Any]]:
    """One agent (and so one daemon) on every live node; returns their ``info()``. The
    fleet is up from now on (``mark_down``)."""
    mark_down(False)
    agents = [agent_for(n["node_id"], node_root) for n in alive_nodes()]
    return list(ray.get([a.info.remote() for a in agents], timeout=timeout_s))


def list_agents() -> list[tuple[str, Any]]:
    """``(node_id, handle)`` of every live agent in the cluster."""
    out = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and str(entry.get("name", "")).startswith(AGENT_PREFIX):
            name = entry["name"]
            try:
                out.append((name[len(AGENT_PREFIX) :], ray.get_actor(name, namespace=NAMESPACE)))
            except ValueError:
                continue  # gone meanwhile
    return out


def fleet_down(timeout_s: float = STOP_TIMEOUT_S) -> list[dict[str, Any]]:
    """Stop every node's daemon (cancel-everything, as ``systemctl stop``), then its agent.
    The fleet stays down (``mark_down``) until ``ensure_agents`` (`fleet up`): a front
    neither starts the agents again nor takes runs it could only fail."""
    mark_down(True)
    agents = list_agents()
    refs = {node_id: agent.stop.remote(timeout_s) for node_id, agent in agents}
    out: list[dict[str, Any]] = []
    for node_id, agent in agents:
        try:
            out.append(ray.get(refs[node_id], timeout=timeout_s + 10))
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a dead node: nothing to stop there
            out.append({"node_id": node_id, "exit_code": None, "error": str(exc)})
        ray.kill(agent, no_restart=True)
    return out
