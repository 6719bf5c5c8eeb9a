"""Path B's timing on a virtual clock: the kernel is faked at process.py's seams.

The fake tree is a runner that ignores SIGTERM and, once SIGKILLed, never dies (a process
stuck in uninterruptible sleep): the routine must escalate exactly at the grace, give up
exactly KILL_WAIT_S later naming the survivor, and never outlive its own deadline.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from supervisor import process
from supervisor.containment import Proc
from supervisor.process import AdoptedTree

PID = 4242
STUCK = Proc(pid=PID, ppid=1, pgid=PID, sid=PID, state="D", start_ticks=7)


class FakeKernel:
    def __init__(self) -> None:
        self.sent: list[tuple[float, str, int]] = []

    def killpg(self, pgid: int, sig: int) -> str:
        self.sent.append((trio.current_time(), f"group {int(sig)}", pgid))
        return "sent"

    def kill_proc(self, p: Proc, sig: int) -> str:
        self.sent.append((trio.current_time(), f"pid {int(sig)}", p.pid))
        return "sent"


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel()

    async def inline(fn: Any, *args: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    async def never_exits(tree: Any) -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(process, "_blocking", inline)
    monkeypatch.setattr(process, "_members", lambda tree, procs=None: {PID: STUCK})
    monkeypatch.setattr(process, "_scan_members", lambda tree: ({PID: STUCK}, {PID: STUCK}))
    monkeypatch.setattr(process, "_leader_alive", lambda tree: True)
    monkeypatch.setattr(process, "_live_groups", lambda tree: [PID])
    monkeypatch.setattr(process, "wait_leader", never_exits)
    monkeypatch.setattr(process, "_killpg", k.killpg)
    monkeypatch.setattr(process, "_kill_proc", k.kill_proc)
    monkeypatch.setattr(process, "_cmdline", lambda pid: "stuck --forever")
    monkeypatch.setattr(process, "reap_adopted_zombies", lambda **kw: [])
    return k


def fake_tree() -> AdoptedTree:
    return AdoptedTree(
        tree_id="t-fake", pid=PID, pgid=PID, start_time=0.0, cgroup=None, containment="group", leader_ticks=7
    )


async def test_escalation_fires_exactly_at_the_grace_and_a_stuck_tree_is_named(
    autojump_clock: Any, kernel: FakeKernel
) -> None:
    start = trio.current_time()
    receipt = await process.terminate_and_kill(fake_tree(), grace_s=10.0)
    assert [(t - start, what) for t, what, _ in kernel.sent] == [
        (0.0, "group 15"),  # SIGTERM to the runner's group at once
        (10.0, "group 9"),  # SIGKILL to the group exactly at the grace
        (10.0, "pid 9"),  # and to the member by pid, once
    ]
    assert receipt.escalated and receipt.leader == "killed"
    assert receipt.waited_s == 10.0
    assert receipt.tree_dead_at is None
    assert receipt.survivors == [{"pid": PID, "cmdline": "stuck --forever", "state": "D"}]
    assert not receipt.timed_out
    elapsed = trio.current_time() - start
    assert 10.0 + process.KILL_WAIT_S <= elapsed < 10.0 + process.KILL_WAIT_S + 0.1


async def test_the_routine_never_outlives_its_own_deadline(
    autojump_clock: Any, kernel: FakeKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "KILL_WAIT_S", 1000.0)
    start = trio.current_time()
    with trio.CancelScope() as outer:
        outer.cancel(reason="the run's scope is unwinding")
        receipt = await process.terminate_and_kill(fake_tree(), grace_s=2.0)
    assert trio.current_time() - start == pytest.approx(2.0 + process.TERMINATE_MARGIN_S)
    assert receipt.timed_out and receipt.escalated
    assert [s["pid"] for s in receipt.survivors] == [PID]


async def test_a_zero_grace_kills_at_once(autojump_clock: Any, kernel: FakeKernel) -> None:
    start = trio.current_time()
    receipt = await process.terminate_and_kill(fake_tree(), grace_s=0.0)
    assert [t - start for t, _, _ in kernel.sent] == [0.0, 0.0, 0.0]
    assert receipt.waited_s == 0.0 and receipt.escalated
