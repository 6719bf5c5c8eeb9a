"""Daemon configuration: one frozen dataclass.

Precedence, lowest first: built-in defaults, the TOML file (``<state_dir>/agentd.toml`` or
``--config``), ``AGENTD_*`` environment variables, then explicit overrides (CLI flags).
Durations end in ``_s``. Validation raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The state dir and its published files are defined with the code that reads them, which
# the CLI's client imports without this module (its dataclass is ~2 ms of a cold command).
from supervisor.control._statefiles import ENDPOINT_FILE as ENDPOINT_FILE
from supervisor.control._statefiles import TOKEN_FILE as TOKEN_FILE
from supervisor.control._statefiles import default_state_dir as default_state_dir
from supervisor.errors import ConfigError

__all__ = ["Config", "default_state_dir", "module_argv", "TOKEN_FILE", "ENDPOINT_FILE", "JOURNAL_FILE"]


def module_argv(python: str, module: str) -> tuple[str, ...]:
    """``python -P -m module``: a process of ours that runs a module of ours (runner,
    zygote, nest holder). ``-P``: no working directory first on ``sys.path``. Plain
    ``-m`` put it there, and a runner's working directory is its run directory, which the
    run's tools write: a module they left there under a name the runner imported later
    (lazily, or a forked runner's ``sys.path[0]``) would have run inside the runner, with
    its model key and its results (found by a probe; no such late import was seen)."""
    return (python, "-P", "-m", module)


JOURNAL_FILE = "agentd.sqlite3"
# The most a ``*_mib`` setting may say (2**40 MiB = 2**60 bytes): a larger one wrapped in
# the kernel's 64-bit byte counts (a tmpfs ``size=`` of 2**44 MiB was no bound at all).
_MAX_MIB = 2**40
_MAX_PIDS = 4 * 1024 * 1024  # PID_MAX_LIMIT on 64-bit Linux


@dataclass(frozen=True, slots=True)
class Config:
    state_dir: Path = field(default_factory=default_state_dir)
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port, published in <state_dir>/daemon.json
    # Browser origins allowed on the control socket; a connection with any other Origin
    # header is refused. Clients that send no Origin (CLI, programs) are not browsers.
    allowed_origins: tuple[str, ...] = ()
    # Path B: how long a runner gets between SIGTERM and SIGKILL of its whole tree.
    grace_s: float = 10.0
    # Runs allowed to be live at once; more wait in the queue.
    max_concurrent: int = 64
    # Default wall-clock limit of a run; None: none. A timeout is a cancel, reason "timeout".
    default_timeout_s: float | None = None
    # The interpreter that runs ``python -m subagent.runner``.
    runner_python: str = sys.executable
    # The whole runner command line, if not ``<runner_python> -m subagent.runner``
    # (a space-separated string in TOML/env; tests use it to run small child scripts).
    runner_command: tuple[str, ...] = ()
    # Warm runners kept pre-spawned (imports done, waiting for a spec); 0 disables the pool.
    pool_size: int = 0
    # Largest control message accepted, in bytes.
    max_message_bytes: int = 1024 * 1024
    # Largest ``history`` reply, about (its turns measured as encoded): a longer session's
    # history comes in pages (``supervisor/core/_history_page.py``); a page holds at least
    # one turn. A reply costs the daemon several times its size while it is built and sent.
    history_reply_bytes: int = 8 * 1024 * 1024
    # Where run directories live; default <state_dir>/runs.
    runs_dir: Path | None = None
    # Use a cgroup v2 per run where one can be created ("auto"), never ("off").
    cgroups: str = "auto"
    # The web dashboard ("on": served on `host`, its URL published in daemon.json; "off").
    dashboard: str = "on"
    # The dashboard's port; 0: an ephemeral port, published in <state_dir>/daemon.json.
    dashboard_port: int = 0
    # Each run's sandbox (subagent/sandbox.py): "auto" (what the kernel allows, shown in
    # status), "required" (a run that cannot have Landlock fails), "off".
    sandbox: str = "auto"
    # More paths no run may reach, beyond the state dir, runs dir and /etc/agentd.
    sandbox_protect: tuple[str, ...] = ()
    # Variable names passed from the daemon's environment to tools, beyond the allowlist
    # (never the model key).
    tool_env: tuple[str, ...] = ()
    # Fork runners from a pre-initialised zygote where that is exact ("auto": Linux, the
    # daemon a child subreaper, the stock runner), or always start them cold ("off").
    zygote: str = "auto"
    # Runners the zygote keeps forked ahead, each born in its own next tree's cgroup and as
    # far along as it can go without a run (a spawn takes one; 0: every runner is forked
    # at its spawn).
    zygote_spares: int = 1
    # A burst of spawns (less than a second apart) that found too few spares grows them to
    # its size, at most this many (and at most ``max_concurrent``), until no burst that
    # large has come for ``zygote_spares_keep_s``; then back to ``zygote_spares``. A parked
    # spare costs ~7 MiB and no CPU. ``zygote_spares_max`` at or below ``zygote_spares``:
    # a fixed number.
    zygote_spares_max: int = 64
    zygote_spares_keep_s: float = 600.0
    # Session browser profiles (cookies, storage kept across a session's turns): removed
    # when the session is closed, after this long unused (seconds), and the least recently
    # used beyond this many.
    session_profile_ttl_s: float = 7 * 24 * 3600.0
    session_profiles_max: int = 32
    # The disk guard's low-water mark (``supervisor/core/diskguard.py``): when the state
    # dir's (or the runs dir's) filesystem has less free space than the larger of these,
    # the live run holding the most there is stopped, reason "disk_full". Both 0: off.
    disk_min_free_mib: int = 256
    disk_min_free_percent: float = 1.0
    # A run's private /tmp, /var/tmp, /dev/shm and /run (subagent/sandbox.py) are one tmpfs
    # (memory): at most this many MiB together; a run that fills it gets ENOSPC there, the
    # others and the daemon keep their memory. 0: the kernel's default (half the RAM).
    run_tmpfs_max_mib: int = 1024
    # One run's own inotify instances and watches (``subagent/_quotas.py``): the kernel
    # counts them per user (128 instances for all of root here: the daemon's, systemd's),
    # a run's in its own user namespace too, capped there. 0: no cap of its own.
    run_inotify_instances: int = 16
    run_inotify_watches: int = 16384
    # All runs together (``subagent/_nest.py``: one user namespace the daemon holds, every
    # run's own made in it): at most this many inotify instances and watches, the rest of
    # the uid's left to the host. 0: no total of their own (each run's cap still holds).
    run_inotify_instances_total: int = 64
    run_inotify_watches_total: int = 65536
    # Most tasks (processes and threads) one run's tree may have at once (``pids.max`` of
    # its pids group: ``supervisor/trees/_pidslimit.py``): a run that forks without end
    # gets EAGAIN at this many, and the other runs and the daemon can still fork. A browser
    # run (runner, node, Chromium and its helpers, their threads) peaked at ~130 here. 0: off.
    run_pids_max: int = 2048
    # Most memory (MiB) one run's tree may charge at once (``memory.max`` of its cgroup v2,
    # or ``memory.limit_in_bytes`` of its cgroup v1 memory group on a hybrid host:
    # ``supervisor/trees/_memlimit.py``): past it the kernel's OOM
    # killer kills a process of that run only, never the daemon or another run. A browser
    # run (runner, @playwright/mcp, Chromium and its helpers) peaked far below. 0: off.
    run_memory_max_mib: int = 4096

    @property
    def token_path(self) -> Path:
        return self.state_dir / TOKEN_FILE

    @property
    def endpoint_path(self) -> Path:
        return self.state_dir / ENDPOINT_FILE

    @property
    def journal_path(self) -> Path:
        return self.state_dir / JOURNAL_FILE

    @property
    def runner_argv(self) -> tuple[str, ...]:
        return self.runner_command or module_argv(self.runner_python, "subagent.runner")

    def min_free_bytes(self, total_bytes: int) -> int:
        """The disk guard's low-water mark for a filesystem of ``total_bytes``."""
        return max(self.disk_min_free_mib * 1024 * 1024, int(total_bytes * self.disk_min_free_percent / 100))

    @property
    def run_root(self) -> Path:
        return self.runs_dir if self.runs_dir is not None else self.state_dir / "runs"

    @classmethod
    def load(
        cls,
        *,
        state_dir: Path | str | None = None,
        config_file: Path | str | None = None,
        environ: dict[str, str] | None = None,
        **overrides: Any,
    ) -> Config:
        """Build a Config from defaults, a TOML file, the environment and overrides."""
        env = dict(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        if state_dir is not None and not str(state_dir):
            raise ConfigError("state_dir", "empty (leave it out for the default)")
        sd = Path(state_dir) if state_dir is not None else None
        if sd is None and env.get("AGENTD_STATE_DIR"):
            sd = Path(env["AGENTD_STATE_DIR"])
        if sd is None:
            sd = default_state_dir()
        # Absolute here, once: a runner works in its run dir (the zygote's forks chdir
        # there), so a relative state dir named files that were not there.
        sd = sd.absolute()
        path = Path(config_file) if config_file is not None else sd / "agentd.toml"
        try:
            found = config_file is not None or path.exists()
        except OSError as exc:  # a state dir under a directory this user cannot search
            raise ConfigError("state_dir", f"cannot use state dir {str(sd)!r}: {exc.strerror or exc}") from exc
        if found:
            import tomllib  # only when there is a file: the CLI's status path stays light

            try:
                with open(path, "rb") as f:
                    values.update(tomllib.load(f))
            except OSError as exc:
                raise ConfigError("config_file", f"cannot read {str(path)!r}: {exc}") from exc
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError("config_file", f"{str(path)!r} is not valid toml: {exc}") from exc
        names = {f.name for f in dataclasses.fields(cls)}
        for name in names:
            key = "AGENTD_" + name.upper()
            if key in env and name != "state_dir":
                values[name] = env[key]
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["state_dir"] = sd
        unknown = set(values) - names
        if unknown:
            raise ConfigError(sorted(unknown)[0], "unknown setting")
        return cls(**_coerce(cls, values))


def _coerce(cls: type[Config], values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        try:
            if f.name in {"state_dir", "runs_dir"}:
                v = None if v in (None, "") else Path(v).absolute()
            elif f.name in {
                "port",
                "max_concurrent",
                "pool_size",
                "max_message_bytes",
                "history_reply_bytes",
                "dashboard_port",
                "session_profiles_max",
                "zygote_spares",
                "zygote_spares_max",
                "disk_min_free_mib",
                "run_tmpfs_max_mib",
                "run_inotify_instances",
                "run_inotify_watches",
                "run_inotify_instances_total",
                "run_inotify_watches_total",
                "run_pids_max",
                "run_memory_max_mib",
            }:
                v = int(v)
                if v < 0:
                    raise ValueError("must be >= 0")
                if f.name == "port" and v > 65535:
                    raise ValueError("must be <= 65535")
                if f.name.endswith("_mib") and v > _MAX_MIB:  # in bytes past 2**63: it wrapped
                    raise ValueError(f"must be <= {_MAX_MIB} (MiB)")
                if f.name == "run_pids_max" and v > _MAX_PIDS:
                    raise ValueError(f"must be <= {_MAX_PIDS} (the kernel's most pids)")
            elif f.name in {"grace_s", "session_profile_ttl_s", "zygote_spares_keep_s"}:
                v = float(v)
                if not math.isfinite(v) or v < 0:  # NaN passed `v < 0`: a grace of NaN SIGKILLed at once
                    raise ValueError("must be a finite number >= 0")
            elif f.name == "disk_min_free_percent":
                v = float(v)
                if not math.isfinite(v) or not 0 <= v < 100:
                    raise ValueError("must be a percentage, >= 0 and < 100")
            elif f.name == "default_timeout_s":
                v = None if v in (None, "", "none") else float(v)
                if v is not None and (not math.isfinite(v) or v <= 0):
                    raise ValueError("must be a finite number > 0 (or none)")
            elif f.name == "runner_command":
                v = tuple(shlex.split(v)) if isinstance(v, str) else tuple(str(a) for a in v)
            elif f.name in {"allowed_origins", "sandbox_protect", "tool_env"}:
                if isinstance(v, str):
                    v = tuple(o.strip() for o in v.split(",") if o.strip())
                else:
                    v = tuple(str(o) for o in v)
            elif f.name in {"cgroups", "zygote"}:
                v = str(v)
                if v not in {"auto", "off"}:
                    raise ValueError("expected 'auto' or 'off'")
            elif f.name == "dashboard":
                v = {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else str(v)
                if v not in {"on", "off"}:
                    raise ValueError("expected 'on' or 'off'")
            elif f.name == "host":
                v = str(v)
                if not v.strip():
                    # trio took "" for every interface: the socket was open to the network,
                    # said only in a log line. 0.0.0.0 or :: says so on purpose.
                    raise ValueError("empty (to listen on every interface, say 0.0.0.0 or ::)")
            elif f.name == "sandbox":
                v = str(v)
                if v not in {"auto", "required", "off"}:
                    raise ValueError("expected 'auto', 'required' or 'off'")
            else:
                v = str(v)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f.name, f"bad value {values[f.name]!r}: {exc}") from exc
        out[f.name] = v
    if out.get("max_concurrent", 1) == 0:
        raise ConfigError("max_concurrent", "must be at least 1")
    return out
