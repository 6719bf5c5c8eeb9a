"""A read-only view of the journal file, for a CLI with no daemon (``agentd logs``).

Stdlib only, no trio. Opens ``<state_dir>/agentd.sqlite3`` with SQLite's ``mode=ro``: it
never creates, migrates or writes the database, so it is safe beside a running daemon (in
WAL mode a reader never blocks the writer, and sees only committed events) and after one
has stopped. Events come out in the shape of the control socket's ``events`` op:
``{"seq", "ts", "kind", "data"}``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from supervisor.errors import JournalError, RunNotFound

__all__ = ["JournalReader"]

# Events read per query.
PAGE: Final = 1000
# How long a read waits for a lock (a checkpoint in progress), in seconds.
BUSY_TIMEOUT_S: Final = 5.0


class JournalReader:
    """A read-only connection to a journal file. Use as a context manager."""

    def __init__(self, path: Path) -> None:
        """Open the file read-only.

        Raises:
            JournalError: no such file, not a journal, or one newer than this agentd.
        """
        self.path = path
        try:
            found = path.is_file()
        except OSError as exc:  # a state dir under a directory this user cannot search
            raise JournalError(f"cannot read the journal {str(path)!r}: {exc.strerror or exc}", path=str(path)) from exc
        if not found:
            raise JournalError(f"no journal at {str(path)!r} (is this the daemon's state dir?)", path=str(path))
        try:
            self._conn = sqlite3.connect(
                f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None
            )
        except sqlite3.Error as exc:
            raise JournalError(f"cannot open the journal {str(path)!r}: {exc}", path=str(path)) from exc
        try:
            from supervisor.store._schema import SCHEMA_VERSION

            version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
            if not 1 <= version <= SCHEMA_VERSION:
                raise JournalError(
                    f"the journal {str(path)!r} has schema version {version}; this agentd reads 1..{SCHEMA_VERSION}",
                    path=str(path),
                )
        except sqlite3.Error as exc:
            self._conn.close()
            raise JournalError(f"cannot read the journal {str(path)!r}: {exc}", path=str(path)) from exc
        except BaseException:
            self._conn.close()
            raise

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def run_state(self, run_id: str) -> str:
        """The run's state as journaled.

        Raises:
            RunNotFound: no such run in this journal.
            JournalError: the file cannot be read.
        """
        row = self._query("SELECT state FROM runs WHERE id = ?", (run_id,))
        if not row:
            raise RunNotFound(run_id)
        return str(row[0][0])

    def events_after(self, run_id: str, after_seq: int = 0) -> Iterator[dict[str, Any]]:
        """Every journaled event of the run with ``seq > after_seq``, in order, page by page.

        Raises:
            RunNotFound: no such run in this journal.
            JournalError: the file cannot be read.
        """
        self.run_state(run_id)
        while True:
            rows = self._query(
                "SELECT seq, ts, kind, data FROM events WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (run_id, after_seq, PAGE),
            )
            for seq, ts, kind, data in rows:
                yield {"seq": seq, "ts": ts, "kind": kind, "data": json.loads(data)}
            if len(rows) < PAGE:
                return
            after_seq = rows[-1][0]

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        try:
            return self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise JournalError(f"cannot read the journal {str(self.path)!r}: {exc}", path=str(self.path)) from exc
