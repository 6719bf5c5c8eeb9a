"""Path B's timing on a virtual clock, with a fake kernel injected once (tests/fake_kernel.py).

The fake tree is a runner that ignores SIGTERM and, once SIGKILLed, never dies (a process
stuck in uninterruptible sleep): the routine must escalate exactly at the grace, give up
exactly KILL_WAIT_S later naming the survivor, and never outlive its own deadline.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from subagent.osedge import ProcessTable
from supervisor.trees import process
from supervisor.trees.process import AdoptedTree
from tests.fake_kernel import FakeKernel

PID = 4242


@pytest.fixture
def kernel() -> FakeKernel:
    k = FakeKernel()
    k.start(PID, cmdline="stuck --forever", env={"AGENTD_TREE": "t-fake"}, state="D")
    k.unkillable.add(PID)
    return k


def fake_tree(kernel: FakeKernel) -> AdoptedTree:
    ticks = kernel.procs[PID].start_ticks
    tree = AdoptedTree(
        tree_id="t-fake",
        pid=PID,
        pgid=PID,
        start_time=0.0,
        cgroup=None,
        containment="group",
        leader_ticks=ticks,
        table=ProcessTable(kernel),
    )
    tree.groups[PID] = ticks
    return tree


async def test_escalation_fires_exactly_at_the_grace_and_a_stuck_tree_is_named(
    autojump_clock: Any, kernel: FakeKernel
) -> None:
    start = trio.current_time()
    receipt = await process.terminate_and_kill(fake_tree(kernel), grace_s=10.0)
    assert [(t - start, how, sig) for t, how, sig in ((s.at, s.how, s.sig) for s in kernel.sent if s.sig != 18)] == [
        (0.0, "group", 15),  # SIGTERM to the runner's group at once
        (10.0, "group", 9),  # SIGKILL to the group exactly at the grace
        (10.0, "pid", 9),  # and to the member by pidfd, once
    ]
    assert receipt.escalated and receipt.leader == "killed"
    assert receipt.waited_s == 10.0
    assert receipt.tree_dead_at is None
    assert receipt.survivors == [{"pid": PID, "cmdline": "stuck --forever", "state": "D"}]
    assert not receipt.timed_out
    elapsed = trio.current_time() - start
    assert 10.0 + process.KILL_WAIT_S <= elapsed < 10.0 + process.KILL_WAIT_S + 0.1
    assert kernel.open_fds() == 0  # every pidfd closed


async def test_the_routine_never_outlives_its_own_deadline(
    autojump_clock: Any, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "KILL_WAIT_S", 1000.0)
    start = trio.current_time()
    with trio.CancelScope() as outer:
        outer.cancel(reason="the run's scope is unwinding")
        receipt = await process.terminate_and_kill(fake_tree(kernel), grace_s=2.0)
    assert trio.current_time() - start == pytest.approx(2.0 + process.TERMINATE_MARGIN_S)
    assert receipt.timed_out and receipt.escalated
    assert [s["pid"] for s in receipt.survivors] == [PID]


async def test_a_zero_grace_kills_at_once(autojump_clock: Any, kernel: FakeKernel) -> None:
    start = trio.current_time()
    receipt = await process.terminate_and_kill(fake_tree(kernel), grace_s=0.0)
    assert [s.at - start for s in kernel.sent if s.sig != 18] == [0.0, 0.0, 0.0]  # less each SIGTERM's SIGCONT
    assert receipt.waited_s == 0.0 and receipt.escalated


async def test_a_runner_that_obeys_sigterm_ends_the_tree_in_the_grace(autojump_clock: Any, kernel: FakeKernel) -> None:
    kernel.unkillable.clear()
    start = trio.current_time()
    receipt = await process.terminate_and_kill(fake_tree(kernel), grace_s=10.0)
    # What is left is the runner's zombie: its group is SIGKILLed (harmless), nothing by pid.
    assert [(s.at - start, s.how, s.sig) for s in kernel.sent] == [
        (0.0, "group", 15),
        (0.0, "group", 18),
        (0.0, "group", 9),
    ]
    assert receipt.leader == "exited" and not receipt.escalated and receipt.survivors == []
    assert receipt.tree_dead_at is not None and receipt.tree_dead_at - start < 0.1
