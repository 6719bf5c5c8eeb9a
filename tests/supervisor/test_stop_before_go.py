"""A run stopped before its runner was let go never starts: a spare the zygote forked ahead
is never sent ``go`` once the stop came (it is hung up on and exits having done nothing of
the run: no ``runner_started``, no step), and the run ends ``cancelled``, never started.

The window is real: ``go`` waits for the spare's acknowledgement of its assignment (a spare
forked just before, still rehearsing, takes a few ms), and a cancel that came and was
acknowledged meanwhile was followed by ``go`` (3 runs in 30 of a spawn-then-cancel loop
here, each with a ``runner_started`` after the stop). The tests hold that wait open.

An in-process daemon (``serve``) with a real zygote and its spare, the real runner with the
scripted model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from supervisor.store.journal import Journal
from supervisor.trees import zygote as zygote_mod
from tests.supervisor.test_zygote import daemon, gated, zygote_state
from tests.supervisor.test_zygote_spare import ZygoteProc, assign, read_all, spare_ready

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")

NEVER_STARTED = "cancelled before its runner was let go: never started"


def hold_go(monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, trio.Event]:
    """``Spare.go`` is entered (``entered`` set), then held until ``release``: the wait for
    the spare's acknowledgement, long."""
    real_go = zygote_mod.Spare.go
    entered, release = trio.Event(), trio.Event()

    async def held(spare: zygote_mod.Spare, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        with trio.CancelScope(shield=True):  # as a spare slow to acknowledge: not cut short
            await release.wait()
        return await real_go(spare, *args, **kwargs)

    monkeypatch.setattr(zygote_mod.Spare, "go", held)
    return entered, release


async def exited(pid: int, pidfd: int) -> None:
    """Until ``pid`` (its pidfd opened while it lived) has exited."""
    await trio.lowlevel.wait_readable(pidfd)


async def test_a_spare_whose_run_was_stopped_while_it_acknowledged_is_never_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = hold_go(monkeypatch)
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1) as m:
            await zygote_state(m)
            spare = await spare_ready(m)
            pidfd = os.pidfd_open(spare)
            try:
                r = await m.spawn(gated("echo never"))
                assert r["state"] == "starting"  # started with its creation: the spare is its
                await entered.wait()
                ack = await m.cancel(r["run_id"])  # acknowledged: durable, before `go`
                assert ack["was_active"] is True and ack["state"] == "cancelling"
                release.set()
                st = await m.wait_terminal(r["run_id"])
                events = await m.journal.events_after(r["run_id"])
                await exited(spare, pidfd)  # hung up on: it exits
                z = (await m.summary())["zygote"]
            finally:
                os.close(pidfd)
    kinds = [e["kind"] for e in events]
    assert "runner_started" not in kinds and "step_started" not in kinds, kinds
    assert [e["data"]["state"] for e in events if e["kind"] == "state"] == [
        "queued",
        "starting",
        "cancelling",
        "cancelled",
    ]
    assert st["state"] == "cancelled" and st["reason"] == "user"
    assert st["receipt"]["note"] == NEVER_STARTED
    assert st["result"] is None
    assert z["spares"]["used"] == 0  # never a runner of a run


async def test_a_queued_run_stopped_while_its_spare_acknowledged_is_never_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a run that waited for a place (its spare assigned at its start)."""
    with trio.fail_after(120):
        async with daemon(tmp_path, zygote_spares=1, max_concurrent=1) as m:
            await zygote_state(m)
            first_spare = await spare_ready(m)
            first = await m.spawn(gated("sleep 60"))
            spare = await spare_ready(m, other_than=first_spare)
            pidfd = os.pidfd_open(spare)
            try:
                r = await m.spawn(gated("echo never"))
                assert r["state"] == "queued"
                entered, release = hold_go(monkeypatch)
                await m.cancel(first["run_id"])  # its place goes to the queued run
                await entered.wait()
                ack = await m.cancel(r["run_id"])
                assert ack["was_active"] is True and ack["state"] == "cancelling"
                release.set()
                st = await m.wait_terminal(r["run_id"])
                events = await m.journal.events_after(r["run_id"])
                await exited(spare, pidfd)
            finally:
                os.close(pidfd)
    kinds = [e["kind"] for e in events]
    assert "runner_started" not in kinds and "step_started" not in kinds, kinds
    assert st["state"] == "cancelled" and st["receipt"]["note"] == NEVER_STARTED


def test_a_spare_hung_up_on_right_after_its_assignment_exits_quietly(tmp_path: Path) -> None:
    """The daemon hangs up on a spare whose run was stopped as it was assigned (before the
    spare acknowledged it): the spare exits 0 without a word, as one hung up on at its gate
    does. (It failed to send its acknowledgement and reported 'the forked runner could not
    start: BrokenPipeError', exit 70, on the daemon's log.)"""
    log = tmp_path / "zygote.err"
    with open(log, "wb") as err:
        z = ZygoteProc(tmp_path, stderr=err.fileno())
    try:
        pid, chan, run_dir = z.spare(1)
        stdin_w, stdout_r, stderr_r = assign(chan, run_dir, "touch ran")
        chan.close()  # its assignment is in its socket; its acknowledgement finds none to take it
        code = z.wait_exit(pid)
        os.close(stdin_w)
        assert read_all(stdout_r) == b"" and read_all(stderr_r) == b""
    finally:
        z.close()
    said = log.read_text()
    assert code == 0 and "could not start" not in said, (code, said)
    assert not (run_dir / "ran").exists()


async def test_a_run_stopped_while_its_start_is_journaled_gets_no_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No zygote: a stop that comes while the run's start commits (before its runner is
    spawned) spawns none. (A cold runner was started after the stop, then stopped.)"""
    real_start = Journal.start_run
    entered, release = trio.Event(), trio.Event()

    async def held(journal: Journal, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        await release.wait()
        return await real_start(journal, *args, **kwargs)

    monkeypatch.setattr(Journal, "start_run", held)
    with trio.fail_after(60):
        async with daemon(tmp_path, zygote="off") as m, trio.open_nursery() as nursery:
            r = await m.spawn(gated("echo never"))
            await entered.wait()
            nursery.start_soon(m.cancel, r["run_id"])
            await trio.testing.wait_all_tasks_blocked()  # the stop is taken (its token), not yet journaled
            release.set()
            st = await m.wait_terminal(r["run_id"])
            events = await m.journal.events_after(r["run_id"])
    assert st["state"] == "cancelled" and st["receipt"]["note"] == NEVER_STARTED, st.get("receipt")
    assert st["pid"] is None and st["tree_id"] is None  # no runner was ever spawned
    assert "runner_started" not in [e["kind"] for e in events]
