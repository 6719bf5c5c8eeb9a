"""All runs together and the kernel's per-user counts they share with the host's processes.

Each run caps its own user namespace's inotify instances (``subagent/_quotas.py``), but
runs at their caps added up: with ``max_concurrent`` 64, eight runs at 16 held all 128 of
the host's root. Now every run's namespace is made in the daemon's nest
(``subagent/_nest.py``, ``supervisor/trees/_nest.py``), whose limits bound their total.
Small numbers (a total of 12, 8 a run), far below the host's 128: a run holds its
instances while a second one opens its own, which stops at what is left of the total.
Runners cold, forked by the zygote, and its spares (each joins the nest its own way).
Where the nest cannot be made, runs go on without it and say so: there the two runs
held 16, as all runs did before the nest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent import _nest
from supervisor.config import Config
from supervisor.daemon import serve
from supervisor.trees._nest import Nest
from tests.e2e.sandbox_daemon import lines
from tests.e2e.test_sandbox import CHILDREN, SCENARIO_S, Daemon, command, outputs, scripted
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture
from tests.supervisor.test_zygote import zygote_state
from tests.supervisor.test_zygote_spare import spare_ready

HOLD = str(CHILDREN / "inotify_hold.py")
PER_RUN = 8
TOTAL = 12
# How the runners are made: cold, forked by the zygote, the zygote's spares.
WAYS = {"cold": {"zygote": "off"}, "forked": {"zygote": "auto", "zygote_spares": 0}, "spare": {"zygote": "auto"}}


async def _daemon(tmp_path: Path, way: str) -> AsyncIterator[Daemon]:
    config = Config.load(
        state_dir=tmp_path / "state", runner_python=sys.executable, grace_s=3, environ={}, sandbox="required",
        run_inotify_instances=PER_RUN, run_inotify_instances_total=TOTAL, **WAYS[way],
    )  # fmt: skip
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        d = Daemon(info["manager"], config, info)
        yield d
        stop.set()


@pytest.fixture(params=list(WAYS))
async def daemon(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    async for d in _daemon(tmp_path, str(request.param)):
        yield d


@pytest.fixture(params=["cold", "spare"])
async def refused(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    """A daemon whose nest cannot be made (its holder exits without one)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent.parent))
    monkeypatch.setattr(Nest, "holder_argv", lambda _self: [sys.executable, "-c", "import sys; sys.exit(3)"])
    async for d in _daemon(tmp_path, str(request.param)):
        yield d


async def _ready(d: Daemon, other_than: int | None = None) -> int | None:
    """The zygote ready where runners are forked; where they are spares, one ready
    (other than ``other_than``): its pid."""
    if d.config.zygote == "off":
        return None
    if d.config.zygote_spares == 0:
        await zygote_state(d.m)
        return None
    return await spare_ready(d.m, other_than=other_than)


async def _two_at_once(d: Daemon, meet: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run A opens PER_RUN instances and holds them while run B opens PER_RUN of its own;
    then A lets go. Both runs' statuses, A's first."""
    meet.mkdir()
    held, release = meet / "held", meet / "release"
    os.mkfifo(held)
    os.mkfifo(release)
    grant = {"write": [str(meet)]}
    held_fd = os.open(held, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with trio.fail_after(SCENARIO_S):
            first = await _ready(d)
            a = await d.m.spawn(
                scripted([command(f"{sys.executable} {HOLD} {PER_RUN} {held} {release}")], sandbox=grant)
            )
            await trio.lowlevel.wait_readable(held_fd)
            assert os.read(held_fd, 64).strip() == str(PER_RUN).encode()
            await _ready(d, other_than=first)
            b = await d.m.spawn(scripted([command(f"{sys.executable} {HOLD} {PER_RUN}")]))
            st_b = await d.m.wait_terminal(b["run_id"])
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))  # A's wait ends
            st_a = await d.m.wait_terminal(a["run_id"])
    finally:
        os.close(held_fd)
    return st_a, st_b


async def _made_as_asked(d: Daemon) -> None:
    zygote = (await d.m.summary())["zygote"]
    if d.config.zygote == "off":
        assert zygote["state"] == "off", zygote
    elif d.config.zygote_spares == 0:
        assert zygote["spawned"] >= 2 and zygote["cold_fallbacks"] == 0, zygote
    else:
        assert zygote["spares"]["used"] == 2 and zygote["cold_fallbacks"] == 0, zygote


async def test_all_runs_together_take_no_more_than_the_nests_total(daemon: Daemon, tmp_path: Path) -> None:
    d = daemon
    nest = (await d.m.summary())["nest"]
    assert nest["state"] == "ready" and nest["limits"]["max_inotify_instances"] == TOTAL, nest
    st_a, st_b = await _two_at_once(d, tmp_path / "meet")
    (out_a,) = outputs(st_a)
    (out_b,) = outputs(st_b)
    a, b = lines(out_a), lines(out_b)
    # A: its own cap; B: what A left of the total, then EMFILE (8 of its own were 16 in all).
    assert a.get("opened") == str(PER_RUN) and a.get("released") == str(PER_RUN), out_a
    assert b.get("opened") == str(TOTAL - PER_RUN) and b.get("errno") == "EMFILE", out_b
    for st in (st_a, st_b):
        assert st["state"] == "completed", st
        sandbox = st["sandbox"]
        assert "problems" not in sandbox, sandbox
        assert sandbox["quotas"]["max_inotify_instances"] == PER_RUN, sandbox
        assert sandbox["quotas"]["total_max_inotify_instances"] == TOTAL, sandbox
    await _made_as_asked(d)


async def test_without_a_nest_runs_go_on_and_say_so(refused: Daemon, tmp_path: Path) -> None:
    d = refused
    nest = (await d.m.summary())["nest"]
    assert nest["state"] == "off" and "exited (3)" in nest["why"], nest
    st_a, st_b = await _two_at_once(d, tmp_path / "meet")
    (out_b,) = outputs(st_b)
    # Each run's own cap still holds; their total is the host's: 16 held at once.
    assert lines(out_b).get("opened") == str(PER_RUN), out_b
    for st in (st_a, st_b):
        assert st["state"] == "completed", st
        sandbox = st["sandbox"]
        assert sandbox["quotas"]["max_inotify_instances"] == PER_RUN, sandbox
        assert "total_max_inotify_instances" not in sandbox["quotas"], sandbox
        assert any(p.startswith(_nest.UNBOUNDED) and "exited (3)" in p for p in sandbox.get("problems", [])), sandbox
    await _made_as_asked(d)
