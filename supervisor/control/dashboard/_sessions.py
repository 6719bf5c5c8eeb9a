"""Dashboard sessions: one-time login links exchanged for a session secret. No I/O.

The one owner of who is signed in to the dashboard. Both servers ask it: the dashboard's
HTTP server (``/login``, the API, state-changing requests) and the control socket, which
accepts a browser handshake carrying a valid session from the dashboard's own origin as
an alternative to the control token. Sessions live in memory: a daemon restart (which also
changes the control token) signs everyone out.

No cookie: a browser sends cookies to every port of a host (a local web app, or a server a
supervised run starts on loopback, would receive it), and whoever holds the credential can
forge ``Origin`` from a non-browser client. So the secret lives in the page's own
origin-scoped storage (``localStorage`` is per scheme, host *and port*), and the page
presents it explicitly: a ``X-Agentd-Session`` header on its HTTP API calls, and a
websocket subprotocol entry ``agentd-session.<secret>`` on the control socket (browsers
cannot set headers on a websocket). Invariants: a login link works once; a session is valid
only when presented explicitly, with a request from the dashboard's own origin (checked by
the callers through ``origin_ok``).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Final

import trio

from supervisor.control import _dashlink
from supervisor.control.server import DASHBOARD_SUBPROTOCOL

__all__ = ["Sessions", "LoginRefused", "names_for", "SESSION_HEADER", "SUBPROTOCOL", "SESSION_PROTOCOL_PREFIX"]

# A session not used for this long ends (seconds).
SESSION_IDLE_S: Final = 12 * 3600
# Sessions kept at once; the least recently used one ends beyond this.
MAX_SESSIONS: Final = 100
# Used login nonces remembered at once (each only until its link expires anyway).
MAX_USED_NONCES: Final = 10_000
SESSION_BYTES: Final = 32
# The HTTP header the page presents its session in (lower-case, as requests hold names).
SESSION_HEADER: Final = "x-agentd-session"
# The websocket subprotocol the control socket selects for the page; the page offers it
# together with ``SESSION_PROTOCOL_PREFIX + secret`` (never echoed back, never logged).
SUBPROTOCOL: Final = DASHBOARD_SUBPROTOCOL
SESSION_PROTOCOL_PREFIX: Final = "agentd-session."


def names_for(bound: str) -> tuple[str, ...]:
    """The host names the dashboard answers to when bound to ``bound``: the address itself,
    never a name. ``localhost`` can resolve to an address of another family than the one
    bound (``::1`` beside ``127.0.0.1``), where another local process may listen on the
    same port: a browser sent it the login link, and a page it served there shared the
    dashboard's origin (its storage, the session) and passed the Origin check."""
    if bound in ("", "0.0.0.0"):
        return ("127.0.0.1",)
    if bound == "::":  # both families (Linux binds :: dual-stack)
        return ("127.0.0.1", "[::1]")
    return (f"[{bound}]" if ":" in bound else bound,)


class LoginRefused(Exception):
    """A login link that cannot be redeemed: forged, expired or already used."""


class Sessions:
    """Who is signed in. ``bind`` once the dashboard's port is known."""

    def __init__(
        self,
        control_token: str,
        *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._control_token = control_token
        self._wall = wall_clock
        self._clock = clock
        self._sessions: OrderedDict[str, float] = OrderedDict()  # id -> last use (clock)
        self._used: dict[str, float] = {}  # login nonce -> its expiry (wall clock)
        # Open control-socket connections of each session (``watching``): set when it ends.
        self._watchers: dict[str, set[trio.Event]] = {}
        self.port: int | None = None
        self.hosts: tuple[str, ...] = names_for("127.0.0.1")

    def bind(self, port: int, bound: str = "127.0.0.1") -> None:
        """The dashboard listens on ``port`` at the address ``bound`` (as the listener has
        it): the names a browser may use for it are that address's (``names_for``)."""
        self.port = port
        self.hosts = names_for(bound)

    # ------------------------------------------------------------------ login

    def redeem(self, login: str) -> str:
        """Exchange a one-time login token for a new session id.

        Raises:
            LoginRefused: the token is forged, expired or was used before.
        """
        now = self._wall()
        claim = _dashlink.check_login_token(self._control_token, login, now=now)
        if isinstance(claim, str):
            raise LoginRefused(claim)
        for nonce, expires in list(self._used.items()):
            if expires < now:
                del self._used[nonce]
        if claim.nonce in self._used:
            raise LoginRefused("this login link was already used")
        if len(self._used) >= MAX_USED_NONCES:
            raise LoginRefused("too many logins at once; try again in a few minutes")
        self._used[claim.nonce] = claim.expires_at
        sid = secrets.token_urlsafe(SESSION_BYTES)
        self._sessions[sid] = self._clock()
        while len(self._sessions) > MAX_SESSIONS:
            self._drop(next(iter(self._sessions)))
        return sid

    def end(self, sid: str) -> bool:
        """Sign out: the session is refused from now on, and its open sockets are closed."""
        return self._drop(sid)

    def _drop(self, sid: str) -> bool:
        for ended in self._watchers.pop(sid, ()):
            ended.set()
        return self._sessions.pop(sid, None) is not None

    @contextlib.contextmanager
    def watching(self, protocols: str | None) -> Iterator[trio.Event | None]:
        """For an open control-socket connection let in by the session in ``protocols``:
        an event set when that session ends (sign-out, idle, evicted), so the connection
        is closed then; None when the connection came in otherwise (the token)."""
        sid = session_in_protocols(protocols)
        if sid is None or sid not in self._sessions:
            yield None
            return
        ended = trio.Event()
        self._watchers.setdefault(sid, set()).add(ended)
        try:
            yield ended
        finally:
            watchers = self._watchers.get(sid)
            if watchers is not None:
                watchers.discard(ended)
                if not watchers:
                    del self._watchers[sid]

    # ------------------------------------------------------------------ checks

    def session_of(self, sid: str | None) -> str | None:
        """``sid`` if it is a valid session (its use is noted), else None."""
        if not sid or self.port is None:
            return None
        last = self._sessions.get(sid)
        if last is None:
            return None
        now = self._clock()
        if now - last > SESSION_IDLE_S:
            self._drop(sid)
            return None
        self._sessions[sid] = now
        self._sessions.move_to_end(sid)
        return sid

    def host_ok(self, host: str | None) -> bool:
        """The ``Host`` header names this dashboard (a loopback name and its port)."""
        if host is None or self.port is None:
            return False
        return host.strip().lower() in {f"{h}:{self.port}" for h in self.hosts}

    def origin_ok(self, origin: str | None) -> bool:
        """``origin`` is the dashboard's own (``http://<loopback name>:<port>``)."""
        if origin is None or self.port is None:
            return False
        return origin.strip().rstrip("/").lower() in {f"http://{h}:{self.port}" for h in self.hosts}

    def handshake_ok(self, origin: str | None, protocols: str | None) -> bool:
        """For the control socket: a browser on the dashboard's origin that offers its
        session as a subprotocol entry (``protocols``: the ``Sec-WebSocket-Protocol``
        header). A cookie would not do: see the module's docstring."""
        return self.origin_ok(origin) and self.session_of(session_in_protocols(protocols)) is not None


def session_in_protocols(protocols: str | None) -> str | None:
    """The secret in a ``Sec-WebSocket-Protocol`` header's ``agentd-session.<secret>`` entry."""
    for entry in (protocols or "").split(","):
        entry = entry.strip()
        if entry.startswith(SESSION_PROTOCOL_PREFIX):
            return entry[len(SESSION_PROTOCOL_PREFIX) :]
    return None
