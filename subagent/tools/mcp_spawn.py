"""Spawning MCP server processes before the ``mcp`` SDK is imported.

Importing ``mcp`` costs over half a second; a server (``node``, a Python SDK server)
needs about as long to boot. So the runner spawns every server first, exactly as the
SDK's ``_create_platform_compatible_process`` would on POSIX (``anyio.open_process``,
new session, stderr to a file), reports its group at once, then imports ``mcp`` while the
servers boot (in a worker thread, so that a stop meanwhile is not held: ``import_mcp_tools``),
and hands each process to the SDK through that seam (``subagent.tools.mcp_tools``), which
resumes what of its tree is stopped right before the SDK closes it (``resume_stopped_server``).
Invariants: no ``mcp`` import at this module's import; the environment is the tool environment
(``subagent.sandbox.tool_env``: an allowlist that covers the SDK's default inherited set)
plus the server's configured ``env``, never a secret of the runner's (``server_env``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import anyio
import trio

from subagent.osedge import Targets, resume_stopped
from subagent.sandbox import AGENTD_TOOL_VARS, tool_env
from subagent.spec import McpServerSpec
from subagent.stop import import_abortably
from subagent.tools.commands import SUBTREE_VAR, end_group_and_escapers, leader_ticks, own_tree_cgroup
from subagent.tools.runfiles import open_regular

__all__ = [
    "Prespawned",
    "import_mcp_tools",
    "prespawn",
    "resume_stopped_server",
    "server_env",
    "SDK_INHERITED_ENV_VARS",
    "MCP_KILL_GRACE_S",
]

logger = logging.getLogger(__name__)

# The module whose import brings in mcp (``import_mcp_tools``).
MCP_TOOLS_MODULE: Final = "subagent.tools.mcp_tools"

# Between SIGTERM and SIGKILL for a server's group when it is ended (seconds).
MCP_KILL_GRACE_S: Final = 2.0

# How long we wait to reap a server leader after its group was ended (seconds).
REAP_WAIT_S: Final = 1.0
REAP_POLL_S: Final = 0.01

# mcp.client.stdio.DEFAULT_INHERITED_ENV_VARS on POSIX (checked by a test against the SDK).
SDK_INHERITED_ENV_VARS: Final = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")


@dataclass
class Prespawned:
    name: str
    marker: str
    stderr_path: Path
    errlog: IO[bytes]
    process: Any | None = None  # anyio.abc.Process
    error: OSError | None = None
    leader_ticks: int | None = None  # the server's start time: its group is its own while it matches

    @property
    def pgid(self) -> int | None:
        return None if self.process is None else self.process.pid


def server_env(spec: McpServerSpec, marker: str) -> dict[str, str]:
    """The tool environment with the spec's env on top (minus the runner's secrets), our marker.

    The run's AGENTD_* markers are applied last: a spec cannot override them.
    """
    env = tool_env(spec.env)
    for k in AGENTD_TOOL_VARS:
        if k in os.environ:
            env[k] = os.environ[k]
    env[SUBTREE_VAR] = marker
    return env


def _file_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _open_errlog(name: str, run_dir: Path | None) -> tuple[IO[bytes], Path]:
    if run_dir is not None:
        path = run_dir / f"mcp-{_file_safe(name)}.stderr.log"
        try:
            # A server spawned before this one can put a FIFO or a link there.
            fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            return os.fdopen(fd, "ab"), path
        except OSError as exc:
            logger.warning("cannot write mcp server %r stderr into the run dir: %s", name, exc)
    f = tempfile.NamedTemporaryFile(prefix=f"mcp-{_file_safe(name)}-", suffix=".stderr.log", delete=False)
    return f, Path(f.name)


async def prespawn(
    name: str,
    spec: McpServerSpec,
    stack: AsyncExitStack,
    *,
    run_dir: Path | None,
    on_group: Callable[[int, bool], None],
    ends: list[Callable[[], Awaitable[None]]] | None = None,
) -> Prespawned:
    """Start one server process; ``stack`` ends its group (and escapers) on close.

    Never raises for a spawn failure: ``error`` holds it. The cleanup is registered before
    the spawn, so it runs after the SDK's own close of this server (LIFO).
    """
    errlog, path = _open_errlog(name, run_dir)
    stack.callback(errlog.close)
    p = Prespawned(name=name, marker=f"{os.getpid()}-mcp-{name}", stderr_path=path, errlog=errlog)

    async def end() -> None:
        if p.process is None:
            return
        if p.leader_ticks is None and p.process.returncode is None:
            # Out of sight at its start (``own_leader_ticks``); unreaped, its pid is its own.
            p.leader_ticks = leader_ticks(p.process.pid)
        await end_group_and_escapers(
            p.process.pid, p.leader_ticks, p.marker, grace_s=MCP_KILL_GRACE_S, what=f"mcp server {name!r} group"
        )
        with anyio.CancelScope(shield=True), anyio.move_on_after(REAP_WAIT_S):
            # Reading returncode reaps the leader (the SDK may never have adopted it).
            while p.process.returncode is None:
                await anyio.sleep(REAP_POLL_S)
        on_group(p.process.pid, False)

    if ends is None:
        stack.push_async_callback(end)
    else:
        ends.append(end)  # the caller ends them all at once (each has its kill grace)
    try:
        p.process = await anyio.open_process(
            [spec.command, *spec.args],
            env=server_env(spec, p.marker),
            stderr=errlog,
            cwd=spec.cwd,
            start_new_session=True,
        )
    except OSError as exc:
        p.error = exc
        return p
    p.leader_ticks = leader_ticks(p.process.pid)
    on_group(p.process.pid, True)
    return p


def resume_stopped_server(p: Prespawned) -> list[int]:
    """SIGCONT what of a server's tree is stopped (its group while its leader is the one
    spawned, and whatever carries its marker: a child that left the group), right before
    the SDK closes it.

    Seen: a run's own command SIGSTOPped its MCP server (or a process the server started),
    and a stop then took ~4 s more: the SDK's close waited 2 s for the server to act on its
    closed stdin, SIGTERMed its group, waited 2 s more, SIGKILLed it. Resumed, it exits
    on the closed stdin as usual. Only the run's own processes: those the group or the
    marker names, looked for in the run's tree cgroup when there is one. Linux (/proc)
    only; never raises (a table that cannot be read: nothing resumed). Blocking.

    Returns:
        The pids resumed.
    """
    if p.process is None or not os.path.isdir("/proc"):
        return []
    targets = Targets(groups={p.process.pid: p.leader_ticks}, marker=(SUBTREE_VAR, p.marker), within=own_tree_cgroup())
    try:
        resumed = resume_stopped(targets)
    except OSError as exc:
        logger.warning("mcp server %r: its stopped processes could not be looked for: %s", p.name, exc)
        return []
    if resumed:
        logger.warning("mcp server %r was stopped: resumed %s so that it can close", p.name, resumed)
    return resumed


async def import_mcp_tools(abortable: Callable[[str], contextlib.AbstractContextManager[trio.CancelScope]]) -> bool:
    """Import ``subagent.tools.mcp_tools`` (so ``mcp``: 1.3-1.6 s in a cold runner) in a
    worker thread while the loop watches the stop (``abortable("setup")``: a scope the stop
    cancels, ``StopControl.abortable``); False when the stop came first.

    On the loop, the import held the stop until it was done: a cold runner stopped then
    exited 1.5-2 s after its SIGTERM. A stop now abandons the import (a setup has no side
    effect to wait for): its thread goes on until the process exits, which it then does
    at once (``runner.start``: ``os._exit``); nothing of the run uses ``mcp`` after a stop
    in its setup. A forked runner has it already (the zygote's ``preload``): no thread.
    With no thread to be had (the run's pids limit) it is imported on the loop, as before.
    """
    return await import_abortably(MCP_TOOLS_MODULE, abortable)
