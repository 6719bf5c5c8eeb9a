"""Trio helpers for benchmarks that run the daemon in-process (``supervisor.daemon.serve``)."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from supervisor.config import Config  # noqa: E402
from supervisor.daemon import serve  # noqa: E402


class WarningCounter(logging.Handler):
    """Counts the daemon's warnings by their message pattern (run and tree ids cut out)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        import re

        msg = re.sub(r"\b(r|t)-[0-9a-f]{16}\b", r"\1-*", record.getMessage())
        msg = re.sub(r"\d+(\.\d+)?", "N", msg)[:120]
        self.counts[msg] = self.counts.get(msg, 0) + 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


WARNINGS = WarningCounter()


def quiet_logs(verbose: bool) -> None:
    """Daemon logs: warnings are counted (``WARNINGS``), and printed only when verbose."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING if verbose else logging.ERROR)
    handler.setFormatter(logging.Formatter("  [daemon %(levelname)s] %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    for name in ("supervisor", "subagent"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.WARNING)
        lg.addHandler(WARNINGS)


def show_warnings(print_line: Any) -> dict[str, int]:
    counts = WARNINGS.take()
    for msg, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print_line(f"  daemon warning x{n}: {msg}")
    return counts


@asynccontextmanager
async def in_process_daemon(state_dir: Path, **overrides: Any) -> AsyncIterator[dict[str, Any]]:
    """serve() in this process; yields {"port", "url", "token", "manager", "config"}."""
    config = Config.load(state_dir=state_dir, environ={}, **overrides)
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(functools.partial(serve, config, stop=stop))
        try:
            yield {**info, "config": config}
        finally:
            stop.set()


async def wait_event(
    manager: Any, run_id: str, kind: str, *, timeout_s: float = 60.0, pred: Any = None
) -> dict[str, Any] | None:
    """The first event of ``kind`` (replayed or live) with its arrival time in ``_arrived``.

    ``_replayed`` is True when it was already in the journal when we subscribed (its arrival
    time is then an upper bound). None if the run ended without one, or on timeout.
    """
    with trio.move_on_after(timeout_s):
        async with manager.subscribe(run_id) as live:
            for e in await manager.events_after(run_id, 0):
                if e["kind"] == kind and (pred is None or pred(e)):
                    return {**e, "_arrived": time.perf_counter(), "_replayed": True}
            async for e in live:
                if e["kind"] == kind and (pred is None or pred(e)):
                    return {**e, "_arrived": time.perf_counter(), "_replayed": False}
    return None


def wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


def pool_pids(manager: Any) -> list[int] | None:
    """Pids of the warm runners ready in the pool (reads a private field; None if unknown)."""
    pool = getattr(manager, "_pool", None)
    ready = getattr(pool, "_ready", None)
    if ready is None:
        return None
    try:
        return [w.tree.pid for w in list(ready)]
    except AttributeError:
        return None


async def wait_pool_warm(manager: Any, size: int, *, timeout_s: float = 120.0) -> float | None:
    """Wait until ``size`` warm runners are in the pool and each blocks reading its spec
    (imports done). Returns the seconds waited, or None on timeout or if unknowable."""
    t0 = time.perf_counter()
    with trio.move_on_after(timeout_s):
        while True:
            pids = pool_pids(manager)
            if pids is None:
                await trio.sleep(min(timeout_s, 5.0))
                return None
            if len(pids) >= size and all("pipe" in wchan(p) for p in pids):
                return time.perf_counter() - t0
            await trio.sleep(0.05)
    return None


def scripted_spec(
    turns: list[Any] | None = None, *, final: str = "ok", tools: list[str] | None = None, **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "task": "benchmark",
        "model": {"provider": "scripted", "script": {"turns": turns or [], "final": final}},
    }
    if tools is not None:
        spec["builtin_tools"] = tools
    spec.update(extra)
    return spec


def env_pid() -> int:
    return os.getpid()
