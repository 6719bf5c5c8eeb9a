"""Dashboard sessions: one-time login links exchanged for a session cookie. No I/O.

The one owner of who is signed in to the dashboard. Both servers ask it: the dashboard's
HTTP server (``/login``, pages, state-changing requests) and the control socket, which
accepts a browser handshake carrying a valid session cookie from the dashboard's own
origin as an alternative to the control token. Sessions live in memory: a daemon restart
(which also changes the control token) signs everyone out. Invariants: a login link works
once; a session cookie is ``HttpOnly; SameSite=Strict``; a session is valid only with a
request from the dashboard's own origin (checked by the callers through ``origin_ok``).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from supervisor.control import _dashlink

__all__ = ["Sessions", "LoginRefused", "LOOPBACK_NAMES"]

# A session not used for this long ends (seconds).
SESSION_IDLE_S: Final = 12 * 3600
# Sessions kept at once; the least recently used one ends beyond this.
MAX_SESSIONS: Final = 100
# Used login nonces remembered at once (each only until its link expires anyway).
MAX_USED_NONCES: Final = 10_000
SESSION_BYTES: Final = 32

# Host names a browser may use to reach a loopback-bound dashboard. Any other Host header
# is refused (a DNS-rebinding page would present its own name).
LOOPBACK_NAMES: Final = ("127.0.0.1", "localhost", "[::1]")


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
        self.port: int | None = None
        self.hosts: tuple[str, ...] = LOOPBACK_NAMES

    def bind(self, port: int, extra_hosts: tuple[str, ...] = ()) -> None:
        """The dashboard listens on ``port``; ``extra_hosts``: its non-loopback bind address."""
        self.port = port
        self.hosts = LOOPBACK_NAMES + tuple(h for h in extra_hosts if h not in LOOPBACK_NAMES)

    @property
    def cookie_name(self) -> str:
        # Cookies ignore ports: two daemons on one host must not share one cookie.
        return f"agentd_session_{self.port}"

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
            self._sessions.popitem(last=False)
        return sid

    def end(self, sid: str) -> bool:
        return self._sessions.pop(sid, None) is not None

    # ------------------------------------------------------------------ checks

    def session_of(self, cookie_header: str | None) -> str | None:
        """The valid session id in a ``Cookie`` header, if any (its use is noted)."""
        if not cookie_header or self.port is None:
            return None
        sid = _cookie_value(cookie_header, self.cookie_name)
        if sid is None:
            return None
        last = self._sessions.get(sid)
        if last is None:
            return None
        now = self._clock()
        if now - last > SESSION_IDLE_S:
            del self._sessions[sid]
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

    def handshake_ok(self, origin: str | None, cookie_header: str | None) -> bool:
        """For the control socket: a browser on the dashboard's origin with a session."""
        return self.origin_ok(origin) and self.session_of(cookie_header) is not None

    def set_cookie(self, sid: str) -> str:
        # No Max-Age: a browser session cookie; the daemon ends it after SESSION_IDLE_S.
        return f"{self.cookie_name}={sid}; Path=/; HttpOnly; SameSite=Strict"

    def clear_cookie(self) -> str:
        return f"{self.cookie_name}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"


def _cookie_value(header: str, name: str) -> str | None:
    # Not http.cookies.SimpleCookie: it stops at the first cookie it dislikes, and other
    # apps on localhost set all sorts (cookies ignore ports).
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None
