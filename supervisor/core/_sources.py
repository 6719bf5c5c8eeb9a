"""Where a run's events and result come from: its pipes, or its run directory's files.

A runner writes its events on stderr and appends them to its events file, and writes its
result in its result file, then on stdout. Both files lie beside its run
directory, out of its tools' reach (``subagent.emit.record_paths``): a file a tool wrote
never passes for the runner's result or events. The run lifecycle
(``supervisor.core._lifecycle``) reads them through an ``EventSource``:

- ``PipeSource``: a runner this daemon started: the spec and steering go to its stdin,
  events come from stderr and the result from stdout, each pipe read until EOF, or for at
  most ``DRAIN_AFTER_EXIT_S`` after the runner exited (a descendant may hold it open);
- ``FileSource``: a runner re-adopted after a daemon restart (its pipes went with the old
  daemon): events are read from its events file as it grows, less those the journal
  holds already (the old daemon's, or an earlier re-adoption's: ``journaled``) (an inotify event, not a
  poll, where the kernel has inotify) until the runner is gone, and the result from
  its result file; there is no exit status.

Either way ``pump`` returns by itself once the runner's output is complete.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import trio

from subagent.emit import record_paths
from subagent.events import TS_REPLACED, BadLine, Event, decode_result
from subagent.osedge import IN_MODIFY, Watch
from supervisor.core._run import Run
from supervisor.core._spec_check import spec_for_runner
from supervisor.core.progress import LineSplitter
from supervisor.trees import process
from supervisor.trees._handles import AdoptedTree, AnyTree, Tree

__all__ = ["EventSource", "PipeSource", "FileSource", "event_key", "read_result_file", "MAX_RESULT_BYTES"]

logger = logging.getLogger(__name__)

# Most of a runner's stdout kept: its last bytes, where its result (the last JSON object
# line) is; what came before them is dropped as it comes.
MAX_RESULT_BYTES: Final = 16 * 1024 * 1024
# A re-adopted run's events file is read again at least this often (seconds): where
# inotify is missing this is the poll; with it, a bound on a missed event.
TAIL_POLL_S: Final = 0.2
TAIL_FALLBACK_S: Final = 5.0
# A re-adopted run's events file is read this much at a time, in a worker thread: at a
# restart it may hold all a runner wrote while no daemon read it (gigabytes, say), and one
# ``read()`` of it on the Trio thread stalled the daemon's every task, and held it all.
READ_CHUNK_BYTES: Final = 1024 * 1024

# Takes what one read brought, in order (the run's lifecycle journals it in one commit).
OnItems = Callable[[list[Event | BadLine]], Awaitable[None]]


class EventSource(Protocol):
    """A run's events and result, whichever way they reach the daemon."""

    @property
    def tree(self) -> AnyTree: ...

    async def feed(self, run: Run) -> None:
        """Write the runner's input (the spec, then steering) until cancelled; returns at
        once when the runner has no input from us."""
        ...

    async def pump(self, on_items: OnItems) -> None:
        """Hand every event to ``on_items``, what each read brought at a time, in order;
        return once the runner's output is complete."""
        ...

    def result(self) -> dict[str, Any] | BadLine:
        """The runner's final result, or why there is none."""
        ...

    def exit_code(self) -> int | None:
        """The runner's exit status, if this daemon can know it."""
        ...

    def annotate(self, receipt: dict[str, Any]) -> None:
        """Add what the source saw to the stop receipt (pipes held open)."""
        ...


def event_key(kind: str, ts: float, data: Mapping[str, Any]) -> tuple[str, float, str]:
    """What tells a runner's event from another: its kind, its own time and its data (not
    the time the reader gave one whose own was no number: a new one at each read)."""
    if data.get(TS_REPLACED) is True:
        ts = 0.0
    return kind, ts, json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)


def read_result_file(path: Path) -> dict[str, Any] | BadLine:
    try:
        data = path.read_bytes()
    except OSError:
        return BadLine(text="", problem="no result on stdout and none in its result file")
    return decode_result(data)


class PipeSource:
    """A runner this daemon started: its stdin, stdout and stderr pipes."""

    def __init__(self, tree: Tree, run_dir: Path | None, *, early_stderr: bytes = b"", spec_sent: bool = False) -> None:
        self._tree = tree
        self._run_dir = run_dir
        self._early = early_stderr  # what a warm runner wrote while it got ready
        self._spec_sent = spec_sent  # the spec went with a spare's run, before its start
        # Its stdout's last chunks, at most MAX_RESULT_BYTES and one chunk: a result follows
        # whatever a runner (or a descendant holding its stdout) wrote before it.
        self._stdout: collections.deque[bytes] = collections.deque()
        self._stdout_size = 0
        self.stdout_overflow = False
        self.pipes_held_open = False

    @property
    def tree(self) -> Tree:
        return self._tree

    async def feed(self, run: Run) -> None:
        stdin = self._tree.process.stdin
        if stdin is None:
            return
        try:
            async with run.stdin_lock:
                if not self._spec_sent:
                    await stdin.send_all((json.dumps(spec_for_runner(run.runner_spec or run.spec)) + "\n").encode())
            run.stdin = stdin
            await trio.sleep_forever()  # until the run ends and cancels the feed
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            run.stdin = None
            run.stdin_closed = True
            with trio.CancelScope(shield=True):
                await stdin.aclose()

    async def pump(self, on_items: OnItems) -> None:
        async with trio.open_nursery() as pumps:
            pumps.start_soon(self._pump_stdout)
            pumps.start_soon(self._pump_stderr, on_items)

    async def _pump_stdout(self) -> None:
        proc = self._tree.process
        if proc.stdout is None:
            return

        async def sink(chunk: bytes) -> None:
            self._stdout.append(chunk)
            self._stdout_size += len(chunk)
            while self._stdout_size - len(self._stdout[0]) >= MAX_RESULT_BYTES:
                self._stdout_size -= len(self._stdout.popleft())
                self.stdout_overflow = True

        if not await process.drain_bounded(proc.stdout, sink, process=proc):
            self.pipes_held_open = True

    async def _pump_stderr(self, on_items: OnItems) -> None:
        proc = self._tree.process
        if proc.stderr is None:
            return
        splitter = LineSplitter()

        async def sink(chunk: bytes) -> None:
            items = splitter.feed(chunk)
            if items:
                await on_items(items)

        if self._early:
            await sink(self._early)
        if not await process.drain_bounded(proc.stderr, sink, process=proc):
            self.pipes_held_open = True
        last = splitter.close()
        if last:
            await on_items(last)

    def result(self) -> dict[str, Any] | BadLine:
        data = b"".join(self._stdout)[-MAX_RESULT_BYTES:]
        self._stdout.clear()  # decoded now
        self._stdout_size = 0
        result = decode_result(data)
        if isinstance(result, BadLine) and self._run_dir is not None:
            return read_result_file(record_paths(self._run_dir)[1])
        return result

    def exit_code(self) -> int | None:
        return self._tree.process.returncode

    def annotate(self, receipt: dict[str, Any]) -> None:
        if self.pipes_held_open:
            receipt["pipes_held_open"] = True


def _read_at(path: Path, offset: int, size: int) -> bytes:
    """Up to ``size`` bytes of the file at ``path`` from ``offset`` (a worker thread's)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


class FileSource:
    """A runner re-adopted after a restart: its events file and its result file."""

    def __init__(
        self, tree: AdoptedTree, run_dir: Path | None, *, journaled: Iterable[tuple[str, float, str]] = ()
    ) -> None:
        self._tree = tree
        self._run_dir = run_dir
        self._offset = 0
        self._splitter = LineSplitter()
        # Set once ``pump`` has taken in the file as it was when it started (what the runner
        # wrote while no daemon read it), or has ended: a request about the run (an answer
        # to a call it asked about meanwhile) waits for that, not for the file's end.
        self.caught_up = trio.Event()
        # Events the journal holds (``event_key``): skipped once each, never journaled twice.
        self._journaled = collections.Counter(journaled)

    @property
    def tree(self) -> AdoptedTree:
        return self._tree

    async def feed(self, run: Run) -> None:
        return  # its stdin went with the old daemon

    async def read_once(self, on_items: OnItems) -> None:
        """Hand on what was appended to the events file since the last read: up to
        ``READ_CHUNK_BYTES`` at a time, each read in a worker thread, each chunk's events
        handed on (together) before the next is read."""
        if self._run_dir is None:
            return
        path = record_paths(self._run_dir)[0]
        while True:
            try:
                data = await trio.to_thread.run_sync(_read_at, path, self._offset, READ_CHUNK_BYTES)
            except OSError:
                return
            self._offset += len(data)
            items = []
            for item in self._splitter.feed(data):
                if isinstance(item, Event):
                    key = event_key(str(item.kind), item.ts, item.data)
                    if self._journaled[key] > 0:
                        self._journaled[key] -= 1
                        continue
                items.append(item)
            if items:
                await on_items(items)
            if len(data) < READ_CHUNK_BYTES:
                return

    async def pump(self, on_items: OnItems) -> None:
        try:
            await self._pump(on_items)
        finally:
            self.caught_up.set()  # also when it failed or ended early: never leave a waiter hanging

    async def _pump(self, on_items: OnItems) -> None:
        if self._run_dir is None:
            self.caught_up.set()
            await process.wait_leader(self._tree)
            return
        watch = Watch.open([(record_paths(self._run_dir)[0], IN_MODIFY)])
        wake = trio.Event()
        gone = trio.Event()

        async def leader() -> None:
            await process.wait_leader(self._tree)
            gone.set()
            wake.set()

        async def appended(w: Watch) -> None:
            while True:
                await trio.lowlevel.wait_readable(w.fd)
                w.drain()
                wake.set()

        try:
            async with trio.open_nursery() as n:
                n.start_soon(leader)
                if watch is not None:
                    n.start_soon(appended, watch)
                while True:
                    await self.read_once(on_items)
                    self.caught_up.set()
                    if gone.is_set():
                        await self.read_once(on_items)  # what it wrote last
                        break
                    with trio.move_on_after(TAIL_FALLBACK_S if watch is not None else TAIL_POLL_S):
                        await wake.wait()
                    wake = trio.Event()
                n.cancel_scope.cancel(reason="the runner is gone and its events are read")
        finally:
            if watch is not None:
                trio.lowlevel.notify_closing(watch.fd)
                watch.close()

    def result(self) -> dict[str, Any] | BadLine:
        if self._run_dir is None:
            return BadLine(text="", problem="no run directory to find its result file by")
        return read_result_file(record_paths(self._run_dir)[1])

    def exit_code(self) -> int | None:
        return None  # the runner is not our child: its status went to its reaper

    def annotate(self, receipt: dict[str, Any]) -> None:
        return
