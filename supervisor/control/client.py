"""A small synchronous client for the control socket: what the ``agentd`` CLI uses.

No trio: the websocket is ``_wsclient``, a blocking socket driven by ``h11`` and
``wsproto``. The daemon is found through its state dir:
the endpoint file (where it listens, its pid) and the 0600 token file.

``Client.follow`` subscribes to a run's events and, when the connection drops, reconnects
(re-reading the endpoint, the daemon may have restarted) and resumes after the last
sequence number it yielded: every event once, in order. Leaving never cancels the run.

Size: one method per control operation (STYLE §5), each a few lines over one request
helper; splitting them would split the one client the CLI imports.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

from supervisor import protocol
from supervisor.control._statefiles import ENDPOINT_FILE, TOKEN_FILE, default_state_dir, read_endpoint, read_token
from supervisor.control._wsclient import ConnectionLost, Unauthorized, WebSocket
from supervisor.errors import AgentdError, ControlProtocolError, DaemonNotRunning

__all__ = ["Client", "Follow", "ConnectionLost", "Unauthorized", "locate", "START_HINT"]

START_HINT: Final = "start one with `agentd serve` or `systemctl start agentd`"

# Bounds connecting and the opening handshake.
CONNECT_TIMEOUT_S: Final = 5.0
# Bounds one request's round trip (a spawn included: it returns once the run is queued).
REQUEST_TIMEOUT_S: Final = 30.0
# How long follow() keeps trying to reconnect after the connection drops.
RECONNECT_TIMEOUT_S: Final = 30.0
# How long a stop (``cancel``, ``cancel_session``, ``cancel_many``) keeps trying to reach a
# daemon that takes its connection but does not answer the handshake: one that is starting
# (it holds connections in its listen backlog until it has found its runs again, which for
# many runs takes seconds) or at its connection limit. Nothing was sent, so trying again
# is safe; a person who pressed Stop should not have to press it again.
STOP_DELIVERY_S: Final = 60.0
# Requests that change nothing: safe to send again after a dropped connection.
_READ_ONLY_OPS: Final = frozenset({"status", "list", "events", "ping", "history", "sessions"})
# Backoff between reconnect attempts: first at once, then doubling up to the cap.
RECONNECT_BACKOFF_S: Final = (0.0, 0.1, 0.2, 0.5, 1.0, 2.0)
# Requests a pipelined call (``spawn_many``) keeps unanswered at once on its connection:
# the daemon serves up to 32 of one connection's requests at a time (``Limits.in_flight``)
# and reads the next once one is done, so more would only wait in the socket's buffers.
PIPELINE_WINDOW: Final = 32
# Run ids per ``cancel`` request of ``cancel_many`` (well under the protocol's maximum
# and the daemon's message size).
CANCEL_CHUNK: Final = 2000


# ----------------------------------------------------------------------------- locating


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # os.kill(pid, 0) would TerminateProcess there; let the connect decide
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def locate(state_dir: Path | str | None = None) -> tuple[str, str]:
    """The daemon's URL and token, from its state dir.

    Raises:
        DaemonNotRunning: no endpoint file, or it names a dead process.
        Unauthorized: the token file cannot be read (another user's daemon).
    """
    sd = Path(state_dir) if state_dir is not None else default_state_dir()
    endpoint_path = sd / ENDPOINT_FILE
    try:
        info = read_endpoint(endpoint_path)
    except FileNotFoundError:
        raise DaemonNotRunning(str(sd), START_HINT) from None
    except (OSError, ValueError) as exc:
        raise DaemonNotRunning(str(sd), f"cannot read {str(endpoint_path)!r}: {exc}; {START_HINT}") from exc
    pid = info.get("pid")
    if isinstance(pid, int) and pid > 0 and not _pid_alive(pid):
        raise DaemonNotRunning(str(sd), f"stale endpoint file: pid {pid} is gone; {START_HINT}")
    token_path = sd / TOKEN_FILE
    try:
        token = read_token(token_path)
    except PermissionError:
        raise Unauthorized(0, f"cannot read the token file {str(token_path)!r}: permission denied") from None
    except (OSError, ValueError) as exc:
        raise DaemonNotRunning(str(sd), f"cannot read the token file {str(token_path)!r}: {exc}") from exc
    return str(info["url"]), token


# ----------------------------------------------------------------------------- client


class Client:
    """A connection to the daemon, opened on first use. Methods mirror the control ops.

    Every method raises ``DaemonNotRunning`` when no daemon can be reached,
    ``RunNotFound`` for an unknown run, ``SpawnError`` for a refused spec,
    ``ConnectionLost`` when the connection breaks, and ``ControlProtocolError`` for any
    other error reply (its ``code`` says which).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        state_dir: Path | str | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self._url = url
        self._token = token
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.timeout_s = timeout_s
        self.stop_delivery_s = STOP_DELIVERY_S
        # Called once when a stop has to wait for the daemon to answer (the CLI says so).
        self.on_stop_wait: Callable[[str], None] | None = None
        self._ws: WebSocket | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def _open(self) -> WebSocket:
        if self._url is not None and self._token is not None:
            url, token = self._url, self._token
        else:
            url, token = locate(self.state_dir)
        try:
            return WebSocket.connect(url, {"Authorization": f"Bearer {token}"}, CONNECT_TIMEOUT_S)
        except ConnectionRefusedError as exc:
            raise DaemonNotRunning(
                str(self.state_dir), f"nothing answers at {url} ({exc.strerror}); {START_HINT}"
            ) from exc
        except (ConnectionResetError, TimeoutError) as exc:
            # Something took the connection: a daemon that is up but would not serve it
            # (at its connection limit, or too busy), not a daemon that is not running.
            how = (
                "closed the connection at once"
                if isinstance(exc, ConnectionResetError)
                else (f"did not answer within {CONNECT_TIMEOUT_S} s")
            )
            raise ConnectionLost(
                f"the daemon at {url} {how}: it may be starting (finding its runs again after a restart), "
                "at its connection limit or too busy; try again"
            ) from exc
        except OSError as exc:
            raise DaemonNotRunning(str(self.state_dir), f"cannot connect to {url}: {exc}") from exc

    def connect(self) -> None:
        if self._ws is None or self._ws.closed:
            self._ws = self._open()

    def _connect_for_a_stop(self) -> None:
        """Connect, trying again for up to ``stop_delivery_s`` while the daemon takes the
        connection and leaves its handshake unanswered (``ConnectionLost`` from the
        connect: nothing sent). No daemon at all (``DaemonNotRunning``) or a refused token
        still fail at once."""
        deadline = time.monotonic() + self.stop_delivery_s
        waits = itertools.chain(RECONNECT_BACKOFF_S, itertools.repeat(RECONNECT_BACKOFF_S[-1]))
        told = False
        while True:
            try:
                self.connect()
                return
            except ConnectionLost as exc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectionLost(
                        f"{exc} (tried for {self.stop_delivery_s:g} s: the stop was not delivered)"
                    ) from exc
                if not told and self.on_stop_wait is not None:
                    told = True
                    self.on_stop_wait(
                        f"the daemon has not answered yet ({exc}); "
                        f"still trying to deliver the stop, for up to {self.stop_delivery_s:g} s"
                    )
                time.sleep(min(next(waits), remaining))

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and return its result.

        A read-only request (status, list, events, ping) that finds its connection dropped
        since the last use (a daemon restart) is sent once more on a fresh one; spawn and
        cancel are not, since the daemon may have acted on them.

        Raises:
            see the class docstring.
        """
        reused = self._ws is not None and not self._ws.closed
        try:
            return self._request_once(op, args)
        except ConnectionLost:
            if not reused or op not in _READ_ONLY_OPS:
                raise
        return self._request_once(op, args)

    def _request_once(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        self.connect()
        assert self._ws is not None
        ws = self._ws
        rid = next(self._ids)
        sent = False
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            ws.send_text(protocol.encode_request(rid, op, **args))
            sent = True
            deadline = time.monotonic() + timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectionLost(f"no reply to {op!r} within {timeout_s:g} s")
                msg = protocol.decode_server_message(ws.recv_text(remaining))
                if msg.get("id") != rid or "ok" not in msg:
                    continue  # a pushed message or a stale reply
                if msg["ok"] is True:
                    return _object_result(op, msg.get("result"))
                raise protocol.error_from_reply(msg.get("error"), run_id=args.get("run_id"))
        except ConnectionLost as exc:
            self.close()
            exc.sent = sent
            raise

    def ping(self) -> dict[str, Any]:
        return self.request("ping")

    def _waits_for_a_stop(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A request the daemon answers only once a stop has ended (a session's live turn,
        for ``spawn`` with ``interrupt`` and ``session_close``): up to its grace and a
        margin (``stop_wait_s`` from ``ping``), which the reply timeout covers too. A
        timeout then did not mean that nothing was done: the daemon went on with it."""
        wait = self.ping().get("stop_wait_s")
        extra = float(wait) if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0 else 0.0
        return self._request_once(op, args, self.timeout_s + extra)

    def spawn(
        self,
        spec: dict[str, Any],
        *,
        session_id: str | None = None,
        timeout_s: float | None = None,
        model_key: str | None = None,
        interrupt: bool = False,
        key: str | None = None,
    ) -> dict[str, Any]:
        """Start a run. ``model_key``: this run's model API key, handed to its runner only
        (never journaled); the daemon's own ``OPENAI_API_KEY`` is used without it. With a
        session, ``interrupt`` stops the session's live turn first (else a session with a
        live turn refuses the new one: ``ControlProtocolError`` coded ``session_busy``).
        ``key``: an idempotency key; a spawn whose key already made a run returns that
        run (``"existing": true``) and starts nothing, so a spawn whose answer was lost
        may be sent again with its key."""
        args = {
            "spec": spec,
            "session_id": session_id,
            "timeout_s": timeout_s,
            "model_key": model_key,
            "interrupt": interrupt or None,
            "key": key,
        }
        if interrupt:
            return self._waits_for_a_stop("spawn", args)
        return self.request("spawn", **args)

    def spawn_many(
        self,
        specs: list[dict[str, Any]],
        *,
        timeout_s: float | None = None,
        model_key: str | None = None,
    ) -> list[dict[str, Any] | AgentdError]:
        """Start a run per spec, the requests pipelined on one connection (a burst pays
        one connection and no round trip per run). The daemon serves them concurrently.
        No session argument: a session runs one turn at a time (a spec may name its own).

        Returns, in the order of ``specs``, each spawn's result or the error it got
        (``SpawnError`` for a refused spec; ``ConnectionLost`` for every request left
        unanswered when the connection broke: those may or may not have started).

        Raises:
            DaemonNotRunning: no daemon to connect to (nothing was sent).
        """
        args = [{"spec": spec, "timeout_s": timeout_s, "model_key": model_key} for spec in specs]
        return self._request_pipelined("spawn", args)

    def _request_pipelined(self, op: str, args: list[dict[str, Any]]) -> list[Any]:
        """Send ``op`` once per ``args`` entry, at most ``PIPELINE_WINDOW`` unanswered at a
        time; each result or error in order. Never resent (see ``request``)."""
        self.connect()
        assert self._ws is not None
        ws = self._ws
        out: list[Any] = [None] * len(args)
        waiting: dict[int, int] = {}  # request id -> its index in args
        sent = 0
        try:
            while sent < len(args) or waiting:
                while sent < len(args) and len(waiting) < PIPELINE_WINDOW:
                    rid = next(self._ids)
                    ws.send_text(protocol.encode_request(rid, op, **args[sent]))
                    waiting[rid] = sent
                    sent += 1
                # Bounds the wait for the next reply, not the whole call.
                msg = protocol.decode_server_message(ws.recv_text(self.timeout_s))
                reply_id = msg.get("id")
                if not isinstance(reply_id, int) or reply_id not in waiting or "ok" not in msg:
                    continue  # a pushed message or a stale reply
                i = waiting.pop(reply_id)
                if msg["ok"] is True:
                    out[i] = _object_result(op, msg.get("result"))
                else:
                    out[i] = protocol.error_from_reply(msg.get("error"), run_id=args[i].get("run_id"))
        except ConnectionLost as exc:
            self.close()
            for i in waiting.values():
                out[i] = exc
            for i in range(sent, len(args)):
                out[i] = ConnectionLost(f"not sent: the connection to the daemon broke first ({exc})")
        return out

    def cancel(self, run_id: str, *, reason: str = "user") -> dict[str, Any]:
        """Stop a run. A daemon that takes the connection but does not answer yet (starting,
        finding its runs again) is waited for, up to ``stop_delivery_s``."""
        self._connect_for_a_stop()
        return self.request("cancel", run_id=run_id, reason=reason)

    def cancel_session(self, session_id: str, *, reason: str = "user", turn: str | None = None) -> dict[str, Any]:
        """Cancel the session's live turn (a session has one at a time).

        Without ``turn``, the turn live when the cancel arrives is stopped, whichever it
        is: a Stop meant for turn 1 that arrives after turn 2 started stops turn 2. Give
        ``turn`` (the run id of the turn meant, as ``history`` and ``sessions`` name it)
        and only that turn is ever stopped: once it has ended nothing is, and the reply
        says so (``was_active`` false, ``runs`` that turn with its terminal state,
        ``live_run`` the session's live turn now, or None).

        Raises:
            ControlProtocolError: ``unsupported``, the daemon is older than ``turn`` (it
                refused the request: nothing was stopped); ``bad_args``, ``turn`` is not a
                turn of this session.
        """
        self._connect_for_a_stop()
        try:
            return self.request("cancel", session_id=session_id, run_id=turn, reason=reason)
        except ControlProtocolError as exc:
            if turn is None or exc.code != protocol.ErrorCode.BAD_ARGS or "exactly one of" not in str(exc):
                raise
            raise ControlProtocolError(
                protocol.ErrorCode.UNSUPPORTED,
                f"the daemon cannot cancel a session's turn by its id (it is older than that): nothing was stopped; "
                f"cancel the run itself (agentd cancel {turn})",
            ) from exc

    def cancel_many(self, run_ids: list[str], *, reason: str = "user") -> dict[str, Any]:
        """Cancel many runs at once: one ``cancel`` naming them all (``run_ids``; a very
        long list in a few), so the daemon sends every run its stop before it journals
        any. (A daemon that does not know ``run_ids`` gets a ``cancel`` per run, every
        request sent before any reply is read.)

        Returns ``{"was_active", "runs": [each cancel's result or {"run_id", "error"}]}``.

        Raises:
            ConnectionLost: the connection broke (some stops may have been sent).
        """
        if not run_ids:
            return {"was_active": False, "runs": []}
        self._connect_for_a_stop()
        chunks = [run_ids[i : i + CANCEL_CHUNK] for i in range(0, len(run_ids), CANCEL_CHUNK)]
        replies = self._request_pipelined("cancel", [{"run_ids": chunk, "reason": reason} for chunk in chunks])
        runs: list[dict[str, Any]] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, ConnectionLost):
                raise reply
            if isinstance(reply, AgentdError) and getattr(reply, "code", None) == protocol.ErrorCode.BAD_ARGS:
                return self._cancel_each(run_ids, reason)  # a daemon from before run_ids
            if isinstance(reply, AgentdError):
                runs.extend(
                    {"run_id": r, "error": {"code": str(getattr(reply, "code", "refused")), "message": str(reply)}}
                    for r in chunk
                )
            else:
                runs.extend(reply["runs"])
        return {"was_active": any(r.get("was_active") for r in runs), "runs": runs}

    def _cancel_each(self, run_ids: list[str], reason: str) -> dict[str, Any]:
        """A ``cancel`` per run, every request sent before any reply is read."""
        self.connect()
        assert self._ws is not None
        ws = self._ws
        ids = {next(self._ids): run_id for run_id in run_ids}
        try:
            for rid, run_id in ids.items():
                ws.send_text(protocol.encode_request(rid, "cancel", run_id=run_id, reason=reason))
            out: dict[str, dict[str, Any]] = {}
            deadline = time.monotonic() + self.timeout_s
            while len(out) < len(ids):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConnectionLost(
                        f"no reply to {len(ids) - len(out)} of {len(ids)} cancels within {self.timeout_s} s"
                    )
                msg = protocol.decode_server_message(ws.recv_text(remaining))
                reply_id = msg.get("id")
                if reply_id not in ids or "ok" not in msg:
                    continue
                if msg["ok"] is True:
                    out[ids[reply_id]] = _object_result("cancel", msg.get("result"))
                else:
                    out[ids[reply_id]] = {"run_id": ids[reply_id], "error": msg.get("error")}
        except ConnectionLost:
            self.close()
            raise
        runs = [out[r] for r in run_ids]
        return {"was_active": any(r.get("was_active") for r in runs), "runs": runs}

    def steer(self, run_id: str, text: str) -> dict[str, Any]:
        """Extra input for a running turn: ``{"run_id", "accepted", "state"}``."""
        return self.request("steer", run_id=run_id, text=text)

    def approve(self, run_id: str, call_id: str) -> dict[str, Any]:
        """Let a call awaiting approval run: ``{"run_id", "call_id", "decision", "state"}``."""
        return self.request("approve", run_id=run_id, call_id=call_id)

    def deny(self, run_id: str, call_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Refuse a call awaiting approval; the model is told "denied by the user: REASON"."""
        return self.request("deny", run_id=run_id, call_id=call_id, reason=reason)

    def history(
        self,
        session_id: str,
        *,
        before_turn: int | None = None,
        after_turn: int | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """A session's transcript (its turns, and the history its next turn would get):
        one page of it, the newest turns that fit unless a cursor says otherwise
        (``docs/control-protocol.md``, Sessions)."""
        return self.request(
            "history", session_id=session_id, before_turn=before_turn, after_turn=after_turn, max_bytes=max_bytes
        )

    def history_pages(self, session_id: str, *, max_bytes: int | None = None) -> Iterator[dict[str, Any]]:
        """A session's whole transcript, page after page, oldest turns first: one reply if
        it fits (a daemon that does not page says nothing of ``complete``: it did)."""
        page = self.history(session_id, max_bytes=max_bytes)
        if page.get("complete", True):
            yield page
            return
        after = 0
        while True:
            page = self.history(session_id, after_turn=after, max_bytes=max_bytes)
            yield page
            turns = page.get("turns") or []
            if not page.get("more") or not turns:
                return
            after = int(turns[-1]["turn"])

    def sessions(self, *, limit: int = protocol.DEFAULT_LIST_LIMIT) -> list[dict[str, Any]]:
        return _list_in(self.request("sessions", limit=limit), "sessions")

    def close_session(self, session_id: str) -> dict[str, Any]:
        """Stop the session's live turn, remove its browser profile; it takes no new turn."""
        return self._waits_for_a_stop("session_close", {"session_id": session_id})

    def status(self, run_id: str | None = None) -> dict[str, Any]:
        return self.request("status", run_id=run_id)

    def list_runs(
        self,
        *,
        limit: int = protocol.DEFAULT_LIST_LIMIT,
        state: str | None = None,
        session_id: str | None = None,
        key: str | None = None,
    ) -> list[dict[str, Any]]:
        """Newest first; with ``key``, the run a spawn with that idempotency key made (or none)."""
        return _list_in(self.request("list", limit=limit, state=state, session_id=session_id, key=key), "runs")

    def events(
        self, run_id: str, *, after_seq: int = 0, limit: int = protocol.DEFAULT_EVENTS_LIMIT
    ) -> list[dict[str, Any]]:
        return _list_in(self.request("events", run_id=run_id, after_seq=after_seq, limit=limit), "events")

    def iter_events(self, run_id: str, *, after_seq: int = 0) -> Iterator[dict[str, Any]]:
        """Every journaled event after ``after_seq``, page by page."""
        while True:
            reply = self.request("events", run_id=run_id, after_seq=after_seq, limit=protocol.DEFAULT_EVENTS_LIMIT)
            page = reply["events"]
            yield from page
            # A page is cut by bytes too: ``more`` says so (an older daemon: a full page).
            more = reply.get("more", len(page) >= protocol.DEFAULT_EVENTS_LIMIT)
            if not page or not more:
                return
            after_seq = page[-1]["seq"]

    def follow(
        self,
        run_id: str,
        *,
        after_seq: int = 0,
        reconnect: bool = True,
        reconnect_timeout_s: float = RECONNECT_TIMEOUT_S,
    ) -> Follow:
        """Iterate over a run's events after ``after_seq``, replayed then live, until it ends."""
        return Follow(self, run_id, after_seq, reconnect, reconnect_timeout_s)


def _object_result(op: str, result: Any) -> dict[str, Any]:
    """A reply's result: a JSON object for every op (docs/control-protocol.md)."""
    if not isinstance(result, dict):
        raise ControlProtocolError(
            protocol.ErrorCode.BAD_REPLY, f"expected an object as the result of {op!r}, got {type(result).__name__}"
        )
    return result


def _list_in(result: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = result.get(key)
    if not isinstance(items, list):
        raise ControlProtocolError(
            protocol.ErrorCode.BAD_REPLY, f"expected a list in the reply's {key!r}, got {type(items).__name__}"
        )
    return items


class Follow:
    """A run's events: iterate for event dicts; afterwards ``state`` is its terminal state.

    On its own connection. ``last_seq`` is the last event yielded, ``reconnects`` how
    many times a dropped connection was resumed.
    """

    def __init__(
        self, client: Client, run_id: str, after_seq: int, reconnect: bool, reconnect_timeout_s: float
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.last_seq = after_seq
        self.state: str | None = None
        self.reconnects = 0
        self._reconnect = reconnect
        self._reconnect_timeout_s = reconnect_timeout_s
        self._ws: WebSocket | None = None

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            self._subscribe()  # a first failure is reported as is: no daemon, no such run
            while self.state is None:
                try:
                    if self._ws is None:
                        self._subscribe()
                    yield from self._pump()
                except (ConnectionLost, DaemonNotRunning):
                    self.close()
                    if not self._reconnect:
                        raise
                    self._resume()
        finally:
            self.close()

    def _subscribe(self) -> None:
        ws = self.client._open()
        self._ws = ws
        ws.send_text(protocol.encode_request(1, "subscribe", run_id=self.run_id, after_seq=self.last_seq))
        while True:
            msg = protocol.decode_server_message(ws.recv_text(self.client.timeout_s))
            if msg.get("id") == 1 and "ok" in msg:
                if msg["ok"] is not True:
                    raise protocol.error_from_reply(msg.get("error"), run_id=self.run_id)
                self._sub = msg["result"]["sub"]
                return

    def _pump(self) -> Iterator[dict[str, Any]]:
        assert self._ws is not None
        while True:
            # No timeout: a run may be quiet for a long time; a dead daemon shows as EOF.
            msg = protocol.decode_server_message(self._ws.recv_text(None))
            op = msg.get("op")
            if op == "event":
                seq = msg.get("seq")
                if not isinstance(seq, int) or seq <= self.last_seq:
                    continue
                self.last_seq = seq
                yield {k: msg.get(k) for k in ("run_id", "seq", "ts", "kind", "data")}
            elif op == "end":
                error = msg.get("error")
                if error is not None:
                    raise protocol.error_from_reply(error, run_id=self.run_id)
                self.state = str(msg.get("state"))
                return

    def _resume(self) -> None:
        deadline = time.monotonic() + self._reconnect_timeout_s
        last_exc: Exception | None = None
        for delay in itertools.chain(RECONNECT_BACKOFF_S, itertools.repeat(RECONNECT_BACKOFF_S[-1])):
            if time.monotonic() + delay > deadline:
                break
            if delay:
                time.sleep(delay)  # backoff between attempts, not synchronisation
            try:
                self._subscribe()
            except (ConnectionLost, DaemonNotRunning) as exc:
                self.close()
                last_exc = exc
                continue
            self.reconnects += 1
            return
        raise ConnectionLost(
            f"lost the connection to the daemon while following run {self.run_id!r} and could not "
            f"reconnect within {self._reconnect_timeout_s} s (last event seen: {self.last_seq}): {last_exc}"
        )
