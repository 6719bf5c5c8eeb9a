"""Connection limits for the daemon's sockets: who may hold how many, and for how long.

A ``Gate`` wraps a TCP listener. It counts open connections per peer address and in all,
and closes at once (before any byte is read) a connection above either count, so a local
user without the token cannot pile up connections until the daemon runs out of file
descriptors. The total is capped further by ``RLIMIT_NOFILE``: half of what is left after
a reserve goes to connections, the rest stays for runs (pipes, pidfds), the journal and
/proc scans. Each accepted connection is a ``GatedStream``: it gives its slot back when
closed, remembers when its peer last sent a byte (for idle timeouts), and can be closed
by its handler at once (a refused handshake is not left open for the client to keep).
A connection a run's process made (``_peer_cgroup.RunPeers``) is closed at once and takes
no slot: every local client is 127.0.0.1, and a run must not be able to fill its slots.

A connection still in its handshake (it has not shown the token yet) holds its slot only
until a newer one needs it: when a peer's slots or all of them are taken, the oldest such
connection is closed (evicted) to make room for the newcomer, instead of refusing the
newcomer. Otherwise any local process, with no token, could keep all 128 slots every
local client shares by opening them and sending nothing (each held for the handshake's
5 s): ``agentd cancel`` got "at its connection limit". Now such a flood only churns, and a
real client's handshake (a few ms) gets through unless the flood opens more than
``per_peer`` connections in that time. An authenticated connection (``authenticated``) is
never evicted: when every slot is one, the newcomer is refused as before.
"""

from __future__ import annotations

import contextvars
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, final

import trio

from supervisor.control._peer_cgroup import RunPeers, refuse_a_runs

__all__ = ["Limits", "Gate", "GatedStream", "Throttled", "current_stream", "fd_connection_cap"]

logger = logging.getLogger(__name__)

# File descriptors kept out of the connection budget: the interpreter, trio, the journal
# (database, WAL, shm), the listener, logs, a /proc scan in flight.
FD_RESERVE: Final = 64
# Floor of the fd-derived connection cap, so a tiny RLIMIT_NOFILE still admits a CLI.
MIN_CONNECTIONS: Final = 8
# At most one "refused: too many connections" line per this many seconds.
REFUSAL_LOG_INTERVAL_S: Final = 10.0


class Throttled:
    """A warning a client can cause at will, logged at most once per ``interval_s``: a
    flood of refusals must not become a flood of log lines (each line says how many so far)."""

    def __init__(self, log: logging.Logger, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self._log = log
        self._interval_s = interval_s
        self._last = -float("inf")

    def due(self) -> bool:
        """Whether a line may be logged now (then the next is ``interval_s`` away)."""
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return False
        self._last = now
        return True

    def warning(self, msg: str, *args: object) -> None:
        if self.due():
            self._log.warning(msg, *args)


@dataclass(frozen=True, slots=True)
class Limits:
    """The control socket's limits. Every duration is in seconds, every size in bytes."""

    # Connect to a complete HTTP upgrade request (trio-websocket's connect timeout).
    handshake_s: float = 5.0
    # An authenticated connection with no request in flight and no subscription that
    # receives nothing (no message, no ping) for this long is closed (1001). Clients that
    # keep a connection for later send a ping now and then.
    idle_s: float = 300.0
    # Open connections (handshaking or authenticated) from one peer address. Every local
    # client is 127.0.0.1, so on loopback this is the cap for all local users together.
    # A newcomer beyond it (or beyond ``total``) evicts the oldest connection still in
    # its handshake; it is refused only when every slot is an authenticated connection.
    per_peer: int = 128
    # Open connections in all (further capped by RLIMIT_NOFILE, see fd_connection_cap).
    total: int = 1024
    # Requests served at once on one connection; the reader waits while all are busy.
    in_flight: int = 32
    # Subscriptions open at once on one connection.
    subscriptions: int = 64
    # Live events (encoded) buffered per subscription while it replays or its client is
    # slow; beyond this they are dropped here and re-read from the journal later.
    subscriber_bytes: int = 1024 * 1024
    # The same, all subscriptions of all connections together: beyond it each one keeps at
    # most one event (a reading client still sees its gaps and fills them from the journal).
    subscribers_total_bytes: int = 64 * 1024 * 1024
    # A journal page read to replay a subscription or fill a gap: at least one event.
    replay_page_bytes: int = 256 * 1024
    # The events of one ``events`` reply (at least one event; ``more`` says if it was cut).
    events_reply_bytes: int = 4 * 1024 * 1024
    # A client that takes no message off the socket for this long is disconnected.
    send_s: float = 30.0


def fd_connection_cap(total: int) -> int:
    """``total``, capped so connections cannot take the fds that runs and scans need."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return total
    if soft == resource.RLIM_INFINITY:
        return total
    return min(total, max(MIN_CONNECTIONS, (soft - FD_RESERVE) // 2))


# The GatedStream of the connection the current task serves. Set by Gate.accept in the
# accepting task; trio copies a task's context into the tasks it starts, and
# trio.serve_listeners starts each connection's handler from the accepting task.
current_stream: contextvars.ContextVar[GatedStream | None] = contextvars.ContextVar(
    "agentd_current_stream", default=None
)


@final
class GatedStream(trio.abc.HalfCloseableStream):
    """An accepted TCP connection that holds one of its gate's slots until closed.

    It may be evicted (closed by the gate for a newer connection) until its handler calls
    ``authenticated``; ``evict_scope``, set by the task that serves it, is cancelled then.
    """

    def __init__(self, stream: trio.SocketStream, peer: str, gate: Gate) -> None:
        self._stream = stream
        self.peer = peer
        self._gate = gate
        self._released = False
        self.last_received = trio.current_time()
        self.evicted = False
        self.evict_scope: trio.CancelScope | None = None

    def authenticated(self) -> None:
        """The handshake showed the token (or a session): no newcomer evicts it now."""
        self._gate.authenticated(self)

    def evict(self) -> None:
        """Close now, from another task: the slot is free at once, and so is the fd."""
        self.evicted = True
        self._release()
        if self.evict_scope is not None:
            self.evict_scope.cancel(reason="evicted for a newer connection")
        self._stream.socket.close()  # its reader, if any, gets ClosedResourceError

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self._stream.receive_some(max_bytes)
        self.last_received = trio.current_time()
        return data

    async def aclose(self) -> None:
        self._release()
        await self._stream.aclose()

    async def close_now(self) -> None:
        """Close at once: what was sent is flushed to the kernel (FIN, not a reset, unless
        the peer sent more than was read)."""
        self._release()
        try:
            await self._stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
            pass  # (busy: a send is stuck mid-frame; the close below ends it)
        await trio.aclose_forcefully(self._stream)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._gate.release(self)


@final
class Gate(trio.abc.Listener[trio.abc.Stream]):
    """A listener that admits at most ``per_peer`` connections per address, ``total`` in
    all; a newcomer beyond either evicts the oldest connection still in its handshake."""

    def __init__(self, inner: trio.SocketListener, *, per_peer: int, total: int, runs: RunPeers | None = None) -> None:
        self.inner = inner
        self.runs = runs
        self.per_peer = per_peer
        self.total = total
        self.open: Counter[str] = Counter()
        # Connections not authenticated yet, oldest first (a dict keeps insertion order).
        self.pending: dict[GatedStream, None] = {}
        self.refused = 0
        self.evicted = 0
        self._refusal_log = Throttled(logger)
        self._eviction_log = Throttled(logger)

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    @property
    def count(self) -> int:
        return sum(self.open.values())

    async def accept(self) -> GatedStream:
        while True:
            stream = await self.inner.accept()  # EMFILE etc.: serve_listeners waits, retries
            try:
                peer = str(stream.socket.getpeername()[0])
            except OSError:  # already reset by the peer
                await trio.aclose_forcefully(stream)
                continue
            if await refuse_a_runs(stream, self.runs, "control"):
                continue  # a run's: no slot, no handshake (counted and logged by ``runs``)
            if not self._make_room(peer):
                self.refused += 1
                self._log_refusal(peer)
                await trio.aclose_forcefully(stream)
                continue
            self.open[peer] += 1
            gated = GatedStream(stream, peer, self)
            self.pending[gated] = None
            current_stream.set(gated)
            return gated

    def _make_room(self, peer: str) -> bool:
        """Whether a new connection from ``peer`` fits, once the oldest handshaking one
        (of ``peer``, or of anyone for the total) is evicted if need be."""
        if self.open[peer] >= self.per_peer and not self._evict_oldest(lambda s: s.peer == peer):
            return False
        if self.count >= self.total and not self._evict_oldest(lambda s: True):
            return False
        return True

    def _evict_oldest(self, which: Callable[[GatedStream], bool]) -> bool:
        for stream in self.pending:
            if which(stream):
                stream.evict()  # releases it: out of ``pending`` and ``open``
                self.evicted += 1
                self._log_eviction(stream.peer)
                return True
        return False

    def authenticated(self, stream: GatedStream) -> None:
        self.pending.pop(stream, None)

    def release(self, stream: GatedStream) -> None:
        self.pending.pop(stream, None)
        peer = stream.peer
        self.open[peer] -= 1
        if self.open[peer] <= 0:
            del self.open[peer]

    def _log_eviction(self, peer: str) -> None:
        self._eviction_log.warning(
            "control: at the connection limit (%d from %s, %d in all); closed the oldest "
            "connection still in its handshake for a new one; %d closed so far",
            self.open[peer],
            peer,
            self.count,
            self.evicted,
        )

    def _log_refusal(self, peer: str) -> None:
        self._refusal_log.warning(
            "control: refused a connection from %s: %d open from it, %d in all "
            "(limits %d per peer, %d in all); %d refused so far",
            peer,
            self.open[peer],
            self.count,
            self.per_peer,
            self.total,
            self.refused,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()
