"""The sandbox e2e tests' daemon: in-process, the sandbox required, its runners cold
(``zygote = "off"``) or forked from a zygote's spare (both halves of the sandbox made at
once, and ahead); and the ``name=value`` lines their probes print."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.config import Config
from supervisor.daemon import serve
from tests.e2e.test_sandbox import Daemon
from tests.supervisor.test_zygote_spare import spare_ready

__all__ = ["lines", "sandboxed_daemon"]


def lines(out: str) -> dict[str, str]:
    """A probe's ``name=value`` lines (a line with a space in it is prose)."""
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line)


@asynccontextmanager
async def sandboxed_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zygote: str, **config: Any
) -> AsyncIterator[Daemon]:
    """A daemon on ``tmp_path / "state"`` with ``zygote`` (``off``, ``auto``: then served
    once a spare is parked) and ``config`` besides; stopped at the end."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    loaded = Config.load(
        state_dir=tmp_path / "state", runner_python=sys.executable, grace_s=3, environ={}, sandbox="required",
        zygote=zygote, **config,
    )  # fmt: skip
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(loaded, stop=stop, task_status=task_status))
        d = Daemon(info["manager"], loaded, info)
        if zygote == "auto":
            await spare_ready(d.m)
        yield d
        stop.set()
