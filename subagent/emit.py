"""The runner's only writer of stderr and stdout.

Invariants: every stderr line is one JSON event (``events.encode_event``), written whole
and at once (``os.write`` loop on fd 2), and appended to its *events file* as well: what a
daemon that died had not read from the pipe yet is not lost (the next daemon takes from
the file what its journal lacks); once stderr is broken the runner keeps going on the file;
Python logging, warnings, unraisable exceptions and stray writes to ``sys.stderr`` become
``log`` events, so nothing else can reach fd 2; a line never exceeds
``MAX_EVENT_LINE_BYTES`` (long strings in it are cut). The result goes to stdout once and is
also written, and fsynced, to its *result file* first.

Both files live beside the run directory (``record_paths``: ``<run dir>.events.jsonl``,
``<run dir>.result.json``), as its approvals channel does, not in it: the run's tools may
write their run directory, and a file they wrote must never pass for the runner's
result or events (a re-adopted run is read from these files alone). The runner opens both
before its sandbox (``open_records``; close-on-exec, so no tool inherits them).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Final

from subagent.events import CUT_MARK, MAX_EVENT_LINE_BYTES, Event, EventKind, encode_event, encode_result, make_event

__all__ = ["Emitter", "install_stderr_guards", "bare_result", "record_paths", "open_records"]

EVENTS_SUFFIX: Final = ".events.jsonl"
RESULT_SUFFIX: Final = ".result.json"
# The largest result we write (bytes); the daemon keeps the last 16 MiB of stdout.
MAX_RESULT_BYTES: Final = 8 * 1024 * 1024
# A log message longer than this is cut (characters): one event stays one sane line.
MAX_LOG_MESSAGE_CHARS: Final = 8192


def _shrink(value: Any, cap: int) -> Any:
    """A copy of a JSON value with every string longer than ``cap`` characters cut."""
    if isinstance(value, str):
        return value if len(value) <= cap else value[:cap] + CUT_MARK
    if isinstance(value, dict):
        return {k: _shrink(v, cap) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shrink(v, cap) for v in value]
    return value


def record_paths(run_dir: Path) -> tuple[Path, Path]:
    """A runner's events file and result file: beside its run directory, out of its tools' reach."""
    return run_dir.with_name(run_dir.name + EVENTS_SUFFIX), run_dir.with_name(run_dir.name + RESULT_SUFFIX)


def open_records(run_dir: Path | None) -> tuple[int, int] | None:
    """Open the run's events and result files for writing (before the sandbox, which
    closes the path to them), close-on-exec; None without a run directory or when they
    cannot be made (the pipes still carry everything while the daemon lives)."""
    if run_dir is None:
        return None
    events, result = record_paths(run_dir)
    try:
        efd = os.open(events, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        rfd = os.open(result, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        os.close(efd)
        return None
    return efd, rfd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Emitter:
    """Writes events (stderr and the events file) and the final result."""

    def __init__(
        self, run_dir: Path | None, *, records: tuple[int, int] | None = None, err_fd: int = 2, out_fd: int = 1
    ) -> None:
        self.run_dir = run_dir
        self._records = records  # (events fd, result fd): ``open_records``
        self._err_fd = err_fd
        self._out_fd = out_fd
        self._stderr_broken = False
        self._lock = threading.Lock()  # logging may call from worker threads
        self.run_id: str | None = None

    @property
    def stderr_broken(self) -> bool:
        return self._stderr_broken

    def emit(self, event_kind: EventKind, /, **data: Any) -> None:
        event = make_event(event_kind, **data)
        line = encode_event(event)
        limit = MAX_EVENT_LINE_BYTES - 1024
        cap = MAX_LOG_MESSAGE_CHARS * 8
        while len(line) > limit and cap >= 16:
            # A longer line would reach the daemon as a BadLine: cut long strings until it fits.
            line = encode_event(Event(kind=event_kind, ts=event.ts, data=_shrink(data, cap)))
            cap //= 2
        with self._lock:
            self._append_record(line)  # first: the pipe's copy may die with its daemon
            if not self._stderr_broken:
                try:
                    _write_all(self._err_fd, line)
                except (BrokenPipeError, OSError):
                    # The daemon is gone (EPIPE) or fd 2 is unusable: keep running, keep a record.
                    self._stderr_broken = True

    def _append_record(self, line: bytes) -> None:
        if self._records is None:
            return
        try:
            _write_all(self._records[0], line)  # O_APPEND: whole lines, in order
        except OSError:
            pass  # nowhere left to write: the run itself goes on

    def log(self, level: str, message: str, **extra: Any) -> None:
        if len(message) > MAX_LOG_MESSAGE_CHARS:
            message = message[:MAX_LOG_MESSAGE_CHARS] + CUT_MARK
        self.emit(EventKind.LOG, level=level, message=message, **extra)

    def result(self, result: dict[str, Any]) -> None:
        """Write the final result: the result file first (fsynced), then stdout."""
        data = _fit_result(result)
        if self._records is not None:
            # Written once; a runner killed while writing leaves a partial document, which
            # the daemon reads as no result (as it reads an empty file).
            fd = self._records[1]
            try:
                os.ftruncate(fd, 0)
                view, offset = memoryview(data), 0
                while offset < len(data):
                    offset += os.pwrite(fd, view[offset:], offset)
                os.fsync(fd)
            except OSError as exc:
                self.log("warning", f"could not write the result file: {exc}")
        try:
            _write_all(self._out_fd, data)
        except OSError:
            pass  # the daemon is gone; the result file is the record


def _fit_result(result: dict[str, Any]) -> bytes:
    """The result, encoded within ``MAX_RESULT_BYTES`` (the daemon reads at most 16 MiB).

    What is cut, in order, until it fits (``result_truncated: true`` then): ``messages``,
    the whole conversation, a session's earlier turns included, so the part that grows
    (its long strings, then its oldest messages); then the other long strings (outputs,
    progress); the turn's own answer (``final_text``) last, only when it alone is too long:
    a large history never costs a turn its answer.
    """
    data = encode_result(result)
    if len(data) <= MAX_RESULT_BYTES:
        return data
    fitted: dict[str, Any] = {**result, "result_truncated": True}
    messages = result.get("messages")
    if isinstance(messages, list):
        cap = MAX_LOG_MESSAGE_CHARS * 8
        while cap >= 16:
            fitted["messages"] = _shrink(messages, cap)
            data = encode_result(fitted)
            if len(data) <= MAX_RESULT_BYTES:
                return data
            cap //= 2
        kept: list[Any] = fitted["messages"]
        while kept:
            kept = kept[(len(kept) + 1) // 2 :]  # the older half goes
            fitted["messages"] = kept
            data = encode_result(fitted)
            if len(data) <= MAX_RESULT_BYTES:
                return data
    answer = result.get("final_text")
    for keep_answer in (True, False):
        cap = MAX_LOG_MESSAGE_CHARS * 8
        while cap >= 16:
            shrunk = _shrink(fitted, cap)
            if keep_answer:
                shrunk["final_text"] = answer
            data = encode_result(shrunk)
            if len(data) <= MAX_RESULT_BYTES:
                return data
            cap //= 2
    return data


class _LogHandler(logging.Handler):
    def __init__(self, emitter: Emitter) -> None:
        super().__init__(logging.DEBUG)
        self._emitter = emitter

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                message = f"{message}: {type(exc).__name__}: {exc}"
            self._emitter.log(record.levelname.lower(), message, logger=record.name)
        except Exception:  # never let logging break the run
            pass


class _StderrToLog(io.TextIOBase):
    """Replaces ``sys.stderr``: whole lines become ``log`` events."""

    def __init__(self, emitter: Emitter) -> None:
        self._emitter = emitter
        self._buf = ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip():
                self._emitter.log("warning", line, source="stderr")
        return len(s)

    def flush(self) -> None:
        if self._buf.strip():
            self._emitter.log("warning", self._buf, source="stderr")
        self._buf = ""

    def fileno(self) -> int:
        # Code that wants a real fd (a child's stderr) must not get ours.
        raise io.UnsupportedOperation("sys.stderr is routed into log events")


# A runner's logging levels: the root's, and its own modules'.
LOG_LEVELS: Final = (("", logging.WARNING), ("subagent", logging.INFO))


def set_log_levels() -> None:
    """Give the loggers a runner's levels (``LOG_LEVELS``), changing only those that differ.

    Setting a level clears every logger's cache. In a runner forked from the zygote that is
    a write to each of the zygote's ~100 loggers (a copy-on-write fault each, ~1 ms before
    its first step); the zygote sets them once (``runner.preload``), and a forked runner
    finds them set. A level already set leaves the caches as they are: they were made
    under it."""
    for name, level in LOG_LEVELS:
        logger = logging.getLogger(name or None)
        if logger.level != level:
            logger.setLevel(level)


def install_stderr_guards(emitter: Emitter) -> None:
    """Route logging, warnings, unraisable errors and ``sys.stderr`` into log events."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_LogHandler(emitter))
    set_log_levels()
    logging.captureWarnings(True)
    sys.stderr = _StderrToLog(emitter)

    def unraisable(u: Any) -> None:
        emitter.log("warning", f"unraisable exception: {u.exc_type.__name__}: {u.exc_value}", source="unraisable")

    sys.unraisablehook = unraisable


def bare_result(
    status: str, reason: str | None, error: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A result for a run that never reached its loop (bad spec, setup failure, early stop)."""
    return {
        "status": status,
        "reason": reason,
        "final_text": None,
        "progress": "",
        "steps": 0,
        "tool_calls": [],
        "usage": None,
        "error": error,
        "unapplied_steering": [],
        **(extra or {}),
    }
