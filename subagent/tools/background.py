"""Background commands: ``run_command`` with ``background: true``, read with ``command_output``.

A background command starts like a foreground one (``/bin/sh -c``, new session, marker
variable) but the call returns at once with an id; its output goes to a file in the run
dir and ``command_output`` reads its state and the last ``max_output_bytes`` of it.
Invariants: every background group is reported alive at spawn and gone once it really
is; when the shell exits, what it left in its group is ended; when the run ends
(``aclose``, from the run's exit stack) every background group still alive is ended,
SIGTERM then SIGKILL: nothing a run started outlives it.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final

import trio

from subagent.callgroups import Slot
from subagent.events import StopEffect, ToolCallRecord, ToolCallState
from subagent.tools.commands import (
    COMMAND_KILL_GRACE_S,
    STOP_SETTLE_S,
    _child_env,
    end_group_and_escapers,
    kill_unreaped_group,
    killed_by_signal,
    own_leader_ticks,
    start_gated,
)
from subagent.tools.runfiles import open_regular

__all__ = ["BACKGROUND_ENDED_WITH_RUN", "BackgroundCommands", "BackgroundEnd", "COMMAND_OUTPUT_TOOL", "settle_call"]

# Bounds ending all background commands at the end of a run: their groups and escapers
# get COMMAND_KILL_GRACE_S each (after a stop, the stop's command grace), in parallel,
# then a bounded wait after SIGKILL (seconds; for the default grace).
CLOSE_TIMEOUT_S: Final = 3 * COMMAND_KILL_GRACE_S + 2.0

COMMAND_OUTPUT_TOOL: Final = {
    "type": "function",
    "function": {
        "name": "command_output",
        "description": "State (running or exit code) and the latest output of a background command started with run_command.",
        "parameters": {
            "type": "object",
            "properties": {"id": {"type": "string", "description": "The id run_command returned."}},
            "required": ["id"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class _Job:
    id: str
    command: str
    pgid: int
    log: Path
    proc: trio.Process
    leader_ticks: int | None = None
    exit_code: int | None = None
    done: bool = False
    reader: int | None = None  # its log, opened for reading before it started (``output``)
    temporary: bool = False  # its log is a temp file of ours (not in the run dir): removed at the end
    exited_at: float | None = None  # (Trio clock) its shell's exit
    killed: bool = False  # something of it outlived SIGTERM: SIGKILLed at the end of the grace


@dataclass(frozen=True, slots=True)
class BackgroundEnd:
    """How one background command ended, for its call's record (``AgentLoop.settle_background``)."""

    id: str
    exited_at: float | None  # (Trio clock) its shell's exit; None: not seen to exit
    exit_code: int | None  # its shell's (negative: the signal that killed it)
    killed: bool  # something of it was SIGKILLed at the end of the grace
    by_run_end: bool  # still running when the run's end (``aclose``) began: the runner ended it


def _open_log(path: Path) -> IO[bytes]:
    """A new regular file at ``path`` for a command's output: never through a link, and
    never a FIFO or device a tool of the run put there (its open would block, or write
    elsewhere): ``runfiles.open_regular``."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")


# The start of the reason of a call whose background command was still running when its
# run ended without a stop (the runner ended it with the run; no ``stop_effect``).
BACKGROUND_ENDED_WITH_RUN: Final = "background_ended_with_run:"


def _how(end: BackgroundEnd) -> str:
    if end.exit_code is None:
        how = "not seen to exit"
    elif end.exit_code < 0:
        try:
            how = f"killed by {signal.Signals(-end.exit_code).name}"
        except ValueError:
            how = f"killed by signal {-end.exit_code}"
    else:
        how = f"exit code {end.exit_code}"
    return how + (", SIGKILLed at the end of the grace" if end.killed else "")


def settle_call(rec: ToolCallRecord, end: BackgroundEnd, stop_at: float | None, stop_wall: float | None) -> bool:
    """The record of the call that started a background command, once the run has ended
    it: True if changed. The call stays ``succeeded`` (it did start the command); if the
    command was still running when the stop came (``stop_at``, Trio clock), the stop ended
    it: ``stop_effect`` ``background_ended``, its reason and ``stop_to_end_s`` say so and
    how; if it was still running when the run ended without a stop, the reason says the
    run's end ended it. The model's history then says it no longer runs."""
    if rec.state != ToolCallState.SUCCEEDED or rec.stop_effect is not None:
        return False
    how = _how(end)
    # Killed by a signal just before the runner saw the stop: the daemon's path A signals
    # the runner and an interruptible command's group at once (as ``commands`` reads it).
    by_path_a = (
        stop_at is not None
        and end.exited_at is not None
        and killed_by_signal(end.exit_code)
        and end.exited_at >= stop_at - STOP_SETTLE_S
    )
    if stop_at is not None and (end.exited_at is None or end.exited_at >= stop_at or by_path_a):
        rec.stop_effect = str(StopEffect.BACKGROUND_ENDED)
        rec.stop_requested_at = stop_wall
        after = None if end.exited_at is None else round(max(0.0, end.exited_at - stop_at), 4)
        rec.stop_to_end_s = after
        when = "" if after is None else f", {after:.3g} s after the stop"
        rec.reason = (
            f"background_ended: its background command {end.id} was still running when the run was "
            f"stopped; the stop ended it ({how}{when})"
        )
        return True
    if end.by_run_end:
        rec.reason = (
            f"{BACKGROUND_ENDED_WITH_RUN} its background command {end.id} was still running when the run "
            f"ended; it was ended with the run ({how})"
        )
        return True
    return False


class BackgroundCommands:
    """Owns the run's background commands; ``run(task_status=...)`` is its service task."""

    def __init__(self, run_dir: Path | None, on_group: Callable[[int, bool, str], None], max_output_bytes: int) -> None:
        self._dir = run_dir
        self._on_group = on_group
        self._max = max_output_bytes
        self._jobs: dict[str, _Job] = {}
        self._seq = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._finished = trio.Event()
        self._grace_s = COMMAND_KILL_GRACE_S  # each group's, between SIGTERM and SIGKILL (``aclose``)
        self._closing_at: float | None = None  # (Trio clock) when ``aclose`` began

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._finished.set()

    async def start(self, command: str, asked: Callable[[], bool] | None = None) -> str | None:
        """Start a command in the background; returns the text the model sees, or None
        when a stop was ``asked`` while it was spawned: it never ran (held at its gate)."""
        launched = await self.launch(command, asked)
        return None if launched is None else launched[0]

    async def launch(self, command: str, asked: Callable[[], bool] | None = None) -> tuple[str, str | None] | None:
        """``start``, with the command's id (None when it could not start)."""
        assert self._nursery is not None, "BackgroundCommands.run is not running"
        job_id = f"bg{next(self._seq)}"
        marker = f"{os.getpid()}-{job_id}"
        log_file: IO[bytes] | None = None
        if self._dir is not None:
            log = self._dir / f"command-{job_id}.log"
            try:
                log_file = _open_log(log)
            except OSError:
                log_file = None  # an unusable run dir (or a name the run's tools took): a temp file will do
        temporary = log_file is None
        if log_file is None:
            log_file = tempfile.NamedTemporaryFile(prefix=f"command-{job_id}-", suffix=".log", delete=False)
            log = Path(log_file.name)
        try:
            with log_file:
                # Read through this descriptor, never the name: the run's tools can write
                # the run dir, and a FIFO put in the log's place blocked the runner's open.
                reader = os.open(f"/proc/self/fd/{log_file.fileno()}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    started = await start_gated(
                        command,
                        marker,
                        asked or (lambda: False),
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=_child_env(marker),
                    )
                except BaseException:
                    os.close(reader)
                    raise
        except (OSError, ValueError) as exc:  # ValueError: a NUL in it, a lone surrogate (not UTF-8)
            return f"error: could not start the command: {type(exc).__name__}: {exc}", None
        if started is None:  # a stop came while it was spawned: it never ran
            os.close(reader)
            log.unlink(missing_ok=True)  # (empty: nothing ran)
            return None
        proc, ticks, cgroup = started
        job = _Job(job_id, command, proc.pid, log, proc, ticks, reader=reader, temporary=temporary)
        self._jobs[job_id] = job
        self._on_group(proc.pid, True, command[:200])
        self._nursery.start_soon(self._watch, job, marker, cgroup)
        return f"started in the background: id {job_id}, pid {proc.pid}; read it with command_output", job_id

    async def _watch(self, job: _Job, marker: str, cgroup: Slot | None) -> None:
        escalated: list[bool] = []
        try:
            await job.proc.wait()
            job.exit_code = job.proc.returncode
            job.exited_at = trio.current_time()
        finally:
            with trio.CancelScope(shield=True):
                job.leader_ticks = own_leader_ticks(job.proc, job.leader_ticks)
                await end_group_and_escapers(
                    job.pgid,
                    job.leader_ticks,
                    marker,
                    grace_s=self._grace_s,
                    what="background command group",
                    cgroup=cgroup,
                    escalated=escalated,
                )
                with trio.move_on_after(self._grace_s):
                    await job.proc.wait()
                await kill_unreaped_group(job.proc, "background command group")
                if job.exited_at is None and job.proc.returncode is not None:
                    job.exit_code, job.exited_at = job.proc.returncode, trio.current_time()
                job.killed = any(escalated)
                job.done = True
                self._on_group(job.pgid, False, job.command[:200])

    def output(self, job_id: str) -> tuple[bool, str]:
        """(known id, text for the model): state and the tail of the output."""
        job = self._jobs.get(job_id)
        if job is None:
            return False, f"error: no background command {job_id!r} (known: {', '.join(self._jobs) or 'none'})"
        try:
            if job.reader is None:
                raise OSError("its output is closed")
            size = os.fstat(job.reader).st_size
            data = os.pread(job.reader, self._max, max(0, size - self._max))
        except OSError as exc:
            return True, f"error: cannot read its output: {exc}"
        state = "[running]" if not job.done else f"[exit code {job.exit_code}]"
        cut = " [earlier output dropped]" if size > self._max else ""
        return True, f"{state}{cut}\n{data.decode('utf-8', 'replace')}"

    def ends(self) -> list[BackgroundEnd]:
        """How each background command ended (once ``aclose`` is through: all have)."""
        closing = self._closing_at
        return [
            BackgroundEnd(
                id=job.id,
                exited_at=job.exited_at,
                exit_code=job.exit_code,
                killed=job.killed,
                by_run_end=closing is not None and (job.exited_at is None or job.exited_at >= closing),
            )
            for job in self._jobs.values()
        ]

    async def aclose(self, grace_s: float | None = None) -> None:
        """End every background command (the run is ending) and wait for it. Shielded, bounded.
        ``grace_s``: each group's between SIGTERM and SIGKILL (a stop's command grace; by
        default ``COMMAND_KILL_GRACE_S``)."""
        if self._nursery is None:
            return
        if grace_s is not None:
            self._grace_s = grace_s
        if self._closing_at is None:
            self._closing_at = trio.current_time()
        self._nursery.cancel_scope.cancel(reason="the run ends: its background commands end")
        bound = CLOSE_TIMEOUT_S + 3 * max(0.0, self._grace_s - COMMAND_KILL_GRACE_S)
        with trio.CancelScope(shield=True), trio.move_on_after(bound):
            await self._finished.wait()
        for job in self._jobs.values():
            if job.reader is not None:
                os.close(job.reader)
                job.reader = None
            if job.temporary:  # made outside the run dir: nothing else removes it
                try:
                    job.log.unlink()
                except OSError:
                    pass
