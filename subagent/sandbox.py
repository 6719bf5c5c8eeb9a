"""A run's sandbox: what its processes can touch, set up by the runner on itself.

The runner calls ``enter`` once, after reading its spec (the grants come from it) and
before it starts any thread, tool or model request; everything it starts afterwards
inherits the sandbox and cannot leave it. A forked runner (a zygote's child) does the same
first thing after its fork. Layers, each reported (``Report``, shown by ``status``):

- identity: the runner moves into its own user, mount and IPC namespace, where it is uid
  ``SANDBOX_ID`` if it was uid 0 (so Chromium's own sandbox can run), else its own uid;
  /tmp, /var/tmp, /dev/shm and /run are private to the run (a user's sockets there are
  out of reach), so are its terminals (``/dev/pts``: a devpts of its own) and its System V
  IPC (freed with its last process), the daemon's protected directories covered by an
  empty tmpfs (the run's own directory bound back: Landlock does not refuse a
  ``connect()`` to another run's unix socket there), and the kernel's tunables read-only;
  a root runner's /proc is a procfs of its own, ``hidepid=invisible`` (``_private_proc``:
  the host's, the daemon's and other runs' processes out of sight); where namespaces are refused
  (systemd's ``RestrictNamespaces=``) a uid 0 runner is uid 0 without any capability.
  The runner is not dumpable: its tools cannot read its memory or environment (the key).
- Landlock: read the system, the interpreter and this checkout; write the run directory;
  plus the spec's explicit grants; never the daemon's protected paths (state directory,
  token, journal, other runs, config). No ptrace of, signal to, or abstract socket of a
  process outside the run (ABI 6). The network is not restricted.
- seccomp: ``clone3`` is refused (``_seccomp``: its ``CLONE_INTO_CGROUP`` starts a child
  in any cgroup the uid may write by mode, which Landlock does not see), and the key calls
  (the key quota is the host uid's).
- quotas: the run's share of its uid's per-user kernel counts (inotify, namespaces, message
  queues, terminals: ``_quotas``), capped in its own user namespace and by rlimits; all
  runs' together, in the daemon's nest, the parent of each run's namespace (``_nest``).
- environment: tools get ``tool_env()``: an allowlist, never a secret of the runner's.

The daemon passes ``Settings`` in ``AGENTD_RUN_SANDBOX`` (JSON). Stdlib only (the daemon
imports it to validate grants).

Size: one sandbox in its two halves (``prepare_ahead``, made before the spec is known by a
zygote's spare, and the spec's half in ``enter``), which share the grants, the protected
paths and the report; split, each half would import the other's private helpers. The
kernel calls live in ``_isolate`` and ``_landlock``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from subagent import _importfinder, _isolate, _landlock, _links, _nest, _quotas, _seccomp, _wide
from subagent._landlock import FS_READ, FS_WRITE, Grant

__all__ = [
    "SANDBOX_ENV",
    "TMPFS_MAX_MIB",
    "SANDBOX_ID",
    "MODES",
    "DEFAULT_PROTECT",
    "Settings",
    "Report",
    "SandboxError",
    "enter",
    "Ahead",
    "prepare_ahead",
    "tool_env",
    "check_grants",
    "browser_sandbox",
]

logger = logging.getLogger(__name__)

SANDBOX_ENV: Final = "AGENTD_RUN_SANDBOX"
MODES: Final = ("auto", "required", "off")
# What a root runner's processes are inside their user namespace: not 0, so Chromium's
# sandbox runs; on the host they stay uid 0 without any capability.
SANDBOX_ID: Final = 65000
# The checkout this module lives in (the runner's code, node_modules).
CHECKOUT: Final = str(Path(__file__).resolve().parent.parent)

# Read (and execute) for every run (``_wide``: what it holds is never too wide to grant).
SYSTEM_READ: Final = _wide.SYSTEM_READ
# Device files a tool may open for reading and writing.
DEVICES_RW: Final = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/pts",
)
# The run's own terminals: a new devpts instance here when it has its own mount namespace
# (the host's, other people's and other runs' terminals out of sight); granted read-write.
DEVPTS: Final = "/dev/pts"
# Private (an empty tmpfs each) when the runner has its own mount namespace; writable then.
PRIVATE_DIRS: Final = _wide.SHARED_DIRS  # (the host's: every user's, never granted whole)
# What the private dirs may hold together, in MiB (one tmpfs: memory), unless the daemon
# says otherwise (its ``run_tmpfs_max_mib``); 0: the kernel's default (half the RAM).
# Chromium and @playwright/mcp put next to nothing there (their files go to TMPDIR, in the
# run dir; Chromium's shared memory is memfd); 1 GiB is what Chrome is given in a container
# (``--shm-size=1g``, Docker's 64 MiB being what makes it crash).
TMPFS_MAX_MIB: Final = 1024
# What ``status`` says (``sandbox.proc``) the run sees of other processes under /proc.
PROC_HIDDEN: Final = (
    "own procfs, hidepid=invisible: only the processes the run may ptrace-read (its own, inside its "
    "Landlock domain) are listed; the host's, the daemon's and other runs' (command lines, environments, "
    "status) are not"
)
PROC_SHARED: Final = (
    "the daemon's: the run lists what the daemon lists under /proc (the host's processes, the daemon's, "
    "other runs'), their command lines and status readable (a procfs of the run's own needs a daemon that is "
    "the host's root with its capabilities: not a daemon run as a normal user, nor the systemd unit's)"
)
# Never reachable, whatever is granted around them: this daemon's configuration and the
# files a uid-0 run could otherwise read as their owner.
DEFAULT_PROTECT: Final = (
    "/etc/agentd", "/var/lib/agentd", "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
    "/etc/sudoers", "/etc/sudoers.d", "/etc/ssl/private",
)  # fmt: skip

_SCOPES: Final = _landlock.SCOPE_SIGNAL | _landlock.SCOPE_ABSTRACT_UNIX_SOCKET
_DEVICE_ACCESS: Final = FS_READ | _landlock.WRITE_FILE | _landlock.IOCTL_DEV

# The environment a tool gets: these names, LC_*, the run's own AGENTD_* markers, and the
# names the daemon's ``tool_env`` setting adds. Nothing else of the runner's.
TOOL_ENV_NAMES: Final = (
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "TERM",
    "TZ",
    "USER",
    "LOGNAME",
    "SHELL",
    "TMPDIR",
    "COLORTERM",
    "NO_COLOR",
)
TOOL_ENV_PREFIXES: Final = ("LC_",)
# (The test suite's and the benchmarks' own markers pass too: they find a run's processes.)
AGENTD_TOOL_VARS: Final = ("AGENTD_RUN_ID", "AGENTD_RUN_DIR", "AGENTD_TREE", "AGENTD_TEST_MARK", "AGENTD_BENCH_MARK")
# The model key: its value never reaches a tool, whatever asks for it.
MODEL_KEY_VARS: Final = ("OPENAI_API_KEY",)
_SECRET_NAME: Final = re.compile(
    r"PASSWORD|PASSWD|SECRET|(^|_)(API_?KEY|KEY|TOKEN|PASS|CREDENTIALS?|AUTH|COOKIE)(_|$)", re.IGNORECASE
)
# A shorter value is not treated as a secret (it could equal an ordinary value by chance).
_SECRET_MIN_CHARS: Final = 8


class SandboxError(Exception):
    """The run's sandbox could not be set up as asked (``why`` says what failed)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass(frozen=True, slots=True)
class Settings:
    """What the daemon decides for every run: the mode, its paths, extra tool variables."""

    mode: str = "auto"
    protect: tuple[str, ...] = ()
    tool_env: tuple[str, ...] = ()
    # The private dirs' one tmpfs: at most this many MiB (0: the kernel's default).
    tmpfs_max_mib: int = TMPFS_MAX_MIB
    # The run's own inotify instances and watches (``_quotas``; 0: only the uid's, shared).
    inotify_instances: int = _quotas.INOTIFY_INSTANCES
    inotify_watches: int = _quotas.INOTIFY_WATCHES

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        raw = (os.environ if environ is None else environ).get(SANDBOX_ENV)
        if not raw:
            return cls()
        if raw in MODES:
            return cls(mode=raw)
        try:
            d = json.loads(raw)
            mode = str(d.get("mode", "auto"))
            return cls(
                mode=mode if mode in MODES else "required",  # unreadable intent: the safe side
                protect=tuple(str(p) for p in d.get("protect", ())),
                tool_env=tuple(str(n) for n in d.get("tool_env", ())),
                tmpfs_max_mib=max(0, int(d.get("tmpfs_max_mib", TMPFS_MAX_MIB))),
                inotify_instances=max(0, int(d.get("inotify_instances", _quotas.INOTIFY_INSTANCES))),
                inotify_watches=max(0, int(d.get("inotify_watches", _quotas.INOTIFY_WATCHES))),
            )
        except (ValueError, AttributeError, TypeError):
            return cls(mode="required")

    def to_env(self) -> str:
        return json.dumps(
            {
                "mode": self.mode,
                "protect": list(self.protect),
                "tool_env": list(self.tool_env),
                "tmpfs_max_mib": self.tmpfs_max_mib,
                "inotify_instances": self.inotify_instances,
                "inotify_watches": self.inotify_watches,
            }
        )


@dataclass
class Report:
    """What the sandbox of this run is; ``to_dict`` is what ``status`` shows."""

    mode: str  # "landlock" or "none"
    requested: str
    why: str | None = None
    landlock_abi: int = 0
    identity: str = ""
    private: list[str] = field(default_factory=list)
    private_max_mib: int | None = None  # what ``private`` may hold together (0: the kernel's default)
    read: list[str] = field(default_factory=list)
    write: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    scopes: list[str] = field(default_factory=list)
    # System calls a seccomp filter refuses the run (``_seccomp``: clone3, which starts a
    # child outside the run's cgroup).
    denied_syscalls: list[str] = field(default_factory=list)
    # The run's caps on its uid's per-user kernel counts (``_quotas``): /proc/sys/user
    # names, RLIMIT_* names, "ptys".
    quotas: dict[str, int] = field(default_factory=dict)
    workdir: str | None = None
    browser_sandbox: bool | None = None
    browser_sandbox_why: str | None = None
    # What the run sees under /proc of the other processes (``PROC_HIDDEN`` or ``PROC_SHARED``).
    proc: str | None = None
    problems: list[str] = field(default_factory=list)
    setup_ms: float | None = None  # how long ``enter`` took

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "requested": self.requested,
            "identity": self.identity,
            "landlock_abi": self.landlock_abi,
            "read": self.read,
            "write": self.write,
            "protected": self.protected,
            "private": self.private,
            "scopes": self.scopes,
            "network": "unrestricted",
        }
        for k in ("why", "workdir", "browser_sandbox", "browser_sandbox_why", "setup_ms", "private_max_mib", "proc"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        if self.denied_syscalls:
            out["denied_syscalls"] = self.denied_syscalls
        if self.quotas:
            out["quotas"] = self.quotas
        if self.problems:
            out["problems"] = self.problems
        return out


# ----------------------------------------------------------------------------- grants


def _exists(paths: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(p for p in paths if p and os.path.isabs(p) and os.path.exists(p)))


def runtime_paths() -> list[str]:
    """What the runner itself needs to keep running: interpreter, packages, this checkout
    (read whole; ``runtime_grants`` says what is narrowed)."""
    return runtime_grants().read


def runtime_grants() -> _wide.Narrowed:
    """``runtime_paths`` and what was too wide among them (``_wide.narrow_runtime``): a
    ``PYTHONPATH`` naming a home (or ``/``, ``/tmp``) gave every run all of it."""
    imports = [p for p in sys.path if p and os.path.isabs(p)]
    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, CHECKOUT]
    paths += [os.path.realpath(sys.executable), str(Path(os.path.realpath(sys.executable)).parent.parent)]
    return _wide.narrow_runtime(_exists([*paths, *imports]), imports, keep=[CHECKOUT])


def _browser_paths(options: Any) -> list[str]:
    try:
        from subagent.tools import browser, browser_setup

        setup = browser.check_browser(options)
    except Exception:  # the preset reports it properly when it starts
        return []
    return _exists(browser_setup.read_paths(setup.node, setup.playwright_mcp, setup.chromium))


def _browser_notes(browser: Any) -> list[str]:
    """Why a browser run's Chromium directory was not granted whole (``read_paths``)."""
    if browser is False:
        return []
    try:
        from subagent.tools import browser as preset
        from subagent.tools import browser_setup

        chromium = preset.check_browser(True if browser is True else dict(browser)).chromium
    except Exception:  # the preset reports it properly when it starts
        return []
    why = browser_setup.chromium_narrowed(chromium)
    where = os.path.dirname(os.path.realpath(chromium))
    return [] if why is None else [f"{where!r} (Chromium's) is {why}: only Chromium's binary and own files granted"]


def _server_paths(spec: Any) -> list[str]:
    out: list[str] = []
    for server in spec.mcp_servers.values():
        found = shutil.which(server.command)
        if found:
            out.append(os.path.realpath(found))
            if os.path.isabs(found) and os.path.realpath(found) != found:
                out.append(found)  # the link the runner starts too: under a private /tmp it is bound back
        if server.cwd:
            out.append(server.cwd)
    return _exists(out)


def _resolv_target() -> str | None:
    target = os.path.realpath("/etc/resolv.conf")
    return target if target != "/etc/resolv.conf" and os.path.exists(target) else None


def protected(settings: Settings) -> list[str]:
    """What no run may reach: the daemon's (its state, its runs) and the host's secrets."""
    return list(dict.fromkeys([*settings.protect, *DEFAULT_PROTECT, *glob.glob("/etc/ssh/ssh_host_*key")]))


def tool_paths(spec: Any) -> list[str]:
    """What the tools of a run of ``spec`` (a ``RunSpec``) need to read, as this process
    sees the filesystem: its MCP servers' commands and working directories, its browser's
    files."""
    out = _server_paths(spec)
    if spec.browser is not False:
        out += _browser_paths(True if spec.browser is True else dict(spec.browser))
    return out


def spec_paths(spec: Any) -> tuple[list[str], list[str]]:
    """What a run of ``spec`` (a ``RunSpec``) is granted, (read, write): its sandbox's
    grants, and what its tools need (``tool_paths``; the daemon's, found on the host, when
    the spec carries them), its script. The daemon checks every one of them at the spawn
    and the runner again as it enters its sandbox."""
    workdir = spec.sandbox.workdir
    script = [spec.model.script_path] if spec.model.script_path else []  # the run's own input
    tools = list(spec.tool_paths) if spec.tool_paths is not None else tool_paths(spec)
    read = [*spec.sandbox.read, *tools, *script]
    write = [*spec.sandbox.write, *([workdir] if workdir else [])]
    return read, write


def runner_code() -> list[str]:
    """Where the runner's own code is: this checkout and the interpreter's prefix (a
    virtualenv). Runners are started from it before they sandbox themselves, so a run that
    could write there would run its own code, unsandboxed, in the next run's runner."""
    return list(dict.fromkeys(os.path.realpath(p) for p in (CHECKOUT, sys.prefix)))


def _realpath(g: str) -> str | None:
    try:
        return os.path.realpath(g)
    except (OSError, ValueError):  # a path that changed type under us, a NUL...
        return None


def check_grants(read: Iterable[str], write: Iterable[str], protect: Iterable[str]) -> str | None:
    """Why these grants are refused, or None: one at or below a protected path, or a write
    grant at, below or above the runner's own code (``runner_code``)."""
    prot = [os.path.realpath(p) for p in protect]
    write = list(write)
    for g in [*read, *write]:
        real = _realpath(g)
        if real is None:
            return f"{g!r} cannot be resolved"
        for p in prot:
            if real == p or real.startswith(p.rstrip("/") + "/"):
                return f"{g!r} is inside {p!r}, which no run may reach"
        if (same := _links.protected_file_linked_as(real, prot)) is not None:
            return f"{g!r} is another hard link to {same!r}, which no run may reach"
    for g in write:
        real = _realpath(g) or g
        for code in runner_code():
            if real == code or real.startswith(code.rstrip("/") + "/") or code.startswith(real.rstrip("/") + "/"):
                return (
                    f"{g!r} would let the run write agentd's own code ({code!r}), which the next runner "
                    "runs before it sandboxes itself: grant a directory that does not hold it"
                )
    return None


# ----------------------------------------------------------------------------- enter


def enter(
    spec: Any,
    run_dir: Path | None,
    *,
    settings: Settings | None = None,
    prepare: Callable[[], None] | None = None,
    ahead: Ahead | None = None,
) -> Report:
    """Sandbox this process and everything it will start, for ``spec``; report what held.

    ``prepare`` runs after the identity step and before Landlock (what the run must create
    outside its grants, such as the browser's short temp link). ``ahead``: the half made
    before the spec was known (``prepare_ahead``, in this process), used if it is for this
    run directory and these settings (else closed, and the whole made here).

    Raises:
        SandboxError: the mode is ``required`` and Landlock could not be applied.
    """
    t0 = time.perf_counter()
    settings = Settings.from_env() if settings is None else settings
    report = Report(mode="none", requested=settings.mode, workdir=spec.sandbox.workdir)
    proc_writable = _enter(spec, run_dir, settings, prepare, report, ahead)
    if report.workdir is not None:
        try:
            os.chdir(report.workdir)  # run_command and servers without a cwd run there
        except OSError as exc:
            raise SandboxError(f"cannot enter the workdir {report.workdir!r}: {exc.strerror}") from None
    if spec.browser is not False:
        _browser_verdict(report, proc_writable)
    report.setup_ms = round((time.perf_counter() - t0) * 1000, 1)
    return report


def _enter(
    spec: Any,
    run_dir: Path | None,
    settings: Settings,
    prepare: Callable[[], None] | None,
    report: Report,
    ahead: Ahead | None,
) -> bool:
    """The body of ``enter``; returns whether the run's processes may write under /proc."""
    base = run_dir if run_dir is not None else Path.cwd()
    if settings.mode == "off" and ahead is not None:
        ahead.close()
    if settings.mode == "off":
        report.why = "turned off in the daemon's configuration (sandbox = off)"
        _drop_unit_capability()
        _nest.forget()
        _prepare(prepare, None)
        return True
    abi = _landlock.abi_version()
    threads = _isolate.thread_count()
    if abi <= 0 or threads > 1:
        why = "landlock is not available in this kernel" if abi <= 0 else f"the runner already has {threads} threads"
        if settings.mode == "required":
            raise SandboxError(f"the sandbox is required but {why}")
        report.why = why
        _drop_unit_capability()
        _nest.forget()
        _prepare(prepare, None)
        return True
    spec_read, spec_write = spec_paths(spec)
    # The one grant the daemon itself makes inside its state dir: the session's browser
    # profile (``sessions/<key>/browser-profile``), kept as it is (``plan_rules``).
    made = {spec.session.browser_profile} if spec.session.browser_profile else set()
    checked = ([p for p in spec_read if p not in made], [p for p in spec_write if p not in made])
    if ahead is None or not ahead.fits(base, settings, abi):
        if ahead is not None:
            ahead.close()
        # Checked at the spawn, and again now, on the host's paths (the namespace below
        # hides what a private /tmp covers): a granted path may have become a link into
        # the daemon's state since (a queued run's grant, swapped by another run's tool).
        refused = check_grants(*checked, protected(settings))
        if refused is not None:
            raise SandboxError(f"refused: {refused}")
        # A cold runner: the same two halves at once (the spec's paths kept in one go).
        ahead = prepare_ahead(
            base,
            settings,
            keep=_exists(spec_write),
            keep_read_only=_exists(spec_read),
            checked=[*checked[0], *checked[1]],
        )
        if ahead is None:  # cannot happen: the checks above are the ones it makes
            raise SandboxError("the sandbox could not be prepared")
    try:
        return _finish(ahead, spec_read, spec_write, settings, prepare, report, checked, spec.browser)
    finally:
        ahead.close()


def _drop_unit_capability() -> None:
    """A runner whose one capability is CAP_SETFCAP (the systemd unit's, held for its user
    namespace) drops it where it makes none: its tools never hold it (``NoNewPrivileges``
    keeps it from coming back at an execve). Any other set (a root daemon's) is left as is."""
    if _isolate.effective_capabilities() == 1 << _isolate.CAP_SETFCAP:
        try:
            _isolate.drop_capabilities()
        except OSError as exc:
            logger.warning("CAP_SETFCAP not dropped: %s", exc)


@dataclass
class Ahead:
    """The half of a run's sandbox that does not depend on its spec, made by
    ``prepare_ahead``: a forked-ahead runner (a zygote's spare) makes it before it has a
    run, a cold runner just before the other half. Holds descriptors: ``close`` it (``enter``
    does)."""

    base: Path
    settings: Settings
    abi: int
    read: list[str]
    write: list[str]
    protect: list[str]
    resolv: str | None
    root: bool
    host_uid: int
    inner: int
    # The sys.path directories too wide to grant whole (``runtime_grants``), neither read
    # nor listed: the names Python imports from each (``_importfinder``).
    imports: dict[str, list[str]] = field(default_factory=dict)
    userns: bool = False
    # A procfs of the run's own at /proc, hidepid=invisible (``_isolate.private_proc``).
    proc_hidden: bool = False
    quotas: dict[str, int] = field(default_factory=dict)  # the caps set so far (``Report.quotas``)
    private: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    proc_writable: bool = True
    ruleset: _landlock.Ruleset | None = None
    landlock_error: OSError | None = None
    # What each private tmpfs covers (O_PATH), to bind a spec's path there back later.
    hidden: dict[str, int] = field(default_factory=dict)

    def fits(self, base: Path, settings: Settings, abi: int) -> bool:
        return self.base == base and self.settings == settings and self.abi == abi

    def fds(self) -> list[int]:
        return [*self.hidden.values(), *([self.ruleset.fd] if self.ruleset is not None else [])]

    def close(self) -> None:
        hidden, self.hidden = self.hidden, {}
        for fd in hidden.values():
            os.close(fd)
        if self.ruleset is not None:
            self.ruleset.close()

    def bind_hidden(
        self, read: Iterable[str], write: Iterable[str] = (), *, checked: Iterable[str] | None = None
    ) -> None:
        """Bind back the paths a private tmpfs hides (a spec's grant under /tmp, say), as a
        cold runner's ``private_mounts`` keeps them (``_isolate.bind_plan``: the topmost of
        nested ones, and a written path again under a read-only one), over the directories
        the run's own bind left there (a grant holding the run directory is bound whole, as
        a cold runner binds it). While the capabilities are held."""
        if not self.userns:
            return
        read, write = list(read), list(write)
        paths = [*read, *write]
        check = {os.path.normpath(p) for p in (paths if checked is None else checked)}  # not the daemon's grant
        bound = [p for p in self.private if p not in self.hidden]  # the binds, not the tmpfs

        def norm(ps: Iterable[str]) -> list[str]:
            return [os.path.normpath(p) for p in ps if p and os.path.isabs(p)]

        wanted: list[tuple[str, str, bool]] = []
        for p, ro in _isolate.bind_plan(norm(read), norm([*write, *self.write]), within=self.hidden):
            tops = [b for b in bound if p == b or p.startswith(b.rstrip("/") + "/")]
            if tops and (ro or not _read_only_mount(max(tops, key=len))):
                continue  # what a bind made ahead brings (the run directory), unless written under a read-only one
            seen = self._on_the_host(p)
            if seen is not None:
                wanted.append((p, seen, ro))
        for path, seen, ro in wanted:
            # What it is now, on the host (a link followed: ``realpath`` cannot see past the
            # tmpfs here): never the daemon's state, whatever it was at the spawn. The
            # descriptor checked is the one bound: a swap after the check changes nothing.
            try:
                fd = os.open(seen, os.O_PATH | os.O_CLOEXEC)
            except OSError as exc:
                self.problems.append(f"cannot keep {path!r} in the run's private dir: {exc.strerror or exc}")
                continue
            try:
                now = os.readlink(f"/proc/self/fd/{fd}")
                why = check_grants([now], [], self.protect) if path in check else None
                if why is not None:
                    raise SandboxError(f"refused: {path!r} leads to {why}")
                try:
                    _isolate.bind_fd(fd, path, read_only=ro)
                    self.private.append(path)
                except OSError as exc:
                    self.problems.append(f"cannot keep {path!r} in the run's private {exc.filename or 'dir'}: {exc}")
            finally:
                os.close(fd)

    def in_view(self, paths: Iterable[str]) -> list[str]:
        """``paths`` less those a private tmpfs hides from this view: under /tmp, a state
        dir is there only if a bind brought it back (a read grant that holds it). The
        directories the run's own bind left on the way to its run directory are the
        tmpfs's, not the state dir's: protecting them kept the run from writing /tmp at
        all. A path this view has but the host does not is kept (it is not known)."""
        out: list[str] = []
        for p in paths:
            if self._hidden_view(p) is None:
                out.append(p)  # not under a private tmpfs: as the host has it
                continue
            try:
                here = os.stat(p)
            except OSError:
                continue  # not in this view
            host = self._on_the_host(p)
            try:
                there = None if host is None else os.stat(host)
            except OSError:
                there = None
            if there is None or (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                out.append(p)
        return out

    def _hidden_view(self, p: str) -> str | None:
        for d, fd in self.hidden.items():
            if p.startswith(d.rstrip("/") + "/"):
                return f"/proc/self/fd/{fd}/{os.path.relpath(p, d)}"
        return None

    def _on_the_host(self, p: str) -> str | None:
        """``p`` as the host has it, through the descriptors of what the private tmpfs
        hide: a path to open, or None if there is nothing there. A link on the way whose
        target is absolute is followed on the host too (here it would lead into the empty
        tmpfs): a grant, or a server's command, kept as a link under /tmp."""
        for _hop in range(40):
            seen = self._hidden_view(p)
            if seen is None:
                return None
            link = self._first_link(p)
            if link is None:
                return seen if os.path.exists(seen) else None
            at, rest = link
            target = os.readlink(self._hidden_view(at) or at)
            p = os.path.normpath(os.path.join(os.path.dirname(at), target, *rest))  # (an absolute target wins)
            if self._hidden_view(p) is None:  # out of the private dirs: as this view has it
                return p if os.path.exists(p) else None
        return None

    def _first_link(self, p: str) -> tuple[str, list[str]] | None:
        """The first link on ``p``'s way below its private dir, as the host has it, and the
        components after it; None if there is none. Any component may be one: the kernel
        would follow a link in the middle in this view, into the empty tmpfs."""
        top = next(d for d in self.hidden if p.startswith(d.rstrip("/") + "/"))
        parts = os.path.relpath(p, top).split("/")
        at = top
        for i, part in enumerate(parts):
            at = os.path.join(at, part)
            seen = self._hidden_view(at)
            if seen is not None and os.path.islink(seen):
                return at, parts[i + 1 :]
        return None


def _read_only_mount(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _refuse_protected(protect: list[str], granted: Iterable[str]) -> Callable[[str, str], None]:
    """For ``private_mounts``: a granted path whose descriptor, opened to be bound, names
    something inside a protected path (a link swapped in after the grants were checked by
    name) is refused."""
    mine = {os.path.realpath(p) for p in granted}

    def check(path: str, named: str) -> None:
        if path in mine:
            why = check_grants([named], [], protect)
            if why is not None:
                raise SandboxError(f"refused: {path!r} leads to {why}")

    return check


def prepare_ahead(
    base: Path,
    settings: Settings,
    *,
    keep: Iterable[str] = (),
    keep_read_only: Iterable[str] = (),
    checked: Iterable[str] = (),
) -> Ahead | None:
    """The spec-independent half of ``enter`` for a run in ``base``: its own user and
    mount namespace, private /tmp and the like (``keep``: more paths to bind back;
    ``keep_read_only``: more, read-only; those of them in ``checked`` are refused if what
    they name as they are bound is protected), and a
    Landlock ruleset holding every grant but the spec's; capabilities kept (the other half
    may bind a spec's path back) and nothing restricted yet. None where there is nothing
    to prepare (the sandbox is off, Landlock missing, more than one thread)."""
    if settings.mode == "off":
        return None
    abi = _landlock.abi_version()
    if abi <= 0 or _isolate.thread_count() > 1:
        return None
    root = os.geteuid() == 0
    runtime = runtime_grants()
    ahead = Ahead(
        base=base,
        settings=settings,
        abi=abi,
        read=_exists([*SYSTEM_READ, *runtime.read]),
        imports=runtime.imports,
        write=_exists([str(base)]),
        protect=protected(settings),
        resolv=_resolv_target(),
        root=root,
        host_uid=os.getuid(),
        # A normal user's runner stays that uid inside (its files are the user's); a root
        # runner becomes SANDBOX_ID. Either way /tmp, /run and the like are the run's own:
        # the user's sockets there (systemd --user, the session bus, ssh-agent) are out of reach.
        inner=SANDBOX_ID if root else os.getuid(),
        problems=runtime.problems,
    )
    if root:
        _private_proc(ahead)
    _join_nest(ahead)  # after what needs the host's root, before its own namespace
    try:
        _isolate.enter_user_namespace(ahead.inner)
        ahead.userns = True
        _limit_user_namespace(ahead)  # while /proc/sys is writable and the capabilities held
        # Opened in the new mount namespace (a bind from a mount of another one is refused).
        for d in PRIVATE_DIRS:
            if os.path.isdir(d) and not os.path.islink(d):
                ahead.hidden[d] = os.open(d, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)
        resolv = [ahead.resolv] if ahead.resolv else []
        # What the run only reads is bound back read-only: the write rule each private
        # tmpfs gets reaches down through the mounts under it.
        ahead.private = _isolate.private_mounts(
            tmpfs=PRIVATE_DIRS,
            read_only=_isolate.KERNEL_TUNABLES,
            keep=[*ahead.write, *keep],
            keep_read_only=[*ahead.read, *keep_read_only, *resolv],
            check=_refuse_protected(ahead.protect, checked),
            tmpfs_max_mib=settings.tmpfs_max_mib,
        )
        _private_terminals(ahead)
        _cover_protected(ahead, [*ahead.write, *keep], [*ahead.read, *keep_read_only, *resolv])
        os.chdir(base)
    except OSError as exc:
        ahead.problems.append(f"no private namespace for the run: {exc.strerror or exc}")
    if not ahead.userns:
        ahead.problems.append(f"{_quotas.UNCAPPED}: no user namespace of its own")
    tunables_ro = bool(os.statvfs("/proc/sys").f_flag & os.ST_RDONLY) if os.path.exists("/proc/sys") else True
    # Chromium's sandbox writes its namespaces' uid_map under /proc: allowed where /proc's
    # tunables cannot be written anyway (not uid 0, or mounted read-only).
    ahead.proc_writable = not root or tunables_ro
    grants = [Grant(p, FS_READ) for p in ahead.read] + [Grant(p, FS_WRITE) for p in ahead.write]
    grants += [
        Grant("/proc", FS_READ | (_landlock.WRITE_FILE if ahead.proc_writable else 0)),
        Grant("/dev", _landlock.READ_DIR),
    ]
    grants += [Grant(d, _DEVICE_ACCESS) for d in DEVICES_RW]
    if ahead.resolv:
        grants.append(Grant(ahead.resolv, FS_READ))
    try:
        ahead.ruleset = _landlock.Ruleset(abi=abi, scoped=_SCOPES)
        ahead.ruleset.add(_landlock.plan_rules(grants, ahead.protect))
    except OSError as exc:
        if ahead.ruleset is not None:
            ahead.ruleset.close()
            ahead.ruleset = None
        ahead.landlock_error = exc
    return ahead


def _cover_protected(ahead: Ahead, keep: list[str], keep_read_only: list[str]) -> None:
    """The protected directories (the daemon's state and runs, ``protected``) out of the
    run's sight where its view still shows them (not under a private tmpfs): an empty
    tmpfs over each, the run's own directory (``keep``) and what it reads there
    (``keep_read_only``) bound back (``_isolate.cover``); a spare's spec paths there
    later (a session's browser profile) by ``bind_hidden``, through the host's directory
    held in ``hidden``. Landlock refuses every open there, but not a ``connect()`` to a
    unix socket: another run's tool listening in its run directory was in reach."""
    tops: list[str] = []
    for p in sorted({os.path.normpath(p) for p in ahead.protect if os.path.isabs(p)}, key=len):
        if any(p == t or p.startswith(t.rstrip("/") + "/") for t in [*tops, *ahead.hidden]):
            continue  # out of sight already
        if os.path.isdir(p) and not os.path.islink(p):
            tops.append(p)
    for p in tops:  # each on its own: one that cannot be covered leaves the others covered
        fd = -1
        try:
            fd = os.open(p, os.O_PATH | os.O_CLOEXEC | os.O_DIRECTORY)  # the host's, for ``bind_hidden``
            ahead.private += _isolate.cover([p], keep=keep, keep_read_only=keep_read_only)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            ahead.problems.append(
                f"{p!r} is in the run's sight (a unix socket there is in reach): {exc.strerror or exc}"
            )
            continue
        ahead.hidden[p] = fd


def _limit_user_namespace(ahead: Ahead) -> None:
    """The run's caps on its uid's per-user counts (``_quotas``), in its new namespace."""
    s = ahead.settings
    try:
        ahead.quotas.update(_quotas.limit_user_namespace(_quotas.user_limits(s.inotify_instances, s.inotify_watches)))
    except OSError as exc:
        ahead.problems.append(f"{_quotas.UNCAPPED}: {exc.strerror or exc}")


def _join_nest(ahead: Ahead) -> None:
    """All runs' counts bounded together: the daemon's nest joined (``_nest``), its
    limits reported as ``total_*``; why not, in ``problems``."""
    limits, why = _nest.join()
    ahead.quotas.update({f"total_{name}": v for name, v in limits.items()})
    if why is not None:
        ahead.problems.append(f"{_nest.UNBOUNDED}: {why}")


def _private_proc(ahead: Ahead) -> None:
    """A root runner's own /proc, ``hidepid=invisible`` (``_isolate.private_proc``), made
    while it is still the host's root (a procfs belongs to the host's user namespace,
    which owns the PID namespace; a normal user's runner cannot mount one): the command
    lines, environments and status of the host's processes, the daemon's and other runs'
    (all uid 0 on the host, like the run, but outside its Landlock domain, which refuses
    the run ptrace access to them) are out of its sight."""
    try:
        _isolate.private_proc()
    except OSError as exc:
        why = exc.strerror or str(exc)
        if not _isolate.effective_capabilities() & (1 << _isolate.CAP_SYS_ADMIN):
            # The systemd unit's root: a procfs belongs to the user namespace owning its PID
            # namespace (the host's), and the run's own user namespace owns none.
            why = f"{why} (uid 0 without CAP_SYS_ADMIN: the host's PID namespace is not the run's to mount)"
        ahead.problems.append(
            f"the daemon's /proc (its processes, the host's, other runs', their command lines) is in the run's "
            f"sight: {why}"
        )
        return
    ahead.proc_hidden = True


def _private_terminals(ahead: Ahead) -> None:
    """The run's own devpts at ``DEVPTS`` (``_isolate.private_devpts``), before the
    Landlock rules name it (a rule holds the inode it was made on: the new instance's)."""
    if not os.path.isdir(DEVPTS) or os.path.islink(DEVPTS):
        return
    try:
        _isolate.private_devpts(DEVPTS, max_ptys=_quotas.PTYS)
    except OSError as exc:
        ahead.problems.append(f"the host's terminals ({DEVPTS}) are in the run's reach: {exc.strerror or exc}")
        return
    ahead.private.append(DEVPTS)
    ahead.quotas["ptys"] = _quotas.PTYS


def _finish(
    ahead: Ahead,
    spec_read: list[str],
    spec_write: list[str],
    settings: Settings,
    prepare: Callable[[], None] | None,
    report: Report,
    checked: tuple[list[str], list[str]],
    browser: Any,
) -> bool:
    """The spec's half of ``_enter``: its paths, capabilities dropped, Landlock applied.
    ``checked``: its paths less the daemon's own grant (see ``_enter``); ``browser``: the
    spec's."""
    # Checked at the spawn, and again now (see ``_enter``); what a private tmpfs hides is
    # checked as it is bound back (``bind_hidden``).
    why = check_grants(*checked, ahead.protect)
    if why is not None:
        raise SandboxError(f"refused: {why}")
    ahead.bind_hidden(spec_read, spec_write, checked=[*checked[0], *checked[1]])
    read = list(dict.fromkeys([*ahead.read, *_exists(spec_read)]))
    write = list(dict.fromkeys([*ahead.write, *_exists(spec_write)]))
    report.private = ahead.private
    report.proc = PROC_SHARED
    if any(p in PRIVATE_DIRS for p in ahead.private):
        report.private_max_mib = ahead.settings.tmpfs_max_mib
    report.problems.extend(ahead.problems)
    report.problems.extend(_browser_notes(browser))  # (its binary in view now, $HOME still the daemon's)
    if ahead.root or ahead.userns:
        try:
            _isolate.drop_capabilities()
        except OSError as exc:
            report.problems.append(f"capabilities: {exc}")
    _isolate.set_dumpable(False)
    try:
        _seccomp.deny_syscalls()  # no child born outside the run's cgroup, no key (``_seccomp``)
        report.denied_syscalls = list(_seccomp.DENIED)
    except OSError as exc:
        report.problems.append(
            f"clone3 and the key calls are not refused (a child could start outside the run's cgroup): {exc}"
        )
    report.quotas = dict(ahead.quotas)
    try:
        report.quotas.update(_quotas.limit_rlimits())
    except OSError as exc:
        report.problems.append(f"the run's message queues and queued signals are not capped: {exc}")
    host = f"uid {ahead.host_uid}"
    if ahead.userns:
        report.identity = f"{host} on the host, uid {ahead.inner} in its own user namespace, no capabilities"
    else:
        report.identity = f"{host} without capabilities" if ahead.root else host
    _prepare(prepare, ahead.base)
    try:
        if ahead.ruleset is None:
            raise ahead.landlock_error or OSError("no ruleset")
        spec_grants = [Grant(p, FS_READ) for p in read if p not in ahead.read]
        spec_grants += [Grant(p, FS_WRITE) for p in write if p not in ahead.write]
        ahead.ruleset.add(_landlock.plan_rules(spec_grants, ahead.protect))
        # The private tmpfs are the run's own, whole: once every bind is made, only what
        # a bind brought back of a protected path is kept from them (``in_view``).
        private = [Grant(p, FS_WRITE) for p in ahead.private if p in PRIVATE_DIRS]
        ahead.ruleset.add(_landlock.plan_rules(private, ahead.in_view(ahead.protect)))
        linked = _links.linked_protected(ahead.protect, [*read, *write])
        _importfinder.install(ahead.imports)  # (a too wide sys.path entry: imported from, never listed)
        ahead.ruleset.restrict()
    except OSError as exc:
        if settings.mode == "required":
            raise SandboxError(f"the sandbox is required but landlock failed: {exc}") from exc
        report.why = f"landlock failed: {exc}"
        return ahead.proc_writable
    report.mode = "landlock"
    report.landlock_abi = ahead.abi
    report.problems.extend(linked)  # another hard link to a protected file may be in reach
    if ahead.proc_hidden:  # (without Landlock the host's uid-0 processes are the run's uid, in its sight)
        report.proc = PROC_HIDDEN
    report.read, report.write, report.protected = read, write, ahead.protect
    report.scopes = ["signal", "abstract_unix_socket"] if ahead.abi >= 6 else []
    return ahead.proc_writable


def _prepare(prepare: Callable[[], None] | None, base: Path | None) -> None:
    if base is not None:
        home = base / "home"
        try:
            home.mkdir(mode=0o700, exist_ok=True)
            os.environ["HOME"] = str(home)  # tools get a home they can write
        except OSError:
            pass
    if prepare is not None:
        prepare()


def _browser_verdict(report: Report, proc_writable: bool) -> None:
    if os.geteuid() == 0:
        report.browser_sandbox, report.browser_sandbox_why = (
            False,
            "the run is uid 0 (it has no user namespace of its own)",
        )
    elif not proc_writable:
        report.browser_sandbox, report.browser_sandbox_why = False, "the kernel's tunables are writable by this uid"
    elif not _isolate.can_nest_user_namespace():
        report.browser_sandbox, report.browser_sandbox_why = (
            False,
            "this run cannot create the user, PID and network namespaces Chromium's sandbox makes",
        )
    else:
        report.browser_sandbox = True


def browser_sandbox(report: Mapping[str, Any] | None) -> tuple[bool, str | None]:
    """Whether a run's Chromium keeps its own sandbox, and why not, from its report's dict."""
    if report is None or report.get("browser_sandbox") is None:
        return False, "unknown: no sandbox report for this run"
    return bool(report["browser_sandbox"]), report.get("browser_sandbox_why")


# ----------------------------------------------------------------------------- environment


def tool_env(extra: Mapping[str, str] | None = None, *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a tool process: the allowlist from ``environ``, then ``extra``.

    ``extra`` (a server's configured ``env``) is passed, except a value equal to a secret
    of the runner's (the model key); the run's own AGENTD_* markers are applied last.
    """
    environ = os.environ if environ is None else environ
    settings = Settings.from_env(environ)
    explicit = set(settings.tool_env) - set(MODEL_KEY_VARS)
    secrets = {
        v
        for k, v in environ.items()
        if len(v) >= _SECRET_MIN_CHARS and _SECRET_NAME.search(k) and (k not in explicit or k in MODEL_KEY_VARS)
    }
    env: dict[str, str] = {}
    for k, v in environ.items():
        if k in TOOL_ENV_NAMES or k.startswith(TOOL_ENV_PREFIXES) or k in explicit:
            if v not in secrets and not v.startswith("()"):  # "()": an exported shell function
                env[k] = v
    dropped = []
    for k, v in (extra or {}).items():
        if v in secrets:
            dropped.append(k)
        else:
            env[k] = v
    if dropped:
        logger.warning("not passed to a tool: %s (the value is a secret of the runner's)", ", ".join(sorted(dropped)))
    env.update({k: environ[k] for k in AGENTD_TOOL_VARS if k in environ})
    return env
