"""The fleet front: one control surface for runs on many nodes, placed by Ray.

It implements the control socket's ``Backend`` (``supervisor.protocol``), so the same
websocket server (``supervisor.control.server``), token and Origin rules, CLI and clients work
unchanged. A spawn gets a fleet-unique id and a lease: a detached Ray placement group
holding the run's demand (``_resources``). Ray's scheduler picks the node or queues it;
once placed, the node's agent hands the run to that node's daemon (idempotent per fleet
id), and the front mirrors the run's events into its index as they stream. The lease is
removed when the run is terminal, which frees its slot for the next queued run.

Invariants: a cancel while queued means the run never reaches a node (the hand-off
happens only after placement, in the same task that checks the cancel token); a cancel
of a placed run goes to its node, whose contract (both paths, grace, receipt) is the
stop; a run's terminal fact is written once in the index (compare-and-set), whether it
came from its node or from Ray reporting the node dead (``lost``, with the last mirrored
snapshot as its partial result); a front restarted from its index resumes every run:
queued ones wait on their lease again, placed ones resubscribe after their last seq.

Sessions (conversations): a session's turns go to the node that holds its history and
browser profile (the node of its latest turn, pinned through Ray's ``node:<ip>``
resource), one live turn at a time here as on the node (``session_busy``, or
``interrupt``: the live turn is cancelled and waited for). ``approve``/``deny`` go to the
run's node; ``history`` and ``session_close`` to the session's node (run ids mapped back
to the fleet's); ``sessions`` is read from the front's index.

Size: the front is the fleet's ``Backend``: one method per control op, each routing to a
node; the placement, index and node links already live in their own modules.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import ray
import trio
from ray.util.placement_group import (
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from supervisor.config import Config
from supervisor.core.sessions import SessionNotFound
from supervisor.core.token import CancelToken
from supervisor.errors import ControlProtocolError, RunNotFound, SpawnError
from supervisor.fleet._agent import NAMESPACE, agent_for, agent_name, alive_nodes, down_since
from supervisor.fleet._index import Index
from supervisor.fleet._nodelink import LinkDown, NodeLink
from supervisor.fleet._resources import split_demand
from supervisor.protocol import ErrorCode
from supervisor.states import TERMINAL_STATES

__all__ = ["FleetFront", "LEASE_PREFIX"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_PREFIX: Final = "agentd-lease-"
# How often Ray's node table is read: bounds how late a dead node's runs turn lost
# (on top of Ray's own health checks) and a new node gets its agent.
NODE_POLL_S: Final = 0.5
# Between attempts to reach a node whose socket dropped while Ray still says it lives.
RELINK_BACKOFF_S: Final = (0.1, 0.2, 0.5, 1.0, 2.0)
# Threads for blocking Ray calls (placement group creation, actor lookups, node table).
RAY_THREADS: Final = 8
# Events buffered per subscriber of the front; a slower one is dropped (it resumes).
SUBSCRIBER_BUFFER: Final = 4096
# Bounds a node agent's start (its daemon's start included) when a node joins.
AGENT_START_TIMEOUT_S: Final = 90.0
# A session's next turn asks for this much of its node's own ``node:<ip>`` resource (each
# node has 1.0 of it): pins the turn there without using anything up.
NODE_AFFINITY: Final = 0.001
# Margin on top of the config's grace for an interrupted session turn to end (seconds).
INTERRUPT_MARGIN_S: Final = 10.0
# A run whose node's agent is gone (no such actor: `fleet down` killed it for good) while
# Ray still lists the node: after the config's grace plus this margin with no agent, a run
# whose terminal fact never reached the front is `lost` (its daemon got SIGTERM with its
# agent, and nothing can reach that daemon any more). Without a bound it was retried forever.
AGENT_GONE_MARGIN_S: Final = 10.0
# Runs of the index read to list sessions (the newest).
SESSION_SCAN_LIMIT: Final = 1000


@dataclass(eq=False)
class _Run:
    id: str
    session_id: str | None
    spec: dict[str, Any]
    bundle: dict[str, float]
    timeout_s: float | None
    token: CancelToken
    state: str = "queued"
    node_id: str | None = None
    node_run_id: str | None = None
    last_seq: int = 0
    cancel_sent: bool = False
    node_final: dict[str, Any] | None = None  # the node's terminal state event, once mirrored
    handed_over: bool = False  # its spawn went to its node's agent (a cancel then goes there too)
    pg: Any = None
    queue_scope: trio.CancelScope | None = None
    scope: trio.CancelScope | None = None
    subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = field(default_factory=set)
    done: trio.Event = field(default_factory=trio.Event)


async def _await_ref(ref: Any) -> Any:
    """The value of a Ray ObjectRef, waited for without holding a thread."""
    future = ref.future()
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_f: Any) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    future.add_done_callback(wake)
    await done.wait()
    return future.result()


def _lease(name: str, bundle: dict[str, float]) -> Any:
    """The run's placement group: found by name (a restarted front), else created."""
    try:
        return get_placement_group(name)
    except ValueError:
        return placement_group([bundle], strategy="STRICT_PACK", name=name, lifetime="detached")


def _lease_node(pg: Any) -> str:
    return str(placement_group_table(pg)["bundles_to_node_id"][0])


class AgentGone(LinkDown):
    """Ray has no agent for the node (killed for good): nothing can reach its daemon."""


class FleetFront:
    """The fleet's ``Backend``: routes each operation to the run's node, or answers from the index."""

    def __init__(self, config: Config, index: Index, *, node_root: str | None = None) -> None:
        self.config = config
        self.index = index
        self.node_root = node_root
        # How long a run may wait on a node without an agent before it is `lost`.
        self.agent_gone_s = config.grace_s + AGENT_GONE_MARGIN_S
        self._live: dict[str, _Run] = {}
        self._links: dict[str, NodeLink] = {}
        self._link_locks: dict[str, trio.Lock] = {}
        self._nodes: dict[str, dict[str, Any]] = {}  # alive per Ray: node_id -> {ip, resources}
        self._dead: set[str] = set()
        self._agents: dict[str, dict[str, Any]] = {}  # node_id -> agent info
        self._down: float | None = None  # when `fleet down` took the fleet down, while it is
        self._agent_starting: set[str] = set()
        self._db_limiter = trio.CapacityLimiter(1)
        self._ray_limiter = trio.CapacityLimiter(RAY_THREADS)
        self._nursery: trio.Nursery | None = None
        self._accepting = False
        self._session_locks: dict[str, trio.Lock] = {}

    # ------------------------------------------------------------------ plumbing

    async def _db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=self._db_limiter)

    async def _ray(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await trio.to_thread.run_sync(
            functools.partial(fn, *args, **kwargs), limiter=self._ray_limiter, abandon_on_cancel=True
        )

    # ------------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Resume every run of the index, watch Ray's nodes, serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self._refresh_nodes()
            for row in await self._db(self.index.live):
                self._resume(row)
            await self._free_ended_leases()
            nursery.start_soon(self._watch_nodes)
            self._accepting = True
            task_status.started()
            await trio.sleep_forever()

    def _resume(self, row: dict[str, Any]) -> None:
        assert self._nursery is not None
        run = _Run(
            id=row["id"],
            session_id=row["session_id"],
            spec=row["spec"],
            bundle=row["bundle"],
            timeout_s=row["timeout_s"],
            token=CancelToken(row["id"]),
            state=row["state"],
            node_id=row["node_id"],
            node_run_id=row["node_run_id"],
            last_seq=row["last_seq"],
        )
        if row["cancel_reason"]:
            run.token.cancel(row["cancel_reason"])
        # Recorded on a node (written before any hand-off): the run may be there.
        run.handed_over = run.node_id is not None
        self._live[run.id] = run
        logger.info("fleet: resuming run %s (%s, node %s)", run.id, run.state, (run.node_id or "-")[:8])
        self._nursery.start_soon(self._drive, run, name=f"fleet run {run.id}")

    async def _free_ended_leases(self) -> None:
        """A front killed between a run's terminal fact and freeing its lease left the
        lease (a detached placement group) holding a slot for good: free those of runs the
        index has ended. Only this front's runs: a lease it does not know is left alone."""
        try:
            table = await self._ray(placement_group_table)
        except ray.exceptions.RayError as exc:
            logger.warning("fleet: cannot read the placement groups: %r", exc)
            return
        for info in table.values():
            name = str(info.get("name") or "")
            if not name.startswith(LEASE_PREFIX) or info.get("state") == "REMOVED":
                continue
            run_id = name[len(LEASE_PREFIX) :]
            if run_id in self._live:
                continue
            row = await self._db(self.index.get, run_id)
            if row is None or row["state"] not in TERMINAL_STATES:
                continue
            logger.info("fleet: run %s ended without its lease freed (a front killed then): freeing it", run_id)
            try:
                await self._ray(remove_placement_group, await self._ray(get_placement_group, name))
            except (ValueError, ray.exceptions.RayError) as exc:
                logger.warning("fleet: run %s: could not remove its lease: %r", run_id, exc)

    async def _watch_nodes(self) -> None:
        while True:
            await trio.sleep(NODE_POLL_S)
            try:
                await self._refresh_nodes()
            except Exception:
                logger.exception("fleet: reading Ray's node table failed")

    async def _refresh_nodes(self) -> None:
        assert self._nursery is not None
        nodes = {n["node_id"]: n for n in await self._ray(alive_nodes)}
        gone = [n for n in self._nodes if n not in nodes]
        self._nodes = nodes
        for node_id in gone:
            await self._node_lost(node_id)
        # A run left on a node that died while no front watched (or never seen alive).
        for run in list(self._live.values()):
            if run.node_id is not None and run.node_id not in nodes:
                await self._node_lost(run.node_id)
        down = await self._ray(down_since)
        if down is not None:
            if self._down is None:
                logger.warning("fleet: the fleet is down (`agentd fleet down`): no agent is started, no run taken")
            self._down = down
            return
        self._down = None
        for node_id in nodes:
            if node_id not in self._agents and node_id not in self._agent_starting:
                self._agent_starting.add(node_id)
                self._nursery.start_soon(self._start_agent, node_id)

    async def _start_agent(self, node_id: str) -> None:
        """A node that joined gets its agent (and daemon), as ``fleet up`` gives one to every node."""
        try:
            info = await self._ray(
                lambda: ray.get(agent_for(node_id, self.node_root).info.remote(), timeout=AGENT_START_TIMEOUT_S)
            )
            self._agents[node_id] = info
            logger.info("fleet: node %s has its agentd at %s", node_id[:8], info["url"])
        except Exception as exc:  # a task root: the next round tries again
            logger.warning("fleet: could not start an agent on node %s: %r", node_id[:8], exc)
        finally:
            self._agent_starting.discard(node_id)

    # ------------------------------------------------------------------ nodes

    async def _link(self, node_id: str) -> NodeLink:
        """An open connection to the node's daemon (reconnecting, re-reading where it listens)."""
        link = self._links.get(node_id)
        if link is not None and not link.closed.is_set():
            return link
        if node_id in self._dead:
            raise LinkDown(f"node {node_id[:8]} is dead")
        lock = self._link_locks.setdefault(node_id, trio.Lock())
        async with lock:
            link = self._links.get(node_id)
            if link is not None and not link.closed.is_set():
                return link
            try:
                handle = await self._ray(ray.get_actor, agent_name(node_id), namespace=NAMESPACE)
            except ValueError as exc:  # no such actor: not one restarting (they restart forever)
                raise AgentGone(f"node {node_id[:8]} has no agentd agent: {exc}") from exc
            try:
                info = await _await_ref(handle.info.remote())
            except ray.exceptions.RayError as exc:
                raise LinkDown(f"no agentd agent answers on node {node_id[:8]}: {exc}") from exc
            self._agents[node_id] = info
            link = NodeLink(node_id, info["url"], info["token"])
            assert self._nursery is not None
            await self._nursery.start(self._run_link, link)
            self._links[node_id] = link
            return link

    async def _run_link(self, link: NodeLink, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await link.run(task_status=task_status)
        except LinkDown:
            raise
        except Exception:
            logger.exception("fleet: connection to node %s failed", link.node_id[:8])

    async def _node_dead_now(self, node_id: str) -> bool:
        """Ask Ray again (a socket just failed): is the node dead?"""
        if node_id in self._dead:
            return True
        alive = {n["node_id"] for n in await self._ray(alive_nodes)}
        if node_id not in alive:
            await self._node_lost(node_id)
            return True
        return False

    async def _node_lost(self, node_id: str) -> None:
        """Ray reports the node dead: each of its live runs becomes ``lost``, once."""
        first = node_id not in self._dead
        self._dead.add(node_id)
        self._nodes.pop(node_id, None)
        self._agents.pop(node_id, None)
        link = self._links.pop(node_id, None)
        if link is not None:
            link.close()
        runs = [r for r in self._live.values() if r.node_id == node_id]
        if first:
            logger.warning("fleet: node %s is dead; %d run(s) lost", node_id[:8], len(runs))
        for run in runs:
            await self._finish_lost(run, node_id)

    async def _finish_lost(
        self,
        run: _Run,
        node_id: str,
        *,
        reason: str = "node_lost",
        message: str | None = None,
    ) -> None:
        """The run is ``lost``, its last mirrored snapshot its partial result.

        Its drive is cancelled; the fact is written shielded, so this may be called from
        that drive itself (its mirror finding the node dead or without an agent).
        """
        if run.scope is not None:
            run.scope.cancel(reason=f"node {node_id[:8]}: {reason}")
        if run.node_final is not None:
            # The node told its outcome before it went: that is the run's one terminal
            # fact, not `lost` written after it.
            with trio.CancelScope(shield=True):
                await self._conclude_from_event(run)
            return
        with trio.CancelScope(shield=True):
            row = await self._db(self.index.get, run.id)
            partial = row["partial_snapshot"] if row else None
            now = time.time()
            data = {"state": "lost", "reason": reason, "partial": partial is not None, "node": node_id}
            ok = await self._db(
                self.index.finish,
                run.id,
                "lost",
                reason=reason,
                ended_at=now,
                result=partial,
                partial=partial is not None,
                error={"code": reason, "message": message or f"node {node_id} died (Ray reported it dead)"},
                event={"kind": "state", "data": data},
            )
            if ok:
                run.last_seq += 1
                run.state = "lost"
                self._fan_out(run, {"run_id": run.id, "seq": run.last_seq, "ts": now, "kind": "state", "data": data})
            await self._release(run)

    # ------------------------------------------------------------------ a run's life

    async def _drive(self, run: _Run) -> None:
        try:
            with trio.CancelScope() as run.scope:
                if run.node_run_id is None and not await self._place_and_hand_off(run):
                    return
                await self._mirror(run)
        except Exception as exc:
            logger.exception("fleet: run %s: supervision failed", run.id)
            await self._finish_here(run, "failed", reason="internal", error={"code": "internal", "message": repr(exc)})

    async def _place_and_hand_off(self, run: _Run) -> bool:
        """Wait for Ray to place the lease, then hand the run to that node. False: it ended here.

        The run's node is written to the index before the hand-off, so a run without one
        never reached a node. A run with one (a front before this one recorded it) may be
        on that node, and only there: it is asked there by its fleet id, never handed to
        wherever its lease is now (a dead node's lease moves to a live one; the run is
        lost with its node).
        """
        run.pg = await self._ray(_lease, LEASE_PREFIX + run.id, run.bundle)
        if run.node_id is None:
            with trio.CancelScope() as run.queue_scope:
                if not run.token.cancelled:
                    await _await_ref(run.pg.ready())
            run.queue_scope = None
            if run.token.cancelled:
                await self._finish_queued_cancel(run)
                return False
            node_id = await self._ray(_lease_node, run.pg)
            run.node_id = node_id
            await self._db(self.index.set_node, run.id, node_id)
        else:
            node_id = run.node_id
        if node_id in self._dead or node_id not in self._nodes and await self._node_dead_now(node_id):
            # Its node died (before this drive looked, maybe before the node was on the
            # run's record: then no one wrote its end): it is lost with it.
            if run.id in self._live:
                await self._finish_lost(run, node_id)
            return False
        reply = await self._ask_node(run, node_id)
        if reply is None:
            return False
        run.node_run_id = str(reply["node_run_id"])
        await self._db(self.index.set_node_run, run.id, run.node_run_id)
        logger.info("fleet: run %s is %s on node %s", run.id, run.node_run_id, node_id[:8])
        return True

    async def _ask_node(self, run: _Run, node_id: str) -> dict[str, Any] | None:
        """Hand the run to its node's agent, or (cancelled) settle it there; None: it ended here.

        An answer the node cannot give yet (its daemon was sent the spawn and has not
        answered: stalled, or restarting) is asked again, by the fleet id, until it comes:
        the lease is held all that time, as the node may yet run it. Only a node that
        says the run never started there (refused, or settled as never started) ends it
        here; a node that dies makes it lost.
        """
        delays = iter(RELINK_BACKOFF_S)
        gone_since: float | None = None
        while True:
            try:
                handle = await self._ray(ray.get_actor, agent_name(node_id), namespace=NAMESPACE)
            except ValueError as exc:
                if await self._node_dead_now(node_id):
                    return None
                if not run.handed_over:  # nothing was sent: it never started there
                    await self._finish_here(
                        run,
                        "failed",
                        reason="no_agent",
                        error={"code": "no_agent", "message": f"node {node_id[:8]}: {exc}"},
                    )
                    return None
                now = trio.current_time()
                gone_since = now if gone_since is None else gone_since
                if now - gone_since >= self.agent_gone_s:
                    await self._finish_lost(
                        run,
                        node_id,
                        reason="agent_gone",
                        message=f"node {node_id} has had no agentd agent for {self.agent_gone_s:.0f} s while its"
                        " hand-off of the run was unsettled (its daemon gets SIGTERM when its agent goes)",
                    )
                    return None
            else:
                gone_since = None
                if run.token.cancelled and not run.handed_over:
                    # A cancel came while the lease was read: the run is still queued here, as
                    # that cancel's reply said, and never reaches the node.
                    await self._finish_queued_cancel(run)
                    return None
                ref: Any
                if run.token.cancelled:  # it may be there: the node run to stop, or never to start
                    ref = handle.settle.remote(run.id)
                else:
                    ref = handle.spawn.remote(run.id, run.spec, run.session_id, run.timeout_s)
                run.handed_over = True  # (with the check above: no await between them)
                try:
                    reply = await _await_ref(ref)
                except ray.exceptions.RayError as exc:
                    if await self._node_dead_now(node_id):
                        return None
                    # The agent failed mid-call (Ray restarts it): the spawn may have reached
                    # its daemon. Its durable record of the hand-off answers the next ask.
                    logger.warning("fleet: run %s: node %s's agent failed mid-hand-off: %r", run.id, node_id[:8], exc)
                else:
                    if reply.get("ok"):
                        return dict(reply)
                    if not reply.get("unknown"):  # the node says it never started there
                        if run.token.cancelled:
                            await self._finish_queued_cancel(run)
                        else:
                            error = reply.get("error") or {}
                            await self._finish_here(run, "failed", reason="refused_by_node", error=error)
                        return None
                    logger.warning("fleet: run %s: %s", run.id, (reply.get("error") or {}).get("message"))
            await trio.sleep(next(delays, RELINK_BACKOFF_S[-1]))

    async def _finish_queued_cancel(self, run: _Run) -> None:
        await self._finish_here(
            run,
            "cancelled",
            reason=run.token.reason,
            receipt={"note": "cancelled while queued in the fleet: never started", "cancel_reason": run.token.reason},
        )

    async def _mirror(self, run: _Run) -> None:
        """Follow the run on its node into the index, until its terminal fact."""
        assert run.node_id is not None and run.node_run_id is not None
        delays = iter(RELINK_BACKOFF_S)
        unreachable = 0
        agent_gone_since: float | None = None  # trio time the node was first found without an agent
        while True:
            try:
                link = await self._link(run.node_id)
                agent_gone_since = None
                if run.token.cancelled and not run.cancel_sent:
                    await link.request("cancel", run_id=run.node_run_id, reason=run.token.reason)
                    run.cancel_sent = True
                async with link.subscribe(run.node_run_id, run.last_seq) as messages:
                    delays = iter(RELINK_BACKOFF_S)
                    async for msg in messages:
                        if msg.get("op") == "event":
                            await self._on_event(run, msg)
                        elif msg.get("op") == "end" and msg.get("state") is not None:
                            await self._conclude(run, link)
                            return
                        else:
                            break  # the node could not go on: subscribe again
            except RunNotFound:
                await self._finish_here(
                    run,
                    "lost",
                    reason="unknown_to_node",
                    error={
                        "code": "unknown_to_node",
                        "message": f"node {run.node_id[:8]} has no run {run.node_run_id!r}",
                    },
                )
                return
            except LinkDown as exc:
                if await self._node_dead_now(run.node_id):
                    return
                unreachable += 1
                if run.node_final is not None and unreachable > len(RELINK_BACKOFF_S):
                    # Its node wrote the terminal fact and then went away for good (its
                    # daemon stopped: `agentd fleet down`): the fact stands, without the
                    # details only a status from the node would add.
                    await self._conclude_from_event(run)
                    return
                if isinstance(exc, AgentGone):
                    now = trio.current_time()
                    agent_gone_since = now if agent_gone_since is None else agent_gone_since
                    if now - agent_gone_since >= self.agent_gone_s:
                        await self._finish_lost(
                            run,
                            run.node_id,
                            reason="agent_gone",
                            message=(
                                f"node {run.node_id} has had no agentd agent for {self.agent_gone_s:.0f} s and its"
                                " daemon never told the front how the run ended (a daemon gets SIGTERM, its"
                                " cancel-everything stop, when its agent goes)"
                            ),
                        )
                        return
                logger.info("fleet: run %s: %s; retrying", run.id, exc)
            await trio.sleep(next(delays, RELINK_BACKOFF_S[-1]))

    async def _on_event(self, run: _Run, msg: dict[str, Any]) -> None:
        seq = msg.get("seq")
        if not isinstance(seq, int) or seq <= run.last_seq:
            return
        data = msg.get("data") or {}
        event: dict[str, Any] = {"seq": seq, "ts": msg.get("ts"), "kind": msg.get("kind"), "data": data}
        await self._db(self.index.add_events, run.id, [event])
        run.last_seq = seq
        state = data.get("state") if isinstance(data, dict) else None
        if event["kind"] == "state" and isinstance(state, str):
            if state not in TERMINAL_STATES:
                run.state = state
            else:
                run.node_final = event
        self._fan_out(run, {"run_id": run.id, **event})

    async def _conclude(self, run: _Run, link: NodeLink) -> None:
        node = await link.request("status", run_id=run.node_run_id)
        state = str(node.get("state"))
        if state in TERMINAL_STATES:
            await self._db(
                self.index.finish,
                run.id,
                state,
                reason=node.get("reason"),
                ended_at=node.get("ended_at") or time.time(),
                result=node.get("result"),
                partial=bool(node.get("partial")),
                error=node.get("error"),
            )
            run.state = state
        await self._release(run)

    async def _conclude_from_event(self, run: _Run) -> None:
        """The node's terminal state event, already mirrored, is the run's terminal fact."""
        assert run.node_final is not None
        data = run.node_final["data"]
        state = str(data["state"])
        ts = run.node_final.get("ts")
        await self._db(
            self.index.finish,
            run.id,
            state,
            reason=data.get("reason"),
            ended_at=ts if isinstance(ts, (int, float)) else time.time(),
            partial=bool(data.get("partial")),
            error=data.get("error"),
        )
        run.state = state
        logger.info("fleet: run %s: its node is unreachable after its %s fact; concluded from it", run.id, state)
        await self._release(run)

    async def _finish_here(
        self,
        run: _Run,
        state: str,
        *,
        reason: str | None,
        error: dict[str, Any] | None = None,
        receipt: dict[str, Any] | None = None,
    ) -> None:
        """A terminal fact the front writes itself (the run never reached a node, or it failed there)."""
        now = time.time()
        data: dict[str, Any] = {"state": state, "partial": False}
        if reason:
            data["reason"] = reason
        if receipt:
            data["receipt"] = receipt
        with trio.CancelScope(shield=True):
            ok = await self._db(
                self.index.finish,
                run.id,
                state,
                reason=reason,
                ended_at=now,
                error=error,
                event={"kind": "state", "data": data},
            )
            if ok:
                run.last_seq += 1
                run.state = state
                self._fan_out(run, {"run_id": run.id, "seq": run.last_seq, "ts": now, "kind": "state", "data": data})
            await self._release(run)

    async def _release(self, run: _Run) -> None:
        """The run is terminal: end its subscribers, forget it, free its lease.

        In that order: freeing the lease is a call to Ray's GCS, which waits while the GCS
        is down; the run's end (already in the index) must not wait with it. A front
        killed before the lease is freed leaves it to the next front (``_free_ended_leases``).
        """
        run.token.retire()
        for send in list(run.subscribers):
            send.close()
        run.subscribers.clear()
        self._live.pop(run.id, None)
        run.done.set()
        with trio.CancelScope(shield=True):
            await self._free_lease(run)

    async def _free_lease(self, run: _Run) -> None:
        pg = run.pg
        if pg is None:
            try:
                pg = await self._ray(get_placement_group, LEASE_PREFIX + run.id)
            except ValueError:
                pg = None
        if pg is not None:
            try:
                await self._ray(remove_placement_group, pg)
            except ray.exceptions.RayError as exc:
                logger.warning("fleet: run %s: could not remove its lease: %r", run.id, exc)

    def _fan_out(self, run: _Run, msg: dict[str, Any]) -> None:
        for send in list(run.subscribers):
            try:
                send.send_nowait(msg)
            except trio.WouldBlock:
                logger.warning("fleet: run %s: dropping a subscriber that fell behind", run.id)
                run.subscribers.discard(send)
                send.close()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.subscribers.discard(send)

    # ------------------------------------------------------------------ Backend

    async def spawn(
        self,
        spec: dict[str, Any],
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
        interrupt: bool = False,
        model_key: Any = None,
    ) -> dict[str, Any]:
        if model_key is not None:
            # Refused, not dropped (a run without the key it was given) nor an internal
            # error (it was: spawn() did not take the argument).
            raise ControlProtocolError(
                ErrorCode.UNSUPPORTED,
                "the fleet does not carry a run's own model key (--model-key-env): give the nodes' daemons "
                "OPENAI_API_KEY (or a base_url of a local server) instead",
            )
        if not self._accepting or self._nursery is None:
            raise SpawnError("the fleet front is not accepting runs (starting or shutting down)")
        if not isinstance(spec, dict):
            raise SpawnError(f"spec must be a json object, got {type(spec).__name__}")
        node_spec, bundle = split_demand(spec)
        if "session" in node_spec:
            raise SpawnError(
                "invalid run spec: session: a node sets it for a turn of a session; spawn with a session_id instead"
            )
        _validate_spec(node_spec)
        if session_id is None and isinstance(node_spec.get("session_id"), str):
            session_id = node_spec["session_id"]
        down = self._down  # as the node watch last read it (every NODE_POLL_S)
        if down is not None:
            raise ControlProtocolError(
                ErrorCode.REFUSED,
                f"the fleet is down (`agentd fleet down` at {time.strftime('%H:%M:%S', time.localtime(down))}): "
                "bring it up with `agentd fleet up`",
            )
        missing = _infeasible(bundle, self._nodes.values())
        if missing:
            raise SpawnError(f"no live node in the fleet offers {missing} (the run could never be placed)")
        if timeout_s is None:
            timeout_s = self.config.default_timeout_s
        if session_id is None:
            return await self._create(node_spec, bundle, None, timeout_s)
        lock = self._session_locks.setdefault(session_id, trio.Lock())
        async with lock:
            live = [r for r in self._live.values() if r.session_id == session_id]
            if live and not interrupt:
                raise ControlProtocolError(
                    ErrorCode.SESSION_BUSY,
                    f"session {session_id!r} has a live turn, run {live[0].id!r} ({live[0].state}): wait for it to end, "
                    "cancel it, or start the new turn with interrupt",
                )
            for run in live:
                await self.cancel(run.id, reason="user")
            with trio.move_on_after(self.config.grace_s + INTERRUPT_MARGIN_S):
                for run in live:
                    await run.done.wait()
            if any(not r.done.is_set() for r in live):
                raise ControlProtocolError(
                    ErrorCode.REFUSED, f"session {session_id!r}: its live turn has not ended yet (stop sent)"
                )
            node_id = await self._session_node(session_id)
            if node_id is not None:
                bundle = {**bundle, f"node:{self._nodes[node_id]['ip']}": NODE_AFFINITY}
            return await self._create(node_spec, bundle, session_id, timeout_s)

    async def _session_node(self, session_id: str) -> str | None:
        """The live node of the session's latest turn (its history and profile are there)."""
        rows = await self._db(self.index.list, limit=1, state=None, session_id=session_id)
        node_id = rows[0]["node_id"] if rows else None
        if node_id is None or node_id in self._dead or node_id not in self._nodes or not self._nodes[node_id].get("ip"):
            return None
        return str(node_id)

    async def _create(
        self, node_spec: dict[str, Any], bundle: dict[str, float], session_id: str | None, timeout_s: float | None
    ) -> dict[str, Any]:
        assert self._nursery is not None
        run_id = "f-" + uuid.uuid4().hex[:16]
        run = _Run(run_id, session_id, node_spec, bundle, timeout_s, CancelToken(run_id))
        await self._db(
            self.index.create,
            run_id,
            session_id=session_id,
            spec=node_spec,
            bundle=bundle,
            created_at=time.time(),
            timeout_s=timeout_s,
        )
        self._live[run_id] = run
        self._nursery.start_soon(self._drive, run, name=f"fleet run {run_id}")
        return {"run_id": run_id, "state": "queued", "session_id": session_id, "node": None}

    async def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        run = self._live.get(run_id)
        if run is None:
            row = await self._db(self.index.get, run_id)
            if row is None:
                raise RunNotFound(run_id)
            if row["state"] == "lost":
                return _lost_reply(run_id, row["node_id"])
            return {"run_id": run_id, "was_active": False, "state": row["state"], "node": row["node_id"]}
        if run.node_id is not None and run.node_id in self._dead:
            return _lost_reply(run_id, run.node_id)
        was_active = run.token.cancel(reason)
        if was_active and run.token.first_cancel:
            await self._db(self.index.request_cancel, run_id, reason)
        if run.node_run_id is None:
            if run.queue_scope is not None:
                run.queue_scope.cancel(reason="cancelled while queued")
            # Handed to its node already: it starts there, and the stop follows it (not
            # "queued", which promises it never starts).
            state = "starting" if run.handed_over else run.state
            return {"run_id": run_id, "was_active": was_active, "state": state, "node": run.node_id}
        assert run.node_id is not None
        try:
            link = await self._link(run.node_id)
            reply = await link.request("cancel", run_id=run.node_run_id, reason=reason)
            run.cancel_sent = True
        except LinkDown as exc:
            if await self._node_dead_now(run.node_id):
                return _lost_reply(run_id, run.node_id)
            raise ControlProtocolError(
                ErrorCode.REFUSED,
                f"node {run.node_id[:8]} does not answer ({exc}); the stop is recorded and goes out when it does",
            ) from exc
        return {**reply, "run_id": run_id, "node": run.node_id, "node_run_id": run.node_run_id}

    async def cancel_session(self, session_id: str, *, reason: str = "user", turn: str | None = None) -> dict[str, Any]:
        """The session's live turn stopped; with ``turn`` (a fleet run id of the session),
        that turn only, or nothing once it ended (as ``RunManager.cancel_session``)."""
        if turn is None:
            hits = [r.id for r in list(self._live.values()) if r.session_id == session_id]
        else:
            live = self._live.get(turn)
            if live is not None:
                of = live.session_id
            else:
                row = await self._db(self.index.get, turn)
                if row is None:
                    raise RunNotFound(turn)
                of = row["session_id"]
            if of != session_id:
                raise ControlProtocolError(
                    ErrorCode.BAD_ARGS, f"run {turn!r} is not a turn of session {session_id!r} (of session {of!r})"
                )
            hits = [turn]
        out: dict[str, dict[str, Any]] = {}

        async def one(rid: str) -> None:
            out[rid] = await self.cancel(rid, reason=reason)

        async with trio.open_nursery() as n:
            for rid in hits:
                n.start_soon(one, rid)
        runs = [out[r] for r in hits]
        live_run = next((r.id for r in self._live.values() if r.session_id == session_id), None)
        was_active = any(r["was_active"] for r in runs)
        return {"session_id": session_id, "was_active": was_active, "runs": runs, "live_run": live_run}

    async def steer(self, run_id: str, text: str) -> dict[str, Any]:
        run = self._live.get(run_id)
        if run is None or run.node_run_id is None or run.node_id is None:
            row = await self._db(self.index.get, run_id)
            if row is None:
                raise RunNotFound(run_id)
            why = "the run has ended" if row["terminal"] else "the run is not on a node yet"
            return {"run_id": run_id, "accepted": False, "state": row["state"], "why": why}
        link = await self._link(run.node_id)
        reply = await link.request("steer", run_id=run.node_run_id, text=text)
        return {**reply, "run_id": run_id}

    async def _run_on_node(self, run_id: str) -> tuple[_Run, NodeLink]:
        run = self._live.get(run_id)
        if run is None or run.node_run_id is None or run.node_id is None:
            row = await self._db(self.index.get, run_id)
            if row is None:
                raise RunNotFound(run_id)
            why = "the run has ended" if row["terminal"] else "the run is not on a node yet"
            raise ControlProtocolError(ErrorCode.REFUSED, f"run {run_id!r}: nothing awaits approval ({why})")
        return run, await self._link(run.node_id)

    async def approve(self, run_id: str, call_id: str) -> dict[str, Any]:
        run, link = await self._run_on_node(run_id)
        reply = await link.request("approve", run_id=run.node_run_id, call_id=call_id)
        return {**reply, "run_id": run_id}

    async def deny(self, run_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
        run, link = await self._run_on_node(run_id)
        reply = await link.request("deny", run_id=run.node_run_id, call_id=call_id, reason=reason)
        return {**reply, "run_id": run_id}

    async def _session_rows(self, session_id: str) -> list[dict[str, Any]]:
        rows = await self._db(self.index.list, limit=SESSION_SCAN_LIMIT, state=None, session_id=session_id)
        if not rows:
            raise SessionNotFound(session_id)
        return rows

    async def history(self, session_id: str, **page: int) -> dict[str, Any]:
        """The node's page of the session's history (``page``: its cursor and bound, as given)."""
        rows = await self._session_rows(session_id)
        node_id = next((r["node_id"] for r in rows if r["node_id"]), None)
        if node_id is None or node_id in self._dead:
            raise ControlProtocolError(
                ErrorCode.REFUSED, f"session {session_id!r}: its node is gone, and its history with it"
            )
        link = await self._link(node_id)
        result = await link.request("history", session_id=session_id, **page)
        return _fleet_ids(result, rows, node_id)

    async def list_sessions(self, *, limit: int = 50) -> dict[str, Any]:
        rows = await self._db(self.index.list, limit=SESSION_SCAN_LIMIT, state=None, session_id=None)
        sessions: dict[str, dict[str, Any]] = {}
        for r in rows:  # newest first
            sid = r["session_id"]
            if sid is None:
                continue
            s = sessions.get(sid)
            if s is None:
                live = self._live.get(r["id"])
                s = sessions[sid] = {
                    "session_id": sid,
                    "turns": 0,
                    "first_at": r["created_at"],
                    "last_at": r["created_at"],
                    "last_run": r["id"],
                    "last_state": live.state if live else r["state"],
                    "live_run": None,
                    "closed_at": None,
                    "profile": None,
                    "node": r["node_id"],
                }
            s["turns"] += 1
            s["first_at"] = r["created_at"]
            if r["id"] in self._live:
                s["live_run"] = r["id"]
        return {"sessions": list(sessions.values())[:limit]}

    async def close_session(self, session_id: str) -> dict[str, Any]:
        rows = await self._session_rows(session_id)
        lock = self._session_locks.setdefault(session_id, trio.Lock())
        async with lock:
            live = [r for r in self._live.values() if r.session_id == session_id]
            for run in live:
                await self.cancel(run.id, reason="session_closed")
            with trio.move_on_after(self.config.grace_s + INTERRUPT_MARGIN_S):
                for run in live:
                    await run.done.wait()
            node_id = next((r["node_id"] for r in rows if r["node_id"]), None)
            out: dict[str, Any] = {"session_id": session_id, "was_open": True, "profile_removed": False}
            if node_id is not None and node_id not in self._dead:
                link = await self._link(node_id)
                out = await link.request("session_close", session_id=session_id)
        return {**out, "stopped": [r.id for r in live], "node": node_id}

    def _fleet_fields(self, row: dict[str, Any]) -> dict[str, Any]:
        node_id = row["node_id"]
        return {
            "node": node_id,
            "node_run_id": row["node_run_id"],
            "node_alive": None if node_id is None else (node_id in self._nodes and node_id not in self._dead),
            "lease": LEASE_PREFIX + row["id"],
            "demand": row["bundle"],
        }

    async def status(self, run_id: str) -> dict[str, Any]:
        row = await self._db(self.index.get, run_id)
        if row is None:
            raise RunNotFound(run_id)
        fleet = self._fleet_fields(row)
        if row["node_run_id"] and fleet["node_alive"]:
            try:
                link = await self._link(row["node_id"])
                node = await link.request("status", run_id=row["node_run_id"])
                return {**node, "id": run_id, "run_id": run_id, **fleet}
            except LinkDown:
                pass
        return {**_index_view(row), "live": run_id in self._live, **fleet}

    async def list_runs(
        self, *, limit: int = 50, state: str | None = None, session_id: str | None = None
    ) -> list[dict[str, Any]]:
        rows = await self._db(self.index.list, limit=limit, state=state, session_id=session_id)
        return [{**_index_view(r), "live": r["id"] in self._live, **self._fleet_fields(r)} for r in rows]

    async def events_after(self, run_id: str, after_seq: int, limit: int = 1000) -> list[dict[str, Any]]:
        row = await self._db(self.index.get, run_id)
        if row is None:
            raise RunNotFound(run_id)
        node_id = row["node_id"]
        if row["node_run_id"] and row["state"] != "lost" and node_id in self._nodes and node_id not in self._dead:
            try:
                link = await self._link(node_id)
                result = await link.request("events", run_id=row["node_run_id"], after_seq=after_seq, limit=limit)
                return [{**e, "run_id": run_id} for e in result["events"]]
            except LinkDown:
                pass
        return await self._db(self.index.events_after, run_id, after_seq, limit)

    @asynccontextmanager
    async def subscribe(self, run_id: str) -> AsyncIterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
        send, recv = trio.open_memory_channel[dict[str, Any]](SUBSCRIBER_BUFFER)
        run = self._live.get(run_id)
        if run is None:
            if await self._db(self.index.get, run_id) is None:
                raise RunNotFound(run_id)
            send.close()
            async with recv:
                yield recv
            return
        run.subscribers.add(send)
        try:
            async with recv:
                yield recv
        finally:
            run.subscribers.discard(send)
            send.close()

    async def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        per_node: dict[str, int] = {}
        for run in self._live.values():
            counts[run.state] = counts.get(run.state, 0) + 1
            if run.node_id:
                per_node[run.node_id] = per_node.get(run.node_id, 0) + 1
        nodes = []
        for node_id, node in sorted(self._nodes.items()):
            agent = self._agents.get(node_id) or {}
            nodes.append(
                {
                    "node_id": node_id,
                    "ip": node.get("ip"),
                    "resources": {k: v for k, v in node["resources"].items() if not k.startswith("node:")},
                    "agentd": agent.get("url"),
                    "state_dir": agent.get("state_dir"),
                    "live_runs": per_node.get(node_id, 0),
                }
            )
        return {
            "fleet": True,
            "live": len(self._live),
            "by_state": counts,
            "nodes": nodes,
            "dead_nodes": sorted(self._dead),
            "accepting": self._accepting,
        }

    def stop_accepting(self) -> None:
        self._accepting = False


def _index_view(row: dict[str, Any]) -> dict[str, Any]:
    """A run as the index knows it, in the shape of a node's run record."""
    return {
        "id": row["id"],
        "run_id": row["id"],
        "session_id": row["session_id"],
        "state": row["state"],
        "reason": row["reason"],
        "created_at": row["created_at"],
        "ended_at": row["ended_at"],
        "timeout_s": row["timeout_s"],
        "spec": row["spec"],
        "result": row["result"],
        "partial": row["partial"],
        "partial_snapshot": row["partial_snapshot"],
        "error": row["error"],
        "last_seq": row["last_seq"],
        "tool_calls": [],
    }


def _fleet_ids(history: dict[str, Any], rows: list[dict[str, Any]], node_id: str) -> dict[str, Any]:
    """A node's ``history`` reply with its run ids as the fleet knows them."""
    ids = {r["node_run_id"]: r["id"] for r in rows if r["node_run_id"]}
    turns = []
    for t in history.get("turns") or []:
        t = dict(t)
        t["node_run_id"] = t.get("run_id")
        t["run_id"] = ids.get(t["node_run_id"], t["node_run_id"])
        turns.append(t)
    live = history.get("live_run")
    return {**history, "turns": turns, "live_run": ids.get(live, live), "node": node_id}


def _validate_spec(spec: dict[str, Any]) -> None:
    """The runner's own validator, at the front (the node checks again, browser included)."""
    try:
        from subagent.spec import RunSpec, SpecError
    except ImportError:
        return
    try:
        RunSpec.from_dict(spec)
    except SpecError as exc:
        raise SpawnError(f"invalid run spec: {exc}") from exc


def _infeasible(bundle: dict[str, float], nodes: Any) -> str | None:
    """The first resource of the bundle no live node has enough of in total, if any."""
    nodes = list(nodes)
    if not nodes:
        return "anything (no live node)"
    for node in nodes:
        if all(node["resources"].get(k, 0.0) >= v for k, v in bundle.items()):
            return None
    lacking = [k for k in bundle if not any(n["resources"].get(k, 0.0) >= bundle[k] for n in nodes)]
    return repr(lacking[0] if lacking else sorted(bundle))


def _lost_reply(run_id: str, node_id: str) -> dict[str, Any]:
    """A cancel's reply for a run whose node is dead: nothing was active to stop."""
    return {
        "run_id": run_id,
        "was_active": False,
        "state": "lost",
        "node": node_id,
        "why": f"node {node_id} is dead: the run was lost",
    }
