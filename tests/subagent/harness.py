"""Drive a real ``python -m subagent.runner`` child the way the daemon does.

``RunnerProc`` starts the runner in a new session with the daemon's environment contract
(``AGENTD_RUN_ID``, ``AGENTD_RUN_DIR``, ``TMPDIR``), writes the spec on stdin, decodes
every stderr line as it arrives (a line that is not a valid event fails the test), and
lets a test wait for an event with ``wait_event`` (bound it with ``fail_after``). On exit
the whole session is killed, whatever the test did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from subagent.events import BadLine, Event, EventKind, decode_event_line, decode_result, fold_snapshot
from tests import conftest

REPO = Path(__file__).resolve().parents[2]
CHILDREN = REPO / "tests" / "children"
# Bounds how long a test waits for a runner to end by itself (seconds).
RUN_TIMEOUT_S = 20.0


def runner_env(run_dir: Path, run_id: str = "run-test", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    tmp = run_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(AGENTD_RUN_ID=run_id, AGENTD_RUN_DIR=str(run_dir), TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    env.update(extra)
    return env


async def _chunks(stream: Any) -> AsyncIterator[bytes]:
    # A test may close our end of a pipe (to play a daemon that died): that is EOF too.
    try:
        async for chunk in stream:
            yield chunk
    except trio.ClosedResourceError:
        return


class RunnerProc:
    def __init__(self, proc: trio.Process, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.events: list[Event] = []
        self.bad_lines: list[BadLine] = []
        self.stdout = bytearray()
        self._changed = trio.Event()
        self.stderr_eof = trio.Event()
        self.stdout_eof = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        buf = b""
        chunks = _chunks(self.proc.stderr)
        async for chunk in chunks:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                ev = decode_event_line(line)
                if isinstance(ev, BadLine):
                    self.bad_lines.append(ev)
                else:
                    self.events.append(ev)
            self._notify()
        if buf.strip():
            self.bad_lines.append(BadLine(buf.decode(errors="replace"), "unterminated last line"))
        self.stderr_eof.set()
        self._notify()

    async def pump_stdout(self) -> None:
        assert self.proc.stdout is not None
        async for chunk in self.proc.stdout:
            self.stdout += chunk
        self.stdout_eof.set()

    def of(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def snapshots(self) -> list[dict[str, Any]]:
        """The whole snapshot after each ``step_snapshot`` (each is a delta: folded, as
        the daemon folds them)."""
        out: list[dict[str, Any]] = []
        for e in self.of(EventKind.STEP_SNAPSHOT):
            out.append(fold_snapshot(out[-1] if out else None, e.data))
        return out

    async def wait_event(self, kind: EventKind, pred: Callable[[Event], bool] = lambda e: True) -> Event:
        """The first event of ``kind`` matching ``pred``: seen already, or when it arrives."""
        seen = 0
        while True:
            for e in self.events[seen:]:
                if e.kind == kind and pred(e):
                    return e
            seen = len(self.events)
            if self.stderr_eof.is_set():
                raise AssertionError(
                    f"runner ended without a {kind} event; events: {[e.to_dict() for e in self.events]}"
                )
            await self._changed.wait()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def finish(self, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
        """Wait for exit and both pipes; return (exit code, decoded result)."""
        with trio.fail_after(timeout_s):
            await self.proc.wait()
            await self.stderr_eof.wait()
            await self.stdout_eof.wait()
        assert not self.bad_lines, f"stderr lines that are not events: {self.bad_lines}"
        result = decode_result(bytes(self.stdout))
        assert not isinstance(result, BadLine), f"no result on stdout: {result}"
        return self.proc.returncode, result

    def tool_records(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        return result["tool_calls"]

    def kill_session(self) -> None:
        """SIGKILL every process of ours left in the runner's session, each through a pidfd
        checked against its start time (never ``killpg`` by number: once the runner is
        reaped and its session empty, that number may be another's)."""
        for p in conftest.descendants(conftest.root_pid()):
            if _session_of(p.pid) == self.proc.pid:
                conftest.kill_exactly(p)


def _session_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rfind(b")") + 2 :].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def spec(task: str = "do it", *, script: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    model: dict[str, Any] = {"provider": "scripted"}
    if script is not None:
        model["script"] = script
    d: dict[str, Any] = {"task": task, "model": model, "run_id": "run-test"}
    for k, v in more.items():
        if k == "model":
            d["model"] = v
        else:
            d[k] = v
    return d


@asynccontextmanager
async def start_runner(
    spec_obj: dict[str, Any] | str | bytes,
    tmp_path: Path,
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    stdin_close: bool = True,
) -> AsyncIterator[RunnerProc]:
    """``async with start_runner(spec, tmp_path) as r:`` runs one runner child, killed at exit."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "subagent.runner", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=str(run_dir),
        env=runner_env(run_dir) if env is None else env,
        start_new_session=True,
    )
    runner = RunnerProc(proc, run_dir)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.pump_stderr)
            nursery.start_soon(runner.pump_stdout)
            data = spec_obj
            if isinstance(data, dict):
                data = json.dumps(data) + "\n"
            if isinstance(data, str):
                data = data.encode()
            assert proc.stdin is not None
            await proc.stdin.send_all(data)
            if stdin_close:
                await proc.stdin.aclose()
            try:
                yield runner
            finally:
                runner.kill_session()
                with trio.move_on_after(5, shield=True):
                    await proc.wait()
                    await runner.stderr_eof.wait()
                    await runner.stdout_eof.wait()
                nursery.cancel_scope.cancel()
    finally:
        runner.kill_session()
