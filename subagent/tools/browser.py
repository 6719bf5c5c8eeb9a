"""The browser preset: one run's Chromium, driven through ``@playwright/mcp`` over stdio.

``browser_server_config(run_dir, options)`` returns the ``mcpServers`` entry the runner adds
as server ``"browser"``: ``node`` started directly (never ``npx``, whose wrapper can swallow
the stdin close that tells the server to quit), headless, ``--isolated``, the Chromium this
machine has, and every file the browser writes kept under ``<run_dir>/browser``: its
profile and temp files (TMPDIR), crashpad's database and caches (XDG dirs), the server's
output files and config. Removing the run dir therefore removes all of it, even after a
SIGKILL that gave Chromium no chance to clean up. (When the run dir is too deep for
Chromium's socket path, TMPDIR is a short symlink in /tmp to the run's tmp dir:
``release_browser_dir`` removes it.)

``end_browser_processes(run_dir)`` is the last-resort teardown: Chromium's helpers lose the
AGENTD_* marker from /proc/PID/environ, so they are found by the run's paths in their
command lines instead.

Where Chromium, node and ``@playwright/mcp`` are is ``browser_setup``'s (re-exported here).
Invariants: stdlib only at import (the daemon checks a spec's browser at spawn time,
through ``subagent.presets``, to reject a run whose browser cannot start); a missing piece is a ``BrowserSetupError`` naming what
is missing and what to install; nothing here starts a process, and only
``end_browser_processes`` and ``resume_stopped_browser`` send signals.

Size: everything this module knows is the one browser a run has (its command line, its
files, its profile's preparation for a session, its teardown): the facts of
``docs/dev/BROWSER.md``, each in the one place that acts on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from subagent.osedge import ProcessTable, Targets, escalate, resume_stopped
from subagent.tools.browser_setup import (
    BrowserSetupError as BrowserSetupError,
)
from subagent.tools.browser_setup import (
    find_chromium as find_chromium,
)
from subagent.tools.browser_setup import (
    find_node as find_node,
)
from subagent.tools.browser_setup import (
    find_playwright_mcp as find_playwright_mcp,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BROWSER_SERVER_NAME",
    "BrowserSetupError",
    "BrowserSetup",
    "browser_server_config",
    "browser_dir",
    "browser_tmpdir",
    "browser_processes",
    "check_browser",
    "prepare_session_profile",
    "end_browser_processes",
    "resume_stopped_browser",
    "release_browser_dir",
    "find_chromium",
    "find_node",
    "find_playwright_mcp",
    "OPTION_KEYS",
]

# The name the runner gives the preset's MCP server; its tools appear as ``browser__<tool>``
# or however the runner namespaces them.
BROWSER_SERVER_NAME: Final = "browser"

# Chromium switches on top of Playwright's defaults (which already include
# --disable-background-networking, --disable-component-update, --disable-sync, ...): a run's
# browser talks to the pages it is sent to and nothing else. Measured through a trap proxy:
# with Playwright's defaults alone Chromium still POSTs an on-demand component update to
# update.googleapis.com and opens accounts.google.com within seconds of starting; pointing
# the component updater and the GAIA endpoint at a closed loopback port stops both (pages
# on accounts.google.com still load as ordinary pages).
_NOWHERE: Final = "http://127.0.0.1:9"  # discard port: refused, never leaves the machine
QUIET_CHROMIUM_ARGS: Final = (
    f"--component-updater=url-source={_NOWHERE}/",
    f"--gaia-url={_NOWHERE}",
    "--no-pings",
    "--disable-domain-reliability",
    "--disable-crash-reporter",
    "--disable-breakpad",
    "--no-first-run",
    "--no-default-browser-check",
    # Shared memory in TMPDIR (the run's own), not /dev/shm, which a run may not write.
    "--disable-dev-shm-usage",
)

# Chromium binds its singleton socket at $TMPDIR/org.chromium.Chromium.XXXXXX/SingletonSocket
# and aborts ("Socket path too long") past the 107 usable bytes of sun_path. A run dir deep
# enough (a pytest tmp dir, ~/.local/state/agentd/runs/<id>) crosses that, so a longer
# TMPDIR is reached through a short symlink in LINK_ROOT instead: the files stay in the run
# dir, only the link lives outside it (removed by ``release_browser_dir``, and dangling ones
# by the next ``browser_server_config``).
SOCKET_PATH_MAX: Final = 107
_CHROMIUM_SOCKET_SUFFIX: Final = len("/org.chromium.Chromium.XXXXXX/SingletonSocket")
MAX_TMPDIR_CHARS: Final = SOCKET_PATH_MAX - _CHROMIUM_SOCKET_SUFFIX - 4
LINK_ROOT: Final = pathlib.Path("/tmp")
LINK_PREFIX: Final = "agentd-browser-"

# The keys a spec's ``"browser": {...}`` may hold.
OPTION_KEYS: Final = frozenset(
    {
        "executable_path",  # str: the Chromium binary; else AGENTD_CHROMIUM, Debian's, Playwright's
        "headless",  # bool, default true
        "sandbox",  # bool, default: on where the run's identity allows it (see subagent.sandbox)
        "args",  # [str]: extra Chromium switches
        "viewport",  # "WIDTHxHEIGHT"
        "allowed_origins",  # [str]: origins the browser may request
        "blocked_origins",  # [str]: origins it may not
        "timeout_action_ms",  # int: per action
        "timeout_navigation_ms",  # int: per navigation
        "image_responses",  # "allow" | "omit" | "only"; default "omit" (the runner is text-only)
        "caps",  # [str]: extra @playwright/mcp capabilities ("vision", "pdf", "devtools")
        "webmcp",  # bool, default false: expose tools that pages register (WebMCP) to the model
    }
)
_IMAGE_RESPONSES: Final = ("allow", "omit", "only")
_CAPS: Final = frozenset({"vision", "pdf", "devtools"})
_VIEWPORT_RE: Final = re.compile(r"^[1-9][0-9]{1,4}x[1-9][0-9]{1,4}$")


@dataclass(frozen=True, slots=True)
class BrowserSetup:
    """What a browser run needs, resolved and checked: paths exist, options are valid."""

    node: pathlib.Path
    playwright_mcp: pathlib.Path  # its cli.js
    chromium: pathlib.Path
    options: Mapping[str, Any] = field(default_factory=dict)


def _str_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v and "\x00" not in v for v in value):
        raise BrowserSetupError(f"browser option {key!r}", f"expected a list of non-empty strings, got {value!r}")
    return list(value)


def _pos_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BrowserSetupError(f"browser option {key!r}", f"expected a positive integer, got {value!r}")
    return value


def _check_options(options: Mapping[str, Any] | bool | None) -> dict[str, Any]:
    """Validate a spec's ``browser`` value; ``true``/``None`` mean no options."""
    if options is None or options is True:
        return {}
    if options is False or not isinstance(options, Mapping):
        raise BrowserSetupError("browser options", f"expected true or an object, got {options!r}")
    unknown = sorted(set(options) - OPTION_KEYS)
    if unknown:
        raise BrowserSetupError(f"browser option {unknown[0]!r}", f"unknown; expected one of {sorted(OPTION_KEYS)!r}")
    out: dict[str, Any] = {}
    for key, value in options.items():
        if key == "executable_path":
            if not isinstance(value, str) or not value:
                raise BrowserSetupError(f"browser option {key!r}", f"expected a path, got {value!r}")
        elif key in ("headless", "sandbox", "webmcp"):
            if not isinstance(value, bool):
                raise BrowserSetupError(f"browser option {key!r}", f"expected true or false, got {value!r}")
        elif key in ("args", "allowed_origins", "blocked_origins"):
            value = _str_list(value, key)
        elif key == "caps":
            value = _str_list(value, key)
            bad = sorted(set(value) - _CAPS)
            if bad:
                raise BrowserSetupError(
                    f"browser option {key!r}", f"expected some of {sorted(_CAPS)!r}, got {bad[0]!r}"
                )
        elif key == "viewport":
            if not isinstance(value, str) or not _VIEWPORT_RE.match(value):
                raise BrowserSetupError(
                    f"browser option {key!r}", f"expected 'WIDTHxHEIGHT' like '1280x720', got {value!r}"
                )
        elif key in ("timeout_action_ms", "timeout_navigation_ms"):
            value = _pos_int(value, key)
        elif key == "image_responses":
            if value not in _IMAGE_RESPONSES:
                raise BrowserSetupError(
                    f"browser option {key!r}", f"expected one of {list(_IMAGE_RESPONSES)!r}, got {value!r}"
                )
        out[key] = value
    return out


def check_browser(options: Mapping[str, Any] | bool | None = None) -> BrowserSetup:
    """Validate the options and find node, @playwright/mcp and Chromium, without writing
    anything or starting a process: what the daemon calls at spawn time.

    Raises:
        BrowserSetupError: a bad option, or a missing piece (the message says what to install).
    """
    opts = _check_options(options)
    return BrowserSetup(
        node=find_node(),
        playwright_mcp=find_playwright_mcp(),
        chromium=find_chromium(opts.get("executable_path")),
        options=opts,
    )


def browser_dir(run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's browser keeps everything it writes."""
    return pathlib.Path(run_dir) / "browser"


def _sweep_dangling_links(root: pathlib.Path) -> None:
    """Remove our links whose run dir is gone (a run whose cleanup never ran).

    Ours: this uid's. In a shared /tmp another user's links are theirs, and their targets
    may be out of our reach (a stat of them fails with EACCES): skipped, never followed.
    """
    try:
        names = [n for n in os.listdir(root) if n.startswith(LINK_PREFIX)]
    except OSError:
        return
    me = os.geteuid()
    for name in names:
        link = root / name
        try:
            st = os.lstat(link)
            if stat.S_ISLNK(st.st_mode) and st.st_uid == me and not link.exists():
                link.unlink()
        except OSError:
            pass


def _link_path(tmp: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(LINK_ROOT) / (LINK_PREFIX + hashlib.sha256(str(tmp).encode()).hexdigest()[:16])


def _short_tmpdir(tmp: pathlib.Path) -> pathlib.Path:
    """``tmp`` itself when Chromium's socket path fits, else a short symlink to it."""
    if len(str(tmp)) <= MAX_TMPDIR_CHARS:
        return tmp
    root = pathlib.Path(LINK_ROOT)
    _sweep_dangling_links(root)
    link = _link_path(tmp)
    if len(str(link)) > MAX_TMPDIR_CHARS:
        raise BrowserSetupError(
            f"no short temp dir for chromium (its socket path must stay under {SOCKET_PATH_MAX} bytes)",
            f"use a shorter run dir than {str(tmp.parent.parent)!r}",
        )
    try:
        st: os.stat_result | None = os.lstat(link)
    except FileNotFoundError:
        st = None
    if st is not None:
        if st.st_uid != os.geteuid():  # (the kernel would not let Chromium follow it anyway)
            raise BrowserSetupError(
                f"the browser's short temp link {str(link)!r} belongs to another user", "use a shorter run dir"
            )
        if stat.S_ISLNK(st.st_mode) and os.readlink(link) == str(tmp):
            return link
        link.unlink()
    try:
        link.symlink_to(tmp, target_is_directory=True)
    except OSError as exc:
        raise BrowserSetupError(
            f"cannot create the browser's short temp link {str(link)!r}: {exc.strerror}",
            f"make {str(root)!r} writable, or use a shorter run dir",
        ) from exc
    return link


def browser_tmpdir(run_dir: pathlib.Path, *, create: bool = False) -> pathlib.Path:
    """The TMPDIR the run's browser was given: its tmp dir or the short link to it.

    With ``create``, make the dir and the link (the runner does it before its sandbox
    closes /tmp).

    Raises:
        BrowserSetupError: with ``create``, the short link cannot be made.
    """
    tmp = browser_dir(pathlib.Path(run_dir)).absolute() / "tmp"
    if create:
        tmp.mkdir(parents=True, exist_ok=True)
        return _short_tmpdir(tmp)
    return tmp if len(str(tmp)) <= MAX_TMPDIR_CHARS else _link_path(tmp)


def release_browser_dir(run_dir: pathlib.Path) -> None:
    """Remove what the preset made outside the run dir (the short temp link, if any).

    Call it when the run ends, before or after removing the run dir; idempotent.
    """
    tmp = browser_dir(pathlib.Path(run_dir)).absolute() / "tmp"
    link = browser_tmpdir(run_dir)
    try:
        if link != tmp and link.is_symlink() and os.readlink(link) == str(tmp):
            link.unlink()
    except OSError:  # gone, or out of reach inside a run's sandbox: the daemon removes it
        pass
    _sweep_dangling_links(pathlib.Path(LINK_ROOT))


# Chromium keeps a login's session cookies (no Expires/Max-Age: PHPSESSID, JSESSIONID,
# express-session) only for a profile set to continue where it left off: it writes them to
# its cookie store on every shutdown, but deletes them at the next start unless
# ``session.restore_on_startup`` is 1 ("last session") or the last exit was a crash. With
# it, the previous session's tabs would reopen too: their record is removed first, so a
# turn still starts on one blank page.
_PROFILE: Final = "Default"  # the profile a persistent context uses in its user data dir
_RESTORE_LAST_SESSION: Final = 1
_SESSION_RECORDS: Final = ("Sessions", "Sessions_Encrypted")  # the tabs to reopen


def prepare_session_profile(profile_dir: pathlib.Path | str) -> None:
    """Set a session's profile up so that its next browser keeps every cookie, session
    cookies included, and reopens none of the previous turn's tabs. Call it before the
    browser starts; idempotent.

    Keeps the rest of the profile's ``Preferences``; one Chromium cannot parse is replaced
    (Chromium would reset it anyway).

    Raises:
        OSError: the profile cannot be written.
    """
    profile = pathlib.Path(profile_dir) / _PROFILE
    profile.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in _SESSION_RECORDS:
        records = profile / name
        if records.is_symlink() or records.is_file():
            records.unlink()
        elif records.is_dir():
            shutil.rmtree(records)
    path = profile / "Preferences"
    prefs: Any = None
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):  # (never a FIFO or a link a page's run left)
            prefs = json.loads(path.read_text())
    except (FileNotFoundError, UnicodeDecodeError, ValueError):
        pass
    if not isinstance(prefs, dict):
        prefs = {}
    session = prefs.get("session")
    if not isinstance(session, dict):
        session = {}
    if session.get("restore_on_startup") == _RESTORE_LAST_SESSION:
        return
    prefs["session"] = {**session, "restore_on_startup": _RESTORE_LAST_SESSION}
    tmp = path.with_name(path.name + ".agentd-tmp")
    tmp.write_text(json.dumps(prefs))
    os.replace(tmp, path)


def browser_server_config(
    run_dir: pathlib.Path,
    options: Mapping[str, Any] | bool | None,
    *,
    sandbox: tuple[bool, str | None] = (False, "not known to be possible"),
    profile_dir: pathlib.Path | str | None = None,
) -> dict[str, Any]:
    """The ``mcpServers`` entry that runs this run's browser.

    Creates ``<run_dir>/browser`` with the server's config file, output dir, temp dir and XDG
    dirs. The env holds only what the preset needs; the runner puts it over the tool
    environment (``subagent.sandbox.tool_env``, which carries the containment markers).

    Args:
        run_dir: the run's own directory, removed when the run ends.
        options: the spec's ``browser`` value: ``true`` or an object with ``OPTION_KEYS``.
        sandbox: whether Chromium's own sandbox can work for this run, and why not
            (``subagent.sandbox.browser_sandbox``): the default of option ``sandbox``.
        profile_dir: a session's profile directory (cookies, storage), kept across its
            turns (``prepare_session_profile``: session cookies too); None: an isolated,
            throwaway profile in the run's own directory.

    Returns:
        ``{"command", "args", "env", "cwd"}`` for an MCP stdio client.

    Raises:
        BrowserSetupError: a bad option or a missing node / @playwright/mcp / Chromium.
    """
    setup = check_browser(options)
    opts = setup.options
    base = browser_dir(pathlib.Path(run_dir)).absolute()
    dirs = {
        "tmp": base / "tmp",  # profile (playwright_chromiumdev_profile-*), sockets, artifacts
        "output": base / "output",  # snapshots, console logs, screenshots
        "config": base / "xdg" / "config",  # crashpad's "Crash Reports" database
        "cache": base / "xdg" / "cache",
        "data": base / "xdg" / "data",
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)

    headless = bool(opts.get("headless", True))
    possible, why_not = sandbox
    if opts.get("sandbox") is True and not possible:
        raise BrowserSetupError("browser option 'sandbox'", f"chromium's sandbox cannot work for this run: {why_not}")
    sandbox_on = bool(opts.get("sandbox", possible))
    launch: dict[str, Any] = {
        "executablePath": str(setup.chromium),
        "headless": headless,
        "chromiumSandbox": sandbox_on,
        "args": [*QUIET_CHROMIUM_ARGS, *opts.get("args", [])],
    }
    browser_config: dict[str, Any] = {"browserName": "chromium", "isolated": True, "launchOptions": launch}
    if profile_dir is not None:
        # The session's profile: a persistent context, used by one turn at a time.
        try:
            prepare_session_profile(profile_dir)
        except OSError as exc:
            raise BrowserSetupError(
                f"cannot prepare the session's browser profile {str(profile_dir)!r}: {exc.strerror or exc}",
                "check that the daemon's state dir is writable",
            ) from exc
        browser_config = {**browser_config, "isolated": False, "userDataDir": str(profile_dir)}
    config: dict[str, Any] = {
        "browser": browser_config,
        "outputDir": str(dirs["output"]),
        "imageResponses": opts.get("image_responses", "omit"),
        # Off unless asked: a page must not add tools to the model's toolbox mid-run.
        "webmcp": bool(opts.get("webmcp", False)),
    }
    config_path = base / "playwright-mcp.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n")

    # The flags repeat the config file on purpose: `ps` shows what the browser runs with.
    args = [
        str(setup.playwright_mcp),
        "--config", str(config_path),
        "--browser", "chromium",
        "--executable-path", str(setup.chromium),
        *(["--isolated"] if profile_dir is None else ["--user-data-dir", str(profile_dir)]),
        "--output-dir", str(dirs["output"]),
        "--image-responses", str(config["imageResponses"]),
    ]  # fmt: skip
    if not config["webmcp"]:
        args.append("--no-webmcp")
    if headless:
        args.append("--headless")
    args.append("--sandbox" if sandbox_on else "--no-sandbox")
    if "viewport" in opts:
        args += ["--viewport-size", opts["viewport"]]
    if "allowed_origins" in opts:
        args += ["--allowed-origins", ";".join(opts["allowed_origins"])]
    if "blocked_origins" in opts:
        args += ["--blocked-origins", ";".join(opts["blocked_origins"])]
    if "timeout_action_ms" in opts:
        args += ["--timeout-action", str(opts["timeout_action_ms"])]
    if "timeout_navigation_ms" in opts:
        args += ["--timeout-navigation", str(opts["timeout_navigation_ms"])]
    if "caps" in opts:
        args += ["--caps", ",".join(opts["caps"])]

    # Only what the preset needs: the runner's tool environment (``subagent.sandbox``) is
    # applied under it, and every AGENTD_* marker on top.
    env = {
        "TMPDIR": str(_short_tmpdir(dirs["tmp"])),
        "XDG_CONFIG_HOME": str(dirs["config"]),
        "XDG_CACHE_HOME": str(dirs["cache"]),
        "XDG_DATA_HOME": str(dirs["data"]),
    }
    return {"command": str(setup.node), "args": args, "env": env, "cwd": str(base)}


# --- a run's browser processes, by their command lines -------------------------------
#
# Chromium's zygote, gpu, utility and renderer processes rewrite their argv/environ area
# for the process title, so /proc/PID/environ no longer shows the AGENTD_* marker they
# inherited: a marker sweep misses them, and when the browser main process dies (SIGKILL,
# or a sweep that found it by its marker) they are reparented and left behind, stopped if
# the browser was stopped. Their command lines still name the profile dir, which the preset
# put under the run's browser dir (or its short TMPDIR link): that is how we find them.


def _run_paths(run_dir: pathlib.Path, profile_dir: pathlib.Path | str | None = None) -> list[str]:
    base = browser_dir(pathlib.Path(run_dir)).absolute()
    paths = [str(base) + "/", str(browser_tmpdir(run_dir)) + "/"]
    if profile_dir is not None:
        # A session's profile: Chromium names it (--user-data-dir=...), without a slash after.
        paths.append(str(profile_dir))
    return paths


# After SIGKILL, how long the browser's processes may take to be gone (seconds).
KILL_WAIT_S: Final = 2.0


def _targets(run_dir: pathlib.Path, profile_dir: pathlib.Path | str | None = None) -> Targets:
    return Targets(cmdline=tuple(_run_paths(run_dir, profile_dir)))


def browser_processes(run_dir: pathlib.Path, *, profile_dir: pathlib.Path | str | None = None) -> list[int]:
    """Live processes whose command line names this run's browser dirs: the node server,
    Chromium and all its helpers, crashpad handlers. Linux (/proc) only; [] elsewhere.
    Blocking (a read of the process table)."""
    if not os.path.isdir("/proc"):
        return []
    return sorted(p.pid for p in ProcessTable().members(_targets(run_dir, profile_dir)).values() if not p.dead)


async def end_browser_processes(
    run_dir: pathlib.Path,
    *,
    wait_s: float = KILL_WAIT_S,
    profile_dir: pathlib.Path | str | None = None,
) -> list[int]:
    """SIGKILL whatever is left of this run's browser; the last resort after a normal close.

    SIGKILL, not SIGTERM: a stopped (SIGSTOP) or wedged Chromium never handles SIGTERM, and
    by the time this runs the server had its chance to close the browser. Re-reads the
    table until none is left (new helpers may appear while the rest dies) or ``wait_s``
    passes; every process by pidfd (``subagent.osedge.escalate``).

    Returns:
        The pids still alive after ``wait_s`` (normally none).
    """
    if not os.path.isdir("/proc"):
        return []
    r = await escalate(
        _targets(run_dir, profile_dir), grace_s=0.0, kill_wait_s=wait_s, sigterm=False, label=f"browser of {run_dir}"
    )
    return sorted(p.pid for p in r.survivors)


def resume_stopped_browser(run_dir: pathlib.Path, profile_dir: pathlib.Path | str | None = None) -> list[int]:
    """SIGCONT this run's browser processes (node, Chromium, its helpers) that are stopped
    (SIGSTOP, e.g. by the run's own command), right before the server is closed.

    A stopped Chromium cannot close: node's close of it, then the SDK's SIGTERM to node, waited
    their timeouts (a stop took 5-6 s, not milliseconds), and the browser was SIGKILLed at the
    end, losing what it had not written (a session's login). Resumed, it closes as usual; the
    kill that follows a close is unchanged. (As a SIGTERM of ours is followed by a SIGCONT.)
    Chromium's helpers are in sessions of their own, without the server's marker: found by
    their command lines, beside what ``subagent.tools.mcp_spawn.resume_stopped_server``
    resumes of every server. Linux (/proc) only. Blocking (a read of the process table).

    Returns:
        The pids resumed.
    """
    if not os.path.isdir("/proc"):
        return []
    resumed = resume_stopped(_targets(run_dir, profile_dir))
    if resumed:
        logger.warning("the run's browser was stopped: resumed %s so that it can close", resumed)
    return resumed
