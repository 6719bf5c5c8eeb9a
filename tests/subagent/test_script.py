"""The script format: validation, the pieces a turn plays, interpolation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from subagent.model.script import DEFAULT_SCRIPT, Script, ScriptError, history_position, plan


def kinds(pieces: list[Any]) -> list[str]:
    return [p.kind for p in pieces]


def test_a_turn_streams_text_then_calls_then_finish() -> None:
    s = Script.from_dict(
        {"chunk_size": 4, "turns": [{"text": "hello!", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]}]}
    )
    pieces = plan(s, 0, "")
    assert kinds(pieces) == ["text", "text", "tool_start", "tool_args", "tool_args", "finish"]
    assert "".join(p.text for p in pieces if p.kind == "tool_args") == '{"a":1}'
    assert pieces[-1].text == "tool_calls"


def test_past_the_last_turn_the_final_answer_plays() -> None:
    s = Script.from_dict({"turns": ["one"], "final": "bye"})
    assert [p.text for p in plan(s, 5, "")] == ["bye", "stop"]


def test_cut_and_hang_end_the_stream_inside_the_arguments() -> None:
    s = Script.from_dict(
        {
            "turns": [
                {"tool_calls": [{"name": "f", "arguments": {"path": "/etc/passwd"}, "cut_after": 9}]},
                {"tool_calls": [{"name": "f", "arguments": "{}", "hang_after": 1}]},
            ]
        }
    )
    cut = plan(s, 0, "")
    assert kinds(cut)[-1] == "cut"
    assert "".join(p.text for p in cut if p.kind == "tool_args") == '{"path":"'
    assert kinds(plan(s, 1, ""))[-1] == "hang"


def test_delays_are_pieces_so_players_can_sleep() -> None:
    s = Script.from_dict({"turns": [{"text": "abcd", "chunk_size": 2, "delay_s": 1.5, "chunk_delay_s": 0.25}]})
    pieces = plan(s, 0, "")
    assert [(p.kind, p.seconds) for p in pieces if p.kind == "delay"] == [("delay", 1.5), ("delay", 0.25)]


def test_variables_interpolate_from_the_last_tool_output() -> None:
    s = Script.from_dict(
        {
            "extract": r"ref=(e\d+)",
            "turns": [
                {
                    "text": "step {{step}} saw {{match}}",
                    "tool_calls": [{"name": "click", "arguments": {"ref": "{{match}}"}}],
                }
            ],
            "final": "last: {{last_output}}",
        }
    )
    pieces = plan(s, 0, "button ref=e42 ok")
    assert "".join(p.text for p in pieces if p.kind == "text") == "step 1 saw e42"
    assert json.loads("".join(p.text for p in pieces if p.kind == "tool_args")) == {"ref": "e42"}
    assert plan(s, 1, "out")[0].text == "last: out"


def test_no_match_interpolates_empty() -> None:
    s = Script.from_dict({"final": "[{{match}}]", "extract": "(x+)"})
    assert plan(s, 0, "yyy")[0].text == "[]"


def test_an_error_turn_plays_its_text_then_fails() -> None:
    s = Script.from_dict({"turns": [{"text": "hm", "error": "boom"}]})
    assert kinds(plan(s, 0, "")) == ["text", "error"]


@pytest.mark.parametrize(
    "d, field",
    [
        ({"turns": {}}, "turns"),
        ({"turns": [{"texts": "x"}]}, "turns[0]"),
        (
            {"turns": [{"tool_calls": [{"name": "f", "cut_after": 1}, {"name": "g"}]}]},
            "turns[0].tool_calls[0].cut_after",
        ),
        (
            {"turns": [{"tool_calls": [{"name": "f", "cut_after": 1, "hang_after": 1}]}]},
            "turns[0].tool_calls[0].hang_after",
        ),
        ({"turns": [{"tool_calls": [{"name": "f", "arguments": 3}]}]}, "turns[0].tool_calls[0].arguments"),
        ({"turns": [{"extract": "("}]}, "turns[0].extract"),
        ({"turns": [{"delay_s": -1}]}, "turns[0].delay_s"),
        ({"turns": [{"usage": {"prompt_tokens": -1}}]}, "turns[0].usage.prompt_tokens"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"final": 1}, "final"),
    ],
)
def test_bad_scripts_name_the_field(d: dict[str, Any], field: str) -> None:
    with pytest.raises(ScriptError) as info:
        Script.from_dict(d)
    assert info.value.field == field


def test_the_default_script_is_valid_and_calls_run_command_twice() -> None:
    s = Script.from_dict(DEFAULT_SCRIPT)
    assert [c.name for t in s.turns for c in t.tool_calls] == ["run_command", "run_command"]


def test_history_position_counts_assistant_turns_and_finds_the_last_tool_output() -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "tool_call_id": "a", "content": "first"},
        {"role": "assistant", "content": "x"},
        {"role": "tool", "tool_call_id": "b", "content": "second"},
    ]
    assert history_position(msgs) == (2, "second")
    assert history_position(msgs[:2]) == (0, "")
