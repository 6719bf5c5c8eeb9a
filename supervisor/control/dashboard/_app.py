"""The dashboard's HTTP routes: a request in, a response out. No I/O.

Routes: ``GET /`` (the page: static, no state in it; its script sends a browser without a
session to ``/signed-out``), ``GET /login?t=`` (redeem a one-time link: a 200 page whose
script, ``login.js``, keeps the session secret in the origin's ``localStorage`` and goes on
to ``/``, which also takes the link out of the address bar and history; ``HEAD`` redeems
nothing, for link-preview bots), ``GET /api/session`` (where the control socket is, for the
page's script), ``POST /logout``, ``GET /static/...`` (the page's own files). The session is
presented only explicitly, in the ``X-Agentd-Session`` header (see ``_sessions``: no
cookie, which a browser would send to other ports too). Every response carries a strict
Content-Security-Policy (no inline script or style; the only connection allowed besides
the page's own origin is the control socket). A request whose ``Host`` is not this
dashboard is refused (DNS rebinding). A state-changing request (any method but GET and
HEAD) needs a session *and* a same-origin request (``Origin`` is the dashboard's, or
``Sec-Fetch-Site: same-origin``), whatever its path; otherwise 403.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, urlsplit

from supervisor.control.dashboard._sessions import SESSION_HEADER, LoginRefused, Sessions

__all__ = ["Request", "Response", "DashboardApp", "CONTENT_TYPES"]

CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
SAFE_METHODS: Final = frozenset({"GET", "HEAD"})
# In login.html, replaced by the new session's secret (URL-safe base64: nothing to escape).
SESSION_PLACEHOLDER: Final = b"{{session}}"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    headers: tuple[tuple[str, str], ...] = ()  # names lower-case

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


class DashboardApp:
    """Routes requests. ``static`` maps a path under ``static/`` to its bytes."""

    def __init__(self, sessions: Sessions, static: Mapping[str, bytes], *, control_port: int) -> None:
        self.sessions = sessions
        self.static = static
        self.control_port = control_port

    def handle(self, req: Request) -> Response:
        host = req.header("host")
        if not self.sessions.host_ok(host):
            # Not our name: a DNS-rebinding page, or a mistyped address. No CSP needed on
            # a plain-text refusal, but the common headers still go on.
            return self._finish(_text(421, f"this is agentd's dashboard; it does not answer to host {host!r}\n"), None)
        assert host is not None
        hostname = host.rsplit(":", 1)[0]
        try:
            path = urlsplit(req.target).path
        except ValueError:  # e.g. "//[": not a URL urllib can split
            return self._finish(_text(400, "bad request target\n"), hostname)
        sid = self.sessions.session_of(req.header(SESSION_HEADER))
        if req.method not in SAFE_METHODS:
            refusal = self._check_state_change(req, sid)
            if refusal is not None:
                return self._finish(refusal, hostname)
        return self._finish(self._route(req, path, sid, hostname), hostname)

    def _check_state_change(self, req: Request, sid: str | None) -> Response | None:
        origin = req.header("origin")
        fetch_site = req.header("sec-fetch-site")
        # Sec-Fetch-Site is set by the browser alone (scripts cannot); it speaks for a
        # request whose Origin is absent or "null" (Chromium sends "null" on a form POST
        # under some referrer policies).
        same_origin = self.sessions.origin_ok(origin) or (origin in (None, "null") and fetch_site == "same-origin")
        if not same_origin:
            return _text(403, f"refused: a {req.method} must come from the dashboard's own page (origin {origin!r})\n")
        if sid is None:
            return _text(403, f"refused: a {req.method} needs a signed-in session\n")
        return None

    def _route(self, req: Request, path: str, sid: str | None, hostname: str) -> Response:
        if path == "/login":
            if req.method not in SAFE_METHODS:
                return _text(405, "use GET\n", allow="GET, HEAD")
            if req.method == "HEAD":
                # A link preview (chat apps, mail scanners) must not use the link up.
                return Response(200, b"", CONTENT_TYPES[".html"])
            return self._login(req)
        if path == "/logout":
            if req.method != "POST":
                return _text(405, "use POST\n", allow="POST")
            assert sid is not None  # _check_state_change
            self.sessions.end(sid)
            return _json(200, {"signed_in": False})
        if req.method not in SAFE_METHODS:
            return _text(
                405 if path in ("/", "/api/session") or path.startswith("/static/") else 404, "no such action\n"
            )
        if path in ("/", "/index.html"):
            return self._page("index.html")
        if path == "/signed-out":
            return self._page("signed-out.html", status=401)
        if path == "/api/session":
            if sid is None:
                return _json(
                    401, {"signed_in": False, "error": "not signed in: run `agentd dashboard` for a login link"}
                )
            return _json(200, {"signed_in": True, "control_url": self._control_url(hostname)})
        if path.startswith("/static/"):
            return self._static(path[len("/static/") :])
        if path == "/favicon.ico":  # what a browser asks for on a page without an icon link
            return self._static("favicon.svg")
        return _text(404, f"no page at {path!r}\n")

    def _login(self, req: Request) -> Response:
        values = parse_qs(urlsplit(req.target).query).get("t")
        if not values:
            return self._page("signed-out.html", status=401)
        try:
            sid = self.sessions.redeem(values[0])
        except LoginRefused:
            return self._page("signed-out.html", status=401)
        page = self.static["login.html"].replace(SESSION_PLACEHOLDER, sid.encode())
        return Response(200, page, CONTENT_TYPES[".html"])

    def _page(self, name: str, *, status: int = 200) -> Response:
        return Response(status, self.static[name], CONTENT_TYPES[".html"])

    def _static(self, name: str) -> Response:
        body = self.static.get(name)
        dot = name.rfind(".")
        ctype = CONTENT_TYPES.get(name[dot:]) if dot >= 0 else None
        if body is None or ctype is None:
            return _text(404, f"no file {name!r}\n")
        return Response(200, body, ctype)

    def _control_url(self, hostname: str) -> str:
        # The same host name the page was loaded from: its Origin is what the socket checks.
        return f"ws://{hostname}:{self.control_port}/"

    def _finish(self, resp: Response, hostname: str | None) -> Response:
        connect = f" ws://{hostname}:{self.control_port}" if hostname is not None else ""
        resp.headers += [
            (
                "Content-Security-Policy",
                "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                f"connect-src 'self'{connect}; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
            ),
            ("X-Content-Type-Options", "nosniff"),
            ("X-Frame-Options", "DENY"),
            # Nothing leaves with a referrer (the page links nowhere else anyway).
            ("Referrer-Policy", "same-origin"),
            ("Cross-Origin-Opener-Policy", "same-origin"),
            ("Cross-Origin-Resource-Policy", "same-origin"),
            ("Cache-Control", "no-store"),
        ]
        return resp


def _text(status: int, text: str, *, allow: str | None = None) -> Response:
    resp = Response(status, text.encode())
    if allow is not None:
        resp.headers.append(("Allow", allow))
    return resp


def _json(status: int, obj: Any) -> Response:
    return Response(status, json.dumps(obj).encode(), "application/json")
