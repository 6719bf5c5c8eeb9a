"""Where a run's events come from: a re-adopted run's events file (``FileSource``)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from subagent.emit import record_paths
from subagent.events import BadLine, Event, EventKind, encode_event, make_event
from supervisor.core import _sources
from supervisor.core._sources import READ_CHUNK_BYTES, FileSource


def lines(first: int, n: int) -> bytes:
    return b"".join(
        encode_event(make_event(EventKind.LOG, level="info", message=f"m{i} " + "x" * 300))
        for i in range(first, first + n)
    )


async def test_a_readopted_runs_big_events_file_is_read_in_bounded_chunks_off_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At a restart the events file holds all a runner wrote while no daemon read it: one
    # read() of it on the Trio thread stalled every task of the daemon, and held it whole.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = record_paths(run_dir)[0]
    path.write_bytes(lines(0, 12_000))
    assert path.stat().st_size > 3 * READ_CHUNK_BYTES
    source = FileSource(None, run_dir)  # type: ignore[arg-type]  # (its tree is not read here)
    fed: list[int] = []
    feed = source._splitter.feed
    monkeypatch.setattr(source._splitter, "feed", lambda data: (fed.append(len(data)), feed(data))[1])
    on_trio_thread: list[bool] = []

    def watched_open(*args: Any, **kwargs: Any) -> Any:
        on_trio_thread.append(threading.current_thread() is threading.main_thread())
        return open(*args, **kwargs)

    monkeypatch.setattr(_sources, "open", watched_open, raising=False)
    got: list[str] = []
    batches: list[int] = []

    async def on_items(items: list[Event | BadLine]) -> None:
        batches.append(len(items))  # what one chunk brought, handed on together
        for item in items:
            assert isinstance(item, Event), item
            got.append(item.data["message"].split()[0])

    await source.read_once(on_items)
    assert got == [f"m{i}" for i in range(12_000)]
    assert max(fed) <= READ_CHUNK_BYTES and len(fed) >= 3, fed
    assert len(batches) == len(fed), (batches, fed)
    assert on_trio_thread and not any(on_trio_thread)
    with path.open("ab") as f:  # what it appends next is read from where the last read ended
        f.write(lines(12_000, 3))
    await source.read_once(on_items)
    assert got[-4:] == ["m11999", "m12000", "m12001", "m12002"] and len(got) == 12_003
