"""The fleet front's durable index of runs, on the head: SQLite, like a node's journal.

One row per fleet run (its node, its node run id, its state as last mirrored, the
cancel asked of it) and the run's events as they streamed from its node. What it
guarantees: a run's terminal state is written once (compare-and-set, and a trigger
refuses any later change), so a front killed and restarted never records a second
terminal fact; every write is committed before the call returns, so a restarted front
resumes from exactly what the last one knew. Blocking: the front calls it through one
worker thread (``trio.to_thread`` with a limiter of 1).
"""

from __future__ import annotations

import builtins  # `list` below is a method's name in class scope
import json
import sqlite3
from pathlib import Path
from typing import Any, Final

from subagent.events import fold_snapshot
from supervisor.states import TERMINAL_STATES

__all__ = ["Index"]

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    session_id TEXT,
    state TEXT NOT NULL,
    reason TEXT,
    terminal INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    ended_at REAL,
    timeout_s REAL,
    spec TEXT NOT NULL,
    bundle TEXT NOT NULL,
    node_id TEXT,
    node_run_id TEXT,
    cancel_reason TEXT,
    partial_snapshot TEXT,
    result TEXT,
    partial INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    last_seq INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS runs_live ON runs (terminal, created_at);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    ts REAL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS terminal_once BEFORE UPDATE OF state ON runs
WHEN OLD.terminal = 1 AND NEW.state IS NOT OLD.state
BEGIN SELECT RAISE(ABORT, 'a terminal state is written once'); END;
"""

_TERMINAL: Final = tuple(str(s) for s in TERMINAL_STATES)
_JSON_COLUMNS: Final = ("spec", "bundle", "partial_snapshot", "result", "error")


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


class Index:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def _row(self, row: sqlite3.Row | None) -> dict[str, Any] | None:
        if row is None:
            return None
        out = dict(row)
        for key in _JSON_COLUMNS:
            if out.get(key) is not None:
                out[key] = json.loads(out[key])
        out["partial"] = bool(out["partial"])
        out["terminal"] = bool(out["terminal"])
        return out

    # ------------------------------------------------------------------ writes

    def create(
        self,
        run_id: str,
        *,
        session_id: str | None,
        spec: dict[str, Any],
        bundle: dict[str, float],
        created_at: float,
        timeout_s: float | None,
    ) -> None:
        self._db.execute(
            "INSERT INTO runs (id, session_id, state, created_at, timeout_s, spec, bundle) VALUES (?, ?, 'queued', ?, ?, ?, ?)",
            (run_id, session_id, created_at, timeout_s, _dumps(spec), _dumps(bundle)),
        )

    def set_node(self, run_id: str, node_id: str) -> None:
        self._db.execute("UPDATE runs SET node_id = ? WHERE id = ? AND node_id IS NULL", (node_id, run_id))

    def set_node_run(self, run_id: str, node_run_id: str) -> None:
        self._db.execute("UPDATE runs SET node_run_id = ? WHERE id = ?", (node_run_id, run_id))

    def request_cancel(self, run_id: str, reason: str) -> None:
        """Durable intent: a restarted front still cancels what was asked."""
        self._db.execute(
            "UPDATE runs SET cancel_reason = ? WHERE id = ? AND cancel_reason IS NULL AND terminal = 0",
            (reason, run_id),
        )

    def add_events(self, run_id: str, events: list[dict[str, Any]]) -> None:
        """Mirror a node's events (idempotent by seq); the run's state follows its ``state`` events."""
        if not events:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT OR IGNORE INTO events (run_id, seq, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
                [(run_id, e["seq"], e.get("ts"), str(e.get("kind")), _dumps(e.get("data") or {})) for e in events],
            )
            last = max(e["seq"] for e in events)
            self._db.execute("UPDATE runs SET last_seq = max(last_seq, ?) WHERE id = ?", (last, run_id))
            row = self._db.execute(
                "SELECT partial_snapshot, node_run_id FROM runs WHERE id = ? AND terminal = 0", (run_id,)
            ).fetchone()
            snapshot = json.loads(row[0]) if row is not None and row[0] is not None else None
            before = snapshot
            for e in sorted(events, key=lambda e: e["seq"]):
                data = e.get("data") or {}
                if e.get("kind") == "step_snapshot" and row is not None:
                    # A delta since the runner's previous snapshot (a whole one from an older
                    # runner): the index keeps the whole snapshot, the node's partial result.
                    if "_id" in data and row[1] is not None and data["_id"] != row[1]:
                        continue  # not this run's runner (as the node's daemon refuses it)
                    try:
                        snapshot = fold_snapshot(snapshot if isinstance(snapshot, dict) else None, data)
                    except (TypeError, ValueError):
                        continue  # malformed: the node's daemon did not keep it either
                elif e.get("kind") == "state" and isinstance(data.get("state"), str) and data["state"] not in _TERMINAL:
                    self._db.execute("UPDATE runs SET state = ? WHERE id = ? AND terminal = 0", (data["state"], run_id))
            if snapshot is not before:
                self._db.execute(
                    "UPDATE runs SET partial_snapshot = ? WHERE id = ? AND terminal = 0", (_dumps(snapshot), run_id)
                )

    def finish(
        self,
        run_id: str,
        state: str,
        *,
        reason: str | None,
        ended_at: float,
        result: dict[str, Any] | None = None,
        partial: bool = False,
        error: dict[str, Any] | None = None,
        event: dict[str, Any] | None = None,
    ) -> bool:
        """Write the run's terminal fact once (and the fleet's own last event with it).

        Returns False if the run already had one: nothing is changed then.
        """
        if state not in _TERMINAL:
            raise ValueError(f"expected a terminal state, got {state!r}")
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute(
                "UPDATE runs SET state = ?, terminal = 1, reason = ?, ended_at = ?, result = ?, partial = ?, error = ? "
                "WHERE id = ? AND terminal = 0",
                (state, reason, ended_at, _dumps(result), int(partial), _dumps(error), run_id),
            )
            if cur.rowcount != 1:
                return False
            if event is not None:
                seq = self._db.execute("SELECT last_seq FROM runs WHERE id = ?", (run_id,)).fetchone()[0] + 1
                self._db.execute(
                    "INSERT INTO events (run_id, seq, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
                    (run_id, seq, ended_at, event["kind"], _dumps(event["data"])),
                )
                self._db.execute("UPDATE runs SET last_seq = ? WHERE id = ?", (seq, run_id))
            return True

    # ------------------------------------------------------------------ reads

    def get(self, run_id: str) -> dict[str, Any] | None:
        return self._row(self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone())

    def live(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT * FROM runs WHERE terminal = 0 ORDER BY created_at, rowid").fetchall()
        return [r for r in map(self._row, rows) if r is not None]

    def list(self, *, limit: int, state: str | None, session_id: str | None) -> list[dict[str, Any]]:
        clauses, params = [], []
        if state is not None:
            clauses.append("state = ?")
            params.append(state)
        if session_id is not None:
            clauses.append("session_id = ?")
            params.append(session_id)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._db.execute(
            f"SELECT * FROM runs {where} ORDER BY created_at DESC, rowid DESC LIMIT ?", (*params, limit)
        ).fetchall()
        return [r for r in map(self._row, rows) if r is not None]

    def events_after(self, run_id: str, after_seq: int, limit: int) -> builtins.list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT seq, ts, kind, data FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (run_id, after_seq, limit),
        ).fetchall()
        return [{"seq": r["seq"], "ts": r["ts"], "kind": r["kind"], "data": json.loads(r["data"])} for r in rows]

    def terminal_event_count(self, run_id: str) -> int:
        """How many terminal ``state`` events the index holds for a run (a test's check)."""
        rows = self._db.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'state'", (run_id,)).fetchall()
        return sum(1 for r in rows if json.loads(r["data"]).get("state") in _TERMINAL)
