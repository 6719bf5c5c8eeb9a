"""The notify protocol against real AF_UNIX datagram sockets (path and abstract), no systemd."""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from supervisor._sdnotify import Notifier, watchdog_loop

# systemd's socket is an AF_UNIX datagram socket: Linux (and other Unixes) only.
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no AF_UNIX datagram sockets")


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"agentd-test-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    yield sock, "@" + name
    sock.close()


def recv(sock: socket.socket) -> bytes:
    return sock.recv(65536)


def assert_nothing_queued(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(65536)


@pytest.mark.parametrize("which", ["path_socket", "abstract_socket"])
def test_messages_arrive_byte_exact(which: str, request: pytest.FixtureRequest) -> None:
    sock, address = request.getfixturevalue(which)
    env = {"NOTIFY_SOCKET": address}
    with Notifier.from_env(env) as n:
        assert n.enabled
        assert n.send("READY=1", "STATUS=0 live runs")
        assert recv(sock) == b"READY=1\nSTATUS=0 live runs"
        assert n.ready(status="up")
        assert recv(sock) == b"READY=1\nSTATUS=up"
        assert n.ready()
        assert recv(sock) == b"READY=1"
        assert n.status("3 live runs")
        assert recv(sock) == b"STATUS=3 live runs"
        assert n.stopping()
        assert recv(sock) == b"STOPPING=1"
        assert n.stopping("cancelling 2 runs")
        assert recv(sock) == b"STOPPING=1\nSTATUS=cancelling 2 runs"
        assert n.watchdog()
        assert recv(sock) == b"WATCHDOG=1"
        assert n.extend_timeout(12.5)
        assert recv(sock) == b"EXTEND_TIMEOUT_USEC=12500000"
        assert n.status("caf\u00e9")
        assert recv(sock) == "STATUS=caf\u00e9".encode()
    assert_nothing_queued(sock)


def test_status_is_one_line(path_socket: tuple[socket.socket, str]) -> None:
    sock, address = path_socket
    n = Notifier(address)
    assert n.status("two\nlines\r\nhere")
    assert recv(sock) == b"STATUS=two lines here"
    n.close()


def test_without_notify_socket_everything_is_a_noop() -> None:
    n = Notifier.from_env({})
    assert not n.enabled
    assert n.send("READY=1") is False
    assert n.ready("x") is False
    assert n.stopping() is False
    assert n.status("x") is False
    assert n.watchdog_interval_s() is None
    assert Notifier.from_env({"NOTIFY_SOCKET": ""}).enabled is False


def test_send_errors_never_raise_and_log_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="supervisor._sdnotify")
    n = Notifier(str(tmp_path / "nobody-listens"))
    assert n.enabled
    assert n.send("READY=1") is False
    assert n.send("STATUS=x") is False
    assert n.stopping() is False
    n.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "nobody-listens" in warnings[0].getMessage()


def test_unsupported_address_is_off_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier("vsock:2:1234")
    assert not n.enabled
    assert n.send("READY=1") is False
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_from_env_removes_the_variables_from_os_environ(
    monkeypatch: pytest.MonkeyPatch, path_socket: tuple[socket.socket, str]
) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier.from_env()
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    assert n.watchdog_interval_s() == 1.5
    assert n.ready()
    assert recv(sock) == b"READY=1"
    n.close()


def test_from_env_can_leave_the_environment_alone(path_socket: tuple[socket.socket, str]) -> None:
    _, address = path_socket
    env = {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000"}
    Notifier.from_env(env, unset_environment=False)
    assert env == {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "1000"}


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("2000000", None, 1.0),
        ("2000000", "self", 1.0),
        ("2000000", "other", None),
        ("2000000", "junk", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(usec: str | None, pid: str | None, expected: float | None) -> None:
    env = {"NOTIFY_SOCKET": "/run/systemd/notify"}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    if pid == "self":
        env["WATCHDOG_PID"] = str(os.getpid())
    elif pid == "other":
        env["WATCHDOG_PID"] = str(os.getpid() + 1)
    elif pid is not None:
        env["WATCHDOG_PID"] = pid
    assert Notifier.from_env(env).watchdog_interval_s() == expected


def test_no_watchdog_without_a_socket() -> None:
    assert Notifier.from_env({"WATCHDOG_USEC": "2000000"}).watchdog_interval_s() is None


async def test_watchdog_loop_pings_at_half_the_interval(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    path = str(tmp_path / "notify")
    receiver = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_DGRAM)
    await receiver.bind(path)
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "8000000"})
    arrivals: list[tuple[float, bytes]] = []
    with receiver, n:
        await _collect_pings(receiver, n, arrivals)
    assert arrivals == [(0.0, b"WATCHDOG=1"), (4.0, b"WATCHDOG=1"), (8.0, b"WATCHDOG=1"), (12.0, b"WATCHDOG=1")]


async def _collect_pings(receiver: trio.socket.SocketType, n: Notifier, arrivals: list[tuple[float, bytes]]) -> None:
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        interval = await nursery.start(watchdog_loop, n)
        assert interval == 4.0
        with trio.fail_after(60):
            while len(arrivals) < 4:
                data = await receiver.recv(65536)
                arrivals.append((trio.current_time() - t0, data))
        nursery.cancel_scope.cancel()


async def test_watchdog_loop_returns_at_once_when_off(autojump_clock: trio.abc.Clock) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": "@agentd-test-unused"})
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        assert await nursery.start(watchdog_loop, n) is None
    assert trio.current_time() == t0


def test_under_journald_each_log_line_carries_its_priority(tmp_path: Path) -> None:
    import logging

    from supervisor._sdnotify import JournalFormatter, stderr_is_journal

    f = JournalFormatter()

    def line(level: int, msg: str) -> str:
        return f.format(logging.LogRecord("agentd", level, __file__, 1, msg, None, None))

    assert line(logging.WARNING, "w") == "<4>WARNING agentd: w"
    assert line(logging.ERROR, "two\nlines") == "<3>ERROR agentd: two\n<3>lines"
    assert line(logging.INFO, "i").startswith("<6>") and line(logging.DEBUG, "d").startswith("<7>")
    assert line(logging.CRITICAL, "c").startswith("<2>")
    with open(tmp_path / "stream", "w") as stream:
        st = os.fstat(stream.fileno())
        assert stderr_is_journal(stream.fileno(), {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not stderr_is_journal(stream.fileno(), {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not stderr_is_journal(stream.fileno(), {})
