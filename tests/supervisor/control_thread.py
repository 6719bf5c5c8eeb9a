"""A control server with a fake backend on its own thread and trio loop, for sync tests.

The client and the CLI are synchronous; they talk to this server over a real socket
while the test thread drives the fake backend through ``call`` (trio.from_thread).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from supervisor.config import Config
from supervisor.control import server as control
from tests.supervisor.fake_backend import FakeBackend

T = TypeVar("T")

# Bounds the server thread's start and stop.
THREAD_TIMEOUT_S = 10.0


class ServerThread:
    def __init__(
        self,
        state_dir: Path,
        backend: FakeBackend | None = None,
        *,
        fixed_token: str | None = None,
        held: bool = False,
        **cfg: Any,
    ) -> None:
        self.backend = backend or FakeBackend()
        self.fixed_token = fixed_token
        # held: the socket is bound and published, but served only after ``release``, as
        # a daemon that is starting holds connections in its listen backlog.
        self.held = held
        self._release: trio.Event | None = None
        self.config = Config(state_dir=state_dir, port=0, **cfg)
        self.port = 0
        self.token = ""
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="control-server", daemon=True)

    def start(self) -> ServerThread:
        self.token = control.write_token(self.config.token_path)
        self._thread.start()
        if not self._started.wait(THREAD_TIMEOUT_S):
            raise RuntimeError(f"the control server did not start: {self._error!r}")
        if self._error is not None:
            raise self._error
        control.write_endpoint(self.config.endpoint_path, host=self.config.host, port=self.port)
        return self

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return control.endpoint_url(self.config.host, self.port)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a sync function on the server's loop (e.g. ``backend.emit``)."""
        return trio.from_thread.run_sync(functools.partial(fn, *args, **kwargs), trio_token=self._trio_token)

    def stop(self) -> None:
        if self._thread.is_alive() and self._scope is not None:
            try:
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._trio_token)
            except trio.RunFinishedError:
                pass
        self._thread.join(THREAD_TIMEOUT_S)
        assert not self._thread.is_alive(), "the control server thread did not stop"
        control.remove_endpoint(self.config.endpoint_path)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # handed to the test thread
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            self._trio_token = trio.lowlevel.current_trio_token()
            self.backend.nursery = nursery
            listener = None
            if self.held:
                listener = await control.open_listener(self.config.host, 0)
                self.port = listener.socket.getsockname()[1]
                self._release = trio.Event()
                self._started.set()
                try:
                    await self._release.wait()
                except BaseException:
                    listener.socket.close()  # stopped before it served
                    raise
            self.port = await nursery.start(
                functools.partial(
                    control.serve_control, self.config, self.backend, token=self.fixed_token, listener=listener
                )
            )
            self._started.set()

    def release(self) -> None:
        """A held server starts serving (its backlog's connections are then answered)."""
        assert self._release is not None, "not a held server"
        trio.from_thread.run_sync(self._release.set, trio_token=self._trio_token)
