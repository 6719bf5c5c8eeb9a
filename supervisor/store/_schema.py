"""The journal's SQLite schema, its migrations and how a connection is opened.

Migrations are append-only: schema version N is ``PRAGMA user_version = N`` after
``MIGRATIONS[:N]`` ran, each in its own transaction, so a crash mid-migration leaves the
previous version intact. A file from a newer agentd is refused, never downgraded.
Everything here runs on the journal's worker thread (see ``supervisor.store.journal``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from typing import Final

from supervisor.errors import JournalError
from supervisor.states import TERMINAL_STATES, RunState

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "BUSY_TIMEOUT_MS", "connect", "migrate"]

logger = logging.getLogger(__name__)

# How long a statement waits for a lock held by another connection (a second process
# reading the file, an external backup) before it fails, in milliseconds. The daemon's
# own writes are serialised on one thread and never wait for each other.
BUSY_TIMEOUT_MS: Final = 5_000

# The run states as version 1 knew them: a migration's text never changes once shipped.
_V1_STATES = "'queued', 'starting', 'running', 'cancelling', 'completed', 'failed', 'cancelled', 'lost'"
_ALL_STATES = ", ".join(f"'{s.value}'" for s in RunState)
_TERMINAL = ", ".join(f"'{s.value}'" for s in sorted(TERMINAL_STATES))

# Version 1: runs and their event log. ``last_seq`` is the per-run sequence counter; it
# lives on the run row so that assigning a number and inserting the event are one
# transaction (gapless) and survive restarts.
_V1 = f"""
CREATE TABLE runs (
    id               TEXT PRIMARY KEY NOT NULL,
    session_id       TEXT,
    state            TEXT NOT NULL CHECK (state IN ({_V1_STATES})),
    reason           TEXT,
    created_at       REAL NOT NULL,
    started_at       REAL,
    ended_at         REAL,
    timeout_s        REAL,
    spec             TEXT NOT NULL,
    result           TEXT,
    partial          INTEGER NOT NULL DEFAULT 0,
    partial_snapshot TEXT,
    error            TEXT,
    receipt          TEXT,
    pid              INTEGER,
    pid_start_time   REAL,
    pgid             INTEGER,
    tree_id          TEXT,
    cgroup           TEXT,
    containment      TEXT,
    run_dir          TEXT,
    last_seq         INTEGER NOT NULL DEFAULT 0
) STRICT;
CREATE INDEX runs_by_created ON runs (created_at);
CREATE INDEX runs_by_session ON runs (session_id, created_at);

CREATE TABLE events (
    run_id TEXT NOT NULL REFERENCES runs (id),
    seq    INTEGER NOT NULL,
    ts     REAL NOT NULL,
    kind   TEXT NOT NULL,
    data   TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) STRICT, WITHOUT ROWID;
"""

# Version 2: tool-call records, the process groups a run owns, and the guard that makes a
# terminal run final in the database itself. The guard backs up the WHERE clauses of the
# journal's compare-and-set updates: any statement, from any code, that would change a
# terminal run's facts aborts. Only the event counter may move (late events are history),
# and a receipt may be filled in once if the terminal write carried none.
_V2 = f"""
CREATE TABLE tool_calls (
    run_id     TEXT NOT NULL REFERENCES runs (id),
    call_id    TEXT NOT NULL,
    step       INTEGER NOT NULL,
    state      TEXT NOT NULL,
    rank       INTEGER NOT NULL,
    record     TEXT NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (run_id, call_id)
) STRICT;

CREATE TABLE process_groups (
    run_id   TEXT NOT NULL REFERENCES runs (id),
    pgid     INTEGER NOT NULL,
    kind     TEXT NOT NULL,
    name     TEXT NOT NULL,
    alive    INTEGER NOT NULL DEFAULT 1,
    added_at REAL NOT NULL,
    ended_at REAL,
    PRIMARY KEY (run_id, pgid)
) STRICT;

CREATE INDEX runs_live ON runs (created_at) WHERE state NOT IN ({_TERMINAL});

CREATE TRIGGER runs_terminal_is_final
BEFORE UPDATE ON runs
WHEN OLD.state IN ({_TERMINAL}) AND (
       NEW.id IS NOT OLD.id
    OR NEW.session_id IS NOT OLD.session_id
    OR NEW.state IS NOT OLD.state
    OR NEW.reason IS NOT OLD.reason
    OR NEW.created_at IS NOT OLD.created_at
    OR NEW.started_at IS NOT OLD.started_at
    OR NEW.ended_at IS NOT OLD.ended_at
    OR NEW.timeout_s IS NOT OLD.timeout_s
    OR NEW.spec IS NOT OLD.spec
    OR NEW.result IS NOT OLD.result
    OR NEW.partial IS NOT OLD.partial
    OR NEW.partial_snapshot IS NOT OLD.partial_snapshot
    OR NEW.error IS NOT OLD.error
    OR (OLD.receipt IS NOT NULL AND NEW.receipt IS NOT OLD.receipt)
    OR NEW.pid IS NOT OLD.pid
    OR NEW.pid_start_time IS NOT OLD.pid_start_time
    OR NEW.pgid IS NOT OLD.pgid
    OR NEW.tree_id IS NOT OLD.tree_id
    OR NEW.cgroup IS NOT OLD.cgroup
    OR NEW.containment IS NOT OLD.containment
    OR NEW.run_dir IS NOT OLD.run_dir
    OR NEW.last_seq < OLD.last_seq
)
BEGIN
    SELECT RAISE(ABORT, 'agentd journal: a terminal run is final');
END;

CREATE TRIGGER runs_live_not_deleted
BEFORE DELETE ON runs
WHEN OLD.state NOT IN ({_TERMINAL})
BEGIN
    SELECT RAISE(ABORT, 'agentd journal: a live run cannot be deleted');
END;
"""

# Version 3: a stop is durable intent and deadlines are absolute (DESIGN "Cancellation").
# ``cancel_reason``/``cancel_requested_at``/``stop_deadline`` are written (once, the first
# cancel) before a cancel is acknowledged, so a restarted daemon resumes the stop with the
# original reason and what is left of its grace; ``deadline`` is a run's timeout as a
# wall-clock time. A group's ``on_stop`` (a command's stop policy) tells path A whether it
# may SIGTERM that group at cancel time. The guard is rebuilt to cover the new columns.
_V3 = f"""
ALTER TABLE runs ADD COLUMN cancel_reason TEXT;
ALTER TABLE runs ADD COLUMN cancel_requested_at REAL;
ALTER TABLE runs ADD COLUMN stop_deadline REAL;
ALTER TABLE runs ADD COLUMN deadline REAL;
ALTER TABLE process_groups ADD COLUMN on_stop TEXT;

DROP TRIGGER runs_terminal_is_final;
CREATE TRIGGER runs_terminal_is_final
BEFORE UPDATE ON runs
WHEN OLD.state IN ({_TERMINAL}) AND (
       NEW.id IS NOT OLD.id
    OR NEW.session_id IS NOT OLD.session_id
    OR NEW.state IS NOT OLD.state
    OR NEW.reason IS NOT OLD.reason
    OR NEW.created_at IS NOT OLD.created_at
    OR NEW.started_at IS NOT OLD.started_at
    OR NEW.ended_at IS NOT OLD.ended_at
    OR NEW.timeout_s IS NOT OLD.timeout_s
    OR NEW.spec IS NOT OLD.spec
    OR NEW.result IS NOT OLD.result
    OR NEW.partial IS NOT OLD.partial
    OR NEW.partial_snapshot IS NOT OLD.partial_snapshot
    OR NEW.error IS NOT OLD.error
    OR (OLD.receipt IS NOT NULL AND NEW.receipt IS NOT OLD.receipt)
    OR NEW.pid IS NOT OLD.pid
    OR NEW.pid_start_time IS NOT OLD.pid_start_time
    OR NEW.pgid IS NOT OLD.pgid
    OR NEW.tree_id IS NOT OLD.tree_id
    OR NEW.cgroup IS NOT OLD.cgroup
    OR NEW.containment IS NOT OLD.containment
    OR NEW.run_dir IS NOT OLD.run_dir
    OR NEW.last_seq < OLD.last_seq
    OR NEW.cancel_reason IS NOT OLD.cancel_reason
    OR NEW.cancel_requested_at IS NOT OLD.cancel_requested_at
    OR NEW.stop_deadline IS NOT OLD.stop_deadline
    OR NEW.deadline IS NOT OLD.deadline
)
BEGIN
    SELECT RAISE(ABORT, 'agentd journal: a terminal run is final');
END;
"""

# Version 4: conversations and approvals. The run states gain ``awaiting_approval``: the
# runs table is rebuilt with the wider CHECK (SQLite cannot alter one), rowids and all,
# then its indexes and guards are made again (foreign keys are off for this migration,
# see ``_FOREIGN_KEYS_OFF``). ``sessions`` holds what a session has beyond its runs: when
# it was closed (it takes no new turn), and its browser profile (path, last use), which
# the daemon removes when the session is closed, idle too long, or the oldest beyond a
# bound.
_RUN_COLUMNS_V3 = (
    "id, session_id, state, reason, created_at, started_at, ended_at, timeout_s, spec, result, partial, "
    "partial_snapshot, error, receipt, pid, pid_start_time, pgid, tree_id, cgroup, containment, run_dir, "
    "last_seq, cancel_reason, cancel_requested_at, stop_deadline, deadline"
)
_V4 = f"""
CREATE TABLE runs_v4 (
    id               TEXT PRIMARY KEY NOT NULL,
    session_id       TEXT,
    state            TEXT NOT NULL CHECK (state IN ({_ALL_STATES})),
    reason           TEXT,
    created_at       REAL NOT NULL,
    started_at       REAL,
    ended_at         REAL,
    timeout_s        REAL,
    spec             TEXT NOT NULL,
    result           TEXT,
    partial          INTEGER NOT NULL DEFAULT 0,
    partial_snapshot TEXT,
    error            TEXT,
    receipt          TEXT,
    pid              INTEGER,
    pid_start_time   REAL,
    pgid             INTEGER,
    tree_id          TEXT,
    cgroup           TEXT,
    containment      TEXT,
    run_dir          TEXT,
    last_seq         INTEGER NOT NULL DEFAULT 0,
    cancel_reason    TEXT,
    cancel_requested_at REAL,
    stop_deadline    REAL,
    deadline         REAL
) STRICT;
INSERT INTO runs_v4 (rowid, {_RUN_COLUMNS_V3}) SELECT rowid, {_RUN_COLUMNS_V3} FROM runs ORDER BY rowid;
DROP TABLE runs;
ALTER TABLE runs_v4 RENAME TO runs;
CREATE INDEX runs_by_created ON runs (created_at);
CREATE INDEX runs_by_session ON runs (session_id, created_at);
CREATE INDEX runs_live ON runs (created_at) WHERE state NOT IN ({_TERMINAL});
{_V3[_V3.index("CREATE TRIGGER runs_terminal_is_final") :]}
CREATE TRIGGER runs_live_not_deleted
BEFORE DELETE ON runs
WHEN OLD.state NOT IN ({_TERMINAL})
BEGIN
    SELECT RAISE(ABORT, 'agentd journal: a live run cannot be deleted');
END;

CREATE TABLE sessions (
    session_id      TEXT PRIMARY KEY NOT NULL,
    created_at      REAL NOT NULL,
    closed_at       REAL,
    profile_dir     TEXT,
    profile_used_at REAL
) STRICT;
"""

# Version 5: spawn idempotency keys. A spawn may carry a key its client chose; the key
# and the run it created are written in the run's creation transaction, so a spawn
# repeated with that key (its answer lost, its client restarted) finds the run, across a
# restart too. One key names one run, and a run has at most one key.
_V5 = """
CREATE TABLE spawn_keys (
    key    TEXT PRIMARY KEY NOT NULL,
    run_id TEXT NOT NULL UNIQUE REFERENCES runs (id)
) STRICT;
"""

# Version 6: a run's partial result is checkpointed, not rewritten whole at each snapshot.
# ``partial_seq`` is the sequence number of the last event ``partial_snapshot`` folded in:
# the partial result now is that checkpoint plus the ``step_snapshot`` events after it
# (``Store`` rebuilds it so for every reader). NULL (a journal from before): the
# checkpoint may be older than any event, and folding them all over it is exact (a delta
# already in it changes nothing). The guard is rebuilt to cover the new column.
_V6_GUARD = _V3[_V3.index("CREATE TRIGGER runs_terminal_is_final") :].replace(
    "    OR NEW.deadline IS NOT OLD.deadline\n",
    "    OR NEW.deadline IS NOT OLD.deadline\n    OR NEW.partial_seq IS NOT OLD.partial_seq\n",
)
_V6 = f"""
ALTER TABLE runs ADD COLUMN partial_seq INTEGER;
DROP TRIGGER runs_terminal_is_final;
{_V6_GUARD}
"""

# Version 7: a stop's detail (``stop_detail``: what the daemon measured when it stopped the
# run for a reason of its own, a full disk's measurement), written in the statement that
# writes its intent (``cancel_reason``), so a restarted daemon's receipt carries it too.
# The guard is rebuilt to cover the new column.
_V7_GUARD = _V6_GUARD.replace(
    "    OR NEW.partial_seq IS NOT OLD.partial_seq\n",
    "    OR NEW.partial_seq IS NOT OLD.partial_seq\n    OR NEW.stop_detail IS NOT OLD.stop_detail\n",
)
_V7 = f"""
ALTER TABLE runs ADD COLUMN stop_detail TEXT;
DROP TRIGGER runs_terminal_is_final;
{_V7_GUARD}
"""

MIGRATIONS: Final[tuple[str, ...]] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7)
# Migrations that rebuild a table others reference: run with foreign keys off (SQLite's
# documented procedure), checked with foreign_key_check before they commit.
_FOREIGN_KEYS_OFF: Final = frozenset({4})
SCHEMA_VERSION: Final = len(MIGRATIONS)


def connect(path: str, *, target: int = SCHEMA_VERSION) -> sqlite3.Connection:
    """Open the journal file in WAL mode and migrate it to ``target``.

    Raises:
        JournalError: the file cannot be opened, is not a database, is damaged, is in a
            directory we cannot write, or carries a schema newer than this code.
    """
    try:
        # Specs and results may hold secrets: a new journal is private to its owner, and
        # SQLite gives the -wal and -shm files the main file's mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        raise JournalError(f"cannot open journal {path!r}: {exc}", path=path) from exc
    try:
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
        conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error as exc:
        raise JournalError(f"cannot open journal {path!r}: {exc}", path=path) from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise JournalError(f"journal {path!r}: expected journal_mode wal, got {mode!r}", path=path)
        # NORMAL between durable writes; the journal switches to FULL for the commits that
        # carry terminal facts (see supervisor.store.journal).
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA trusted_schema = OFF")
        migrate(conn, path=path, target=target)
    except sqlite3.Error as exc:
        conn.close()
        raise JournalError(f"journal {path!r} is unusable: {exc}", path=path) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(conn: sqlite3.Connection, *, path: str, target: int = SCHEMA_VERSION) -> int:
    """Bring the schema to version ``target``; returns the version found before.

    Raises:
        JournalError: the file's schema is newer than ``SCHEMA_VERSION``.
        sqlite3.Error: a migration failed (it was rolled back).
    """
    found = int(conn.execute("PRAGMA user_version").fetchone()[0])
    if found > SCHEMA_VERSION:
        raise JournalError(
            f"journal {path!r} has schema version {found}, newer than this agentd's "
            f"{SCHEMA_VERSION}: refusing to open it",
            path=path,
        )
    if found == 0 and _has_foreign_tables(conn):
        raise JournalError(f"journal {path!r} is an sqlite database that agentd did not create", path=path)
    for version in range(found + 1, target + 1):
        logger.info("journal %s: migrating schema to version %d", path, version)
        keys_off = version in _FOREIGN_KEYS_OFF
        if keys_off:
            # Outside any transaction (inside one the pragma does nothing).
            keys_were = int(conn.execute("PRAGMA foreign_keys").fetchone()[0])
            conn.execute("PRAGMA foreign_keys = OFF")
        try:
            # executescript commits any open transaction first, so the BEGIN is inside it:
            # the DDL and the new user_version commit together or not at all.
            conn.executescript(f"BEGIN IMMEDIATE;\n{MIGRATIONS[version - 1]}\nPRAGMA user_version = {version};")
            if keys_off and conn.execute("PRAGMA foreign_key_check").fetchone() is not None:
                raise sqlite3.IntegrityError(f"migration to version {version} broke a foreign key")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            if keys_off:
                conn.execute(f"PRAGMA foreign_keys = {'ON' if keys_were else 'OFF'}")
    return found


def _has_foreign_tables(conn: sqlite3.Connection) -> bool:
    row = conn.execute("SELECT count(*) FROM sqlite_schema WHERE type = 'table'").fetchone()
    return bool(row[0])
