"""Sessions on the daemon's side: conversations, their history, their browser profiles.

A session is a conversation and each run one turn of it (DESIGN "Conversations, approvals
and browser state"). This module owns what a session has beyond its runs:

- its history: rebuilt from the journal for each new turn (``prepare_turn``), so it
  survives restarts: every earlier turn as ``subagent.history.turn_messages`` says it
  (tasks, the assistant's messages and calls, one honest result per call, a note after a
  turn that did not complete; text the model was still streaming when its runner was
  killed, from the turn's partial result, marked cut short);
- its browser profile: ``<state_dir>/sessions/<key>/browser-profile``, made for the
  session's first ``--browser`` turn and granted to its turns alone (``sandbox.write``,
  a grant only the daemon may make inside its state dir); a stop never removes it;
  ``close``, an idle TTL (``session_profile_ttl_s``) and a bound on their number
  (``session_profiles_max``, oldest use first) do, never while a turn of it is live;
- its lock: one turn of a session at a time is decided under it (``lock``), and a closed
  session takes no new turn.
The run manager owns runs and their cancellation; it passes what this needs.
"""

from __future__ import annotations

import builtins  # `list` below is a method's name in class scope
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import trio

from subagent.history import turn_messages, unfinished_text
from supervisor.config import Config
from supervisor.core._history_page import Built, walk
from supervisor.errors import ControlProtocolError, JournalError
from supervisor.protocol import ErrorCode
from supervisor.states import TERMINAL_STATES
from supervisor.store.journal import Journal, TurnRecord
from supervisor.trees.pool import remove_tree

__all__ = ["SessionDesk", "SessionNotFound", "session_key", "history_messages", "PROFILE_SWEEP_INTERVAL_S"]

logger = logging.getLogger(__name__)

SESSIONS_DIR: Final = "sessions"
PROFILE_DIR: Final = "browser-profile"
# How often idle and surplus profiles are looked for (seconds); also at start and after
# each turn that made a new profile.
PROFILE_SWEEP_INTERVAL_S: Final = 600.0
# What a crashed Chromium leaves in its profile: removed before the next turn uses it
# (only one turn of a session is live, and its processes never outlive it).
_SINGLETONS: Final = ("SingletonLock", "SingletonSocket", "SingletonCookie")
_KEY_CHARS: Final = re.compile(r"[^A-Za-z0-9_.-]")


class SessionNotFound(ControlProtocolError):
    def __init__(self, session_id: str) -> None:
        super().__init__(ErrorCode.NOT_FOUND, f"no session with id {session_id!r}")
        self.session_id = session_id


def session_key(session_id: str) -> str:
    """A directory name for a session: readable, and unique by its hash."""
    readable = _KEY_CHARS.sub("_", session_id)[:32].strip(".") or "s"
    return f"{readable}-{hashlib.sha256(session_id.encode('utf-8', 'surrogatepass')).hexdigest()[:12]}"


def _final_text(turn: TurnRecord) -> str | None:
    result = turn["result"]
    text = result.get("final_text") if isinstance(result, dict) else None
    return text if isinstance(text, str) else None


def _turn_reason(turn: TurnRecord) -> str | None:
    if turn["state"] == "cancelled":
        return turn["cancel_reason"] or turn["reason"]
    if turn["state"] == "failed":
        error = turn["error"]
        if isinstance(error, dict) and error.get("code"):
            return str(error["code"])
    return turn["reason"]


def _messages(turn: TurnRecord) -> list[dict[str, Any]]:
    task = turn["spec"].get("task") if isinstance(turn["spec"], dict) else None
    return turn_messages(
        str(task or ""),
        turn["tool_calls"],
        turn["events"],
        state=turn["state"],
        reason=_turn_reason(turn),
        final_text=_final_text(turn),
        # A runner killed while its model streamed: that text is in its partial result only.
        unfinished=unfinished_text(turn["result"]),
        # Calls of a step beyond its bound: told after that step's results, as it was.
        refused=_refused(turn["result"]),
    )


def _refused(result: Any) -> list[dict[str, Any]]:
    refused = result.get("refused_calls") if isinstance(result, dict) else None
    return [r for r in refused if isinstance(r, dict)] if isinstance(refused, list) else []


def history_messages(turns: Iterable[TurnRecord], *, before: str | None = None) -> list[dict[str, Any]]:
    """The history a new turn is given: every ended turn (before run ``before``), in order."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        if turn["run_id"] == before:
            break
        if turn["state"] in TERMINAL_STATES:
            out.extend(_messages(turn))
    return out


def _dumps(obj: Any) -> str:
    """As the reply encodes it (``protocol._dumps``), to measure a page."""
    return json.dumps(obj, separators=(",", ":"), default=str)


def _remove_tree(path: Path) -> None:
    remove_tree(path)  # a directory its turn left read-only too


def _clear_singletons(profile: Path) -> None:
    for name in _SINGLETONS:
        try:
            (profile / name).unlink()
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            remove_tree(profile / name)


class SessionDesk:
    """Sessions of one daemon: their locks, histories and browser profiles.

    ``live_sessions()``: the session ids with a live turn now (their profiles are in use).
    """

    def __init__(self, config: Config, journal: Journal, live_sessions: Callable[[], set[str]]) -> None:
        self.config = config
        self.journal = journal
        self._live_sessions = live_sessions
        self._locks: dict[str, trio.Lock] = {}
        self.root = config.state_dir / SESSIONS_DIR

    @asynccontextmanager
    async def lock(self, session_id: str) -> AsyncIterator[None]:
        """Held while a session's turns are decided (a new turn, an interrupt, a close).
        A session's lock exists while someone holds it or waits for it: requests naming
        sessions that never were leave nothing behind."""
        lock = self._locks.get(session_id)
        if lock is None:
            lock = self._locks[session_id] = trio.Lock()
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0 and self._locks.get(session_id) is lock:
                del self._locks[session_id]

    def profile_path(self, session_id: str) -> Path:
        return self.root / session_key(session_id) / PROFILE_DIR

    # ------------------------------------------------------------------ turns

    async def open(self, session_id: str) -> None:
        """The session takes a new turn (its row is made once).

        Raises:
            ControlProtocolError: ``refused``, the session was closed.
        """
        closed_at = await self.journal.open_session(session_id)
        if closed_at is not None:
            raise ControlProtocolError(
                ErrorCode.REFUSED,
                f"session {session_id!r} was closed at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(closed_at))}: "
                "it takes no new turn (start a new session)",
            )

    async def prepare_turn(
        self, run_id: str, session_id: str, spec: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The spec the turn's runner gets (its session's history; its profile, granted),
        and the ``session`` event that says so.

        Raises:
            OSError: the profile directory cannot be made.
        """
        turns = await self.journal.session_turns(session_id)
        history = history_messages(turns, before=run_id)
        earlier = sum(1 for t in turns if t["run_id"] != run_id and t["state"] in TERMINAL_STATES)
        runner_spec = dict(spec)
        session: dict[str, Any] = {"history": history}
        event: dict[str, Any] = {"session_id": session_id, "turns": earlier, "messages": len(history)}
        if spec.get("browser"):
            # Under the session's lock: a sweep never removes a profile a turn is taking.
            async with self.lock(session_id):
                profile, made = await self._use_profile(session_id)
            if made:  # outside it: a sweep takes other sessions' locks, one at a time
                await self.sweep(keep={session_id})
            session["browser_profile"] = str(profile)
            sandbox = dict(spec.get("sandbox") or {})
            sandbox["write"] = [*(sandbox.get("write") or []), str(profile)]
            runner_spec["sandbox"] = sandbox
            event["browser_profile"] = str(profile)
        runner_spec["session"] = session
        return runner_spec, event

    async def _use_profile(self, session_id: str) -> tuple[Path, bool]:
        """The session's profile, made if need be (and whether it was)."""
        profile = self.profile_path(session_id)
        record = await self.journal.get_session(session_id)
        made = record is None or record["profile_dir"] != str(profile) or not profile.is_dir()

        def prepare() -> None:
            profile.mkdir(parents=True, exist_ok=True, mode=0o700)
            _clear_singletons(profile)

        await trio.to_thread.run_sync(prepare)
        await self.journal.set_profile(session_id, str(profile), used_at=time.time())
        return profile, made

    # ------------------------------------------------------------------ reading

    async def history(
        self,
        session_id: str,
        live: Mapping[str, str],
        *,
        before_turn: int | None = None,
        after_turn: int | None = None,
        max_bytes: int | None = None,
    ) -> dict[str, Any]:
        """The transcript: every turn as recorded, and the history a next turn would get;
        one page of it, at most ``history_reply_bytes`` (``supervisor.core._history_page``).

        ``live``: run id -> state, for runs of this daemon still live. Without a cursor:
        the newest turns that fit; ``before_turn``/``after_turn``: those numbered below /
        above it. ``complete``: the page holds every turn (then ``messages`` is the whole
        history; otherwise that of the page's turns). ``more``: turns beyond the page
        (earlier; later with ``after_turn``).

        Raises:
            SessionNotFound: no run ever had this session.
        """
        ids = await self.journal.session_turn_ids(session_id)
        record = await self.journal.get_session(session_id)
        if not ids and record is None:
            raise SessionNotFound(session_id)
        # A turn that ended while the journal was read is live in ``live`` (taken before):
        # its journaled end wins.
        ended = {run_id for run_id, state in ids if state in TERMINAL_STATES}
        live = {run_id: state for run_id, state in live.items() if run_id not in ended}
        bound = self.config.history_reply_bytes
        bound = bound if max_bytes is None else min(bound, max_bytes)

        async def build(n: int) -> Built | None:
            t = await self.journal.session_turn(ids[n - 1][0])
            if t is None:
                return None
            ended = t["state"] in TERMINAL_STATES
            state = t["state"] if ended else live.get(t["run_id"], t["state"])
            entry = {
                "turn": n,
                "run_id": t["run_id"],
                "state": state,
                "reason": _turn_reason(t),
                "task": t["spec"].get("task") if isinstance(t["spec"], dict) else None,
                "created_at": t["created_at"],
                "ended_at": t["ended_at"],
                "messages": _messages({**t, "state": state}),
            }
            # An ended turn's messages are in the reply twice: its own and the history's.
            size = len(_dumps(entry)) + (len(_dumps(entry["messages"])) if ended else 0)
            return Built({**entry, "ended": ended}, size)

        page = await walk(len(ids), build, before=before_turn, after=after_turn, max_bytes=bound)
        turns = [b.entry for b in page.turns]
        messages = [m for t in turns if t.pop("ended") for m in t["messages"]]
        return {
            "session_id": session_id,
            "closed_at": record["closed_at"] if record else None,
            "live_run": next((run_id for run_id, _ in ids if run_id in live), None),
            "turns": turns,
            "messages": messages,
            "first_turn": page.first,
            "turn_count": len(ids),
            "more": page.more,
            "complete": len(turns) == len(ids),
        }

    async def list(self, limit: int, live: Mapping[str, tuple[str, str]]) -> dict[str, Any]:
        """Sessions, most recently active first. ``live``: session id -> (run id, state)."""
        rows = await self.journal.sessions(limit=limit)
        out = []
        for r in rows:
            run = live.get(r["session_id"])
            out.append(
                {
                    "session_id": r["session_id"],
                    "turns": r["turns"],
                    "first_at": r["first_at"],
                    "last_at": r["last_at"],
                    "last_run": r["last_run"],
                    "last_state": run[1] if run is not None and run[0] == r["last_run"] else r["last_state"],
                    "live_run": run[0] if run is not None else None,
                    "closed_at": r["closed_at"],
                    "profile": {"path": r["profile_dir"], "used_at": r["profile_used_at"]}
                    if r["profile_dir"]
                    else None,
                }
            )
        return {"sessions": out}

    # ------------------------------------------------------------------ closing, sweeping

    async def known(self, session_id: str) -> None:
        """Raises SessionNotFound if no run ever had this session."""
        record = await self.journal.get_session(session_id)
        if record is None and not await self.journal.list_runs(limit=1, session_id=session_id):
            raise SessionNotFound(session_id)

    async def close(self, session_id: str) -> tuple[bool, bool]:
        """Mark the session closed and remove its profile (its turns have ended).

        Returns (was_open, profile_removed).

        Raises:
            SessionNotFound: no run ever had this session.
        """
        await self.known(session_id)
        was_open = await self.journal.close_session(session_id)
        removed = await self._remove_profile(session_id, "the session was closed")
        return was_open, removed

    async def _remove_profile(self, session_id: str, why: str) -> bool:
        path = self.profile_path(session_id)
        had = path.exists()
        await trio.to_thread.run_sync(_remove_tree, path.parent)  # the files first, whatever the journal says
        record = await self.journal.get_session(session_id)
        had = had or (record is not None and record["profile_dir"] is not None)
        if record is not None and record["profile_dir"] is not None:
            await self.journal.set_profile(session_id, None)
        if had:
            logger.info("session %s: browser profile removed (%s)", session_id, why)
        return had

    async def evict_profile(self, session_id: str, why: str) -> bool:
        """Remove a session's profile now, its turn over (that turn filled the disk:
        ``supervisor.core.diskguard``); the session stays open and its next browser turn
        starts with a new profile. Not while a turn of it is live again. The files go even
        when the journal cannot be written (its record of the profile then names a
        directory that is gone, which the next turn makes again). Returns: it went."""
        async with self.lock(session_id):
            if session_id in self._live_sessions():
                return False
            try:
                await self._remove_profile(session_id, why)
            except JournalError as exc:
                logger.warning("session %s: the removed profile stays in the journal's record: %s", session_id, exc)
            return True

    async def sweep(self, *, now: float | None = None, keep: Iterable[str] = ()) -> builtins.list[str]:
        """Remove profiles idle beyond the TTL, then the least recently used beyond the
        bound; never one of a session with a live turn (or in ``keep``). Returns the
        sessions whose profile went."""
        now = time.time() if now is None else now
        try:
            profiles = await self.journal.profiles()
        except JournalError as exc:
            logger.warning("sessions: cannot read the profiles to sweep: %s", exc)
            return []
        keep = set(keep)
        removed: list[str] = []
        ttl = self.config.session_profile_ttl_s

        async def remove(session_id: str, why: str) -> bool:
            # Under the session's lock, and only if no turn of it is live by then.
            async with self.lock(session_id):
                if session_id in keep or session_id in self._live_sessions():
                    return False
                await self._remove_profile(session_id, why)
            removed.append(session_id)
            return True

        kept = []
        for p in profiles:
            used = p["profile_used_at"] or 0.0
            if not (now - used > ttl and await remove(p["session_id"], f"idle for more than {ttl:g} s")):
                kept.append(p)
        surplus = len(kept) - self.config.session_profiles_max
        for p in kept:  # least recently used first
            if surplus <= 0:
                break
            if await remove(
                p["session_id"], f"more than {self.config.session_profiles_max} profiles; least recently used"
            ):
                surplus -= 1
        return removed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sweep profiles now and every ``PROFILE_SWEEP_INTERVAL_S``."""
        task_status.started()
        while True:
            try:
                await self.sweep()
            except Exception:  # a task root: a bad sweep must not take the daemon down
                logger.exception("sessions: sweeping browser profiles failed")
            await trio.sleep(PROFILE_SWEEP_INTERVAL_S)
