"""The stop marker (``subagent.stopmark``): the daemon's write reaches the descriptor the
runner opened before its sandbox; no marker, no write; what it holds is one word or a client's reason as a json string."""

from __future__ import annotations

import os
from pathlib import Path

from subagent.stop import StopControl
from subagent.stopmark import make_marker, marker_path, open_marker, read_marker, write_marker


def test_the_daemons_write_reaches_the_runners_descriptor(tmp_path: Path) -> None:
    run_dir = tmp_path / "t-0123456789abcdef"
    run_dir.mkdir()
    make_marker(run_dir)
    fd = open_marker(run_dir)
    assert fd is not None
    try:
        assert read_marker(fd) is None  # made empty: no stop yet
        assert write_marker(run_dir, "user")
        assert read_marker(fd) == "user"
        assert write_marker(run_dir, "shutdown")  # a later write replaces it, same file
        assert read_marker(fd) == "shutdown"
        # A client's reason that is not a word is the client's still: it was "stop".
        assert write_marker(run_dir, "User-Request: not now\nuser ☃")
        assert read_marker(fd) == "User-Request: not now\nuser ☃"
        assert b"\n" not in marker_path(run_dir).read_bytes().rstrip(b"\n")  # one line
        assert write_marker(run_dir, "x" * 300)  # cut at the protocol's 256
        assert read_marker(fd) == "x" * 256
        # The longest a reason can be written: 256 characters outside the BMP (each two
        # \u escapes): read back whole, not cut short and taken for 'stop'.
        assert write_marker(run_dir, "\U0001f600" * 256)
        assert read_marker(fd) == "\U0001f600" * 256
        marker_path(run_dir).write_text("not json\n")  # what no daemon writes
        assert read_marker(fd) == "stop"
    finally:
        os.close(fd)
    assert marker_path(run_dir).name == "t-0123456789abcdef.stop"


def test_without_a_marker_nothing_is_written_or_opened(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert open_marker(run_dir) is None and open_marker(None) is None
    assert write_marker(run_dir, "user") is False
    assert not marker_path(run_dir).exists()  # never created by the write


async def test_a_signals_sender_is_looked_up_when_its_stop_is_applied() -> None:
    # A SIGTERM noted while a tool is being started is applied once it has started: the
    # sender is looked up then (after the signal came), once; the first reason wins.
    looked: list[str] = []
    first: list[str] = []

    def resolve(reason: str) -> str:
        looked.append(reason)
        return "signalled" if reason == "signal" else reason

    stop = StopControl(on_first_stop=lambda reason, during: first.append(reason), resolve=resolve)
    with stop.starting():
        stop.note_signal()
        assert looked == [] and stop.reason is None
    assert (stop.reason, first, looked) == ("signalled", ["signalled"], ["signal"])
    stop.request("timeout")
    assert (stop.reason, first, looked) == ("signalled", ["signalled"], ["signal"])
