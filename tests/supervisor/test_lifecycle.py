"""A run's end's bookkeeping (``supervisor.core._book.take_result_records``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


async def test_a_runs_end_takes_thousands_of_result_records_in_a_few_journal_writes(tmp_path: Path) -> None:
    # One write (one commit) per record of the result: 5,000 records held the journal's
    # thread 3 s at the run's end, every other run's and client's call queued behind.
    import time

    from supervisor.core._book import RESULT_RECORDS_PER_WRITE, take_result_records
    from supervisor.core._run import Run
    from supervisor.core.token import CancelToken
    from supervisor.store.journal import Journal

    writes: list[Any] = []

    class Book:
        journal: Journal

        async def write(self, run: Run, what: str, direct: Any, predicted: Any) -> Any:
            writes.append(what)
            return await direct(self.journal)

    n = 3 * RESULT_RECORDS_PER_WRITE + 1
    records: list[dict[str, Any]] = [
        {"id": f"c{i}", "name": "nope", "arguments": "{}", "step": 1, "state": "failed", "error": "unknown tool"}
        for i in range(n)
    ]
    records.insert(5, {"id": "bad", "state": "nonsense"})  # skipped, said in the log
    async with await Journal.open(tmp_path / "j.db") as journal:
        await journal.create_run("r", session_id=None, spec={"task": "t"}, created_at=time.time(), timeout_s=None)
        await journal.upsert_tool_call("r", {**records[0], "state": "running"})
        book = Book()
        book.journal = journal
        run = Run(run_id="r", session_id=None, spec={}, timeout_s=None, token=CancelToken("r"))
        await take_result_records(book, run, {"tool_calls": records})  # type: ignore[arg-type]  # (only write)
        stored = await journal.tool_calls("r")
    assert [r["id"] for r in stored] == [f"c{i}" for i in range(n)]
    assert {r["state"] for r in stored} == {"failed"}  # the running one moved on
    assert len(writes) <= 4, len(writes)
