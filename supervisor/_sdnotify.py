"""The systemd notify protocol, in the few lines it takes (no libsystemd, no extra package).

Under ``Type=notify`` systemd puts a datagram socket in ``$NOTIFY_SOCKET`` (a path, or an
abstract socket when it starts with ``@``) and waits for ``READY=1`` before it calls the
service started. Each message is one datagram of ``KEY=VALUE`` lines. See sd_notify(3).

Use in the daemon (this API is stable; the unit in ``systemd/agentd.service`` relies on it)::

    notifier = Notifier.from_env()          # reads and removes NOTIFY_SOCKET & WATCHDOG_*
    ...store open, control socket listening...
    notifier.ready(status="0 live runs")    # READY=1 + STATUS=...
    await nursery.start(watchdog_loop, notifier)   # WATCHDOG=1 at half of WATCHDOG_USEC
    notifier.status(f"{n} live runs")       # whenever the count changes
    ...on SIGTERM...
    notifier.stopping("cancelling 3 runs")  # STOPPING=1 + STATUS=...

Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op that returns False. Sending
never raises: a failure is logged once (warning) and reported by the return value, so a
notify problem cannot take the daemon down. Only the synchronous part is stdlib;
``watchdog_loop`` imports Trio when it runs.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["Notifier", "watchdog_loop", "NOTIFY_VARS", "JournalFormatter", "stderr_is_journal"]

log = logging.getLogger(__name__)

# The variables systemd sets for the protocol; from_env removes them from os.environ by
# default so that runners, MCP servers and Chromium do not inherit them.
NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# A send that cannot complete in this time is a failure (systemd's socket never fills up in
# practice; this bounds the worst case, since the daemon calls send from its event loop).
SEND_TIMEOUT_S = 2.0


class Notifier:
    """Sends notify messages to one socket address; a no-op when the address is None."""

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self.address = address
        self._watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._target: str | bytes | None = None
        self._warned = False
        if address:
            if address.startswith("@"):
                self._target = b"\0" + address[1:].encode()
            elif address.startswith("/"):
                self._target = address
            else:  # e.g. "vsock:..." (systemd >= 253): not needed for a local service
                self._warn(f"unsupported NOTIFY_SOCKET address {address!r}; notifications off")

    @classmethod
    def from_env(
        cls,
        environ: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = True,
    ) -> Notifier:
        """Build from ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID``.

        ``environ`` defaults to ``os.environ``. With ``unset_environment`` (the default, as
        the daemon wants it) the three variables are removed from it afterwards, so child
        processes do not inherit them; call this once, at startup. The watchdog is on only
        when ``WATCHDOG_USEC`` is a positive integer and ``WATCHDOG_PID``, if set, is this
        process (sd_watchdog_enabled(3)).
        """
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec = _watchdog_usec(env)
        if unset_environment:
            for name in NOTIFY_VARS:
                env.pop(name, None)
        return cls(address, watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        """True when there is a socket to talk to (the process runs under Type=notify)."""
        return self._target is not None

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields as one datagram; True when it was sent."""
        if self._target is None or not fields:
            return False
        data = "\n".join(fields).encode()
        try:
            if self._sock is None:
                # Not inherited by children (PEP 446: Python sockets are close-on-exec).
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.settimeout(SEND_TIMEOUT_S)
            self._sock.sendto(data, self._target)
        except OSError as exc:
            self._warn(f"cannot notify systemd at {self.address!r}: {exc}")
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1`` (and ``STATUS=``): the store is open and the control socket is up."""
        return self.send("READY=1", *_status_field(status))

    def status(self, text: str) -> bool:
        """``STATUS=``: one line shown by ``systemctl status`` (newlines become spaces)."""
        return self.send(*_status_field(text))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1`` (and ``STATUS=``): shutdown has begun."""
        return self.send("STOPPING=1", *_status_field(status))

    def extend_timeout(self, seconds: float) -> bool:
        """``EXTEND_TIMEOUT_USEC=``: ask for ``seconds`` more before systemd times out the
        current start or stop (it must be repeated before that time passes)."""
        return self.send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: one keep-alive ping."""
        return self.send("WATCHDOG=1")

    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of ``WATCHDOG_USEC``, in seconds; None when it is off."""
        if self._watchdog_usec is None or self._target is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Notifier({self.address!r}, watchdog_usec={self._watchdog_usec!r})"

    def _warn(self, message: str) -> None:
        if self._warned:
            log.debug("%s", message)
            return
        self._warned = True
        log.warning("%s (further notify errors are logged at debug level)", message)


async def watchdog_loop(notifier: Notifier, *, task_status: Any = None) -> None:
    """Ping ``WATCHDOG=1`` every ``watchdog_interval_s()`` until cancelled.

    Run it in the daemon's main nursery with ``await nursery.start(watchdog_loop, notifier)``:
    it sends the first ping before ``started`` (with the interval, or None when the watchdog
    is off, in which case it returns at once). Because the pings come from a Trio task, a
    blocked event loop stops them, and systemd restarts or kills the service as the unit
    says (WatchdogSec=).
    """
    import trio

    if task_status is None:
        task_status = trio.TASK_STATUS_IGNORED
    interval = notifier.watchdog_interval_s()
    if interval is None:
        task_status.started(None)
        return
    notifier.watchdog()
    task_status.started(interval)
    while True:
        await trio.sleep(interval)
        notifier.watchdog()


def _watchdog_usec(env: Mapping[str, str]) -> int | None:
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec


def _status_field(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    return ("STATUS=" + " ".join(str(text).splitlines()),)


# ----------------------------------------------------------------------------- journald


def stderr_is_journal(fd: int = 2, environ: Mapping[str, str] | None = None) -> bool:
    """Is ``fd`` the journal stream systemd connected (``$JOURNAL_STREAM``: its device and
    inode, as ``systemd.exec(5)`` says to check)?"""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalFormatter(logging.Formatter):
    """Each line led by its syslog priority (``<4>`` for a warning), which journald reads
    (``SyslogLevelPrefix=``, on by default): ``journalctl -p warning`` then finds the
    daemon's warnings, which all arrived as info. No timestamp: journald keeps its own."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelno
        priority = 7 if level < logging.INFO else 6 if level < logging.WARNING else 4 if level < logging.ERROR else 3
        if level >= logging.CRITICAL:
            priority = 2
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())
