"""The journal's session operations: a session's row, its browser profile, its turns.

A mixin of ``_journal_store.Store`` (same connection, same worker thread, one transaction
each). A session is its runs (``runs.session_id``) plus a row in ``sessions`` for what
runs do not say: when it was closed and where its browser profile is. ``session_turns``
reads what a conversation's history is rebuilt from: each run's task and outcome, its
tool-call records, and its ``assistant_text`` and ``steering`` events, in order.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Final, TypedDict

__all__ = ["SessionRecord", "SessionSummary", "TurnRecord", "SessionStoreMixin", "HISTORY_EVENT_KINDS"]

# The events a turn's history is rebuilt from (the rest is progress, not conversation).
HISTORY_EVENT_KINDS: Final = ("assistant_text", "steering")


class SessionRecord(TypedDict):
    session_id: str
    created_at: float
    closed_at: float | None
    profile_dir: str | None
    profile_used_at: float | None


class SessionSummary(TypedDict):
    session_id: str
    turns: int
    first_at: float
    last_at: float
    last_run: str
    last_state: str
    closed_at: float | None
    profile_dir: str | None
    profile_used_at: float | None


class TurnRecord(TypedDict):
    run_id: str
    state: str
    reason: str | None
    cancel_reason: str | None
    created_at: float
    ended_at: float | None
    spec: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    tool_calls: list[dict[str, Any]]
    events: list[dict[str, Any]]


class SessionStoreMixin:
    """Session operations of a ``Store`` (which provides ``_tx`` and ``_read``)."""

    if TYPE_CHECKING:
        # Provided by ``Store``: a transaction (committed on exit) and a read snapshot.
        def _tx(self, *, durable: bool) -> AbstractContextManager[sqlite3.Connection]: ...
        def _read(self) -> AbstractContextManager[sqlite3.Connection]: ...

    def open_session(self, session_id: str, at: float) -> float | None:
        """Make the session's row if it has none; returns when it was closed (None: open)."""
        with self._tx(durable=True) as conn:
            conn.execute(
                "INSERT INTO sessions (session_id, created_at) VALUES (?, ?) ON CONFLICT (session_id) DO NOTHING",
                (session_id, at),
            )
            row = conn.execute("SELECT closed_at FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            return None if row is None else row[0]

    def close_session(self, session_id: str, at: float) -> bool:
        """Mark it closed (once); returns whether it was open."""
        with self._tx(durable=True) as conn:
            conn.execute(
                "INSERT INTO sessions (session_id, created_at) VALUES (?, ?) ON CONFLICT (session_id) DO NOTHING",
                (session_id, at),
            )
            cur = conn.execute(
                "UPDATE sessions SET closed_at = ? WHERE session_id = ? AND closed_at IS NULL", (at, session_id)
            )
            return cur.rowcount == 1

    def set_profile(self, session_id: str, path: str | None, used_at: float | None) -> str | None:
        """Record the session's profile dir (None: it has none now); returns the one before."""
        with self._tx(durable=True) as conn:
            conn.execute(
                "INSERT INTO sessions (session_id, created_at) VALUES (?, ?) ON CONFLICT (session_id) DO NOTHING",
                (session_id, used_at if used_at is not None else 0.0),
            )
            row = conn.execute("SELECT profile_dir FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            conn.execute(
                "UPDATE sessions SET profile_dir = ?, profile_used_at = ? WHERE session_id = ?",
                (path, used_at, session_id),
            )
            return None if row is None else row[0]

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._read() as conn:
            row = conn.execute(
                "SELECT session_id, created_at, closed_at, profile_dir, profile_used_at FROM sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
        return None if row is None else _session(row)

    def profiles(self) -> list[SessionRecord]:
        """Every session that has a profile, least recently used first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT session_id, created_at, closed_at, profile_dir, profile_used_at FROM sessions "
                "WHERE profile_dir IS NOT NULL ORDER BY profile_used_at, session_id"
            ).fetchall()
        return [_session(r) for r in rows]

    def sessions(self, limit: int) -> list[SessionSummary]:
        """Sessions with at least one run, most recently active first; each one's last run
        is the last one made (``session_turns``)."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT r.session_id, count(*), min(r.created_at), max(r.created_at), "
                "(SELECT id FROM runs l WHERE l.session_id = r.session_id ORDER BY rowid DESC LIMIT 1), "
                "(SELECT state FROM runs l WHERE l.session_id = r.session_id ORDER BY rowid DESC LIMIT 1), "
                "s.closed_at, s.profile_dir, s.profile_used_at "
                "FROM runs r LEFT JOIN sessions s ON s.session_id = r.session_id "
                "WHERE r.session_id IS NOT NULL GROUP BY r.session_id ORDER BY max(r.created_at) DESC LIMIT ?",
                (limit,),
            ).fetchall()
        return [
            SessionSummary(
                session_id=r[0],
                turns=r[1],
                first_at=r[2],
                last_at=r[3],
                last_run=r[4],
                last_state=r[5],
                closed_at=r[6],
                profile_dir=r[7],
                profile_used_at=r[8],
            )
            for r in rows
        ]

    def session_turns(self, session_id: str) -> list[TurnRecord]:
        """The session's runs, oldest first, with what their history is rebuilt from.

        In the order they were made (``rowid``: runs are only ever inserted, one at a time,
        and a session's turns one after the other under its lock), not by ``created_at``: a
        wall clock stepped back between two turns would put the later one first (the next
        turn was given the turns out of order, and a browser turn, prepared once it is in
        the journal, none of those before it)."""
        with self._read() as conn:
            runs = conn.execute(
                "SELECT id, state, reason, cancel_reason, created_at, ended_at, spec, result, error FROM runs "
                "WHERE session_id = ? ORDER BY rowid",
                (session_id,),
            ).fetchall()
            return [_turn(conn, row) for row in runs]

    def session_turn_ids(self, session_id: str) -> list[tuple[str, str]]:
        """The session's runs (id, state), in ``session_turns``' order: none of their records."""
        with self._read() as conn:
            rows = conn.execute("SELECT id, state FROM runs WHERE session_id = ? ORDER BY rowid", (session_id,))
            return [(r[0], r[1]) for r in rows.fetchall()]

    def session_turn(self, run_id: str) -> TurnRecord | None:
        """One run as ``session_turns`` gives it (a history read a turn at a time)."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT id, state, reason, cancel_reason, created_at, ended_at, spec, result, error FROM runs "
                "WHERE id = ?",
                (run_id,),
            ).fetchone()
            return None if row is None else _turn(conn, row)


def _session(row: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(
        session_id=row[0], created_at=row[1], closed_at=row[2], profile_dir=row[3], profile_used_at=row[4]
    )


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _rows(conn: sqlite3.Connection, sql: str, params: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    cur = conn.execute(sql, params)
    try:
        yield from cur
    finally:
        cur.close()


def _turn(conn: sqlite3.Connection, row: tuple[Any, ...]) -> TurnRecord:
    run_id = row[0]
    marks = ", ".join("?" * len(HISTORY_EVENT_KINDS))
    events = [
        {"seq": seq, "ts": ts, "kind": kind, "data": json.loads(data)}
        for seq, ts, kind, data in _rows(
            conn,
            f"SELECT seq, ts, kind, data FROM events WHERE run_id = ? AND kind IN ({marks}) ORDER BY seq",
            (run_id, *HISTORY_EVENT_KINDS),
        )
    ]
    calls = [
        json.loads(r[0])
        for r in _rows(conn, "SELECT record FROM tool_calls WHERE run_id = ? ORDER BY step, rowid", (run_id,))
    ]
    return TurnRecord(
        run_id=run_id,
        state=row[1],
        reason=row[2],
        cancel_reason=row[3],
        created_at=row[4],
        ended_at=row[5],
        spec=json.loads(row[6]),
        result=_loads(row[7]),
        error=_loads(row[8]),
        tool_calls=calls,
        events=events,
    )
