"""The browser preset: flags, paths under the run dir, clear errors; then real Chromium
through the mcp SDK against the preset (marked ``chromium``)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import trio

from subagent.tools import browser, browser_setup
from subagent.tools.browser import BrowserSetupError, browser_server_config, check_browser, find_chromium

# --- fakes: executables that exist, so the unit tests need no real node or Chromium -----


def _exe(path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def link_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[pathlib.Path]:
    """Short temp links go to a short private dir, removed with everything in it."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="al", dir="/tmp"))
    monkeypatch.setattr(browser, "LINK_ROOT", root)
    try:
        yield root
    finally:
        shutil.rmtree(root)


@pytest.fixture
def fake_tools(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, link_root: pathlib.Path
) -> dict[str, pathlib.Path]:
    tools = {
        "node": _exe(tmp_path / "bin" / "node"),
        "chromium": _exe(tmp_path / "chromium" / "chromium"),
        "cli": tmp_path / "node_modules" / "@playwright" / "mcp" / "cli.js",
    }
    tools["cli"].parent.mkdir(parents=True)
    tools["cli"].write_text("// fake\n")
    monkeypatch.setenv("AGENTD_NODE", str(tools["node"]))
    monkeypatch.setenv("AGENTD_CHROMIUM", str(tools["chromium"]))
    monkeypatch.setenv("AGENTD_PLAYWRIGHT_MCP", str(tools["cli"].parent))
    return tools


@pytest.fixture
def nothing_installed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without Chromium, node or the npm install."""
    for var in ("AGENTD_NODE", "AGENTD_CHROMIUM", "AGENTD_PLAYWRIGHT_MCP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(browser_setup, "DEBIAN_CHROMIUM", tmp_path / "no" / "chromium")
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(tmp_path / "no-ms-playwright"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(browser_setup, "CHECKOUT_ROOT", tmp_path / "fresh-clone")


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_preset_runs_node_directly_headless_isolated_with_the_found_chromium(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    cfg = browser_server_config(tmp_path / "run", True)
    assert set(cfg) == {"command", "args", "env", "cwd"}
    assert cfg["command"] == str(fake_tools["node"])
    args = cfg["args"]
    assert args[0] == str(fake_tools["cli"])
    assert "npx" not in " ".join([cfg["command"], *args])
    for flag in ("--headless", "--isolated", "--no-sandbox", "--no-webmcp"):
        assert flag in args
    assert _flag(args, "--browser") == "chromium"
    assert _flag(args, "--executable-path") == str(fake_tools["chromium"])
    assert _flag(args, "--image-responses") == "omit"


def test_everything_the_browser_writes_is_under_the_run_dir(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    run_dir = tmp_path / "runs" / "r1"
    cfg = browser_server_config(run_dir, {})
    paths = [
        cfg["cwd"],
        _flag(cfg["args"], "--output-dir"),
        _flag(cfg["args"], "--config"),
        *(cfg["env"][k] for k in ("TMPDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME")),
    ]
    for p in paths:
        assert pathlib.Path(p).is_absolute()
        assert pathlib.Path(p).resolve().is_relative_to(run_dir.resolve()), p
        assert pathlib.Path(p).exists(), p
    config = json.loads(pathlib.Path(_flag(cfg["args"], "--config")).read_text())
    assert config["outputDir"] == _flag(cfg["args"], "--output-dir")
    assert config["browser"]["isolated"] is True
    launch = config["browser"]["launchOptions"]
    assert launch["executablePath"] == str(fake_tools["chromium"])
    assert launch["headless"] is True and launch["chromiumSandbox"] is False
    for quiet in ("--no-pings", "--disable-domain-reliability"):
        assert quiet in launch["args"]


def test_a_sessions_profile_is_set_to_keep_session_cookies_and_reopen_no_tab(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    # Chromium deletes the session cookies it wrote at its last shutdown unless the profile
    # continues where it left off; the tabs it would then reopen are removed first.
    profile = tmp_path / "sessions" / "s1" / "browser-profile"
    default = profile / "Default"
    (default / "Sessions").mkdir(parents=True)
    (default / "Sessions" / "Session_1").write_text("tabs")
    (default / "Sessions_Encrypted").mkdir()
    prefs = {"profile": {"exit_type": "Normal"}, "session": {"startup_urls": ["http://x/"]}}
    (default / "Preferences").write_text(json.dumps(prefs))
    cfg = browser_server_config(tmp_path / "run", True, profile_dir=profile)
    assert _flag(cfg["args"], "--user-data-dir") == str(profile) and "--isolated" not in cfg["args"]
    assert sorted(p.name for p in default.iterdir()) == ["Preferences"]
    kept = json.loads((default / "Preferences").read_text())
    assert kept == {
        "profile": {"exit_type": "Normal"},
        "session": {"startup_urls": ["http://x/"], "restore_on_startup": 1},
    }
    # A fresh profile, an unreadable Preferences, one that is not a file: set, never read.
    for before in (None, "{not json", b"\xff", "fifo"):
        shutil.rmtree(profile)
        if before is not None:
            default.mkdir(parents=True)
            if before == "fifo":
                os.mkfifo(default / "Preferences")  # a read would block the runner for good
            elif isinstance(before, bytes):
                (default / "Preferences").write_bytes(before)
            else:
                (default / "Preferences").write_text(before)
        browser.prepare_session_profile(profile)
        assert json.loads((default / "Preferences").read_text()) == {"session": {"restore_on_startup": 1}}
    # Idempotent; a profile that cannot be written is a setup error naming it.
    browser.prepare_session_profile(profile)
    shutil.rmtree(default)
    default.write_text("not a dir")  # (as root too, unlike a read-only dir)
    with pytest.raises(BrowserSetupError, match="session's browser profile"):
        browser_server_config(tmp_path / "run", True, profile_dir=profile)


def test_env_carries_agentd_markers_and_nothing_else_from_the_caller(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from subagent.spec import McpServerSpec
    from subagent.tools.mcp_spawn import server_env

    monkeypatch.setenv("AGENTD_TREE", "tree-123")
    monkeypatch.setenv("SECRET_TOKEN", "do-not-pass")
    entry = browser_server_config(tmp_path / "run", True)
    assert set(entry["env"]) == {"TMPDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"}
    # What the server process gets: the tool environment under the preset's own.
    env = server_env(McpServerSpec.from_dict(entry, "browser"), "m")
    assert env["AGENTD_TREE"] == "tree-123"
    assert env["AGENTD_TEST_MARK"] == os.environ["AGENTD_TEST_MARK"]
    assert env["TMPDIR"] == entry["env"]["TMPDIR"]
    assert "SECRET_TOKEN" not in env
    assert all(isinstance(v, str) for v in env.values())


def test_chromium_sandbox_follows_what_the_run_allows(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    on = browser_server_config(tmp_path / "a", True, sandbox=(True, None))
    assert "--sandbox" in on["args"] and "--no-sandbox" not in on["args"]
    off = browser_server_config(tmp_path / "b", True, sandbox=(False, "the run is uid 0"))
    assert "--no-sandbox" in off["args"]
    forced_off = browser_server_config(tmp_path / "c", {"sandbox": False}, sandbox=(True, None))
    assert "--no-sandbox" in forced_off["args"]
    with pytest.raises(BrowserSetupError, match="cannot work for this run: the run is uid 0"):
        browser_server_config(tmp_path / "d", {"sandbox": True}, sandbox=(False, "the run is uid 0"))


def test_options_become_flags_and_chromium_args(tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]) -> None:
    other = _exe(tmp_path / "other" / "chrome")
    cfg = browser_server_config(
        tmp_path / "run",
        {
            "executable_path": str(other),
            "headless": False,
            "sandbox": True,
            "args": ["--lang=de"],
            "viewport": "1024x768",
            "allowed_origins": ["http://127.0.0.1:*", "https://example.org"],
            "blocked_origins": ["https://ads.example"],
            "timeout_action_ms": 2000,
            "timeout_navigation_ms": 9000,
            "image_responses": "allow",
            "caps": ["pdf"],
            "webmcp": True,
        },
        sandbox=(True, None),
    )
    args = cfg["args"]
    assert _flag(args, "--executable-path") == str(other)
    assert "--headless" not in args and "--sandbox" in args and "--no-sandbox" not in args
    assert _flag(args, "--viewport-size") == "1024x768"
    assert _flag(args, "--allowed-origins") == "http://127.0.0.1:*;https://example.org"
    assert _flag(args, "--blocked-origins") == "https://ads.example"
    assert _flag(args, "--timeout-action") == "2000"
    assert _flag(args, "--timeout-navigation") == "9000"
    assert _flag(args, "--image-responses") == "allow"
    assert _flag(args, "--caps") == "pdf"
    assert "--no-webmcp" not in args
    launch = json.loads(pathlib.Path(_flag(args, "--config")).read_text())["browser"]["launchOptions"]
    assert launch["args"][-1] == "--lang=de"
    assert launch["headless"] is False and launch["chromiumSandbox"] is True


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"headles": True}, "'headles'"),
        ({"viewport": "big"}, "'viewport'"),
        ({"args": "--x"}, "'args'"),
        ({"timeout_action_ms": 0}, "'timeout_action_ms'"),
        ({"image_responses": "never"}, "'image_responses'"),
        ({"caps": ["telepathy"]}, "'caps'"),
        (False, "browser options"),
        ("yes", "browser options"),
    ],
)
def test_bad_options_are_named_in_the_error(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path], options: object, field: str
) -> None:
    with pytest.raises(BrowserSetupError) as info:
        browser_server_config(tmp_path / "run", options)  # type: ignore[arg-type]
    assert field in info.value.what
    assert not (tmp_path / "run").exists()


def test_missing_chromium_says_what_to_install(nothing_installed: None) -> None:
    with pytest.raises(BrowserSetupError) as info:
        find_chromium()
    assert "chromium not found" in info.value.what
    assert "apt-get install chromium" in info.value.hint
    assert "apt-get install chromium" in str(info.value)


def test_an_explicit_chromium_that_is_not_there_is_an_error_not_a_fallback(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browser_setup, "DEBIAN_CHROMIUM", _exe(tmp_path / "debian" / "chromium"))
    monkeypatch.setenv("AGENTD_CHROMIUM", str(tmp_path / "typo"))
    with pytest.raises(BrowserSetupError) as info:
        find_chromium()
    assert str(tmp_path / "typo") in info.value.what and "AGENTD_CHROMIUM" in info.value.what
    with pytest.raises(BrowserSetupError, match="executable_path"):
        find_chromium(tmp_path / "also-typo")


def test_chromium_search_order(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, nothing_installed: None
) -> None:
    managed_root = tmp_path / "ms-playwright"
    monkeypatch.setenv("PLAYWRIGHT_BROWSERS_PATH", str(managed_root))
    old = _exe(managed_root / "chromium-1100" / "chrome-linux" / "chrome")
    new = _exe(managed_root / "chromium-1200" / "chrome-linux64" / "chrome")
    _exe(managed_root / "chromium_headless_shell-1300" / "chrome-headless-shell-linux64" / "chrome-headless-shell")
    assert old.exists()
    assert find_chromium() == new  # the newest full Chromium Playwright manages
    (managed_root / "chromium-1100").rename(managed_root / "x-1100")
    (managed_root / "chromium-1200").rename(managed_root / "x-1200")
    shell = managed_root / "chromium_headless_shell-1300" / "chrome-headless-shell-linux64" / "chrome-headless-shell"
    assert find_chromium() == shell  # a headless shell when that is all there is
    debian = _exe(tmp_path / "debian" / "chromium")
    monkeypatch.setattr(browser_setup, "DEBIAN_CHROMIUM", debian)
    assert find_chromium() == debian  # Debian's before Playwright's
    env_one = _exe(tmp_path / "env" / "chromium")
    monkeypatch.setenv("AGENTD_CHROMIUM", str(env_one))
    assert find_chromium() == env_one  # the environment before Debian's
    explicit = _exe(tmp_path / "explicit" / "chromium")
    assert find_chromium(explicit) == explicit  # an explicit option before everything


def test_missing_node_and_npm_install_say_what_to_run(nothing_installed: None) -> None:
    with pytest.raises(BrowserSetupError) as info:
        browser.find_node()
    assert "node not found" in info.value.what and "nodejs" in info.value.hint
    with pytest.raises(BrowserSetupError) as info:
        browser.find_playwright_mcp()
    assert "@playwright/mcp" in info.value.what
    assert "scripts/setup" in info.value.hint and "npm ci" in info.value.hint


def test_spawn_time_check_reports_the_first_missing_piece_without_writing(
    tmp_path: pathlib.Path, nothing_installed: None
) -> None:
    with pytest.raises(BrowserSetupError, match="node"):
        check_browser(True)
    with pytest.raises(BrowserSetupError, match="node"):
        browser_server_config(tmp_path / "run", True)
    assert not (tmp_path / "run").exists()


def test_the_checkout_install_is_found_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTD_PLAYWRIGHT_MCP", raising=False)
    cli = browser_setup.CHECKOUT_ROOT / browser_setup.PLAYWRIGHT_MCP_CLI
    if not cli.is_file():
        with pytest.raises(BrowserSetupError, match="scripts/setup"):
            browser.find_playwright_mcp()
    else:
        assert browser.find_playwright_mcp() == cli


def test_a_short_run_dir_is_tmpdir_itself_and_a_deep_one_gets_a_short_link(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    short_root = pathlib.Path(tempfile.mkdtemp(prefix="ab", dir="/tmp"))
    try:
        short = short_root / "r"
        env = browser_server_config(short, True)["env"]
        assert env["TMPDIR"] == str(short / "browser" / "tmp")
        assert browser.browser_tmpdir(short) == short / "browser" / "tmp"

        deep = tmp_path / ("d" * 80) / "run"
        tmpdir = pathlib.Path(browser_server_config(deep, True)["env"]["TMPDIR"])
        assert len(str(tmpdir)) + len("/org.chromium.Chromium.XXXXXX/SingletonSocket") < 108
        assert tmpdir.is_symlink() and tmpdir.resolve() == (deep / "browser" / "tmp").resolve()
        assert browser.browser_tmpdir(deep) == tmpdir
        # Idempotent for the same run, and released when the run ends.
        assert browser_server_config(deep, True)["env"]["TMPDIR"] == str(tmpdir)
        browser.release_browser_dir(deep)
        assert not tmpdir.is_symlink()
        browser.release_browser_dir(deep)

        # A link whose run dir vanished without a release is swept by the next run.
        gone = tmp_path / ("g" * 80) / "run"
        stale = pathlib.Path(browser_server_config(gone, True)["env"]["TMPDIR"])
        shutil.rmtree(gone)
        assert stale.is_symlink()
        browser_server_config(deep, True)
        assert not stale.is_symlink()
    finally:
        browser.release_browser_dir(tmp_path / ("d" * 80) / "run")
        shutil.rmtree(short_root)


def _as_user(uid: int, gid: int, fn: Callable[[], object]) -> int:
    """Run ``fn`` in a forked child that is ``uid``/``gid`` (no groups); its exit code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            fn()
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_another_users_links_in_a_shared_tmp_are_left_alone_and_never_stop_ours(
    tmp_path: pathlib.Path, link_root: pathlib.Path
) -> None:
    from tests.conftest import require

    require(os.geteuid() == 0, "root, to be two users")
    nobody = 65534
    link_root.chmod(0o1777)  # /tmp's mode
    # Root's link into a dir a normal user cannot enter: a stat of its target is EACCES.
    theirs = link_root / (browser.LINK_PREFIX + "0" * 16)
    theirs.symlink_to(tmp_path / "root-only" / "tmp")
    deep = link_root / "u" / ("d" * 80) / "run"
    deep.mkdir(parents=True)
    for p in (deep, deep.parent, deep.parent.parent):
        os.chown(p, nobody, nobody)
    assert _as_user(nobody, nobody, lambda: browser.browser_tmpdir(deep, create=True)) == 0
    ours = browser.browser_tmpdir(deep)
    assert ours.is_symlink() and ours.lstat().st_uid == nobody
    assert theirs.is_symlink()  # neither followed nor swept (it is dangling to root, too)
    assert _as_user(nobody, nobody, lambda: browser.release_browser_dir(deep)) == 0
    assert not ours.is_symlink() and theirs.is_symlink()
    # Our link's name taken by another user: a clear error, their link untouched.
    taken = link_root / "r" / ("t" * 80) / "run"
    squat = browser._link_path(browser.browser_dir(taken) / "tmp")
    squat.symlink_to(tmp_path)
    os.lchown(squat, nobody, nobody)
    with pytest.raises(BrowserSetupError, match="belongs to another user"):
        browser.browser_tmpdir(taken, create=True)
    assert squat.is_symlink()


# --- real Chromium through the mcp SDK ------------------------------------------------

# How long a browser is watched for requests nobody asked for (seconds after start).
QUIET_WINDOW_S = 5.0


def _snapshot_text(result: object) -> str:
    return "\n".join(getattr(c, "text", "") for c in getattr(result, "content", []))


@pytest.mark.chromium
async def test_real_chromium_reads_a_local_page_and_leaves_nothing(
    tmp_path: pathlib.Path, no_process_left_behind: str, link_root: pathlib.Path
) -> None:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    from tests import browser_support as bs

    bs.require_browser()
    run_dir = tmp_path / "run"
    with bs.LocalSite() as site, bs.TrapProxy() as trap:
        cfg = browser_server_config(run_dir, {"timeout_navigation_ms": 20000, "args": [trap.arg]})
        with trio.fail_after(60):
            async with stdio_client(StdioServerParameters(**cfg)) as (r, w):
                async with ClientSession(r, w) as session:
                    await session.initialize()
                    started = trio.current_time()
                    tools = {t.name for t in (await session.list_tools()).tools}
                    assert {"browser_navigate", "browser_snapshot", "browser_click"} <= tools
                    await session.call_tool("browser_navigate", {"url": site.url + "/"})
                    snap = _snapshot_text(await session.call_tool("browser_snapshot", {}))
                    assert "Welcome to the zebra archive" in snap, snap
                    assert "tangerine-42" in snap
                    await session.call_tool("browser_navigate", {"url": site.url + "/second"})
                    snap = _snapshot_text(await session.call_tool("browser_snapshot", {}))
                    assert "Giraffes are tall." in snap
                    # An observation window, not a synchronisation: without the preset's
                    # quiet switches Chromium phones Google within ~3 s of starting.
                    await trio.sleep_until(started + QUIET_WINDOW_S)
        assert trap.requests == [], f"the browser reached for the network on its own: {trap.requests}"
    await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [str(run_dir), cfg["env"]["TMPDIR"]])
    # The profile lived in the run's TMPDIR; its output went to the run's output dir.
    assert list((run_dir / "browser" / "output").glob("*")), "no output files where the preset put them"
    assert not list((run_dir / "browser" / "tmp").glob("playwright_chromiumdev_profile-*"))
    browser.release_browser_dir(run_dir)
    assert not pathlib.Path(cfg["env"]["TMPDIR"]).is_symlink()


@pytest.mark.chromium
async def test_a_stopped_browser_whose_server_and_main_process_were_killed_is_still_found_and_ended(
    tmp_path: pathlib.Path, no_process_left_behind: str, link_root: pathlib.Path
) -> None:
    """The leak this preset exists to prevent: SIGSTOP the browser, SIGKILL node's group and the
    browser main process (what a group kill plus a marker sweep reaches). Chromium's helpers
    survive, stopped and reparented, without the marker in /proc/PID/environ; the profile
    Chromium could not remove is under the run dir. ``end_browser_processes`` ends them."""
    from tests import browser_support as bs

    bs.require_browser()
    run_dir = tmp_path / "run"
    cfg = browser_server_config(run_dir, True)
    proc = await trio.lowlevel.open_process(
        [cfg["command"], *cfg["args"]],
        env={**os.environ, **cfg["env"]},
        cwd=cfg["cwd"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        lines = b""

        async def request(obj: dict[str, object]) -> dict[str, object]:
            nonlocal lines
            await proc.stdin.send_all((json.dumps(obj) + "\n").encode())  # type: ignore[union-attr]
            while True:
                while b"\n" not in lines:
                    chunk = await proc.stdout.receive_some()  # type: ignore[union-attr]
                    assert chunk, "server closed stdout"
                    lines += chunk
                line, lines = lines.split(b"\n", 1)
                msg = json.loads(line)
                if msg.get("id") == obj["id"]:
                    return msg

        with trio.fail_after(60):
            await request({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})  # fmt: skip
            await proc.stdin.send_all(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n')
            reply = await request({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
                "name": "browser_navigate", "arguments": {"url": "data:text/html,<h1>kill me</h1>"}}})  # fmt: skip
            assert "kill me" in json.dumps(reply)
        found = set(browser.browser_processes(run_dir))
        assert proc.pid in found, "the node server is found by its command line"
        # The browser main process: no --type= (helpers have one), not a crashpad handler.
        mains = [
            p for p in found
            if p != proc.pid and not re.search(rb"--type=|crashpad", pathlib.Path(f"/proc/{p}/cmdline").read_bytes())
        ]  # fmt: skip
        assert len(mains) == 1, mains
        main = mains[0]
        assert os.getsid(main) == main, "Chromium runs in a session of its own"
        os.killpg(main, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGKILL)
        os.kill(main, signal.SIGKILL)
        with trio.fail_after(10):
            while main in browser.browser_processes(run_dir) or proc.pid in browser.browser_processes(run_dir):
                await trio.sleep(0.05)
        helpers = browser.browser_processes(run_dir)
        assert helpers, "expected Chromium's stopped helpers to outlive their browser (the leak)"
        unmarked = set(helpers) - {p.pid for p in conftest_marked(no_process_left_behind)}
        assert unmarked, "Chromium's helpers were expected to have lost the env marker"
        left = await browser.end_browser_processes(run_dir)
        assert left == []
        assert browser.browser_processes(run_dir) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await browser.end_browser_processes(run_dir)
        with trio.move_on_after(5, shield=True):
            await proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                await stream.aclose()
    await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [str(run_dir), cfg["env"]["TMPDIR"]])
    profiles = list((run_dir / "browser" / "tmp").glob("playwright_chromiumdev_profile-*"))
    assert profiles, "a killed Chromium cannot remove its profile: it must be under the run dir"
    browser.release_browser_dir(run_dir)


def conftest_marked(mark: str) -> list[Any]:
    from tests import conftest

    return conftest.marked_processes(mark)


# --- real Chromium through the runner (python -m subagent.runner) ---------------------


class _Runner:
    """A runner child with its pipes: events collected from stderr, the result from stdout."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.events: list[Any] = []
        self.bad_lines: list[Any] = []
        self.stdout = b""
        self._changed = trio.Event()

    async def pump(self) -> None:
        from subagent.events import BadLine, decode_event_line

        async def err() -> None:
            buf = b""
            assert self.proc.stderr is not None
            async for chunk in self.proc.stderr:
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    item = decode_event_line(line)
                    (self.bad_lines if isinstance(item, BadLine) else self.events).append(item)
                self._changed.set()
                self._changed = trio.Event()

        async def out() -> None:
            assert self.proc.stdout is not None
            async for chunk in self.proc.stdout:
                self.stdout += chunk

        async with trio.open_nursery() as n:
            n.start_soon(err)
            n.start_soon(out)

    async def wait_event(self, kind: str) -> Any:
        while True:
            for ev in self.events:
                if str(ev.kind) == kind:
                    return ev
            await self._changed.wait()


async def _run_runner(
    spec: dict[str, Any], run_dir: pathlib.Path, body: Callable[[_Runner], Awaitable[None]] | None = None
) -> tuple[_Runner, dict[str, Any]]:
    from subagent.events import decode_result

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tmp").mkdir(exist_ok=True)
    env = {
        **os.environ,
        "AGENTD_RUN_ID": "r-browser-test",
        "AGENTD_RUN_DIR": str(run_dir),
        "AGENTD_TREE": "t-" + os.environ["AGENTD_TEST_MARK"][:12],
        "TMPDIR": str(run_dir / "tmp"),
    }
    env.pop("OPENAI_API_KEY", None)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "subagent.runner"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=run_dir,
        start_new_session=True,
    )
    runner = _Runner(proc)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.pump)
            assert proc.stdin is not None
            await proc.stdin.send_all(json.dumps(spec).encode() + b"\n")
            await proc.stdin.aclose()
            if body is not None:
                await body(runner)
            await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with trio.move_on_after(5, shield=True):
                await proc.wait()
    result = decode_result(runner.stdout)
    assert isinstance(result, dict), f"no result: {result!r}; events: {runner.events[-5:]!r}"
    return runner, result


@pytest.mark.chromium
async def test_runner_browses_a_local_page_and_answers_from_its_snapshot(
    tmp_path: pathlib.Path, no_process_left_behind: str
) -> None:
    from tests import browser_support as bs

    bs.require_browser()
    from tests import conftest

    conftest.require(bs.runner_available(), "subagent.runner")
    run_dir = tmp_path / "run"
    with bs.LocalSite() as site:
        with trio.fail_after(90):
            runner, result = await _run_runner(bs.scripted_browser_spec(site.url + "/"), run_dir)
    assert runner.proc.returncode == 0, result
    assert result["status"] == "completed", result
    assert "tangerine-42" in result["final_text"]
    calls = [(c["name"], c["state"]) for c in result["tool_calls"]]
    assert calls == [("browser_navigate", "succeeded"), ("browser_snapshot", "succeeded")], calls
    assert any(str(e.kind) == "step_snapshot" for e in runner.events)
    tmpdir = browser.browser_tmpdir(run_dir)
    await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [str(run_dir), str(tmpdir)])
    assert not list((run_dir / "browser" / "tmp").glob("playwright_chromiumdev_profile-*"))
    browser.release_browser_dir(run_dir)


@pytest.mark.chromium
async def test_runner_sigterm_mid_browse_is_cancelled_with_partial_result_and_nothing_left(
    tmp_path: pathlib.Path, no_process_left_behind: str
) -> None:
    from tests import browser_support as bs
    from tests import conftest

    bs.require_browser()
    conftest.require(bs.runner_available(), "subagent.runner")
    run_dir = tmp_path / "run"
    with bs.LocalSite() as site:
        slow = {
            "text": "Now the slow page.",
            "tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/slow"}}],
        }
        spec = bs.scripted_browser_spec(site.url + "/", then=[slow])

        async def cancel_mid_browse(runner: _Runner) -> None:
            # The browser is on its way to /slow (the server holds the response): stop now.
            assert await trio.to_thread.run_sync(site.wait_for_request, "/slow", 60)
            os.killpg(runner.proc.pid, signal.SIGTERM)
            stop = await runner.wait_event("stop_requested")
            assert stop.data.get("reason") == "signal"
            site.release_slow()  # the running tool may finish; nothing new starts

        with trio.fail_after(90):
            runner, result = await _run_runner(spec, run_dir, cancel_mid_browse)
    assert result["status"] == "cancelled", result
    assert result.get("reason") == "signal"
    assert runner.proc.returncode == 3
    states = {c["name"]: c["state"] for c in result["tool_calls"]}
    assert states.get("browser_snapshot") == "succeeded", result["tool_calls"]
    assert "tangerine-42" in json.dumps(result), "the partial result lost what was read before the stop"
    snapshots = [e for e in runner.events if str(e.kind) == "step_snapshot"]
    assert snapshots, "no step_snapshot: the daemon would have no partial result after a SIGKILL"
    tmpdir = browser.browser_tmpdir(run_dir)
    await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [str(run_dir), str(tmpdir)])
    assert not list((run_dir / "browser" / "tmp").glob("playwright_chromiumdev_profile-*"))
    browser.release_browser_dir(run_dir)


@pytest.mark.chromium
async def test_runner_sigterm_with_the_browser_sigstopped_leaves_nothing(
    tmp_path: pathlib.Path, no_process_left_behind: str
) -> None:
    """A wedged browser: every Chromium process stopped, then SIGTERM. The running navigation
    times out (5 s here; the browser is stopped within ms of its request), the run is
    cancelled, and the runner ends the whole browser, helpers that lost the env marker too."""
    from tests import browser_support as bs
    from tests import conftest

    bs.require_browser()
    conftest.require(bs.runner_available(), "subagent.runner")
    run_dir = tmp_path / "run"
    with bs.LocalSite() as site:
        slow = {
            "text": "Now the slow page.",
            "tool_calls": [{"name": "browser_navigate", "arguments": {"url": site.url + "/slow"}}],
        }
        spec = bs.scripted_browser_spec(site.url + "/", then=[slow], timeout_navigation_ms=5000)

        async def stop_browser_then_cancel(runner: _Runner) -> None:
            assert await trio.to_thread.run_sync(site.wait_for_request, "/slow", 60)
            ev = await runner.wait_event("process_group")
            node_sid = ev.data["pgid"]
            stopped = await trio.to_thread.run_sync(
                lambda: bs.stop_sessions_of(lambda: browser.browser_processes(run_dir), keep=[node_sid])
            )
            assert len(stopped) >= 4, "the browser and its helpers should all be stopped now"
            os.killpg(runner.proc.pid, signal.SIGTERM)

        with trio.fail_after(90):
            runner, result = await _run_runner(spec, run_dir, stop_browser_then_cancel)
    assert result["status"] == "cancelled", result
    assert "tangerine-42" in json.dumps(result)
    tmpdir = browser.browser_tmpdir(run_dir)
    try:
        await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [str(run_dir), str(tmpdir)])
    finally:
        await browser.end_browser_processes(run_dir)
        browser.release_browser_dir(run_dir)


async def test_runner_without_chromium_fails_setup_with_what_to_install(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests import browser_support as bs
    from tests import conftest

    conftest.require(bs.runner_available(), "subagent.runner")
    monkeypatch.setenv("AGENTD_CHROMIUM", str(tmp_path / "no-chromium-here"))
    spec = bs.scripted_browser_spec("http://127.0.0.1:9/")
    with trio.fail_after(30):
        runner, result = await _run_runner(spec, tmp_path / "run")
    assert runner.proc.returncode == 4  # ExitCode.TOOL_SETUP
    assert result["status"] == "failed"
    assert "apt-get install chromium" in json.dumps(result), result
    assert result["tool_calls"] == []


def test_the_preset_imports_only_the_stdlib() -> None:
    """The daemon imports it at spawn time: no trio, mcp, psutil or playwright behind it."""
    code = (
        "import sys, subagent.tools.browser; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'trio', 'mcp', 'anyio', 'psutil', 'playwright', 'pydantic', 'openai', 'supervisor'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_end_browser_processes_kills_what_names_the_run_even_stopped_and_only_that(
    tmp_path: pathlib.Path, fake_tools: dict[str, pathlib.Path]
) -> None:
    """Stand-ins for Chromium's helpers: processes whose command line names the run's profile
    dir, one of them SIGSTOPped. A process naming another run is left alone."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    for d in (run_dir, other):
        browser_server_config(d, True)
    sleeper = "import sys, time; time.sleep(60)"
    mine = [
        subprocess.Popen(
            [sys.executable, "-c", sleeper, f"--user-data-dir={browser.browser_tmpdir(run_dir)}/profile-{i}"]
        )
        for i in range(2)
    ]
    theirs = subprocess.Popen(
        [sys.executable, "-c", sleeper, f"--user-data-dir={browser.browser_tmpdir(other)}/profile"]
    )
    try:
        os.kill(mine[0].pid, signal.SIGSTOP)
        with trio.fail_after(10):
            while sorted(browser.browser_processes(run_dir)) != sorted(p.pid for p in mine):
                await trio.sleep(0.01)
        assert await browser.end_browser_processes(run_dir) == []
        for p in mine:
            assert p.wait(timeout=5) == -signal.SIGKILL
        assert theirs.poll() is None
        assert browser.browser_processes(other) == [theirs.pid]
    finally:
        for p in [*mine, theirs]:
            p.kill()
            p.wait()
