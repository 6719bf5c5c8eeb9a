"""``agentd fleet serve``: the fleet front as a process on the head.

Start-up: lock the front's state dir, join Ray as a driver, open the index, resume its
runs, serve the control socket (the daemon's own server: token, Origin, limits), publish
``daemon.json`` and ``token`` there, so ``agentd --fleet ...`` finds it like a daemon.
SIGTERM/SIGINT end the front only: runs live on their nodes and a restarted front picks
them up from its index. Stopping every run is ``agentd fleet down`` (each node daemon's
own cancel-everything stop).
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import signal
from typing import Any, Final

import trio

from supervisor.config import Config
from supervisor.control import _statefiles
from supervisor.control import server as control
from supervisor.errors import DaemonAlreadyRunning

__all__ = ["serve_front", "INDEX_FILE"]

logger = logging.getLogger(__name__)

INDEX_FILE: Final = "fleet.sqlite3"
LOCK_FILE: Final = "front.lock"


def _lock(config: Config) -> int:
    fd = os.open(config.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise DaemonAlreadyRunning(str(config.state_dir), other) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def serve_front(
    config: Config,
    address: str | None,
    *,
    node_root: str | None = None,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the fleet front until SIGTERM/SIGINT (or ``stop``)."""
    import ray

    from supervisor.fleet._agent import connect
    from supervisor.fleet._front import FleetFront
    from supervisor.fleet._index import Index

    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = _lock(config)
    try:
        await trio.to_thread.run_sync(connect, address)
        index = Index(config.state_dir / INDEX_FILE)
        front = FleetFront(config, index, node_root=node_root)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(front.run)
                token = _statefiles.write_token(config.token_path)
                port = await nursery.start(functools.partial(control.serve_control, config, front, token=token))
                endpoint = _statefiles.write_endpoint(
                    config.endpoint_path, host=config.host, port=port, pid=os.getpid()
                )
                logger.info("agentd fleet front listening on %s (state dir %s)", endpoint["url"], config.state_dir)
                task_status.started({"port": port, "url": endpoint["url"], "token": token, "front": front})
                if stop is not None:
                    await stop.wait()
                else:
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for signum in signals:
                            logger.info(
                                "fleet front: received %s; runs go on on their nodes", signal.Signals(signum).name
                            )
                            break
                front.stop_accepting()
                nursery.cancel_scope.cancel(reason="fleet front stopping")
        finally:
            with trio.CancelScope(shield=True):
                _statefiles.remove_endpoint(config.endpoint_path, pid=os.getpid())
                index.close()
                await trio.to_thread.run_sync(ray.shutdown)
    finally:
        os.close(lock)
