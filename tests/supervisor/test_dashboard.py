"""The dashboard's sign-in and routes, without sockets: login links, sessions, refusals, CSP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from supervisor.control import _dashlink
from supervisor.control.dashboard._app import DashboardApp, Request, Response
from supervisor.control.dashboard._server import load_static
from supervisor.control.dashboard._sessions import SESSION_IDLE_S, LoginRefused, Sessions

TOKEN = "control-token-abc"
PORT = 41234
CONTROL_PORT = 41000
HOST = f"127.0.0.1:{PORT}"
ORIGIN = f"http://{HOST}"
STATIC = Path(__file__).resolve().parents[2] / "supervisor" / "dashboard" / "static"


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sessions(wall: Clock | None = None, mono: Clock | None = None) -> Sessions:
    s = Sessions(TOKEN, wall_clock=wall or Clock(1_700_000_000.0), clock=mono or Clock())
    s.bind(PORT)
    return s


def app(s: Sessions | None = None) -> DashboardApp:
    return DashboardApp(s or sessions(), load_static(), control_port=CONTROL_PORT)


def req(method: str, target: str, **headers: str) -> Request:
    hs = {"host": HOST, **{k.replace("_", "-"): v for k, v in headers.items()}}
    return Request(method, target, tuple(hs.items()))


def header(resp: Response, name: str) -> str | None:
    for k, v in resp.headers:
        if k.lower() == name.lower():
            return v
    return None


def signed_in(a: DashboardApp) -> str:
    """Log in through /login; returns the session secret its page keeps (login.js)."""
    login = _dashlink.mint_login_token(TOKEN, now=a.sessions._wall())
    resp = a.handle(req("GET", f"/login?t={login}"))
    assert resp.status == 200 and header(resp, "set-cookie") is None
    found = re.search(rb'<meta name="agentd-session" content="([A-Za-z0-9_-]+)">', resp.body)
    assert found is not None, resp.body
    return found.group(1).decode()


# ------------------------------------------------------------------------- login links


def test_a_login_token_is_accepted_for_the_token_it_was_minted_with_only() -> None:
    login = _dashlink.mint_login_token(TOKEN, now=100.0)
    claim = _dashlink.check_login_token(TOKEN, login, now=101.0)
    assert isinstance(claim, _dashlink.LoginClaim)
    assert claim.expires_at == 100 + _dashlink.LOGIN_TTL_S
    assert "wrong login token" in str(_dashlink.check_login_token("another-daemons-token", login, now=101.0))


def test_a_login_token_expires_and_a_tampered_one_is_refused() -> None:
    login = _dashlink.mint_login_token(TOKEN, now=100.0)
    assert _dashlink.check_login_token(TOKEN, login, now=100.0 + _dashlink.LOGIN_TTL_S + 1) == "expired login token"
    v, exp, nonce, mac = login.split(".")
    longer = f"{v}.{int(exp) + 3600}.{nonce}.{mac}"
    assert "wrong login token" in str(_dashlink.check_login_token(TOKEN, longer, now=101.0))
    # "²" and "١" are digits to str.isdigit(); the first is not to int() (was a ValueError).
    for garbage in (
        "",
        "v1",
        "v2.1.2.3",
        "v1.x.n.m",
        "v1.²³.n.m",
        "v1.١٢.n.m",
        "v1.1.n.m.extra",
        login.replace(".", "", 1),
    ):
        assert isinstance(_dashlink.check_login_token(TOKEN, garbage, now=101.0), str)


def test_a_login_token_minted_for_too_long_is_refused_even_with_the_right_mac() -> None:
    login = _dashlink.mint_login_token(TOKEN, now=100.0, ttl_s=86400)
    assert _dashlink.check_login_token(TOKEN, login, now=101.0) == "login token valid for too long"


def test_the_login_url_carries_the_one_time_token_not_the_control_token() -> None:
    login = _dashlink.mint_login_token(TOKEN)
    url = _dashlink.login_url("http://127.0.0.1:5000/", login)
    assert url == f"http://127.0.0.1:5000/login?t={login}"
    assert TOKEN not in url


# ------------------------------------------------------------------------- sessions


def test_a_login_link_works_once() -> None:
    wall = Clock(1_700_000_000.0)
    s = sessions(wall)
    login = _dashlink.mint_login_token(TOKEN, now=wall.t)
    sid = s.redeem(login)
    assert s.session_of(sid) == sid
    with pytest.raises(LoginRefused, match="already used"):
        s.redeem(login)
    with pytest.raises(LoginRefused, match="expired"):
        wall.t += _dashlink.LOGIN_TTL_S + 1
        s.redeem(_dashlink.mint_login_token(TOKEN, now=wall.t - _dashlink.LOGIN_TTL_S - 2))


def test_a_session_ends_when_idle_or_signed_out() -> None:
    mono = Clock()
    s = sessions(mono=mono)
    sid = s.redeem(_dashlink.mint_login_token(TOKEN, now=s._wall()))
    assert s.session_of(sid) == sid
    assert s.session_of("not-a-session") is None
    assert s.session_of(None) is None
    mono.t += SESSION_IDLE_S - 1
    assert s.session_of(sid) == sid  # use renews it
    mono.t += SESSION_IDLE_S + 1
    assert s.session_of(sid) is None
    sid2 = s.redeem(_dashlink.mint_login_token(TOKEN, now=s._wall()))
    assert s.end(sid2) is True
    assert s.session_of(sid2) is None


def test_only_the_dashboards_own_origin_and_host_names_are_accepted() -> None:
    s = sessions()
    for ok in (f"http://127.0.0.1:{PORT}", f"HTTP://127.0.0.1:{PORT}/"):
        assert s.origin_ok(ok), ok
    for bad in (
        # Names, or the other family: another process may hold that address and port.
        f"http://localhost:{PORT}",
        f"http://[::1]:{PORT}",
        f"http://127.0.0.1:{PORT + 1}",
        f"https://127.0.0.1:{PORT}",
        f"http://evil.example:{PORT}",
        "null",
        f"http://127.0.0.1.evil.example:{PORT}",
    ):
        assert not s.origin_ok(bad), bad
    assert s.host_ok(HOST) and not s.host_ok(f"localhost:{PORT}") and not s.host_ok(f"[::1]:{PORT}")
    both = sessions()
    both.bind(PORT, "::")  # bound to both families: both addresses, still no name
    assert both.host_ok(f"[::1]:{PORT}") and both.host_ok(HOST) and not both.host_ok(f"localhost:{PORT}")
    assert not s.host_ok(f"evil.example:{PORT}") and not s.host_ok("127.0.0.1") and not s.host_ok(None)


def test_the_control_socket_check_needs_both_the_origin_and_a_session_subprotocol() -> None:
    s = sessions()
    sid = s.redeem(_dashlink.mint_login_token(TOKEN, now=s._wall()))
    offered = f"agentd-dashboard, agentd-session.{sid}"
    assert s.handshake_ok(ORIGIN, offered)
    assert not s.handshake_ok("http://evil.example", offered)
    assert not s.handshake_ok(ORIGIN, None)
    assert not s.handshake_ok(ORIGIN, "agentd-dashboard, agentd-session.forged")
    assert not s.handshake_ok(ORIGIN, f"agentd-dashboard, {sid}")


# ------------------------------------------------------------------------- routes


def test_without_a_session_the_api_refuses_and_the_signed_out_page_says_how_to_sign_in() -> None:
    a = app()
    resp = a.handle(req("GET", "/signed-out"))
    assert resp.status == 401
    assert b"agentd dashboard" in resp.body
    api = a.handle(req("GET", "/api/session"))
    assert api.status == 401


def test_login_answers_a_page_that_keeps_the_session_and_sets_no_cookie() -> None:
    a = app()
    sid = signed_in(a)
    page = a.handle(req("GET", "/"))
    assert page.status == 200
    assert b'<script type="module" src="/static/js/main.js">' in page.body
    api = a.handle(req("GET", "/api/session", x_agentd_session=sid))
    assert api.status == 200
    assert b'"control_url": "ws://127.0.0.1:41000/"' in api.body


def test_a_session_cookie_is_no_credential_for_the_api() -> None:
    # A browser sends a host's cookies to every port: another server on 127.0.0.1 would
    # have it. Only the secret the page presents itself counts.
    a = app()
    sid = signed_in(a)
    for name in ("agentd_session", f"agentd_session_{PORT}"):
        assert a.handle(req("GET", "/api/session", cookie=f"{name}={sid}")).status == 401
        assert a.handle(req("POST", "/logout", origin=ORIGIN, cookie=f"{name}={sid}")).status == 403
    assert a.handle(req("GET", "/api/session", x_agentd_session=sid)).status == 200


def test_a_head_request_does_not_use_up_a_login_link() -> None:
    a = app()
    login = _dashlink.mint_login_token(TOKEN, now=a.sessions._wall())
    assert a.handle(req("HEAD", f"/login?t={login}")).status == 200
    resp = a.handle(req("GET", f"/login?t={login}"))
    assert resp.status == 200 and b'content="{{session}}"' not in resp.body


@pytest.mark.parametrize("target", ["/login", "/login?t=", "/login?t=v1.9999999999.abc.def", "/login?t=garbage"])
def test_a_missing_or_wrong_login_token_is_refused(target: str) -> None:
    resp = app().handle(req("GET", target))
    assert resp.status == 401
    assert header(resp, "set-cookie") is None


@pytest.mark.parametrize("target", ["//[", "/login?t=x//[", "//[/login?t=v1.²³.n.m", "/login?t=v1.%C2%B2.n.m"])
def test_a_request_target_that_is_not_a_url_or_a_token_gets_an_answer(target: str) -> None:
    # Each was an exception out of handle(): a closed connection and a traceback.
    resp = app().handle(req("GET", target))
    assert resp.status in (400, 401), resp
    assert header(resp, "set-cookie") is None and header(resp, "content-security-policy") is not None


def test_a_used_login_token_is_refused() -> None:
    a = app()
    login = _dashlink.mint_login_token(TOKEN, now=a.sessions._wall())
    assert a.handle(req("GET", f"/login?t={login}")).status == 200
    again = a.handle(req("GET", f"/login?t={login}"))
    assert again.status == 401 and header(again, "set-cookie") is None


def test_a_foreign_host_header_is_refused_even_with_a_session() -> None:
    a = app()
    sid = signed_in(a)
    for host in ("evil.example:41234", "127.0.0.1:80", "", "localhost"):
        resp = a.handle(Request("GET", "/api/session", (("host", host), ("x-agentd-session", sid))))
        assert resp.status == 421, host
    assert a.handle(Request("GET", "/api/session", (("x-agentd-session", sid),))).status == 421


def test_every_response_has_a_strict_csp_allowing_only_the_control_socket() -> None:
    a = app()
    sid = signed_in(a)
    for target in ("/", "/static/js/main.js", "/nope", "/login?t=x", "/api/session"):
        csp = header(a.handle(req("GET", target, x_agentd_session=sid)), "content-security-policy")
        assert csp is not None, target
        assert "default-src 'none'" in csp and "script-src 'self';" in csp and "style-src 'self';" in csp
        assert "unsafe" not in csp
        assert "connect-src 'self' ws://127.0.0.1:41000;" in csp
        assert "frame-ancestors 'none'" in csp
    resp = a.handle(req("GET", "/"))
    assert header(resp, "x-content-type-options") == "nosniff"
    assert header(resp, "referrer-policy") == "same-origin"
    assert header(resp, "cache-control") == "no-store"


def test_a_cross_site_post_is_refused_and_the_session_survives() -> None:
    a = app()
    sid = signed_in(a)
    for headers in (
        {"origin": "http://evil.example", "x_agentd_session": sid},
        {"origin": f"http://127.0.0.1:{PORT + 1}", "x_agentd_session": sid},  # same site, other origin
        {"origin": "null", "x_agentd_session": sid},
        {"origin": "null", "sec_fetch_site": "cross-site", "x_agentd_session": sid},
        {"origin": "http://evil.example", "sec_fetch_site": "same-origin", "x_agentd_session": sid},
        {"sec_fetch_site": "cross-site", "x_agentd_session": sid},
        {"x_agentd_session": sid},  # neither Origin nor Sec-Fetch-Site: not provably same-origin
    ):
        resp = a.handle(req("POST", "/logout", **headers))
        assert resp.status == 403, headers
    for path in ("/", "/api/session", "/anything", "/login"):
        assert a.handle(req("POST", path, origin="http://evil.example", x_agentd_session=sid)).status == 403
    assert a.handle(req("GET", "/api/session", x_agentd_session=sid)).status == 200


def test_a_same_origin_post_without_a_session_is_refused() -> None:
    a = app()
    assert a.handle(req("POST", "/logout", origin=ORIGIN)).status == 403
    assert a.handle(req("POST", "/logout", origin=ORIGIN, x_agentd_session="forged")).status == 403


def test_sign_out_from_the_page_ends_the_session() -> None:
    a = app()
    sid = signed_in(a)
    resp = a.handle(req("POST", "/logout", origin=ORIGIN, x_agentd_session=sid))
    assert resp.status == 200
    assert a.handle(req("GET", "/api/session", x_agentd_session=sid)).status == 401
    sid2 = signed_in(a)
    assert a.handle(req("POST", "/logout", sec_fetch_site="same-origin", x_agentd_session=sid2)).status == 200
    sid3 = signed_in(a)
    resp = a.handle(req("POST", "/logout", origin="null", sec_fetch_site="same-origin", x_agentd_session=sid3))
    assert resp.status == 200


def test_static_files_have_their_types_and_nothing_else_is_served() -> None:
    a = app()
    assert a.handle(req("GET", "/static/app.css")).content_type.startswith("text/css")
    assert a.handle(req("GET", "/static/js/conn.js")).content_type.startswith("text/javascript")
    # A page without an icon link (a plain-text refusal) makes the browser ask for this.
    assert a.handle(req("GET", "/favicon.ico")).content_type.startswith("image/svg+xml")
    for target in ("/static/../_app.py", "/static/js/../../__init__.py", "/static/nope.js", "/static/", "/etc/passwd"):
        assert a.handle(req("GET", target)).status == 404, target
    assert a.handle(req("GET", "/logout")).status == 405


# ------------------------------------------------------------------------- the files


def test_the_page_has_no_inline_script_or_style_and_fetches_nothing_from_the_internet() -> None:
    files = load_static()
    assert {"index.html", "signed-out.html", "app.css", "js/main.js", "js/conn.js", "js/stop.js"} <= set(files)
    for name, body in files.items():
        text = body.decode()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
        if name.endswith(".html"):
            for tag in re.findall(r"<script\b[^>]*>", text):
                assert "src=" in tag, f"{name}: inline script {tag}"
            assert "<style" not in text and " style=" not in text, name
            assert not re.search(r"\son[a-z]+=", text), f"{name}: inline event handler"
            for ref in re.findall(r'(?:src|href)="(/static/[^"]+)"', text):
                assert ref[len("/static/") :] in files, f"{name} refers to missing {ref}"
        if name.endswith(".js"):
            for spec in re.findall(r'^import .* from "([^"]+)";', text, re.M):
                assert spec.startswith("./") and spec[2:] in {n[3:] for n in files if n.startswith("js/")}, (
                    f"{name}: {spec}"
                )
            assert "innerHTML" not in text and "eval(" not in text, name


def test_the_package_data_covers_every_static_file() -> None:
    import tomllib

    pyproject = tomllib.loads((STATIC.parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["supervisor.control.dashboard"]
    shipped = {str(p.relative_to(STATIC.parent)) for pat in patterns for p in STATIC.parent.glob(pat)}
    on_disk = {str(p.relative_to(STATIC.parent)) for p in STATIC.rglob("*") if p.is_file()}
    assert on_disk == shipped
