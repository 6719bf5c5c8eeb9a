"""The emitter: one valid line per event, bounded; fallback file; atomic result file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from subagent.emit import Emitter, open_records, record_paths, set_log_levels
from subagent.events import MAX_EVENT_LINE_BYTES, EventKind, decode_event_line, decode_result


def _pipe() -> tuple[int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, w


def _read_all(fd: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_an_event_is_one_decodable_line(tmp_path: Path) -> None:
    r, w = _pipe()
    e = Emitter(tmp_path, err_fd=w, out_fd=w)
    e.emit(EventKind.PROCESS_GROUP, pgid=5, pid=5, kind="command", name="x\ny", alive=True)
    data = _read_all(r)
    assert data.count(b"\n") == 1
    ev = decode_event_line(data)
    assert not hasattr(ev, "problem") and ev.data["kind"] == "command"  # type: ignore[union-attr]
    os.close(r)
    os.close(w)


def records(tmp_path: Path) -> tuple[Path, tuple[int, int]]:
    run_dir = tmp_path / "t-1"
    run_dir.mkdir()
    fds = open_records(run_dir)
    assert fds is not None
    return run_dir, fds


def test_an_oversized_event_is_cut_to_fit_a_line(tmp_path: Path) -> None:
    r, w = _pipe()
    os.close(r)  # nobody reads: events go to the events file
    run_dir, fds = records(tmp_path)
    e = Emitter(run_dir, records=fds, err_fd=w, out_fd=w)
    huge = "x" * (MAX_EVENT_LINE_BYTES * 2)
    e.emit(EventKind.STEP_SNAPSHOT, step=1, progress=huge, tool_calls=[{"output": huge}], _id="r")
    assert e.stderr_broken
    (line,) = record_paths(run_dir)[0].read_bytes().splitlines()
    assert len(line) < MAX_EVENT_LINE_BYTES
    assert json.loads(line)["progress"].endswith("...[cut]")
    os.close(w)


def test_the_result_goes_to_stdout_and_to_the_result_file_beside_the_run_dir(tmp_path: Path) -> None:
    r, w = _pipe()
    run_dir, fds = records(tmp_path)
    events, result = record_paths(run_dir)
    assert (events.parent, result.parent) == (tmp_path, tmp_path)  # out of the run dir: its tools'
    result.write_bytes(b"x" * 100_000)  # longer than the result: replaced whole
    e = Emitter(run_dir, records=fds, err_fd=w, out_fd=w)
    e.result({"status": "completed", "final_text": "ok"})
    assert decode_result(_read_all(r))["final_text"] == "ok"  # type: ignore[index]
    assert decode_result(result.read_bytes())["status"] == "completed"  # type: ignore[index]
    assert os.get_inheritable(fds[0]) is False and os.get_inheritable(fds[1]) is False  # no tool gets them
    os.close(r)
    os.close(w)


def test_a_broken_stdout_does_not_lose_the_result_file(tmp_path: Path) -> None:
    r, w = _pipe()
    os.close(r)
    run_dir, fds = records(tmp_path)
    e = Emitter(run_dir, records=fds, err_fd=w, out_fd=w)
    e.result({"status": "cancelled"})
    assert decode_result(record_paths(run_dir)[1].read_bytes())["status"] == "cancelled"  # type: ignore[index]
    os.close(w)


def test_an_oversized_result_is_cut_to_fit_and_says_so(tmp_path: Path) -> None:
    from subagent import emit

    out = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)  # a file: nobody needs to read it
    run_dir, fds = records(tmp_path)
    e = Emitter(run_dir, records=fds, err_fd=out, out_fd=out)
    huge = "y" * (emit.MAX_RESULT_BYTES + 10)
    e.result({"status": "completed", "messages": [{"role": "tool", "content": huge}]})
    data = record_paths(run_dir)[1].read_bytes()
    assert len(data) <= emit.MAX_RESULT_BYTES
    decoded = decode_result(data)
    assert decoded["result_truncated"] is True and decoded["status"] == "completed"  # type: ignore[index]
    os.close(out)


def test_a_large_history_is_cut_before_the_turns_answer(tmp_path: Path) -> None:
    # A session's history travels in every result: once it was large (many steers), each
    # turn's own answer was cut to fit (and then showed twice in the session's history).
    from subagent import emit

    out = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    run_dir, fds = records(tmp_path)
    e = Emitter(run_dir, records=fds, err_fd=out, out_fd=out)
    history = [{"role": "user", "content": f"steer {i} " + "s" * 1000} for i in range(9000)]  # ~9 MiB
    answer = "The answer. " + "a" * 100_000
    e.result(
        {"status": "completed", "final_text": answer, "messages": [*history, {"role": "assistant", "content": answer}]}
    )
    data = record_paths(run_dir)[1].read_bytes()
    assert len(data) <= emit.MAX_RESULT_BYTES
    decoded = decode_result(data)
    assert isinstance(decoded, dict)
    assert decoded["result_truncated"] is True and decoded["final_text"] == answer
    os.close(out)


def test_make_event_accepts_a_data_field_named_kind() -> None:
    from subagent.events import make_event

    ev = make_event(EventKind.PROCESS_GROUP, pgid=1, pid=1, kind="command", name="x", alive=True)
    assert ev.kind == EventKind.PROCESS_GROUP and ev.data["kind"] == "command"


def test_log_levels_are_set_where_they_differ_and_a_level_already_set_keeps_every_cache() -> None:
    """The zygote sets a runner's levels once; a forked runner finds them set and leaves
    the zygote's loggers alone (setting a level clears each logger's cache: a
    copy-on-write fault per logger in a forked runner)."""
    root, mine = logging.getLogger(), logging.getLogger("subagent")
    saved = root.level, mine.level
    probe = logging.getLogger("tests.subagent.levels_probe")
    try:
        set_log_levels()
        assert (root.level, mine.level) == (logging.WARNING, logging.INFO)
        probe.isEnabledFor(logging.DEBUG)
        assert probe._cache  # cached under these levels
        set_log_levels()
        assert probe._cache, "a level already set cleared the caches"
        mine.setLevel(logging.DEBUG)
        probe.isEnabledFor(logging.DEBUG)
        set_log_levels()
        assert mine.level == logging.INFO and not probe._cache  # changed: cleared, as setLevel does
    finally:
        root.setLevel(saved[0])
        mine.setLevel(saved[1])
