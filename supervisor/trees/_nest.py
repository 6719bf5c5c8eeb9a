"""The daemon's nest: the user namespace every run's own is made in (``subagent._nest``).

Made once, before the first runner starts, by a holder process (the daemon is
multithreaded and cannot ``unshare(CLONE_NEWUSER)`` itself) that sends its descriptor
back and exits; the daemon holds the descriptor until it stops (a run in the nest keeps
it alive beyond that: a re-adopted run stays in its old daemon's nest) and gives it to
every runner it starts (``pass_fds`` and ``env``: cold runners, the zygote and so its
runners and spares). Where it cannot be made (no user namespaces, /proc/sys read-only,
the sandbox off) runs go on without it and say so (``sandbox.problems``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
from typing import Any, Final

import trio

from subagent._nest import NEST_ENV, totals
from supervisor.config import Config, module_argv

__all__ = ["Nest", "NEST_START_TIMEOUT_S"]

logger = logging.getLogger(__name__)

# How long the holder may take to start Python, make the nest and send it (seconds).
NEST_START_TIMEOUT_S: Final = 30.0
# Largest message of the holder's (its limits, or why it failed).
_MAX_MESSAGE: Final = 65536


class Nest:
    """The nest's descriptor (``fd``), its limits as set, or why there is none."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.fd: int | None = None
        self.limits: dict[str, int] = {}
        self.why: str | None = "not made yet"

    def holder_argv(self) -> list[str]:
        """The holder's command line (a seam: a test replaces it to see a nest refused)."""
        limits = totals(self.config.run_inotify_instances_total, self.config.run_inotify_watches_total)
        return [*module_argv(self.config.runner_python, "subagent._nest"), json.dumps(limits)]

    async def make(self) -> None:
        """Have the nest made (once); on failure ``why`` says why, and runs go without."""
        if self.fd is not None:
            return
        if self.config.sandbox == "off":
            self.why = "the sandbox is off"
            return
        try:
            self.fd, self.limits = await trio.to_thread.run_sync(self._make)
        except OSError as exc:
            self.why = exc.strerror or str(exc)
            logger.warning("no nest for the runs (their total share of the uid's kernel counts): %s", self.why)
            return
        self.why = None
        logger.info("nest for the runs: %s", self.limits)

    def _make(self) -> tuple[int, dict[str, int]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with theirs:
                # Its own group, in the daemon's session and environment (as the zygote).
                proc = subprocess.Popen(
                    self.holder_argv(),
                    stdin=theirs.fileno(),
                    stdout=subprocess.DEVNULL,
                    cwd="/",
                    process_group=0,
                )
            try:
                ours.settimeout(NEST_START_TIMEOUT_S)
                try:
                    data, fds, _flags, _addr = socket.recv_fds(ours, _MAX_MESSAGE, 1)
                except TimeoutError:
                    raise OSError(f"the nest's holder sent nothing in {NEST_START_TIMEOUT_S:.0f} s") from None
            finally:
                if proc.poll() is None:
                    try:
                        proc.wait(NEST_START_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        finally:
            ours.close()
        msg: Any = _decode(data)
        if not fds:
            why = msg.get("error") if isinstance(msg, dict) else None
            raise OSError(str(why or f"the nest's holder exited ({proc.returncode}) without it"))
        for extra in fds[1:]:
            os.close(extra)
        os.set_inheritable(fds[0], False)  # a runner gets it by ``pass_fds`` alone
        limits = msg.get("limits") if isinstance(msg, dict) else None
        return fds[0], {str(k): int(v) for k, v in (limits or {}).items()}

    def env(self) -> dict[str, str]:
        """What a runner is told (``subagent._nest.join``): the descriptor, or why none."""
        return {NEST_ENV: str(self.fd) if self.fd is not None else (self.why or "no nest")}

    def pass_fds(self) -> tuple[int, ...]:
        return (self.fd,) if self.fd is not None else ()

    def describe(self) -> dict[str, Any]:
        """For ``status``: the limits all runs together have, or why they have none."""
        if self.fd is not None:
            return {"state": "ready", "limits": dict(self.limits)}
        return {"state": "off", "why": self.why}

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
            self.why = "closed"


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
