"""Node agents: one detached Ray actor per node, pinned there, supervising its agentd daemon.

The agent owns no run: it starts ``agentd serve`` (through ``_bound``, so the daemon gets
SIGTERM, its cancel-everything stop, when the agent dies or its node is lost) with a
node-local state dir, restarts it if it exits on its own, and hands a run's spec to it
on the front's behalf. That hand-off is idempotent per fleet run id (a node-local map in
SQLite): a front that restarts mid-spawn asks again and gets the same node run, never a
second one. ``fleet_up``/``fleet_down`` are the driver side (``agentd fleet up/down``).
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from subagent.osedge import LINUX
from supervisor.config import ENDPOINT_FILE, TOKEN_FILE, default_state_dir
from supervisor.control._statefiles import read_endpoint, read_token
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


def _parent_of(pid: int) -> int | None:
    p = LINUX.stat(pid)
    return p.ppid if p is not None else None


def agent_name(node_id: str) -> str:
    return AGENT_PREFIX + node_id


class _SpawnMap:
    """fleet run id -> node run id, durable on the node: what makes a hand-off idempotent."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS spawns (fleet_run_id TEXT PRIMARY KEY, node_run_id TEXT NOT NULL, at REAL)"
        )

    def get(self, fleet_run_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT node_run_id FROM spawns WHERE fleet_run_id = ?", (fleet_run_id,)).fetchone()
        return None if row is None else str(row[0])

    def put(self, fleet_run_id: str, node_run_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO spawns VALUES (?, ?, ?)", (fleet_run_id, node_run_id, time.time()))


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
        self._local = threading.local()
        self._thread = threading.Thread(target=self._supervise, name="agentd-daemon", daemon=True)
        self._thread.start()
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
        """Hand a run to this node's daemon, once per fleet run id.

        Returns ``{"ok": True, "node_run_id", "state"}`` or ``{"ok": False, "error": {code, message}}``
        (errors as values: they cross Ray intact).
        """
        from supervisor import protocol
        from supervisor.control.client import Client

        known = self._map.get(fleet_run_id)
        if known is not None:
            return {"ok": True, "node_run_id": known, "state": None, "again": True}
        endpoint = self._wait_ready(DAEMON_READY_TIMEOUT_S)
        client: Client | None = getattr(self._local, "client", None)
        if client is None or getattr(self._local, "endpoint", None) != endpoint:
            if client is not None:
                client.close()
            client = Client(endpoint["url"], endpoint["token"], state_dir=self.state_dir)
            self._local.client = client
            self._local.endpoint = endpoint
        try:
            result = client.spawn(spec, session_id=session_id, timeout_s=timeout_s)
        except AgentdError as exc:
            client.close()
            code, message = protocol.error_code_for(exc)
            return {"ok": False, "error": {"code": str(getattr(exc, "code", code)), "message": str(exc)}}
        node_run_id = str(result["run_id"])
        self._map.put(fleet_run_id, node_run_id)
        return {"ok": True, "node_run_id": node_run_id, "state": result.get("state")}

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
