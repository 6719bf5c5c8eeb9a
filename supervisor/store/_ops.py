"""The journal's operations: synchronous, one transaction each, on one sqlite3 connection.

Only the journal's worker thread calls into a ``Store`` (see ``supervisor.store.journal``), so
its connection never crosses threads and its writes never race each other. Every
compare-and-set is in the WHERE clause of the UPDATE that makes it; the schema's trigger
``runs_terminal_is_final`` backs that up. Commits that carry facts recovery depends on
(run creation, state changes, terminal writes, pids and groups) are made with
``synchronous = FULL``; the high-volume ones (events, tool-call records, partial
snapshot checkpoints) with NORMAL: they survive a daemon crash, and a power loss can drop only a
suffix of them, never one that a later FULL commit covered, so sequence numbers stay
gapless.

A run's partial result is stored as a checkpoint (``partial_snapshot`` as of event
``partial_seq``); a live run is read with its ``step_snapshot`` events after that folded
in (``_partial_now``), and its end stores the result whole.

Size: one method per journal operation, each one transaction, on one connection; the
schema, the session operations and the async front are in their own modules.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, TypedDict

from subagent.events import TERMINAL_TOOL_STATES, Approval, StopEffect, ToolCallState, fold_snapshot
from supervisor.errors import JournalError, RunNotFound
from supervisor.states import ALLOWED, LIVE_STATES, TERMINAL_STATES, RunState
from supervisor.store._sessions import SessionStoreMixin

__all__ = [
    "NeedsDurableCommit",
    "RunRecord",
    "EventRecord",
    "GroupRecord",
    "Store",
    "tool_call_rank",
    "dumps",
]

# A tool-call record only moves forward: not started (announced) < running < outcome
# unknown < a known outcome. A not-started record that carries a reason is a decision
# ("never executed: the stop came first"), so it ranks with the known outcomes.
_RANK_PENDING: Final = 0
_RANK_RUNNING: Final = 1
_RANK_UNKNOWN: Final = 2
_RANK_FINAL: Final = 3
# A known outcome a later fact of its run amended: a call that started a background
# command, told at the run's end that the command was still running when the stop came
# (``stop_effect`` ``background_ended``) or when the run ended, and was ended then. Its
# call stays ``succeeded``; the amended record replaces the first one, never the reverse.
_RANK_AMENDED: Final = 4
_AMENDED_REASON: Final = "background_ended_with_run:"  # (``subagent.tools.background``)

_TERMINAL_VALUES: Final = tuple(sorted(s.value for s in TERMINAL_STATES))
_LIVE_VALUES: Final = tuple(sorted(s.value for s in LIVE_STATES))


class GroupRecord(TypedDict):
    pgid: int
    kind: str
    name: str
    alive: bool
    added_at: float
    ended_at: float | None
    on_stop: str | None


class EventRecord(TypedDict):
    seq: int
    ts: float
    kind: str
    data: dict[str, Any]


class RunRecord(TypedDict):
    id: str
    session_id: str | None
    state: RunState
    reason: str | None
    created_at: float
    started_at: float | None
    ended_at: float | None
    timeout_s: float | None
    spec: dict[str, Any]
    result: dict[str, Any] | None
    partial: bool
    partial_snapshot: dict[str, Any] | None
    error: dict[str, Any] | None
    receipt: dict[str, Any] | None
    pid: int | None
    pid_start_time: float | None
    pgid: int | None
    tree_id: str | None
    cgroup: str | None
    containment: str | None
    run_dir: str | None
    last_seq: int
    cancel_reason: str | None
    cancel_requested_at: float | None
    stop_deadline: float | None
    deadline: float | None
    stop_detail: dict[str, Any] | None  # what the daemon measured for its stop (a full disk)
    groups: list[GroupRecord]
    tool_calls: list[dict[str, Any]]


def dumps(value: object) -> str:
    # Lenient like the wire format (``subagent.events``): what it cannot encode, it
    # writes as text. ASCII output keeps lone surrogates from failing the SQLite insert.
    # A value nested beyond the recursion limit (a runner's event, say) is stored as a
    # note that it was, rather than failing the run's bookkeeping.
    try:
        return json.dumps(value, separators=(",", ":"), default=str)
    except RecursionError:
        return json.dumps({"unstorable": "nested too deep to store as json"})


def tool_call_rank(record: dict[str, Any]) -> int:
    """Where a tool-call record stands in its lifecycle (see ``_RANK_*``).

    Raises:
        ValueError: the record has no ``id`` or an unknown ``state``.
    """
    if not isinstance(record.get("id"), str) or not record["id"]:
        raise ValueError(f"expected a tool-call record with a string id, got {record!r}")
    state = ToolCallState(record.get("state", ToolCallState.NOT_STARTED))
    if state is ToolCallState.NOT_STARTED:
        return _RANK_FINAL if record.get("reason") else _RANK_PENDING
    if state is ToolCallState.RUNNING:
        return _RANK_RUNNING
    if state is ToolCallState.UNKNOWN:
        return _RANK_UNKNOWN
    assert state in TERMINAL_TOOL_STATES
    if state is ToolCallState.SUCCEEDED and (
        record.get("stop_effect") == StopEffect.BACKGROUND_ENDED
        or str(record.get("reason") or "").startswith(_AMENDED_REASON)
    ):
        return _RANK_AMENDED
    return _RANK_FINAL


def _sources(new: RunState) -> tuple[str, ...]:
    """The states a run may be in for a move to ``new`` to be allowed (never terminal)."""
    return tuple(old.value for old, targets in ALLOWED.items() if new in targets)


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" * len(values))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


_RUN_COLUMNS: Final = (
    "id, session_id, state, reason, created_at, started_at, ended_at, timeout_s, spec, "
    "result, partial, partial_snapshot, error, receipt, pid, pid_start_time, pgid, "
    "tree_id, cgroup, containment, run_dir, last_seq, cancel_reason, cancel_requested_at, "
    "stop_deadline, deadline, stop_detail"
)


class NeedsDurableCommit(Exception):
    """Raised inside a group commit that commits NORMAL when an operation needs FULL:
    the worker commits what came before and runs it again in a FULL one."""


class Store(SessionStoreMixin):
    """The journal's operations on a connection owned by the calling thread."""

    def __init__(self, conn: sqlite3.Connection, path: str) -> None:
        self._conn = conn
        self._path = path
        self._full = False  # the connection's current synchronous mode is FULL
        self._group = False  # inside a group commit: operations share its transaction
        # Write transactions committed so far, and how many of them FULL (fsynced): what
        # the daemon's journal costs, per event (``Journal.commit_counts``).
        self.commits = 0
        self.durable_commits = 0

    @contextmanager
    def _tx(self, *, durable: bool) -> Iterator[sqlite3.Connection]:
        conn = self._conn
        if self._group:
            # The group's transaction is the operation's (the worker wraps each operation
            # in a savepoint of its own); its commit must be as durable as the operation.
            if durable and not self._full:
                raise NeedsDurableCommit()
            yield conn
            return
        if durable != self._full:
            # Outside any transaction: it applies to the commit below.
            conn.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
            self._full = durable
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
            self._count_commit()
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot across several SELECTs."""
        conn = self._conn
        if self._group:  # the group's transaction is one already
            yield conn
            return
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    # -- group commit: several operations, one transaction, one commit (and one fsync) --

    @property
    def durable_mode(self) -> bool:
        """The connection commits FULL (fsynced) now."""
        return self._full

    @property
    def in_group(self) -> bool:
        """A group commit is open (its transaction may have been rolled back under it)."""
        return self._group

    def begin_group(self, *, durable: bool) -> None:
        """Open one transaction for the operations that follow, committed by
        ``commit_group`` as durably as ``durable`` says (FULL: fsynced)."""
        conn = self._conn
        if durable != self._full:
            conn.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
            self._full = durable
        conn.execute("BEGIN IMMEDIATE")
        self._group = True

    def group_op(self, fn: Any) -> Any:
        """Run one operation of the group in a savepoint: an operation that raises leaves
        no write behind, the others' stand."""
        conn = self._conn
        conn.execute("SAVEPOINT op")
        try:
            value = fn(self)
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
            raise
        conn.execute("RELEASE op")
        return value

    def changes(self) -> int:
        """Rows changed on this connection so far (a call that changed none only read)."""
        return self._conn.total_changes

    def group_alive(self) -> bool:
        """The group's transaction is still open (SQLite rolls a whole transaction back
        on some errors: a full disk, an I/O error)."""
        return self._conn.in_transaction

    def commit_group(self) -> None:
        """Commit the group (rolled back if the commit fails). Raises what the commit raised."""
        conn = self._conn
        self._group = False
        try:
            if conn.in_transaction:
                conn.execute("COMMIT")
                self._count_commit()
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _count_commit(self) -> None:
        self.commits += 1
        if self._full:
            self.durable_commits += 1

    def together(self, ops: Sequence[Callable[[Store], Any]], *, durable: bool = True) -> list[Any]:
        """Several operations as one: one transaction, committed FULL (fsynced) once for
        all (``durable=False``: NORMAL, for operations none of which needs FULL; one that
        does raises ``NeedsDurableCommit`` and leaves nothing); any of them raising leaves
        none of their writes. Their values, in order."""
        with self._tx(durable=durable):
            was, self._group = self._group, True  # each one's own ``_tx`` joins this one
            try:
                return [op(self) for op in ops]
            finally:
                self._group = was

    def abandon_group(self) -> None:
        """Roll the group back (nothing of it is written)."""
        conn = self._conn
        self._group = False
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    def _require_run(self, conn: sqlite3.Connection, run_id: str) -> None:
        if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run_id,)).fetchone() is None:
            raise RunNotFound(run_id)

    def _changed(self, conn: sqlite3.Connection, run_id: str, cur: sqlite3.Cursor) -> bool:
        """Whether a guarded update changed the run; a run that does not exist is ``RunNotFound``."""
        if cur.rowcount == 0:
            self._require_run(conn, run_id)
            return False
        return True

    def _append(self, conn: sqlite3.Connection, run_id: str, items: Sequence[tuple[str, str, float]]) -> list[int]:
        if not items:
            self._require_run(conn, run_id)
            return []
        rows = conn.execute(
            "UPDATE runs SET last_seq = last_seq + ? WHERE id = ? RETURNING last_seq",
            (len(items), run_id),
        ).fetchall()
        if not rows:
            raise RunNotFound(run_id)
        last = int(rows[0][0])
        first = last - len(items) + 1
        conn.executemany(
            "INSERT INTO events (run_id, seq, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
            [(run_id, first + i, ts, kind, data) for i, (kind, data, ts) in enumerate(items)],
        )
        return list(range(first, last + 1))

    # -- runs ------------------------------------------------------------------------

    def create_run(
        self,
        run_id: str,
        session_id: str | None,
        spec: str,
        created_at: float,
        timeout_s: float | None,
        key: str | None = None,
    ) -> None:
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                "INSERT INTO runs (id, session_id, state, created_at, timeout_s, spec) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (run_id, session_id, RunState.QUEUED.value, created_at, timeout_s, spec),
            )
            if cur.rowcount != 1:
                raise JournalError(
                    f"journal {self._path!r}: a run with id {run_id!r} already exists",
                    path=self._path,
                )
            if key is not None:
                cur = conn.execute(
                    "INSERT INTO spawn_keys (key, run_id) VALUES (?, ?) ON CONFLICT DO NOTHING", (key, run_id)
                )
                if cur.rowcount != 1:  # the transaction is rolled back: no run either
                    raise JournalError(
                        f"journal {self._path!r}: the spawn key {key!r} names a run already", path=self._path
                    )

    def run_for_key(self, key: str) -> str | None:
        with self._read() as conn:
            row = conn.execute("SELECT run_id FROM spawn_keys WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def transition(self, run_id: str, new: RunState, reason: str | None, at: float) -> bool:
        sources = _sources(new)
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                "UPDATE runs SET state = ?, reason = coalesce(?, reason), "
                "started_at = CASE WHEN ? IN ('starting', 'running') "
                "THEN coalesce(started_at, ?) ELSE started_at END "
                f"WHERE id = ? AND state IN ({_marks(sources)}) "
                f"AND state NOT IN ({_marks(_TERMINAL_VALUES)})",
                (new.value, reason, new.value, at, run_id, *sources, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    def finish(
        self,
        run_id: str,
        state: RunState,
        reason: str | None,
        result: str | None,
        partial: bool,
        error: str | None,
        receipt: str | None,
        at: float,
        *,
        settle_reason: str | None = None,
        groups_ended_at: float | None = None,
        any_live: bool = False,
    ) -> bool:
        sources = _LIVE_VALUES if any_live else _sources(state)
        with self._tx(durable=True) as conn:
            row = conn.execute("SELECT state, partial_snapshot FROM runs WHERE id = ?", (run_id,)).fetchone()
            if row is None or row[0] not in sources or row[0] in _TERMINAL_VALUES:
                self._require_run(conn, run_id)
                return False
            # The one call that ends the run (the transaction holds the write lock from the
            # read above): its calls are settled first, so that a partial result, the last
            # snapshot, shows them as their records say (``_fresh_snapshot``).
            if settle_reason is not None:
                self._settle(conn, run_id, settle_reason, at)
            # Its partial result as of its end, whole (the last checkpoint and the snapshots
            # after it): a terminal run's is read as stored, never rebuilt.
            whole, upto = self._partial_now(conn, run_id, row[1])
            if result is None and partial:
                result = self._fresh_snapshot(conn, run_id, whole)
            conn.execute(
                "UPDATE runs SET state = ?, reason = ?, ended_at = ?, result = ?, partial = ?, error = ?, "
                "receipt = coalesce(?, receipt), partial_snapshot = ?, partial_seq = ? WHERE id = ?",
                (state.value, reason, at, result, int(partial), error, receipt, whole, upto, run_id),
            )
            if groups_ended_at is not None:
                self._end_groups(conn, run_id, groups_ended_at)
            return True

    def _partial_now(
        self, conn: sqlite3.Connection, run_id: str, checkpoint: str | None
    ) -> tuple[str | None, int | None]:
        """A live run's partial result now (its text) and the last event in it: its last
        checkpoint (``partial_snapshot``, as of event ``partial_seq``) with the run's own
        ``step_snapshot`` events after it folded in, as the daemon folded them."""
        row = conn.execute("SELECT partial_seq, last_seq FROM runs WHERE id = ?", (run_id,)).fetchone()
        after = row[0] if row is not None and row[0] is not None else 0
        upto = row[1] if row is not None else after
        rows = conn.execute(
            "SELECT data FROM events WHERE run_id = ? AND seq > ? AND kind = 'step_snapshot' ORDER BY seq",
            (run_id, after),
        ).fetchall()
        if not rows:
            return checkpoint, upto
        obj = _loads(checkpoint)
        whole: dict[str, Any] | None = obj if isinstance(obj, dict) else None
        before = whole
        for (data,) in rows:
            try:
                delta = json.loads(data)
                if isinstance(delta, dict) and delta.get("_id") == run_id:
                    whole = fold_snapshot(whole, delta)
            except (TypeError, ValueError):
                continue  # malformed: the daemon did not fold it either
        return (checkpoint if whole is before else dumps(whole)), upto

    def _fresh_snapshot(self, conn: sqlite3.Connection, run_id: str, snapshot: str | None) -> str | None:
        """The last step snapshot, as a partial result: its calls are as that step left them
        (a call that ran since said `not_started`), so they are replaced by the calls' own
        records, which every later event of theirs updated (and settling closed)."""
        obj = _loads(snapshot)
        if not isinstance(obj, dict) or not isinstance(obj.get("tool_calls"), list):
            return snapshot
        calls = self._tool_calls(conn, [run_id])[run_id]
        if not calls:
            return snapshot
        return dumps({**obj, "tool_calls": calls})

    def record_cancel(
        self, run_id: str, reason: str, at: float, stop_deadline: float, detail: str | None = None
    ) -> bool:
        # The first cancel's facts win; a terminal run takes none.
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                "UPDATE runs SET cancel_reason = ?, cancel_requested_at = ?, stop_deadline = ?, stop_detail = ? "
                "WHERE id = ? AND cancel_requested_at IS NULL "
                f"AND state NOT IN ({_marks(_TERMINAL_VALUES)})",
                (reason, at, stop_deadline, detail, run_id, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    def record_deadline(self, run_id: str, deadline: float) -> bool:
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                "UPDATE runs SET deadline = ? WHERE id = ? AND deadline IS NULL "
                f"AND state NOT IN ({_marks(_TERMINAL_VALUES)})",
                (deadline, run_id, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    def set_partial(self, run_id: str, snapshot_id: object, snapshot: str, seq: int | None = None) -> bool:
        with self._tx(durable=False) as conn:
            cur = conn.execute(
                "UPDATE runs SET partial_snapshot = ?, partial_seq = ? WHERE id = ? AND id IS ? "
                f"AND state NOT IN ({_marks(_TERMINAL_VALUES)})",
                (snapshot, seq, run_id, snapshot_id if isinstance(snapshot_id, str) else None, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    def set_receipt(self, run_id: str, receipt: str) -> bool:
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                "UPDATE runs SET receipt = ? WHERE id = ? AND "
                f"(state NOT IN ({_marks(_TERMINAL_VALUES)}) OR receipt IS NULL)",
                (receipt, run_id, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    def record_process(self, run_id: str, fields: dict[str, object]) -> bool:
        names = list(fields)
        sets = ", ".join(f"{name} = coalesce(?, {name})" for name in names)
        with self._tx(durable=True) as conn:
            cur = conn.execute(
                f"UPDATE runs SET {sets} WHERE id = ? AND state NOT IN ({_marks(_TERMINAL_VALUES)})",
                (*(fields[n] for n in names), run_id, *_TERMINAL_VALUES),
            )
            return self._changed(conn, run_id, cur)

    # -- process groups --------------------------------------------------------------

    def add_group(self, run_id: str, pgid: int, kind: str, name: str, at: float, on_stop: str | None = None) -> None:
        with self._tx(durable=True) as conn:
            self._require_run(conn, run_id)
            # A pgid can be reused by a new group after the old one ended.
            conn.execute(
                "INSERT INTO process_groups (run_id, pgid, kind, name, alive, added_at, on_stop) "
                "VALUES (?, ?, ?, ?, 1, ?, ?) ON CONFLICT (run_id, pgid) DO UPDATE SET "
                "kind = excluded.kind, name = excluded.name, alive = 1, "
                "added_at = excluded.added_at, ended_at = NULL, on_stop = excluded.on_stop",
                (run_id, pgid, kind, name, at, on_stop),
            )

    def remove_group(self, run_id: str, pgid: int, at: float) -> bool:
        with self._tx(durable=False) as conn:
            cur = conn.execute(
                "UPDATE process_groups SET alive = 0, ended_at = ? WHERE run_id = ? AND pgid = ? AND alive = 1",
                (at, run_id, pgid),
            )
            return self._changed(conn, run_id, cur)

    def end_groups(self, run_id: str, at: float) -> int:
        with self._tx(durable=False) as conn:
            self._require_run(conn, run_id)
            return self._end_groups(conn, run_id, at)

    def _end_groups(self, conn: sqlite3.Connection, run_id: str, at: float) -> int:
        cur = conn.execute(
            "UPDATE process_groups SET alive = 0, ended_at = ? WHERE run_id = ? AND alive = 1",
            (at, run_id),
        )
        return cur.rowcount

    # -- events ----------------------------------------------------------------------

    def put_events(self, run_id: str, items: Sequence[tuple[int, str, str, float]]) -> int:
        with self._tx(durable=False) as conn:
            self._require_run(conn, run_id)
            new = 0
            for seq, kind, data, ts in items:
                cur = conn.execute(
                    "INSERT INTO events (run_id, seq, ts, kind, data) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id, seq) DO NOTHING",
                    (run_id, seq, ts, kind, data),
                )
                new += cur.rowcount
            if items:
                conn.execute(
                    "UPDATE runs SET last_seq = max(last_seq, ?) WHERE id = ?",
                    (max(seq for seq, _k, _d, _t in items), run_id),
                )
            return new

    def events_page(
        self, run_id: str, after_seq: int, limit: int, max_bytes: int | None
    ) -> tuple[list[EventRecord], bool]:
        out: list[EventRecord] = []
        size = 0
        more = False
        with self._read() as conn:
            # One row past the limit tells whether more follow; rows are read lazily, so
            # a page cut by its size reads one row past the cut, not the whole run.
            cur = conn.execute(
                "SELECT seq, ts, kind, data FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, limit + 1),
            )
            for seq, ts, kind, data in cur:
                size += len(data)
                if len(out) >= limit or (out and max_bytes is not None and size > max_bytes):
                    more = True
                    break
                out.append(EventRecord(seq=seq, ts=ts, kind=kind, data=json.loads(data)))
            cur.close()
            if not out:
                self._require_run(conn, run_id)
        return out, more

    def append_events(
        self, run_id: str, items: Sequence[tuple[str, str, float]], *, durable: bool = False
    ) -> list[int]:
        with self._tx(durable=durable) as conn:
            return self._append(conn, run_id, items)

    def events_after(self, run_id: str, after_seq: int, limit: int) -> list[EventRecord]:
        with self._read() as conn:
            rows = conn.execute(
                "SELECT seq, ts, kind, data FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, limit),
            ).fetchall()
            if not rows:
                self._require_run(conn, run_id)
        return [EventRecord(seq=seq, ts=ts, kind=kind, data=json.loads(data)) for seq, ts, kind, data in rows]

    def _events_of(self, run_id: str, kinds: tuple[str, ...], key: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """The run's events of these kinds, in order, as (kind, data): those whose data is
        an object with a text at ``key`` (anything else is skipped)."""
        marks = ", ".join("?" * len(kinds))
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT kind, data FROM events WHERE run_id = ? AND kind IN ({marks}) ORDER BY seq",  # noqa: S608
                (run_id, *kinds),
            ).fetchall()
        for kind, data in rows:
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get(key), str):
                yield kind, obj

    def steering_texts(self, run_id: str) -> tuple[list[str], list[str], list[str]]:
        """The steering texts the daemon sent the run's runner (``steer_sent`` events, but
        for one a ``steer_unsent`` after it says never went in), those the runner said it
        read (``steering`` events, ``queued``), and those it said became something
        (``applied``, ``unapplied``), in order."""
        sent: list[str] = []
        read: list[str] = []
        settled: list[str] = []
        for kind, obj in self._events_of(run_id, ("steer_sent", "steer_unsent", "steering"), "text"):
            if kind == "steer_sent":
                sent.append(obj["text"])
            elif kind == "steer_unsent":
                if obj["text"] in sent:  # the last one sent with this text (one at a time per run)
                    del sent[len(sent) - 1 - sent[::-1].index(obj["text"])]
            elif obj.get("state") == "queued":
                read.append(obj["text"])
            elif obj.get("state") in ("applied", "unapplied"):
                settled.append(obj["text"])
        return sent, read, settled

    def approvals_sent(self, run_id: str) -> dict[str, dict[str, Any]]:
        """The answers the daemon sent the run's runner (``approval_sent`` events): call id
        -> ``{"decision": "approve"|"deny", "reason": ...}``, the first one per call (the
        one its runner takes), unless an ``approval_unsent`` after it says none of it went
        into the channel (the call could be answered again)."""
        out: dict[str, dict[str, Any]] = {}
        for kind, obj in self._events_of(run_id, ("approval_sent", "approval_unsent"), "call_id"):
            if kind == "approval_unsent":
                out.pop(obj["call_id"], None)
            elif isinstance(obj.get("decision"), str) and obj["call_id"] not in out:
                reason = obj.get("reason")
                out[obj["call_id"]] = {
                    "decision": obj["decision"],
                    "reason": reason if isinstance(reason, str) else None,
                }
        return out

    # -- tool calls ------------------------------------------------------------------

    def upsert_tool_call(
        self,
        run_id: str,
        call_id: str,
        step: int,
        state: str,
        rank: int,
        record: str,
        at: float,
    ) -> bool:
        with self._tx(durable=False) as conn:
            self._require_run(conn, run_id)
            cur = conn.execute(
                "INSERT INTO tool_calls (run_id, call_id, step, state, rank, record, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, call_id) DO UPDATE SET "
                "step = excluded.step, state = excluded.state, rank = excluded.rank, "
                "record = excluded.record, updated_at = excluded.updated_at "
                "WHERE excluded.rank > tool_calls.rank "
                f"OR (excluded.rank = tool_calls.rank AND tool_calls.rank < {_RANK_FINAL})",
                (run_id, call_id, step, state, rank, record, at),
            )
            return cur.rowcount == 1

    def settle_tool_calls(
        self,
        run_id: str,
        reason: str,
        at: float,
        pending_reason: str | None = None,
        stop_effects: tuple[str, str] | None = None,
    ) -> int:
        with self._tx(durable=False) as conn:
            self._require_run(conn, run_id)
            return self._settle(conn, run_id, reason, at, pending_reason, stop_effects)

    def _settle(
        self,
        conn: sqlite3.Connection,
        run_id: str,
        reason: str,
        at: float,
        pending_reason: str | None = None,
        stop_effects: tuple[str, str] | None = None,
    ) -> int:
        """Running calls become outcome-unknown; announced ones never ran.

        ``pending_reason`` (default ``reason``) is the announced ones' reason;
        ``stop_effects`` = (running, announced) ``stop_effect`` values, under a stop.
        """
        # Rewritten here rather than with SQL json_set: records are Python's JSON (which
        # may hold NaN), not necessarily SQLite's.
        rows = conn.execute(
            "SELECT call_id, rank, record FROM tool_calls WHERE run_id = ? AND rank IN (?, ?)",
            (run_id, _RANK_PENDING, _RANK_RUNNING),
        ).fetchall()
        for call_id, rank, text in rows:
            record = json.loads(text)
            if rank == _RANK_RUNNING:
                state, new_rank = ToolCallState.UNKNOWN, _RANK_UNKNOWN
                record["reason"] = reason
            else:
                state, new_rank = ToolCallState.NOT_STARTED, _RANK_FINAL
                record["reason"] = reason if pending_reason is None else pending_reason
            if stop_effects is not None:
                record["stop_effect"] = stop_effects[0 if rank == _RANK_RUNNING else 1]
            if record.get("approval") == Approval.PENDING:
                # The run's end ended the wait: no answer will come (a lost run's record
                # said "pending", with a deadline, for ever).
                record["approval"], record["approval_deadline"] = Approval.REJECTED.value, None
            record["state"] = state.value
            conn.execute(
                "UPDATE tool_calls SET state = ?, rank = ?, record = ?, updated_at = ? "
                "WHERE run_id = ? AND call_id = ?",
                (state.value, new_rank, dumps(record), at, run_id, call_id),
            )
        return len(rows)

    def tool_calls(self, run_id: str) -> list[dict[str, Any]]:
        with self._read() as conn:
            self._require_run(conn, run_id)
            return self._tool_calls(conn, [run_id])[run_id]

    def _tool_calls(self, conn: sqlite3.Connection, run_ids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {r: [] for r in run_ids}
        for run_id, record in conn.execute(
            f"SELECT run_id, record FROM tool_calls WHERE run_id IN ({_marks(run_ids)}) ORDER BY step, rowid",
            tuple(run_ids),
        ):
            out[run_id].append(json.loads(record))
        return out

    def _groups(self, conn: sqlite3.Connection, run_ids: Sequence[str]) -> dict[str, list[GroupRecord]]:
        out: dict[str, list[GroupRecord]] = {r: [] for r in run_ids}
        for run_id, pgid, kind, name, alive, added_at, ended_at, on_stop in conn.execute(
            "SELECT run_id, pgid, kind, name, alive, added_at, ended_at, on_stop FROM process_groups "
            f"WHERE run_id IN ({_marks(run_ids)}) ORDER BY added_at, pgid",
            tuple(run_ids),
        ):
            out[run_id].append(
                GroupRecord(
                    pgid=pgid,
                    kind=kind,
                    name=name,
                    alive=bool(alive),
                    added_at=added_at,
                    ended_at=ended_at,
                    on_stop=on_stop,
                )
            )
        return out

    # -- reading runs ----------------------------------------------------------------

    def _runs(self, conn: sqlite3.Connection, where: str, params: Sequence[object]) -> list[RunRecord]:
        rows = conn.execute(f"SELECT {_RUN_COLUMNS} FROM runs {where}", tuple(params)).fetchall()
        ids = [row[0] for row in rows]
        groups: dict[str, list[GroupRecord]] = {}
        calls: dict[str, list[dict[str, Any]]] = {}
        # SQLite caps host parameters (32766 here); chunk to stay far below it.
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            groups.update(self._groups(conn, chunk))
            calls.update(self._tool_calls(conn, chunk))
        records = [_run_record(row, groups[row[0]], calls[row[0]]) for row in rows]
        for row, record in zip(rows, records, strict=True):
            if record["state"] not in TERMINAL_STATES:
                # The checkpoint and the snapshots after it: the partial result now.
                text, _ = self._partial_now(conn, record["id"], row[11])
                if text is not row[11]:
                    record["partial_snapshot"] = _loads(text)
        return records

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._read() as conn:
            runs = self._runs(conn, "WHERE id = ?", (run_id,))
        return runs[0] if runs else None

    def run_states(self, run_ids: Sequence[str]) -> dict[str, str]:
        """The state of each of these runs that exists (one query per 500 ids)."""
        out: dict[str, str] = {}
        with self._read() as conn:
            for i in range(0, len(run_ids), 500):
                chunk = run_ids[i : i + 500]
                rows = conn.execute(f"SELECT id, state FROM runs WHERE id IN ({_marks(chunk)})", chunk)
                out.update((str(r[0]), str(r[1])) for r in rows)
        return out

    def list_runs(
        self, limit: int, states: Sequence[RunState] | None, session_id: str | None, key: str | None = None
    ) -> list[RunRecord]:
        clauses: list[str] = []
        params: list[object] = []
        if key is not None:
            clauses.append("id IN (SELECT run_id FROM spawn_keys WHERE key = ?)")
            params.append(key)
        if states is not None:
            clauses.append(f"state IN ({_marks(states)})")
            params.extend(s.value for s in states)
        if session_id is not None:
            clauses.append("session_id = ?")
            params.append(session_id)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        with self._read() as conn:
            return self._runs(conn, f"{where} ORDER BY created_at DESC, rowid DESC LIMIT ?", (*params, limit))

    def live_runs(self) -> list[RunRecord]:
        with self._read() as conn:
            return self._runs(
                conn,
                f"WHERE state IN ({_marks(_LIVE_VALUES)}) ORDER BY created_at, rowid",
                _LIVE_VALUES,
            )


def _run_record(row: Sequence[Any], groups: list[GroupRecord], tool_calls: list[dict[str, Any]]) -> RunRecord:
    (
        run_id, session_id, state, reason, created_at, started_at, ended_at, timeout_s,
        spec, result, partial, partial_snapshot, error, receipt, pid, pid_start_time,
        pgid, tree_id, cgroup, containment, run_dir, last_seq, cancel_reason,
        cancel_requested_at, stop_deadline, deadline, stop_detail,
    ) = row  # fmt: skip
    return RunRecord(
        id=run_id,
        session_id=session_id,
        state=RunState(state),
        reason=reason,
        created_at=created_at,
        started_at=started_at,
        ended_at=ended_at,
        timeout_s=timeout_s,
        spec=json.loads(spec),
        result=_loads(result),
        partial=bool(partial),
        partial_snapshot=_loads(partial_snapshot),
        error=_loads(error),
        receipt=_loads(receipt),
        pid=pid,
        pid_start_time=pid_start_time,
        pgid=pgid,
        tree_id=tree_id,
        cgroup=cgroup,
        containment=containment,
        run_dir=run_dir,
        last_seq=last_seq,
        cancel_reason=cancel_reason,
        cancel_requested_at=cancel_requested_at,
        stop_deadline=stop_deadline,
        deadline=deadline,
        stop_detail=_loads(stop_detail),
        groups=groups,
        tool_calls=tool_calls,
    )
