"""TurnAssembler: which streamed tool calls may run, and why the others may not."""

from __future__ import annotations

from subagent.model.provider import REASON_ARGS_INCOMPLETE, REASON_TURN_INCOMPLETE, TurnAssembler


def test_a_finished_turn_with_valid_arguments_is_runnable() -> None:
    a = TurnAssembler()
    a.text("hi ")
    a.text("there")
    a.tool_delta(0, id="c1", name="f", arguments='{"x"')
    a.tool_delta(0, arguments=": 1}")
    a.tool_delta(1, id="c2", name="g")
    a.finish("tool_calls")
    turn = a.result()
    assert turn.whole and turn.text == "hi there"
    assert [(c.id, c.name, c.parsed, c.problem) for c in turn.calls] == [
        ("c1", "f", {"x": 1}, None),
        ("c2", "g", {}, None),
    ]


def test_a_cut_stream_marks_the_streaming_call_incomplete_and_the_others_unrun() -> None:
    a = TurnAssembler()
    a.tool_delta(0, id="c1", name="f", arguments="{}")
    a.tool_delta(1, id="c2", name="g", arguments='{"path": "/ho')
    turn = a.result()
    assert not turn.finished
    first, second = turn.calls
    assert first.problem == REASON_TURN_INCOMPLETE and first.parsed is None
    assert second.problem == REASON_ARGS_INCOMPLETE and second.arguments == '{"path": "/ho'


def test_an_abort_never_makes_a_call_runnable_even_with_whole_arguments() -> None:
    a = TurnAssembler()
    a.tool_delta(0, id="c1", name="f", arguments="{}")
    turn = a.result(aborted=True)
    assert turn.aborted and turn.calls[0].parsed is None
    assert turn.calls[0].problem.startswith("stopped_before_start")
    b = TurnAssembler()
    b.tool_delta(0, id="c1", name="f", arguments='{"a": ')
    assert b.result(aborted=True).calls[0].problem.startswith("arguments_incomplete")


def test_invalid_or_non_object_arguments_are_reported_not_repaired() -> None:
    a = TurnAssembler()
    a.tool_delta(0, id="c1", name="f", arguments="{oops")
    a.tool_delta(1, id="c2", name="f", arguments="[1]")
    a.tool_delta(2, id="c3", arguments="{}")
    a.finish("tool_calls")
    problems = [c.problem for c in a.result().calls]
    assert problems[0].startswith("invalid_arguments: not valid JSON")
    assert problems[1] == "invalid_arguments: expected a JSON object, got list"
    assert problems[2].startswith("invalid_call")


def test_json_the_decoder_refuses_is_an_invalid_call_not_a_crash() -> None:
    # Both are valid JSON syntax: a plain ValueError (int digit limit) and a RecursionError.
    a = TurnAssembler()
    a.tool_delta(0, id="c1", name="f", arguments='{"n": ' + "1" * 5000 + "}")
    a.tool_delta(1, id="c2", name="f", arguments='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    a.finish("tool_calls")
    calls = a.result().calls
    assert [c.parsed for c in calls] == [None, None]
    assert all(c.problem.startswith("invalid_arguments: not decodable JSON") for c in calls)


def test_missing_ids_are_filled_and_usage_is_kept() -> None:
    a = TurnAssembler()
    a.tool_delta(0, name="f")
    a.add_usage(10, None)
    a.finish(None)
    turn = a.result()
    assert turn.calls[0].id == "call_auto_1"
    assert turn.usage == {"prompt_tokens": 10, "completion_tokens": 0}
    assert turn.finish_reason == "stop"


def test_a_turn_cut_by_the_output_limit_runs_none_of_its_calls() -> None:
    a = TurnAssembler()
    a.tool_delta(0, id="c1", name="f", arguments="{}")
    a.tool_delta(1, id="c2", name="f", arguments='{"a": "lo')
    a.finish("length")
    turn = a.result()
    assert not turn.finished
    assert [c.problem.split(":")[0] for c in turn.calls] == ["turn_incomplete", "arguments_incomplete"]
    assert "output limit" in turn.calls[1].problem


def test_a_text_answer_cut_by_the_output_limit_is_still_an_answer() -> None:
    a = TurnAssembler()
    a.text("long answ")
    a.finish("length")
    assert a.result().finished


def test_a_turns_text_and_a_calls_arguments_are_bounded_as_they_stream() -> None:
    # A model that streamed hundreds of MB: all kept (the runner at GBs, then seconds of
    # CPU fitting its result, deaf to a stop, SIGKILLed and its result lost).
    from subagent.model.provider import MAX_CALL_ARGUMENTS_CHARS, MAX_TURN_TEXT_CHARS, REASON_ARGS_TOO_LONG

    sink = TurnAssembler()
    chunk = "x" * 8000
    streamed = (MAX_TURN_TEXT_CHARS // len(chunk) + 100) * len(chunk)
    for _ in range(streamed // len(chunk)):
        sink.text(chunk)
    sink.tool_delta(0, id="c1", name="run_command", arguments='{"command": "')
    for _ in range(MAX_CALL_ARGUMENTS_CHARS // len(chunk) + 10):
        sink.tool_delta(0, arguments=chunk)
    sink.tool_delta(0, arguments='"}')
    sink.tool_delta(1, id="c2", name="run_command", arguments='{"command": "true"}')
    sink.finish("tool_calls")
    turn = sink.result()
    kept, note = turn.text[:MAX_TURN_TEXT_CHARS], turn.text[MAX_TURN_TEXT_CHARS:]
    assert kept == "x" * MAX_TURN_TEXT_CHARS
    dropped = streamed - MAX_TURN_TEXT_CHARS
    assert (
        note == f"\n[{dropped} more characters of the model's answer were dropped: a turn keeps {MAX_TURN_TEXT_CHARS}]"
    )
    big, small = turn.calls
    assert big.problem == REASON_ARGS_TOO_LONG and len(big.arguments) <= MAX_CALL_ARGUMENTS_CHARS
    assert small.problem is None and small.parsed == {"command": "true"}
