"""Warm runners: pre-spawned ``python -m subagent.runner --warm`` processes.

A cold runner pays for Python, trio, and (for real models and MCP tools) over two seconds
of ``openai``/``mcp`` imports before its first step. A warm runner has done that already
and blocks reading its spec on stdin, so a spawn that takes one starts work at once.

Each warm runner is a full tree from the start: its own session, its own cgroup, its
marker, its run directory (named by the tree id). Taking one hands that tree to a run;
the pool refills in the background. At shutdown, or if a warm runner dies while idle,
its tree is ended and its directory removed. A daemon that dies leaves its warm runners
reading an EOF, on which they exit.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import trio

from subagent._nest import NEST_ENV
from subagent.approvals import ANSWERS_ENV
from subagent.sandbox import SANDBOX_ENV, Settings
from subagent.stopmark import make_marker, marker_path
from supervisor.config import Config
from supervisor.core.approvals import make_channel, remove_channel
from supervisor.errors import SpawnError
from supervisor.trees import process
from supervisor.trees.containment import Containment

if TYPE_CHECKING:
    from supervisor.trees._nest import Nest
    from supervisor.trees.zygote import Zygote

__all__ = [
    "WarmPool",
    "Warm",
    "new_tree",
    "runner_env",
    "protected_paths",
    "sandbox_settings",
    "sweep_run_root",
    "remove_tree",
]

logger = logging.getLogger(__name__)

# After a failed warm spawn, wait this long before trying again.
RESPAWN_BACKOFF_S = 1.0
# How long a warm runner may take to import everything and say it is waiting.
WARM_READY_TIMEOUT_S = 60.0
# At shutdown, how long an idle warm runner gets to exit on the EOF of its stdin.
BURY_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class Warm:
    tree: process.Tree
    run_dir: Path
    # What the warm runner wrote on stderr while it got ready (its "waiting" log event):
    # the run reads it first, so no event is lost.
    early_stderr: bytes = b""
    # The spec is in the runner's stdin already (a zygote's spare got it with its run).
    spec_sent: bool = False


def runner_env(run_dir: Path, base: Mapping[str, str] | None = None, config: Config | None = None) -> dict[str, str]:
    """The runner's environment: the daemon's, its run dir, and its sandbox settings."""
    env = dict(os.environ if base is None else base)
    env.pop("AGENTD_RUN_ID", None)
    env.pop(NEST_ENV, None)  # the daemon's own runners are told theirs (``new_tree``, the zygote)
    env.update(AGENTD_RUN_DIR=str(run_dir), TMPDIR=str(run_dir / "tmp"))
    if config is not None:
        env[SANDBOX_ENV] = sandbox_settings(config).to_env()
        env["AGENTD_STOP_GRACE_S"] = repr(config.grace_s)  # (subagent.session_browser.GRACE_ENV)
    return env


def protected_paths(config: Config) -> tuple[str, ...]:
    """What no run may reach: the state dir (token, journal, daemon.json, config), the
    runs dir (other runs), and the configured extras."""
    return tuple(dict.fromkeys(str(p) for p in (config.state_dir, config.run_root, *config.sandbox_protect)))


def sandbox_settings(config: Config) -> Settings:
    return Settings(
        mode=config.sandbox,
        protect=protected_paths(config),
        tool_env=config.tool_env,
        tmpfs_max_mib=config.run_tmpfs_max_mib,
        inotify_instances=config.run_inotify_instances,
        inotify_watches=config.run_inotify_watches,
    )


async def new_tree(
    config: Config,
    containment: Containment,
    *,
    warm: bool,
    extra_env: Mapping[str, str] | None = None,
    zygote: Zygote | None = None,
    nest: Nest | None = None,
) -> Warm:
    """Make a run directory and start a runner tree in it (waiting warm or not).

    Forked by the ``zygote`` when one is given and ready (a few milliseconds, every import
    done), else a cold ``python -m subagent.runner``, given the ``nest`` (the zygote has it).
    """
    tree_id = "t-" + uuid.uuid4().hex[:16]
    run_dir = config.run_root / tree_id
    await trio.to_thread.run_sync(_make_run_dir, run_dir)
    env = runner_env(run_dir, config=config)
    # Approvals reach the runner here (supervisor.core.approvals): beside the run dir, so out
    # of its tools' reach; the runner opens it before it sandboxes itself.
    env[ANSWERS_ENV] = str(await trio.to_thread.run_sync(make_channel, run_dir))
    if extra_env:
        env.update(extra_env)
    args = ["--warm"] if warm else []
    try:
        tree = None
        if zygote is not None:
            tree = await zygote.spawn_tree(args, env=env, cwd=run_dir, tree_id=tree_id)
        if tree is None:
            argv = list(config.runner_argv) + args
            fds: tuple[int, ...] = ()
            if nest is not None:
                env.update(nest.env())
                fds = nest.pass_fds()
            tree = await process.spawn_tree(
                argv, env=env, cwd=run_dir, tree_id=tree_id, containment=containment, pass_fds=fds
            )
    except BaseException:
        await trio.to_thread.run_sync(remove_dir, run_dir)
        raise
    return Warm(tree=tree, run_dir=run_dir)


class WarmPool:
    def __init__(
        self, config: Config, containment: Containment, zygote: Zygote | None = None, nest: Nest | None = None
    ) -> None:
        self.config = config
        self.containment = containment
        self.zygote = zygote  # refills fork from it when it is ready
        self.nest = nest  # cold refills join it (``new_tree``)
        self.size = config.pool_size
        self._ready: collections.deque[Warm] = collections.deque()
        self._dead: list[Warm] = []
        self._starting: Warm | None = None
        self._wake = trio.Event()

    @property
    def ready(self) -> int:
        return len(self._ready)

    def take(self) -> Warm | None:
        """A warm runner still alive, or None (the caller starts a cold one)."""
        while self._ready:
            w = self._ready.popleft()
            self._wake.set()
            if w.tree.process.returncode is None:
                return w
            self._dead.append(w)
        return None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._bury()
                if len(self._ready) < self.size:
                    # One at a time, each only once ready: a burst that takes the whole
                    # pool must not be followed by as many cold imports at once.
                    try:
                        warm = await new_tree(
                            self.config, self.containment, warm=True, zygote=self.zygote, nest=self.nest
                        )
                    except (OSError, SpawnError) as exc:
                        logger.warning("warm pool: could not start a runner: %s", exc)
                        await trio.sleep(RESPAWN_BACKOFF_S)
                        continue
                    self._starting = warm  # buried at shutdown if still getting ready
                    ready = await _wait_ready(warm)
                    self._starting = None
                    if ready is None:
                        self._dead.append(warm)
                        await trio.sleep(RESPAWN_BACKOFF_S)
                    else:
                        self._ready.append(ready)
                    continue
                self._wake = trio.Event()
                with trio.move_on_after(RESPAWN_BACKOFF_S * 5):  # also notice idle deaths
                    await self._wake.wait()
                for w in list(self._ready):
                    if w.tree.process.returncode is not None:
                        self._ready.remove(w)
                        self._dead.append(w)
        finally:
            with trio.CancelScope(shield=True):
                if self._starting is not None:
                    self._dead.append(self._starting)
                    self._starting = None
                self._dead.extend(self._ready)
                self._ready.clear()
                await self._bury()

    async def _bury(self) -> None:
        while self._dead:
            w = self._dead.pop()
            if w.tree.process.stdin is not None:
                with trio.CancelScope(shield=True):
                    await w.tree.process.stdin.aclose()
            with trio.move_on_after(BURY_WAIT_S):  # an idle warm runner exits on EOF
                await w.tree.process.wait()
            await process.terminate_and_kill(w.tree, grace_s=0.0)
            self.containment.remove(w.tree)
            await trio.to_thread.run_sync(remove_dir, w.run_dir)


async def _wait_ready(warm: Warm) -> Warm | None:
    """Read the warm runner's stderr up to its first event line (it says it is waiting)."""
    stderr = warm.tree.process.stderr
    if stderr is None:
        return warm
    buf = bytearray()
    with trio.move_on_after(WARM_READY_TIMEOUT_S):
        while b"\n" not in buf:
            try:
                chunk = await stderr.receive_some()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                logger.warning("warm pool: runner pid %d exited before it was ready", warm.tree.pid)
                return None
            buf += chunk
        return Warm(tree=warm.tree, run_dir=warm.run_dir, early_stderr=bytes(buf))
    logger.warning("warm pool: runner pid %d not ready after %.0f s", warm.tree.pid, WARM_READY_TIMEOUT_S)
    return None


def _make_run_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=False, mode=0o700)
    (path / "tmp").mkdir(mode=0o700)
    # Beside it, its stop marker (``subagent.stopmark``): its runner opens it before its
    # sandbox; the daemon writes a stop's reason there before it SIGTERMs the runner.
    make_marker(path)


# A tree's run directory, and what lies beside it (its answer channel, its runner's events
# and result files, its stop marker): ``t-`` and 16 hex digits, as ``new_tree`` and the
# zygote name them.
_TREE_ENTRY: Final = re.compile(r"(t-[0-9a-f]{16})(?:\.answers|\.events\.jsonl|\.result\.json|\.stop)?")


def sweep_run_root(root: Path, keep: set[str]) -> int:
    """Remove the trees in ``root`` whose run directory is not in ``keep`` (names), and
    what lies beside them; nothing else there. Returns how many trees went. Blocking."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    gone = {m.group(1) for n in names if (m := _TREE_ENTRY.fullmatch(n)) and m.group(1) not in keep}
    for name in gone:
        remove_dir(root / name)
    return len(gone)


def remove_dir(path: Path) -> None:
    """Remove a run directory, the short browser TMPDIR link that may point into it, its
    approval answer channel, its runner's events and result files and its stop marker."""
    from subagent.emit import record_paths
    from subagent.presets import release_run_dir

    release_run_dir(path)
    remove_tree(path)
    remove_channel(path)
    for record in (*record_paths(path), marker_path(path)):
        try:
            record.unlink()
        except FileNotFoundError:
            pass


# A tree left read-only is opened up this many times at most (each time, what is left of
# it is walked again: one more level of nested read-only directories each).
_OPEN_UP_ROUNDS: Final = 256


def remove_tree(path: Path) -> bool:
    """Remove the directory ``path`` and all in it, as far as possible; True if it is gone.

    A run's files are its daemon user's (a normal user's runner stays that uid), and it
    may have left directories that user cannot write or read (``chmod 0``, or Go's module
    cache under the run's ``HOME``, made read-only on purpose): ``rmtree`` could not empty
    them, and the run dir stayed for good (the disk guard, waiting for a stopped run's
    space, waited for ever). Such a directory is made ``0700`` again, never through a link
    (opened ``O_PATH | O_NOFOLLOW``, a link itself left alone), and the removal tried again.
    Blocking."""
    refused: list[str] = []  # the directories that kept a removal from being made

    def note(func: object, failed: str, exc: object) -> None:
        err = exc[1] if isinstance(exc, tuple) else exc
        if isinstance(err, PermissionError):
            unread = func in (os.open, os.scandir, os.listdir)  # a directory it could not read
            refused.append(failed if unread else os.path.dirname(failed))

    for _ in range(_OPEN_UP_ROUNDS):
        refused.clear()
        shutil.rmtree(path, onerror=note)
        if not refused or not path.exists():
            break
        if not [p for p in refused if _open_up(p)]:
            break
    return not path.exists()


def _open_up(path: str) -> bool:
    """Make the directory ``path`` (not a link to one) ``0700``; True if it was done."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            return False
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # the directory the descriptor holds
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
