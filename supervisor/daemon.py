"""The daemon: journal, containment, run manager, control socket, signals, shutdown.

``serve`` owns every long-lived task. Start-up order: state dir, journal, containment,
recovery of runs left by a previous daemon, the runs nursery, the control socket, the web
dashboard (unless ``dashboard = "off"``), then READY=1 to systemd. On SIGTERM/SIGINT/SIGHUP (or ``stop`` set, for in-process use): STOPPING=1,
no more spawns, every run cancelled through both paths and its terminal fact written,
then everything closes. The daemon never dies of a client's mistake: the control socket
turns those into error replies. A journal that cannot be written makes it *degraded*, not
dead: ``STATUS=`` and ``status`` say so, and the run manager keeps what waits in memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import signal
from typing import Any

import trio

from supervisor import _sdnotify
from supervisor.config import Config
from supervisor.control import _statefiles
from supervisor.control import server as control
from supervisor.control._peer_cgroup import RunPeers
from supervisor.core.runs import SHUTDOWN_MARGIN_S, RunManager
from supervisor.errors import ConfigError, DaemonAlreadyRunning
from supervisor.store.journal import Journal
from supervisor.trees import process
from supervisor.trees.containment import Containment

__all__ = ["serve"]

logger = logging.getLogger(__name__)

LOCK_FILE = "daemon.lock"
# How often the STATUS= line for systemd is refreshed.
STATUS_INTERVAL_S = 1.0
# At shutdown, once every run is terminal, how long subscribers may take to get the last
# events and the end of their runs before the control connections close.
SUBSCRIBERS_DRAIN_S = 2.0


async def serve(
    config: Config,
    *,
    stop: trio.Event | None = None,
    task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until SIGTERM, SIGINT or SIGHUP, or until ``stop`` is set when given.

    A signal during the start is kept, not met with its default action (a death with
    the runs it was finding again left unrecorded): once started, the daemon stops as
    it would at any other time, every run cancelled and recorded.
    """
    with contextlib.ExitStack() as stack:
        if stop is None:
            # SIGHUP too (a terminal closed, `systemctl kill -s HUP`): its default action
            # killed the daemon without a word, its runs neither cancelled nor recorded.
            signals = stack.enter_context(trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP))
            stop = trio.Event()
        else:
            signals = None
        try:
            config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            config.run_root.mkdir(parents=True, exist_ok=True, mode=0o700)
            lock = _lock_state_dir(config)
        except OSError as exc:
            raise ConfigError(
                "state_dir", f"cannot use state dir {str(config.state_dir)!r}: {exc.strerror or exc}"
            ) from exc
        try:
            await _serve_locked(config, stop, signals, task_status)
        finally:
            for fd in lock:
                os.close(fd)


async def _stop_at_a_signal(signals: Any, stop: trio.Event) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if stop.is_set():
            logger.info("received %s: already stopping (every run is being cancelled)", name)
            continue
        logger.info("received %s", name)
        stop.set()


def _lock_state_dir(config: Config) -> list[int]:
    """One daemon per state dir: a second one would share the journal and the runs.

    The lock is on the directory itself, which cannot be removed while it holds the
    journal, and on ``daemon.lock``, which names the holder. (On the file alone, a
    ``daemon.lock`` removed as "stale" let a second daemon start beside a live one: both
    then supervised its runs, and a user's cancel ended `failed`.)"""
    fds: list[int] = []
    try:
        fds.append(os.open(config.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        fds.append(os.open(config.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            other = os.pread(fds[1], 32, 0).decode(errors="replace").strip() if len(fds) > 1 else ""
        finally:
            for fd in fds:
                os.close(fd)
        raise DaemonAlreadyRunning(str(config.state_dir), other) from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    os.ftruncate(fds[1], 0)
    os.pwrite(fds[1], f"{os.getpid()}\n".encode(), 0)
    return fds


async def _serve_locked(
    config: Config, stop: trio.Event, signals: Any, task_status: trio.TaskStatus[dict[str, Any]]
) -> None:
    notifier = _sdnotify.Notifier.from_env()
    journal = await Journal.open(config.journal_path)
    containment = await trio.to_thread.run_sync(Containment.setup, config)
    manager = RunManager(config, journal, containment)
    listeners: list[trio.SocketListener] = []
    runs: RunPeers | None = None
    try:
        # Before the runs a previous daemon left are found again, everything a start can
        # fail at for the user's reasons (a full disk, a busy port, a host that does not
        # resolve): such a start stops with an error and leaves those runs as they are,
        # for the next start, rather than ending them on the way out. Connections wait in
        # the listen backlog until the runs are found again.
        try:
            token = _statefiles.write_token(config.token_path)
        except OSError as exc:
            raise ConfigError(
                "state_dir", f"cannot write the control token {str(config.token_path)!r}: {exc.strerror or exc}"
            ) from exc
        listeners.append(control_listener := await control.open_listener(config.host, config.port))
        port = control_listener.socket.getsockname()[1]
        sessions = dash_listener = dashboard_url = static = None
        if config.dashboard == "on":
            from supervisor.control import dashboard

            sessions = dashboard.Sessions(token)
            static = await trio.to_thread.run_sync(dashboard.load_static)
            listeners.append(dash_listener := await dashboard.listen(config))
            # Published as the address bound, never a name (``localhost``): a name can
            # lead a browser or the CLI to another address, where another process listens
            # (``dashboard._sessions.names_for``); the CLI sends the token there.
            dash_host, dash_port = dash_listener.socket.getsockname()[:2]
            dashboard_url = dashboard.dashboard_url(dash_host, dash_port)
        try:
            endpoint = _statefiles.write_endpoint(
                config.endpoint_path,
                host=control_listener.socket.getsockname()[0],
                port=port,
                pid=os.getpid(),
                dashboard_url=dashboard_url,
            )
        except OSError as exc:
            raise ConfigError(
                "state_dir", f"cannot write the endpoint file {str(config.endpoint_path)!r}: {exc.strerror or exc}"
            ) from exc
        # A connection a run's processes made is closed at once, on both sockets.
        runs = RunPeers.open(lambda: containment.root)
        async with trio.open_nursery() as nursery:
            if signals is not None:  # (one that came before is waiting in it)
                nursery.start_soon(_stop_at_a_signal, signals, stop)
            await nursery.start(containment.run)
            try:
                await nursery.start(manager.run)
                subscriptions = control.Subscriptions()
                await nursery.start(
                    functools.partial(
                        control.serve_control,
                        config,
                        manager,
                        token=token,
                        session_ok=sessions.handshake_ok if sessions is not None else None,
                        session_watch=sessions.watching if sessions is not None else None,
                        subscriptions=subscriptions,
                        listener=control_listener,
                        runs=runs,
                    )
                )
                if sessions is not None:
                    await nursery.start(
                        functools.partial(
                            dashboard.serve_dashboard,
                            config,
                            sessions,
                            control_port=port,
                            listener=dash_listener,
                            static=static,
                            runs=runs,
                        )
                    )
                await nursery.start(_sdnotify.watchdog_loop, notifier)
            except BaseException:
                # The start failed (or was cancelled) after the runs were found again:
                # they are left for the next start, as the failures above leave them.
                manager.leave_runs()
                raise
            logger.info("agentd listening on %s (state dir %s)", endpoint["url"], config.state_dir)
            notifier.send("READY=1", f"STATUS=listening on {endpoint['url']}, 0 live runs")
            nursery.start_soon(_status_loop, notifier, manager)
            task_status.started(
                {
                    "port": port,
                    "url": endpoint["url"],
                    "token": token,
                    "manager": manager,
                    "dashboard_url": dashboard_url,
                }
            )
            await stop.wait()
            n = manager.live_count
            logger.info("agentd stopping: cancelling %d live run%s", n, "" if n == 1 else "s")
            notifier.send("STOPPING=1", f"STATUS=stopping, cancelling {n} run{'' if n == 1 else 's'}")
            if n:
                # What the stop may take (the grace, then the kill and the last facts), told
                # to systemd: a grace longer than the unit's TimeoutStopSec (set where the
                # unit does not see it, in agentd.env) timed the stop out and SIGKILLed all.
                notifier.extend_timeout(config.grace_s + SHUTDOWN_MARGIN_S + SUBSCRIBERS_DRAIN_S)
            await manager.shutdown()
            try:
                strays = await process.kill_strays(containment, only_if_idle=False)
            except OSError as exc:  # e.g. out of file descriptors: the scan failed
                logger.warning("shutdown: could not look for untraceable orphans: %s", exc)
                strays = []
            if strays:
                logger.warning("shutdown: killed %d untraceable orphans: %s", len(strays), strays)
            await manager.flush_journal()
            # Every run is terminal: each subscriber (a CLI's `watch`, the fleet's front)
            # gets its run's last events and its end before the connections close.
            if not await subscriptions.drained(SUBSCRIBERS_DRAIN_S):
                logger.warning(
                    "shutdown: %d subscription(s) still sending after %.0f s; closing them",
                    subscriptions.active,
                    SUBSCRIBERS_DRAIN_S,
                )
            nursery.cancel_scope.cancel(reason="daemon shutdown")
    finally:
        with trio.CancelScope(shield=True):
            for listener in listeners:  # (closed already once served; closing again is harmless)
                await listener.aclose()
            if runs is not None:
                runs.close()
            _statefiles.remove_endpoint(config.endpoint_path, pid=os.getpid())
            await journal.aclose()
            await trio.to_thread.run_sync(containment.close)


async def _status_loop(notifier: _sdnotify.Notifier, manager: RunManager) -> None:
    if not notifier.enabled:
        return  # nobody to tell: an idle daemon stays idle
    last = ""
    while True:
        text = status_line(manager)
        if text != last:
            notifier.send(f"STATUS={text}")
            last = text
        await trio.sleep(STATUS_INTERVAL_S)


def status_line(manager: RunManager) -> str:
    """The one-line STATUS= for systemd: live runs, and what is degraded if anything."""
    n = manager.live_count
    text = f"running, {n} live run{'' if n == 1 else 's'}"
    backlog = manager.backlog
    if backlog.degraded:
        waiting = backlog.describe()["pending_writes"]
        text = f"degraded: journal not writable ({backlog.error}); {waiting} writes wait in memory; " + text
    if manager.containment.problem:
        text = f"degraded: {manager.containment.problem}; " + text
    return text
