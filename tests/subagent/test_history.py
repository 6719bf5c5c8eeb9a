from __future__ import annotations

import json
from typing import Any

import pytest

from subagent.events import CUT_MARK
from subagent.history import (
    HISTORY_AWAITING_APPROVAL,
    HISTORY_CUT_SHORT,
    HISTORY_NOT_STARTED_YET,
    STOP_NOTES,
    is_cut,
    replay_arguments,
    stop_note,
    tool_result_text,
    turn_messages,
    unfinished_text,
)
from subagent.model.fake_openai import history_problem
from subagent.model.provider import (
    REASON_ABORTED_IN_ARGS,
    REASON_ABORTED_TURN,
    REASON_ARGS_INCOMPLETE,
    REASON_TURN_INCOMPLETE,
)

_LOST_NOTE = (
    "[This turn was lost: agentd restarted and its runner was gone; what it did after the last record is unknown.]"
)


def rec(cid: str, step: int, state: str, **more: Any) -> dict[str, Any]:
    return {"id": cid, "name": "run_command", "arguments": '{"command": "ls"}', "step": step, "state": state, **more}


def text(step: int, t: str) -> dict[str, Any]:
    return {"kind": "assistant_text", "data": {"step": step, "text": t, "complete": True}}


def test_a_stopped_turn_is_its_task_its_calls_each_with_one_honest_result_and_a_note() -> None:
    records = [
        rec("c1", 1, "succeeded", output="[exit code 0]\nfile-a"),
        rec(
            "c2",
            1,
            "cancelled",
            output="[exit code -15]\npartial",
            stop_effect="interrupted",
            reason="interrupted: ...",
        ),
        rec(
            "c3",
            1,
            "not_started",
            reason="stopped_before_start: a stop was requested before this call started",
            stop_effect="stopped_before_start",
        ),
    ]
    msgs = turn_messages("list files", records, [text(1, "Looking.")], state="cancelled", reason="user")
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "tool", "system"]
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2", "c3"]
    results = {m["tool_call_id"]: m["content"] for m in msgs if m["role"] == "tool"}
    assert results["c1"] == "[exit code 0]\nfile-a\n[this call finished before the run was stopped]"
    assert results["c2"] == "interrupted by the stop; output known before the interruption:\n[exit code -15]\npartial"
    assert results["c3"].startswith("not executed: stopped_before_start")
    assert msgs[-1] == {"role": "system", "content": STOP_NOTES["user"]}
    assert history_problem([{"role": "system", "content": "s"}, *msgs]) is None


@pytest.mark.parametrize(
    "reason",
    [REASON_ARGS_INCOMPLETE, REASON_TURN_INCOMPLETE, REASON_ABORTED_IN_ARGS, REASON_ABORTED_TURN, "model_error: boom"],
)
def test_a_call_whose_turn_never_finished_is_not_replayed_but_the_text_stays(reason: str) -> None:
    cut = rec("cut", 1, "not_started", reason=reason, arguments='{"command": "rm -rf da')
    assert is_cut(cut)
    msgs = turn_messages(
        "t", [cut], [text(1, "Deleting."), text(2, "Done anyway.")], state="completed", final_text="Done anyway."
    )
    assert msgs == [
        {"role": "user", "content": "t"},
        {"role": "assistant", "content": "Deleting."},
        {"role": "assistant", "content": "Done anyway."},
    ]


def test_a_cut_call_without_text_leaves_no_message_at_all() -> None:
    cut = rec("cut", 1, "not_started", reason=REASON_ARGS_INCOMPLETE)
    assert turn_messages("t", [cut], [], state="completed", final_text="ok") == [
        {"role": "user", "content": "t"},
        {"role": "assistant", "content": "ok"},
    ]


def test_calls_that_never_ran_for_their_own_reasons_are_still_calls_with_results() -> None:
    bad = rec(
        "bad",
        1,
        "failed",
        reason="invalid_arguments: not valid JSON",
        error="invalid_arguments: not valid JSON",
        arguments="{nope",
    )
    settled = rec("gone", 1, "unknown", reason="grace_ran_out: the runner was killed")
    assert not is_cut(bad) and not is_cut(settled)
    msgs = turn_messages("t", [bad, settled], [], state="cancelled", reason="timeout")
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == "{}"  # never repaired into a call
    assert [m["content"] for m in msgs if m["role"] == "tool"] == [
        "error: invalid_arguments: not valid JSON",
        "outcome unknown: grace_ran_out: the runner was killed",
    ]
    assert msgs[-1]["content"] == STOP_NOTES["timeout"]


def test_denied_and_rejected_calls_say_so() -> None:
    denied = rec("d", 1, "rejected", approval="denied", approval_reason="not today")
    waited = rec("w", 1, "rejected", approval="rejected")
    assert tool_result_text(denied, stop_reason=None) == "denied by the user: not today"
    assert tool_result_text({**denied, "approval_reason": None}, stop_reason=None) == "denied by the user"
    assert tool_result_text(waited, stop_reason="user") == "not executed: stopped while awaiting approval"


def test_calls_of_a_live_turn_that_have_not_run_yet_say_so_and_never_none() -> None:
    # A live turn's calls are announced before any runs: no reason yet, they may still run.
    pending = rec("p", 1, "not_started", approval="pending", approval_deadline=1e10)
    queued = rec("q", 1, "not_started")
    msgs = turn_messages("t", [pending, queued], [text(1, "Asking.")], state="awaiting_approval")
    results = {m["tool_call_id"]: m["content"] for m in msgs if m["role"] == "tool"}
    assert results == {"p": HISTORY_AWAITING_APPROVAL, "q": HISTORY_NOT_STARTED_YET}
    assert msgs[-1]["role"] == "tool"  # a live turn has no note
    # Nor does any record without a reason or an error put "None" in front of the model.
    for state in ("failed", "cancelled", "unknown"):
        for effect in (None, "interrupted"):
            said = tool_result_text(rec("x", 1, state, stop_effect=effect), stop_reason=None)
            assert "None" not in said, (state, effect, said)


def test_an_answer_is_shown_once_and_whole_though_one_copy_of_it_was_cut() -> None:
    # The result's final_text is cut when the history it carries is too large; an event's
    # text is cut when it alone overflows a line: either way it is the same answer.
    whole = "The answer is " + "x" * 1000
    cut = whole[:100] + CUT_MARK
    for event_text, final_text in ((whole, cut), (cut, whole), (whole, whole)):
        msgs = turn_messages("t", [], [text(1, event_text)], state="completed", final_text=final_text)
        assert msgs == [{"role": "user", "content": "t"}, {"role": "assistant", "content": whole}]
    # A different answer (not a copy) is still shown.
    msgs = turn_messages("t", [], [text(1, "Thinking.")], state="completed", final_text=cut)
    assert [m["content"] for m in msgs] == ["t", "Thinking.", cut]


def test_steering_is_a_user_message_before_the_step_that_applied_it() -> None:
    events = [
        text(1, "First."),
        {"kind": "steering", "data": {"state": "queued", "text": "mind the logs", "step": 1}},
        {"kind": "steering", "data": {"state": "applied", "text": "mind the logs", "step": 2}},
        text(2, "Minding them."),
    ]
    msgs = turn_messages("t", [], events, state="completed", final_text="Minding them.")
    assert [(m["role"], m["content"]) for m in msgs] == [
        ("user", "t"),
        ("assistant", "First."),
        ("user", "mind the logs"),
        ("assistant", "Minding them."),
    ]


@pytest.mark.parametrize(
    ("state", "reason", "note"),
    [
        ("completed", None, None),
        ("running", None, None),
        ("cancelled", "user", STOP_NOTES["user"]),
        ("cancelled", "approval_timeout", STOP_NOTES["approval_timeout"]),
        ("cancelled", "session_closed", "[This turn was stopped before it finished (session_closed).]"),
        ("failed", "model_http", "[This turn failed before it finished (model_http).]"),
        # A turn a restarted daemon found before its runner had its spec: nothing of it ran
        # (it was told "what it did after the last record is unknown").
        (
            "lost",
            "the daemon restarted before the run's process started",
            "[This turn never started: agentd restarted before its runner started; nothing of it ran.]",
        ),
        ("lost", "the runner was gone when the daemon restarted, without a result", _LOST_NOTE),
    ],
)
def test_only_a_turn_that_did_not_complete_gets_a_note(state: str, reason: str | None, note: str | None) -> None:
    assert stop_note(state, reason) == note


def test_the_fake_server_refuses_what_the_api_refuses() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert "did not have response messages: a" in (history_problem([call, {"role": "user", "content": "x"}]) or "")
    assert "did not have response messages: a" in (history_problem([call]) or "")
    assert "must be a response to a preceeding message" in (
        history_problem([{"role": "tool", "tool_call_id": "a", "content": ""}]) or ""
    )
    assert history_problem([call, {"role": "tool", "tool_call_id": "a", "content": "ok"}]) is None
    assert json.dumps(history_problem([])) == "null"


def test_text_a_killed_runner_was_streaming_is_handed_on_cut_short_from_its_partial_result() -> None:
    # Step 1 said its text and ran a call; step 2 was streaming when the runner was killed:
    # only the partial result (progress, unfinished_text) holds step 2's text.
    partial = {
        "progress": "Looking.\n\nThe logs say",
        "unfinished_text": {"step": 2, "at": 10, "streaming": True},
        "tool_calls": [],
    }
    assert unfinished_text(partial) == (2, "The logs say")
    records = [rec("c1", 1, "succeeded", output="ok")]
    for state in ("failed", "lost", "cancelled"):
        msgs = turn_messages(
            "t", records, [text(1, "Looking.")], state=state, reason="runner_died", unfinished=unfinished_text(partial)
        )
        said = [m["content"] for m in msgs if m["role"] == "assistant"]
        assert said == ["Looking.", f"The logs say\n{HISTORY_CUT_SHORT}"], msgs
        assert msgs[-1]["role"] == "system"  # the turn's note still ends it
    # A completed turn's text is its events' (and its answer): nothing is added.
    done = turn_messages("t", [], [text(1, "All done.")], state="completed", unfinished=(1, "All"))
    assert [m["content"] for m in done if m["role"] == "assistant"] == ["All done."]


def test_text_an_event_carried_is_told_once_and_a_stopped_streams_text_is_marked_cut_short() -> None:
    # The runner stopped the stream itself: assistant_text complete false carries the text,
    # and the result's unfinished_text points at the same text: told once, cut short.
    cut = {"kind": "assistant_text", "data": {"step": 1, "text": "Half a", "complete": False}}
    msgs = turn_messages("t", [], [cut], state="cancelled", reason="user", unfinished=(1, "Half a"))
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == [f"Half a\n{HISTORY_CUT_SHORT}"]
    # A completed turn whose stream was cut and asked again: shown as its model saw it.
    done = turn_messages("t", [], [cut, text(2, "Whole.")], state="completed", final_text="Whole.")
    assert [m["content"] for m in done if m["role"] == "assistant"] == ["Half a", "Whole."]


@pytest.mark.parametrize(
    "result",
    [
        None,
        {"progress": "abc"},
        {"progress": "abc", "unfinished_text": {"step": 1, "at": 3}},  # nothing from there on
        {"progress": "abc", "unfinished_text": {"step": True, "at": 0}},
        {"progress": None, "unfinished_text": {"step": 1, "at": 0}},
        {"progress": "abc", "unfinished_text": {"step": 1, "at": -1}},
    ],
)
def test_a_result_without_unfinished_text_gives_none(result: Any) -> None:
    assert unfinished_text(result) is None


def test_a_turn_whose_step_had_calls_refused_tells_them_after_that_steps_results() -> None:
    # The runner told its model after the step's results; the next turn of the session,
    # rebuilt from the journal, must tell it the same, or the model takes the calls it
    # asked for as the ones that ran.
    from subagent.history import refused_calls_note, turn_messages
    from subagent.model.fake_openai import history_problem

    records = [
        {"id": f"c{i}", "name": "run_command", "arguments": "{}", "step": 1, "state": "succeeded", "output": "ok"}
        for i in range(2)
    ]
    refused = [{"step": 1, "asked": 5, "limit": 2, "refused": 3, "names": ["run_command"]}, {"bogus": 1}]
    out = turn_messages("t", records, [], state="completed", final_text="done", refused=refused)
    assert history_problem(out) is None
    roles = [m["role"] for m in out]
    assert roles == ["user", "assistant", "tool", "tool", "user", "assistant"], roles
    assert out[4]["content"] == refused_calls_note(5, 2, 3, ["run_command"])
    assert "asked for 5 tool calls" in out[4]["content"] and "never ran" in out[4]["content"]


@pytest.mark.parametrize(
    ("text", "replayed"),
    [
        ('{"command": "ls"}', '{"command": "ls"}'),
        ("[1]", "{}"),
        ("not json", "{}"),
        # Deeper than the decoder's recursion limit: RecursionError, not ValueError.
        ('{"x": ' + "[" * 5000 + "]" * 5000 + "}", "{}"),
    ],
)
def test_a_calls_arguments_are_replayed_only_as_a_json_object(text: str, replayed: str) -> None:
    assert replay_arguments(text) == replayed
