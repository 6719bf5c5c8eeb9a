"""One-time login links for the web dashboard: minted by the CLI, redeemed by the daemon.

Stdlib only (the CLI mints a link without importing trio). A link carries
``v1.<expires>.<nonce>.<mac>``: ``mac`` is an HMAC-SHA256, keyed with the daemon's control
token, of the rest. Whoever can read the token (mode 0600) can mint a link, and nobody
else; the control token itself never appears in a URL, so it never sits in browser
history. The daemon accepts a link once (it remembers used nonces until they expire) and
only within ``LOGIN_TTL_S``; what it hands back is a session secret (``dashboard``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from typing import Final, NamedTuple
from urllib.parse import quote

__all__ = ["LOGIN_TTL_S", "LoginClaim", "mint_login_token", "check_login_token", "login_url"]

# A login link works this long after it is minted (seconds): long enough to click it.
LOGIN_TTL_S: Final = 300
_VERSION: Final = "v1"
_CONTEXT: Final = b"agentd-dashboard-login"
NONCE_BYTES: Final = 16


class LoginClaim(NamedTuple):
    nonce: str
    expires_at: float  # wall clock (time.time)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _mac(control_token: str, expires: int, nonce: str) -> str:
    msg = b".".join((_CONTEXT, _VERSION.encode(), str(expires).encode(), nonce.encode()))
    return _b64(hmac.new(control_token.encode(), msg, hashlib.sha256).digest())


def mint_login_token(control_token: str, *, now: float | None = None, ttl_s: float = LOGIN_TTL_S) -> str:
    """A fresh one-time login token, valid ``ttl_s`` seconds from ``now``."""
    now = time.time() if now is None else now
    expires = int(now + ttl_s)
    nonce = _b64(os.urandom(NONCE_BYTES))
    return f"{_VERSION}.{expires}.{nonce}.{_mac(control_token, expires, nonce)}"


def check_login_token(control_token: str, login: str, *, now: float | None = None) -> LoginClaim | str:
    """The claim in ``login`` if it is authentic and current, else why not (a short text).

    Whether it was already used is the caller's business (it keeps the used nonces).
    """
    now = time.time() if now is None else now
    parts = login.split(".")
    if len(parts) != 4 or parts[0] != _VERSION:
        return "not a login token"
    _, expires_text, nonce, mac = parts
    # ASCII digits only: str.isdigit() takes "²", which int() refuses.
    if (
        not (expires_text.isascii() and expires_text.isdigit())
        or len(expires_text) > 12
        or not nonce
        or len(nonce) > 64
    ):
        return "not a login token"
    expires = int(expires_text)
    if not hmac.compare_digest(mac.encode(), _mac(control_token, expires, nonce).encode()):
        return "wrong login token (minted for another daemon, or before a restart)"
    if now > expires:
        return "expired login token"
    if expires > now + LOGIN_TTL_S + 60:
        return "login token valid for too long"
    return LoginClaim(nonce, float(expires))


def login_url(dashboard_url: str, login: str) -> str:
    """The URL to open: the dashboard's ``/login`` with the one-time token."""
    return f"{dashboard_url.rstrip('/')}/login?t={quote(login, safe='')}"
