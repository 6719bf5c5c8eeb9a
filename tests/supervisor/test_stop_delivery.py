"""A Stop pressed while the daemon is starting is delivered once it answers, not lost.

A starting daemon has bound its socket and published its endpoint but holds connections
in its listen backlog until it has found its runs again (seconds, for many runs). A
client's handshake then goes unanswered; for a stop, the client tries again (nothing was
sent) for up to ``Client.stop_delivery_s``. Real control server, real websocket, real
client; the server is held (``ServerThread(held=True)``) and released by the test.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from supervisor.cli import ExitCode, cli
from supervisor.config import JOURNAL_FILE
from supervisor.control import _pendingstops
from supervisor.control import client as client_mod
from supervisor.control.client import Client, ConnectionLost
from tests.supervisor.control_thread import ServerThread

# Bounds each wait of the test thread.
WAIT_S = 20.0


@pytest.fixture(autouse=True)
def _short_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    # A handshake left unanswered fails after this (5 s in use), so the test sees retries.
    monkeypatch.setattr(client_mod, "CONNECT_TIMEOUT_S", 0.3)


def _stop_in_thread(
    state_dir: Path, run_id: str, **client_attrs: Any
) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """``Client.cancel(run_id)`` on a thread; ``moved`` is set when it waits or ends."""
    out: dict[str, Any] = {}
    moved = threading.Event()

    def waiting(why: str) -> None:
        out["why"] = why
        moved.set()

    def stop() -> None:
        try:
            with Client(state_dir=state_dir, timeout_s=10) as c:
                c.on_stop_wait = waiting
                for name, value in client_attrs.items():
                    setattr(c, name, value)
                out["reply"] = c.cancel(run_id)
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            out["error"] = exc
        finally:
            moved.set()

    thread = threading.Thread(target=stop, name="stop", daemon=True)
    thread.start()
    return thread, out, moved


def test_a_stop_waits_for_a_starting_daemon_and_is_delivered_once_it_answers(tmp_path: Path) -> None:
    server = ServerThread(tmp_path / "state", held=True).start()
    try:
        run_id = server.backend.add_run()
        thread, out, moved = _stop_in_thread(server.config.state_dir, run_id)
        assert moved.wait(WAIT_S), "the stop neither waited nor ended"
        # Its handshake went unanswered and it said it keeps trying; nothing reached the
        # daemon yet.
        assert "error" not in out, f"the stop failed instead of waiting: {out.get('error')!r}"
        assert "still trying to deliver the stop" in out["why"]
        assert server.backend.cancels == []
        server.release()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        assert "error" not in out, out
        assert out["reply"]["was_active"] is True
        assert server.backend.cancels == [(run_id, "user")]
        assert server.backend.runs[run_id].state == "cancelled"
    finally:
        server.stop()


def test_a_stop_gives_up_after_its_bound_and_says_it_was_not_delivered(tmp_path: Path) -> None:
    server = ServerThread(tmp_path / "state", held=True).start()
    try:
        run_id = server.backend.add_run()
        thread, out, _ = _stop_in_thread(server.config.state_dir, run_id, stop_delivery_s=1.0)
        thread.join(WAIT_S)
        assert not thread.is_alive()
        assert isinstance(out.get("error"), ConnectionLost), out
        assert "the stop was not delivered" in str(out["error"])
        assert server.backend.cancels == []
    finally:
        server.stop()


def test_the_cli_says_why_a_stop_takes_time_and_delivers_it(tmp_path: Path) -> None:
    server = ServerThread(tmp_path / "state", held=True).start()
    try:
        run_id = server.backend.add_run()
        told = threading.Event()
        real = client_mod.Client._connect_for_a_stop

        def connect_and_release_once_told(self: Client) -> None:
            said = self.on_stop_wait
            assert said is not None

            def tell(why: str) -> None:
                said(why)
                if not told.is_set():
                    told.set()
                    server.release()  # the daemon has found its runs: it answers now

            self.on_stop_wait = tell
            real(self)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(client_mod.Client, "_connect_for_a_stop", connect_and_release_once_told)
            result = CliRunner().invoke(
                cli,
                ["--state-dir", str(server.config.state_dir), "cancel", run_id, "--no-wait"],
                catch_exceptions=False,
                prog_name="agentd",
            )
        assert told.is_set()
        assert result.exit_code == 0, result.output
        assert "note: the daemon has not answered yet" in result.stderr
        assert "still trying to deliver the stop" in result.stderr
        assert server.backend.cancels == [(run_id, "user")]
    finally:
        server.stop()


def test_a_daemon_started_after_the_note_that_does_not_answer_leaves_an_honest_exit_10(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No daemon: the CLI records the note, then tries once more. A daemon that started in
    # between and holds its connections (finding its runs again) made that retry raise
    # ConnectionLost: a bare "error: the daemon ... did not answer" and exit 6, though the
    # stop was on disk and that daemon may or may not have read it.
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / JOURNAL_FILE).touch()  # a state dir a daemon used
    monkeypatch.setattr(client_mod, "STOP_DELIVERY_S", 1.0)
    started: list[ServerThread] = []
    real_write = _pendingstops.write

    def write_then_a_daemon_starts(*args: Any, **kwargs: Any) -> Path:
        note = real_write(*args, **kwargs)
        started.append(ServerThread(state, held=True).start())
        return note

    monkeypatch.setattr(_pendingstops, "write", write_then_a_daemon_starts)
    try:
        res = CliRunner().invoke(cli, ["--state-dir", str(state), "--json", "cancel", "r1"], prog_name="agentd")
        (server,) = started
        assert server.backend.cancels == []  # it answered nothing
    finally:
        for s in started:
            s.stop()
    assert res.exit_code == ExitCode.STOP_PENDING, (res.exit_code, res.output)
    out = json.loads(res.stdout)
    note = Path(out["pending_stop"])
    assert note.exists() and note.parent == state / _pendingstops.DIR
    assert (out["run_id"], out["delivered"], out["pending"]) == ("r1", False, True), out
    assert (out["daemon_started"], out["note_taken"], out["sent"]) == (True, False, False), out
    assert f"recorded in {str(note)!r}" in res.stderr, res.stderr
    assert "a daemon started meanwhile did not answer" in res.stderr, res.stderr
    # That daemon applies the note at its start or, written after it read the notes, as soon
    # as it runs (``_pendingwatch``): no longer "only if it read it at its start".
    assert "it applies the note once it has found its runs again" in res.stderr, res.stderr
    assert "next start" not in res.stderr, res.stderr
    assert "check `agentd status r1`" in res.stderr, res.stderr
    assert "error:" not in res.stderr, res.stderr
