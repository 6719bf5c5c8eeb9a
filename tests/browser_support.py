"""Shared by the real-Chromium tests: a local site to browse and a leftover-process check.

``LocalSite`` serves pages on 127.0.0.1 from a thread; its ``/slow`` page holds its response
until released (or the site closes), so a test can have a browser mid-navigation and know
it is, without sleeping. ``leftover_browser_processes`` finds what a test left behind:
processes carrying the test's env mark, everything in their sessions (Chromium's helpers
overwrite /proc/PID/environ with their title, so an env scan alone misses them), and any
chromium/node process whose command line names the test's directory.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import pathlib
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Self

import psutil

from tests import conftest

NODE_MODULES_CLI = pathlib.Path(__file__).resolve().parent.parent / "node_modules/@playwright/mcp/cli.js"
CHROMIUM = pathlib.Path("/usr/lib/chromium/chromium")

# How long a run's processes may take to be gone after its terminal state (seconds).
LEFTOVER_DEADLINE_S = 10.0


def require_browser() -> None:
    """Skip (fail in CI) unless node, @playwright/mcp and a Chromium are here."""
    conftest.require(shutil.which("node") is not None, "node (apt-get install nodejs)")
    conftest.require(NODE_MODULES_CLI.is_file(), "node_modules/@playwright/mcp (run scripts/setup)")
    conftest.require(
        CHROMIUM.is_file() or bool(os.environ.get("AGENTD_CHROMIUM")), "chromium (apt-get install chromium)"
    )


PAGES = {
    "/": (
        "<!doctype html><html><head><title>agentd test home</title></head><body>"
        "<h1>Welcome to the zebra archive</h1>"
        "<p id='secret'>The password is tangerine-42.</p>"
        "<a href='/second'>Second page</a> <a href='/slow'>Slow page</a>"
        "</body></html>"
    ),
    "/second": (
        "<!doctype html><html><head><title>second</title></head><body>"
        "<h2>Second page</h2><p>Giraffes are tall.</p></body></html>"
    ),
}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        self.server.site._hit(path)
        if path == "/slow":
            # Held until the test releases it or the site closes: a navigation in flight.
            self.server.site._release.wait(timeout=120)
            body = "<!doctype html><html><body><h1>Finally loaded</h1></body></html>"
        elif path in self.server.site.pages:
            body = self.server.site.pages[path]
        else:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    site: LocalSite


class LocalSite:
    """A tiny web site on 127.0.0.1:<ephemeral port>, served from a thread."""

    def __init__(self, pages: dict[str, str] | None = None) -> None:
        self.pages = dict(PAGES if pages is None else pages)
        self._release = threading.Event()
        self._cond = threading.Condition()
        self._counts: dict[str, int] = {}
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.site = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _hit(self, path: str) -> None:
        with self._cond:
            self._counts[path] = self._counts.get(path, 0) + 1
            self._cond.notify_all()

    def requests(self, path: str) -> int:
        with self._cond:
            return self._counts.get(path, 0)

    def wait_for_request(self, path: str, timeout: float, count: int = 1) -> bool:
        """Block (call it via trio.to_thread) until ``path`` was requested ``count`` times."""
        with self._cond:
            return self._cond.wait_for(lambda: self._counts.get(path, 0) >= count, timeout)

    def release_slow(self) -> None:
        self._release.set()

    def __enter__(self) -> LocalSite:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def read_with_own_browser(url: str, selector: str) -> str:
    """The text of ``selector`` at ``url``, read by a browser of the test's own (Python
    Playwright, sync API: call it through trio.to_thread). An independent witness for what
    a sub-agent reported."""
    from playwright.sync_api import sync_playwright

    # Its temp dirs in one of the test's own (Chromium left org.chromium.Chromium.* in /tmp).
    with tempfile.TemporaryDirectory(prefix="agentd-test-chromium-") as tmp, sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=os.environ.get("AGENTD_CHROMIUM") or str(CHROMIUM),
            headless=True,
            args=["--no-sandbox"],
            env={**os.environ, "TMPDIR": tmp},
        )
        try:
            page = b.new_page()
            page.goto(url)
            return page.inner_text(selector)
        finally:
            b.close()


class Listener:
    """A listener on 127.0.0.1 served by a thread, each connection given to ``handle``
    (default: closed at once). A context manager: the thread stops at the exit."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)  # so the thread sees _stop: close() does not wake accept()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def handle(self, conn: socket.socket) -> None:
        conn.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.handle(conn)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


class TrapProxy(Listener):
    """A listener posing as an HTTP proxy: it records the first line of every request a
    browser sends it (``CONNECT update.googleapis.com:443 ...``) and answers nothing.
    Chromium bypasses the proxy for loopback, so local test pages load directly."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[str] = []

    @property
    def arg(self) -> str:
        return f"--proxy-server=http://127.0.0.1:{self.port}"

    def handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2)
            try:
                self.requests.append(conn.recv(1024).split(b"\r\n", 1)[0].decode(errors="replace"))
            except OSError:
                pass


def stop_sessions_of(find: Callable[[], list[int]], *, keep: Iterable[int] = (), deadline_s: float = 5.0) -> list[int]:
    """SIGSTOP every session (process group) the processes ``find()`` returns belong to, except
    the sessions in ``keep``, until all of them show as stopped: a wedged browser. Blocking.

    Returns the stopped pids. A helper forked while we signal is caught by the next round.
    """
    keep = set(keep)
    end = time.monotonic() + deadline_s
    while True:
        pids = []
        for pid in find():
            try:
                if os.getsid(pid) not in keep:
                    pids.append(pid)
            except OSError:
                continue
        for sid in {os.getsid(p) for p in pids if psutil.pid_exists(p)}:
            try:
                os.killpg(sid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        states = {}
        for pid in pids:
            try:
                states[pid] = psutil.Process(pid).status()
            except psutil.Error:
                continue
        if states and all(st == psutil.STATUS_STOPPED for st in states.values()):
            return sorted(states)
        if time.monotonic() > end:
            raise AssertionError(f"could not stop the browser: {states}")
        time.sleep(0.02)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _env_marked(needles: list[bytes]) -> set[int]:
    me = os.getpid()
    found = set()
    for pid in psutil.pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if any(n in env for n in needles):
            found.add(pid)
    return found


def leftover_browser_processes(
    mark: str | None, fragments: Iterable[str] = (), env: Iterable[str] = ()
) -> list[psutil.Process]:
    """Live processes that belong to a test or a run: an env marker (``AGENTD_TEST_MARK=mark``
    and any ``VAR=value`` in ``env``, e.g. a run's ``AGENTD_TREE``), everything in the sessions
    of those, or a command line naming one of ``fragments`` (a run dir, its browser temp dir).
    Our own session is never counted: pytest itself carries the test's mark."""
    frags = [f for f in fragments if f]
    wanted = [*([f"{conftest.MARK_VAR}={mark}"] if mark else []), *env]
    marked = _env_marked([b"\0" + w.encode() + b"\0" for w in wanted]) if wanted else set()
    my_sid = os.getsid(0)
    sids: set[int] = set()
    for pid in marked:
        try:
            sid = os.getsid(pid)
        except OSError:
            continue
        if sid != my_sid:
            sids.add(sid)
    found: dict[int, psutil.Process] = {}
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.pid == me:
            continue
        hit = p.pid in marked
        if not hit:
            try:
                hit = os.getsid(p.pid) in sids
            except OSError:
                continue
        if not hit and frags:
            cmdline = " ".join(p.info.get("cmdline") or ())
            hit = any(f in cmdline for f in frags)
        if hit and _alive(p):
            found[p.pid] = p
    return list(found.values())


def wait_no_browser_left(
    mark: str | None,
    fragments: Iterable[str] = (),
    deadline_s: float = LEFTOVER_DEADLINE_S,
    env: Iterable[str] = (),
) -> None:
    """Fail (after killing them) if these processes are not all gone within the deadline.

    A polling wait is the only way to watch for the death of processes we are not the parent
    of; it is bounded and never used to synchronise with the code under test.
    """
    frags, envs = list(fragments), list(env)
    end = time.monotonic() + deadline_s
    left = leftover_browser_processes(mark, frags, envs)
    while left and time.monotonic() < end:
        time.sleep(0.1)
        left = leftover_browser_processes(mark, frags, envs)
    if left:
        text = conftest.describe(left)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        raise AssertionError(f"processes left behind: {text}")


# --- driving a runner (python -m subagent.runner) directly --------------------------


def runner_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("subagent.runner") is not None


def scripted_browser_spec(
    url: str, *, then: list[dict[str, object]] | None = None, **browser: object
) -> dict[str, object]:
    """A scripted run: open ``url``, snapshot it, answer with the password the page shows.

    ``then`` adds turns after the snapshot (e.g. a navigation to ``/slow`` to be cancelled in).
    """
    turns: list[dict[str, object]] = [
        {"text": "Opening the page.", "tool_calls": [{"name": "browser_navigate", "arguments": {"url": url}}]},
        {"text": "Reading what it says.", "tool_calls": [{"name": "browser_snapshot", "arguments": {}}]},
        *(then or []),
    ]
    return {
        "task": "Open the page and tell me the password it shows.",
        "model": {
            "provider": "scripted",
            "script": {
                "turns": turns,
                "extract": r"The password is ([a-z0-9-]+)",
                "final": "The page says the password is {{match}}.",
            },
        },
        "builtin_tools": [],
        "browser": dict(browser) if browser else True,
        "limits": {"max_steps": 10},
    }


def status_field(pid: int, name: str) -> str:
    """One field of ``/proc/PID/status`` (``Seccomp`` tells whether Chromium sandboxed a process)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


@contextlib.asynccontextmanager
async def browser_daemon(tmp_path: pathlib.Path, monkeypatch: Any, **config: Any) -> AsyncIterator[Any]:
    """An in-process daemon for browser runs (its ``RunManager``): skipped without a
    browser or the runner; no model key; this checkout on the runners' ``PYTHONPATH``.
    ``config``: more settings (``grace_s``, ``runner_python``)."""
    from tests.supervisor.test_stop_tools import start_daemon

    require_browser()
    conftest.require(runner_available(), "subagent.runner")
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).resolve().parent.parent))
    async with start_daemon(tmp_path, monkeypatch, **config) as manager:
        yield manager
