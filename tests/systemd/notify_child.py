"""A tiny Type=notify service for the harness tests; it speaks only through supervisor._sdnotify.

    notify_child.py gated STARTED_FIFO GO_FIFO   READY=1 only after the test writes GO_FIFO
    notify_child.py watchdog                     READY=1, then WATCHDOG=1 from watchdog_loop
    notify_child.py silent                       READY=1, then never a watchdog ping

Every mode handles SIGTERM by sending STOPPING=1 and exiting 0.
"""

from __future__ import annotations

import signal
import sys

import trio

from supervisor._sdnotify import Notifier, watchdog_loop


def gated(n: Notifier, started_fifo: str, go_fifo: str) -> None:
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    with open(started_fifo, "w") as f:  # blocks until the test reads it
        f.write("started\n")
    with open(go_fifo) as f:  # blocks until the test writes it
        f.read()
    n.ready(status="harness ready")
    while not stop:
        signal.pause()
    n.stopping("harness stopping")


async def with_watchdog(n: Notifier, ping: bool) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            n.ready(status=f"harness up, watchdog every {n.watchdog_interval_s()} s")
            if ping:
                await nursery.start(watchdog_loop, n)
            async for _ in signals:
                break
            n.stopping("harness stopping")
            nursery.cancel_scope.cancel()


def main() -> None:
    n = Notifier.from_env()
    mode = sys.argv[1]
    if mode == "gated":
        gated(n, sys.argv[2], sys.argv[3])
    elif mode in {"watchdog", "silent"}:
        trio.run(with_watchdog, n, mode == "watchdog")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
