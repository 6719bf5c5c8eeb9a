from subagent.events import BadLine, Event, EventKind, encode_event, make_event
from supervisor.core.progress import LineSplitter


def test_events_split_across_chunks_are_reassembled() -> None:
    line = encode_event(make_event(EventKind.STEP_STARTED, step=1))
    s = LineSplitter()
    assert s.feed(line[:5]) == []
    out = s.feed(line[5:] + encode_event(make_event(EventKind.STEP_STARTED, step=2)))
    assert [e.data["step"] for e in out if isinstance(e, Event)] == [1, 2]


def test_garbage_becomes_bad_lines_and_does_not_stop_the_stream() -> None:
    s = LineSplitter()
    out = s.feed(b'Traceback (most recent call last):\n[1,2]\n{"event":"nope"}\n\xff\xfe\n')
    out += s.feed(encode_event(make_event(EventKind.LOG, level="info", message="ok")))
    assert [type(x) for x in out] == [BadLine, BadLine, BadLine, BadLine, Event]
    assert isinstance(out[2], BadLine) and "unknown event kind" in out[2].problem


def test_an_overlong_line_is_reported_once_and_the_next_line_still_parses() -> None:
    s = LineSplitter(max_line=100)
    out = s.feed(b"x" * 150)
    out += s.feed(b"y" * 150)
    out += s.feed(b"\n" + encode_event(make_event(EventKind.STEP_STARTED, step=3)))
    assert len(out) == 2
    assert isinstance(out[0], BadLine) and "longer than 100" in out[0].problem
    assert isinstance(out[1], Event) and out[1].data["step"] == 3


def test_an_unterminated_last_line_is_decoded_at_close() -> None:
    s = LineSplitter()
    line = encode_event(make_event(EventKind.STEP_STARTED, step=9)).rstrip(b"\n")
    assert s.feed(line) == []
    out = s.close()
    assert isinstance(out[0], Event) and out[0].data["step"] == 9


def test_event_lines_python_reads_but_the_daemon_could_not_keep_are_decoded_totally() -> None:
    s = LineSplitter()
    out = s.feed(
        b'{"event":"log","ts":1' + b"0" * 400 + b"}\n"  # no float holds it: OverflowError
        b'{"event":"log","ts":NaN,"x":Infinity,"y":-1e400}\n'  # NaN: the journal's NOT NULL
        b'{"event":"log","m":' + b"[" * 5000 + b"]" * 5000 + b"}\n"  # RecursionError
        b'{"event":"log","m":' + b"[" * 65 + b"]" * 65 + b"}\n"  # decodable, too deep to keep
        b'{"event":"log","m":' + b"[" * 63 + b"]" * 63 + b"}\n"  # deep enough, kept
    )
    assert [type(x) for x in out] == [Event, Event, BadLine, BadLine, Event]
    assert isinstance(out[0], Event) and isinstance(out[0].ts, float) and out[0].ts > 1e9
    assert isinstance(out[1], Event) and out[1].ts > 1e9 and out[1].data == {"x": None, "y": None, "ts_replaced": True}
    # Too deep for the decoder (RecursionError), or for the bound (with a higher limit).
    assert isinstance(out[2], BadLine) and out[2].problem.startswith("json nested ")
    assert isinstance(out[3], BadLine) and out[3].problem == "json nested more than 64 deep"


def test_integers_beyond_64_bits_in_an_event_line_become_null() -> None:
    out = LineSplitter().feed(
        b'{"event":"process_group","pgid":9223372036854775808,"pid":-9223372036854775808,"n":1' + b"0" * 5000 + b"}\n"
    )
    assert isinstance(out[0], Event)
    assert out[0].data == {"pgid": None, "pid": -(2**63), "n": None, "ts_replaced": True}  # (no ts: now)


async def test_an_approval_deadline_of_true_is_no_deadline() -> None:
    from supervisor.core.approvals import RunApprovals

    p = RunApprovals().add({"call_id": "c1", "deadline": True})
    assert p is not None and p.deadline is None and p.due is None
