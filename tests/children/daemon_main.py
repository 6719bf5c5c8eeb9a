"""Run the daemon in the foreground for tests: ``daemon_main.py STATE_DIR``.

Prints one JSON line ``{"url", "token", "pid"}`` on stdout once it serves; settings come
from ``AGENTD_*`` environment variables (``Config.load``). Ends on SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import trio

from subagent.osedge import run_trio
from supervisor.config import Config
from supervisor.daemon import serve


def _hold_at_spare_go(stop_the_spare: bool) -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT``): where a spare would get its ``go`` (the
    run's start is journaled), once the spare acknowledged its run (it waits at its gate),
    print ``at spare_go`` on stdout and hold there for good (the test SIGKILLs the daemon);
    ``spare_go_stopped`` SIGSTOPs the spare first, so that a restarted daemon finds it
    alive."""
    import signal

    from supervisor.trees import zygote

    async def hold(spare: zygote.Spare, *args: object, **kwargs: object) -> None:
        await trio.lowlevel.wait_readable(spare.chan)  # its acknowledgement
        if stop_the_spare:
            os.kill(spare.pid, signal.SIGSTOP)
        print("at spare_go", flush=True)
        await trio.sleep_forever()

    zygote.Spare.go = hold  # type: ignore[method-assign,assignment]


def _hold_after_spare_go() -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT=spare_let_go``): the spare gets its ``go``;
    then print ``at spare_let_go`` and hold for good, before the run's supervision reads
    any of its events (they stay in its pipes, which die with this daemon)."""
    from supervisor.trees import zygote

    let_go = zygote.Spare.go

    async def hold(spare: zygote.Spare, *args: object, **kwargs: object) -> None:
        await let_go(spare, *args, **kwargs)  # type: ignore[arg-type]
        print("at spare_let_go", flush=True)
        await trio.sleep_forever()

    zygote.Spare.go = hold  # type: ignore[method-assign,assignment]


def _hold_at_process_record() -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT=process_record``): where a runner the spawn
    started (not a spare) has its process record written, print ``at process_record`` on
    stdout and hold there for good (the test SIGKILLs the daemon)."""
    from supervisor.store.journal import Journal

    async def hold(*_args: object, **_kwargs: object) -> None:
        print("at process_record", flush=True)
        await trio.sleep_forever()

    Journal.record_process = hold  # type: ignore[method-assign,assignment]


def _fail_after_recovery() -> None:
    """Fault injection (``AGENTD_TEST_FAIL_AT=after_recovery``): the start fails once the
    runs a previous daemon left were found again (a step of the start that comes after
    them raises): print ``failing after recovery`` on stdout first."""
    from supervisor import daemon

    async def fail(*_args: object, task_status: object = None) -> None:
        print("failing after recovery", flush=True)
        raise RuntimeError("injected: a start step after the recovery failed")

    daemon._sdnotify.watchdog_loop = fail  # type: ignore[assignment]


def _pause_before_recovery() -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT=recovery``): print ``at recovery`` on stdout
    as the start is about to find the runs again, and give the test a moment there (a
    signal sent then arrives during the start, whenever it is handled)."""
    from supervisor.core import recovery

    recover = recovery.Recovery.recover

    async def pause(self: recovery.Recovery) -> object:
        print("at recovery", flush=True)
        await trio.sleep(1.0)
        return await recover(self)

    recovery.Recovery.recover = pause  # type: ignore[assignment,method-assign]


def _hold_between_steps(
    where: str, kind: str, channel: list[tuple[Any, str]], carries: Callable[[tuple[Any, ...]], bool]
) -> None:
    """Hold (for good: the test SIGKILLs the daemon) between the two steps of a fact sent
    to a runner, its journal write (the ``kind`` event) and its write into the runner's
    input (the ``channel`` functions, (owner, name), for the calls that ``carries``), in
    whichever order the daemon takes them: once the first is done, print ``at WHERE``."""
    from supervisor.core import _book

    done: list[str] = []

    async def hold() -> None:
        print(f"at {where}", flush=True)
        await trio.sleep_forever()

    def channel_write(write: Any) -> Any:
        async def wrapped(*args: Any, **kwargs: Any) -> object:
            if not carries(args):
                return await write(*args, **kwargs)
            if done:
                await hold()
            value = await write(*args, **kwargs)
            done.append("channel")
            return value

        return wrapped

    def journal_write(record: Any) -> Any:
        async def wrapped(book: object, run: object, k: str, *args: object, **kwargs: object) -> object:
            if k == kind and done:
                await hold()
            value = await record(book, run, k, *args, **kwargs)
            if k == kind:
                done.append("journal")
            return value

        return wrapped

    for owner, name in channel:
        if hasattr(owner, name):
            setattr(owner, name, channel_write(getattr(owner, name)))
    for name in ("record", "record_durable"):
        if hasattr(_book.RunBook, name):
            setattr(_book.RunBook, name, journal_write(getattr(_book.RunBook, name)))


def _hold_between_approval_steps() -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT=approval_between``): between an answer's
    journal write (``approval_sent``) and its write into the run's channel."""
    from supervisor.core import approvals

    # The channel write (``_send``: before the record came first).
    channel = [(approvals, "_write"), (approvals, "_send")]
    _hold_between_steps("approval_between", "approval_sent", channel, lambda args: True)


def _hold_between_steer_steps() -> None:
    """Fault injection (``AGENTD_TEST_HOLD_AT=steer_between``): between a steer's journal
    write (``steer_sent``) and its write into the runner's stdin (``write_whole`` from
    ``_steers``; the stdin stream's ``send_all`` before the record came first)."""
    from supervisor.core import _steers

    def steer_line(args: tuple[Any, ...]) -> bool:
        data = next((a for a in args if isinstance(a, (bytes, bytearray, memoryview))), b"")
        return bytes(data).lstrip(b"\n").startswith(b'{"steer"')

    channel = [(_steers, "write_whole"), (trio.lowlevel.FdStream, "send_all")]
    _hold_between_steps("steer_between", "steer_sent", channel, steer_line)


async def main(state_dir: str) -> None:
    if os.environ.get("AGENTD_TEST_FAIL_AT") == "after_recovery":
        _fail_after_recovery()
    if os.environ.get("AGENTD_TEST_HOLD_AT") == "recovery":
        _pause_before_recovery()
    hold_at = os.environ.get("AGENTD_TEST_HOLD_AT")
    if hold_at in ("spare_go", "spare_go_stopped"):
        _hold_at_spare_go(hold_at == "spare_go_stopped")
    elif hold_at == "spare_let_go":
        _hold_after_spare_go()
    elif hold_at == "process_record":
        _hold_at_process_record()
    elif hold_at == "approval_between":
        _hold_between_approval_steps()
    elif hold_at == "steer_between":
        _hold_between_steer_steps()
    config = Config.load(state_dir=state_dir)
    async with trio.open_nursery() as n:
        info = await n.start(serve, config)
        print(json.dumps({"url": info["url"], "token": info["token"], "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_trio(main, sys.argv[1])
