"""The CLI's synchronous client against the real control server (fake backend, own thread)."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from supervisor.control import _wsclient
from supervisor.control import server as control
from supervisor.control.client import Client, ConnectionLost, Unauthorized
from supervisor.errors import ControlProtocolError, DaemonNotRunning, RunNotFound, SpawnError
from tests.supervisor.control_thread import ServerThread
from tests.supervisor.fake_backend import FakeBackend


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(tmp_path) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(state_dir=server.config.state_dir, timeout_s=10) as c:
        yield c


class RawServer:
    """One websocket connection served by wsproto's server side, on a thread.

    ``play(send)`` runs after the handshake: ``send(event)`` queues one wsproto event. The
    101 and everything queued go out in one write, so the client finds its first messages
    in the bytes that end the handshake. ``received`` collects what the client sent.
    """

    def __init__(self, play: Callable[[Callable[[Any], None]], None], *, accept_key: bytes | None = None) -> None:
        self.play = play
        self.accept_key = accept_key
        self.received: list[Any] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"ws://127.0.0.1:{self.listener.getsockname()[1]}/"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, CloseConnection, Request

        sock, _ = self.listener.accept()
        sock.settimeout(10)
        with sock:
            ws = WSConnection(ConnectionType.SERVER)
            while True:
                data = sock.recv(65536)
                ws.receive_data(data or None)
                events = list(ws.events())
                if any(isinstance(e, Request) for e in events):
                    break
            if self.accept_key is not None:  # a server that gets the handshake wrong
                sock.sendall(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Accept: " + self.accept_key + b"\r\n\r\n"
                )
                return
            out = bytearray(ws.send(AcceptConnection()))
            self.play(lambda event: out.extend(ws.send(event)))
            sock.sendall(out)
            while True:  # record what the client answers, until it closes
                try:
                    data = sock.recv(65536)
                except OSError:
                    return
                ws.receive_data(data or None)
                for event in ws.events():
                    self.received.append(event)
                    if isinstance(event, CloseConnection):
                        return
                if not data:
                    return

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def test_pings_are_answered_and_fragments_and_binary_messages_arrive_whole() -> None:
    from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage

    def play(send: Callable[[Any], None]) -> None:
        send(Ping(payload=b"are you there"))
        send(TextMessage(data="hel", message_finished=False))
        send(TextMessage(data="lo", message_finished=True))
        send(BytesMessage(data="wö".encode()[:2], message_finished=False))  # a character split in two
        send(BytesMessage(data="wörld".encode()[2:], message_finished=True))
        send(CloseConnection(code=1001, reason="going away"))

    server = RawServer(play)
    try:
        ws = _wsclient.WebSocket.connect(server.url, {}, 10)
        assert ws.recv_text(10) == "hello"
        assert ws.recv_text(10) == "wörld"
        with pytest.raises(ConnectionLost) as info:
            ws.recv_text(10)
        assert "(1001: going away)" in str(info.value) and ws.closed
    finally:
        server.close()
    kinds = [type(e) for e in server.received]
    assert kinds == [Pong, CloseConnection]
    assert server.received[0].payload == b"are you there"
    assert server.received[1].code == 1001  # the close was answered


def test_a_message_over_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from wsproto.events import TextMessage

    monkeypatch.setattr(_wsclient, "MAX_FRAME_BYTES", 8)
    server = RawServer(lambda send: send(TextMessage(data="x" * 9)))
    try:
        ws = _wsclient.WebSocket.connect(server.url, {}, 10)
        with pytest.raises(ConnectionLost) as info:
            ws.recv_text(10)
        assert "at most 8 bytes" in str(info.value) and ws.closed
    finally:
        server.close()


def test_a_bad_accept_token_fails_the_handshake() -> None:
    server = RawServer(lambda send: None, accept_key=b"AAAAAAAAAAAAAAAAAAAAAAAAAAA=")
    try:
        with pytest.raises(ConnectionLost) as info:
            _wsclient.WebSocket.connect(server.url, {}, 10)
        assert "bad Sec-WebSocket-Accept" in str(info.value)
    finally:
        server.close()


def test_ops_round_trip_through_the_real_server(server: ServerThread, client: Client) -> None:
    assert client.ping()["pong"] is True
    spawned = client.spawn({"task": "hi"}, session_id="s1", timeout_s=9)
    run_id = spawned["run_id"]
    assert client.status(run_id)["state"] == "running"
    assert [r["run_id"] for r in client.list_runs(session_id="s1")] == [run_id]
    assert client.status()["live_runs"][0]["run_id"] == run_id
    assert [e["seq"] for e in client.events(run_id)] == [1]
    assert client.cancel(run_id) == {"run_id": run_id, "was_active": True, "state": "cancelled"}
    assert client.cancel(run_id)["was_active"] is False
    assert server.backend.spawns == [{"spec": {"task": "hi"}, "session_id": "s1", "timeout_s": 9.0}]


def test_a_spawn_key_and_a_list_by_key_reach_the_backend_and_only_when_given(tmp_path: Path) -> None:
    class Keyed(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.keys: list[tuple[str, str | None]] = []

        async def spawn(self, spec: dict[str, Any], **kw: Any) -> dict[str, Any]:
            self.keys.append(("spawn", kw.pop("key", None)))
            return await super().spawn(spec, **kw)

        async def list_runs(self, **kw: Any) -> list[dict[str, Any]]:
            self.keys.append(("list", kw.pop("key", None)))
            return await super().list_runs(**kw)

    backend = Keyed()
    with ServerThread(tmp_path, backend) as srv, Client(state_dir=srv.config.state_dir, timeout_s=10) as c:
        c.spawn({"task": "t"}, key="f-1")
        c.spawn({"task": "t"})
        c.list_runs(key="f-1")
        c.list_runs()
    assert backend.keys == [("spawn", "f-1"), ("spawn", None), ("list", "f-1"), ("list", None)]


def test_cancel_many_is_one_request_and_answers_each_run_in_order(tmp_path: Path) -> None:
    class Many(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            self.bulk: list[list[str]] = []

        async def cancel_many(self, run_ids: list[str], *, reason: str = "user") -> list[dict[str, Any]]:
            self.bulk.append(list(run_ids))
            out: list[dict[str, Any]] = []
            for run_id in run_ids:
                try:
                    out.append(await self.cancel(run_id, reason=reason))
                except RunNotFound as exc:
                    out.append({"run_id": run_id, "error": {"code": "not_found", "message": str(exc)}})
            return out

    backend = Many()
    with ServerThread(tmp_path, backend) as srv, Client(state_dir=srv.config.state_dir, timeout_s=10) as c:
        ids = [c.spawn({"task": f"t{i}"})["run_id"] for i in range(3)]
        out = c.cancel_many([ids[2], "r-missing", ids[0]], reason="stop_all")
        assert backend.bulk == [[ids[2], "r-missing", ids[0]]]  # one request for them all
        assert out["was_active"] is True
        assert [r["run_id"] for r in out["runs"]] == [ids[2], "r-missing", ids[0]]
        assert out["runs"][0]["state"] == "cancelled" and out["runs"][1]["error"]["code"] == "not_found"
        assert c.status(ids[1])["state"] == "running"


def test_cancel_many_on_a_backend_without_it_cancels_each_run(server: ServerThread, client: Client) -> None:
    ids = [client.spawn({"task": f"t{i}"})["run_id"] for i in range(3)]
    out = client.cancel_many([*ids, "r-missing"])
    assert [r.get("state") for r in out["runs"]] == ["cancelled"] * 3 + [None]
    assert out["runs"][3] == {
        "run_id": "r-missing",
        "error": {"code": "not_found", "message": "no run with id 'r-missing'"},
    }
    assert sorted(server.backend.cancels) == sorted((r, "user") for r in ids)


def test_cancel_many_falls_back_to_a_cancel_per_run_on_a_daemon_without_run_ids(
    server: ServerThread, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor import protocol

    def old_cancel(rid: Any, obj: Any) -> Any:  # a daemon from before run_ids
        if "run_id" not in obj and "session_id" not in obj:
            raise protocol._Bad(protocol.ErrorCode.BAD_ARGS, "expected exactly one of 'run_id' or 'session_id'")
        return protocol.CancelRequest(rid, obj.get("run_id"), obj.get("session_id"), obj.get("reason") or "user")

    monkeypatch.setitem(protocol._PARSERS, protocol.Op.CANCEL, old_cancel)
    ids = [client.spawn({"task": f"t{i}"})["run_id"] for i in range(2)]
    out = client.cancel_many(ids)
    assert [r["state"] for r in out["runs"]] == ["cancelled", "cancelled"] and out["was_active"] is True
    assert sorted(server.backend.cancels) == sorted((r, "user") for r in ids)


def test_a_session_cancel_naming_its_turn_on_a_daemon_from_before_turns_stops_nothing_and_says_so(
    server: ServerThread, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from supervisor import protocol

    def old_cancel(rid: Any, obj: Any) -> Any:  # a daemon from before a turn could be named
        named = [obj.get("run_id"), obj.get("session_id"), obj.get("run_ids")]
        if named.count(None) != 2:
            raise protocol._Bad(
                protocol.ErrorCode.BAD_ARGS, "expected exactly one of 'run_id', 'session_id' or 'run_ids'"
            )
        return protocol.CancelRequest(rid, obj.get("run_id"), obj.get("session_id"), obj.get("reason") or "user")

    monkeypatch.setitem(protocol._PARSERS, protocol.Op.CANCEL, old_cancel)
    live = server.call(server.backend.add_run, session_id="s1")
    with pytest.raises(ControlProtocolError) as refused:
        client.cancel_session("s1", turn="r-ended")
    assert refused.value.code == "unsupported" and "nothing was stopped" in str(refused.value)
    assert server.backend.cancels == []
    assert client.cancel_session("s1")["runs"][0]["run_id"] == live  # without a turn, as before


def test_errors_arrive_as_typed_exceptions(client: Client) -> None:
    with pytest.raises(RunNotFound) as nf:
        client.status("r-missing")
    assert nf.value.run_id == "r-missing"
    with pytest.raises(SpawnError):
        client.spawn({"task": " "})
    with pytest.raises(ControlProtocolError) as bad:
        client.request("teleport")
    assert bad.value.code == "unknown_op"
    assert client.ping()["pong"] is True  # the same connection still works


def test_a_10_mb_request_gets_a_too_large_reply(client: Client) -> None:
    with pytest.raises(ControlProtocolError) as info:
        client.spawn({"task": "x" * (10 * 1024 * 1024)})
    assert info.value.code == "too_large"
    assert client.ping()["pong"] is True


def test_iter_events_pages_through_a_long_journal(server: ServerThread, client: Client) -> None:
    run = server.call(server.backend.add_run)
    for _ in range(2500):
        server.call(server.backend.emit, run, "log", {})
    assert [e["seq"] for e in client.iter_events(run, after_seq=5)] == list(range(6, 2502))


def test_follow_replays_then_follows_live_until_the_end(server: ServerThread, client: Client) -> None:
    b = server.backend
    run = server.call(b.add_run)
    server.call(b.emit, run, "log", {"n": 1})
    follow = client.follow(run)
    seqs = []
    for event in follow:
        seqs.append(event["seq"])
        assert event["run_id"] == run
        if event["seq"] == 2:
            server.call(b.emit, run, "log", {"n": 2})
        elif event["seq"] == 3:
            server.call(b.finish, run, "completed")
    assert seqs == [1, 2, 3, 4]
    assert follow.state == "completed" and follow.last_seq == 4 and follow.reconnects == 0


def test_follow_resumes_after_a_dropped_connection_without_gaps_or_duplicates(
    server: ServerThread, client: Client
) -> None:
    b = server.backend
    run = server.call(b.add_run)
    for _ in range(3):
        server.call(b.emit, run, "log", {})
    follow = client.follow(run)
    seqs = []
    for event in follow:
        seqs.append(event["seq"])
        if event["seq"] == 2:
            assert follow._ws is not None
            follow._ws._sock.shutdown(socket.SHUT_RDWR)  # the network drops us
            server.call(b.emit, run, "log", {})  # seq 5, while we are away
        if event["seq"] == 5:
            server.call(b.finish, run, "completed")
    assert seqs == [1, 2, 3, 4, 5, 6]
    assert follow.reconnects == 1 and follow.state == "completed"
    assert b.cancels == []


def test_follow_survives_a_daemon_restart_on_a_new_port(tmp_path: Path) -> None:
    backend = FakeBackend()
    first = ServerThread(tmp_path, backend).start()
    second: ServerThread | None = None
    try:
        run = first.call(backend.add_run)
        seqs = []
        follow = Client(state_dir=tmp_path).follow(run)
        for event in follow:
            seqs.append(event["seq"])
            if event["seq"] == 1:
                first.stop()
                second = ServerThread(tmp_path, backend).start()  # new port, new token
                second.call(backend.emit, run, "log", {})
                second.call(backend.finish, run, "failed")
        assert seqs == [1, 2, 3] and follow.state == "failed" and follow.reconnects == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_follow_gives_up_after_the_reconnect_timeout(server: ServerThread, client: Client) -> None:
    run = server.call(server.backend.add_run)
    follow = client.follow(run, reconnect_timeout_s=0.3)
    with pytest.raises(ConnectionLost) as info:
        for _event in follow:
            server.stop()
    assert "could not reconnect" in str(info.value) and "last event seen: 1" in str(info.value)


def test_following_an_unknown_run_raises_at_once(client: Client) -> None:
    with pytest.raises(RunNotFound):
        list(client.follow("r-nope"))


def test_a_long_lived_client_survives_a_daemon_restart_for_reads_but_not_for_spawns(tmp_path: Path) -> None:
    backend = FakeBackend()
    with ServerThread(tmp_path, backend) as first:
        client = Client(state_dir=tmp_path)
        run = first.call(backend.add_run)
        assert client.status(run)["state"] == "running"
    with ServerThread(tmp_path, backend):  # restarted: new port, new token
        assert client.status(run)["state"] == "running"  # reconnected transparently
        client.close()
        client.connect()
    with ServerThread(tmp_path, backend):
        with pytest.raises(ConnectionLost):
            client.spawn({"task": "maybe twice"})  # not resent: it may have been acted on
        assert client.spawn({"task": "once"})["run_id"]
        client.close()


# --------------------------------------------------------------------------- finding the daemon


def test_no_endpoint_file_means_no_daemon_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(DaemonNotRunning) as info:
        Client(state_dir=tmp_path).ping()
    assert "agentd serve" in str(info.value) and str(tmp_path) in str(info.value)


def test_an_endpoint_of_a_dead_process_is_stale(tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    control.write_token(tmp_path / "token")
    control.write_endpoint(tmp_path / "daemon.json", host="127.0.0.1", port=1, pid=dead_pid)
    with pytest.raises(DaemonNotRunning) as info:
        Client(state_dir=tmp_path).ping()
    assert "stale" in str(info.value) and str(dead_pid) in str(info.value)


def test_an_endpoint_where_nothing_listens_means_no_daemon(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    control.write_token(tmp_path / "token")
    control.write_endpoint(tmp_path / "daemon.json", host="127.0.0.1", port=port, pid=os.getpid())
    with pytest.raises(DaemonNotRunning) as info:
        Client(state_dir=tmp_path).ping()
    assert "nothing answers" in str(info.value) and "agentd serve" in str(info.value)


def test_a_wrong_token_is_refused(server: ServerThread) -> None:
    with pytest.raises(Unauthorized) as info:
        Client(server.url, "wrong-token").ping()
    assert info.value.status == 401 and "wrong token" in str(info.value)


def test_the_client_module_imports_neither_trio_nor_openai_nor_mcp() -> None:
    code = (
        "import sys, supervisor.control.client; "
        "print(sorted(m for m in ('trio', 'trio_websocket', 'openai', 'mcp', 'httpx2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_daemon_that_takes_the_connection_and_drops_it_is_not_called_absent(tmp_path: Path) -> None:
    # A daemon at its connection limit accepts and resets: "no daemon is running" would
    # send its user to start a second one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        control.write_token(tmp_path / "token")
        control.write_endpoint(tmp_path / "daemon.json", host="127.0.0.1", port=port, pid=os.getpid())

        def reset_one() -> None:
            conn, _ = s.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST

        t = threading.Thread(target=reset_one)
        t.start()
        try:
            with pytest.raises(ConnectionLost) as info:
                Client(state_dir=tmp_path).ping()
        finally:
            t.join(10)
    assert "connection limit" in str(info.value) and not isinstance(info.value, DaemonNotRunning)


def test_a_request_that_waits_for_a_stop_gets_the_daemons_stop_wait_on_top_of_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `spawn --interrupt` and `session close` are answered once the session's live turn
    # has ended: up to the grace and a margin. With a grace of 35 s the CLI gave up at its
    # 30 s and said "timed out" while the daemon went on and did it.
    monkeypatch.setattr(control, "STOP_WAIT_MARGIN_S", 0.5)
    with ServerThread(tmp_path / "state", grace_s=0.5) as srv:

        async def close_session(session_id: str) -> dict[str, Any]:
            await trio.sleep(0.6 if session_id == "s-1" else 30)  # the daemon's wait for the turn to end
            return {"session_id": session_id, "was_open": True, "stopped": [], "profile_removed": False}

        srv.backend.close_session = close_session  # type: ignore[method-assign]
        with Client(state_dir=srv.config.state_dir, timeout_s=0.3) as c:
            assert c.ping()["stop_wait_s"] == 1.0
            assert c.close_session("s-1")["was_open"] is True  # past 0.3 s, within 0.3 + 1.0
            with pytest.raises(ConnectionLost) as info:
                c.close_session("s-2")  # past it: lost, and it says the request had gone out
            assert info.value.sent is True
