"""Look-alike characters in what a person approves, as the CLI names them.

A prompt-injected model can ask to approve ``curl https://pаypal.com`` (a Cyrillic ``а``)
or ``ｒｍ -rf`` (fullwidth): the person reads one thing and lets another run. The rule
(``supervisor/_lookalikes.py``) and the CLI lines that show a call to decide on; a real
daemon's ``agentd status`` is in ``tests/e2e/test_approvals.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from supervisor._lookalikes import TWINS, find_lookalikes, lookalike_note
from supervisor.cli import _message_lines, _print_run, format_event

CYRILLIC_A, CYRILLIC_O = "\u0430", "\u043e"
SPOOFED = f"curl https://p{CYRILLIC_A}ypal.com/login; \uff52\uff4d -rf /tmp/x"


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        (SPOOFED, [("p\u0430ypal", "mixed scripts"), ("\uff52\uff4d", "compatibility forms")]),
        ("rm -rf /home/alice/\u0440\u0433\u043eject", [("\u0440\u0433\u043eject", "mixed scripts")]),
        ("\U0001d42b\U0001d426 -rf /", [("\U0001d42b\U0001d426", "compatibility forms")]),
        ("ssh \u0391\u03b2c.example", [("\u0391\u03b2c", "mixed scripts")]),  # Greek with Latin
        ("p\u200d\u0430ypal", [("p\u200d\u0430ypal", "mixed scripts")]),  # a joiner does not split it
        # One script per token: a Russian sentence and file name, Chinese with its own
        # punctuation, Latin beside Han, an ellipsis, plain ASCII.
        ("echo Привет, мир; cat файл.txt", []),
        ("echo 你好，世界 tokyo東京", []),
        ("wait\u2026 ok", []),
        ("ls -la /tmp", []),
    ],
)
def test_a_token_mixing_look_alike_scripts_or_holding_compatibility_forms_is_found_and_one_script_is_not(
    text: str, tokens: list[tuple[str, str]]
) -> None:
    assert [(f.token, f.kind) for f in find_lookalikes(text)] == tokens


# "apple", "paypal", "scope" in Cyrillic letters that each have a Latin twin; "opa" in Greek.
APPLE, PAYPAL, SCOPE = (
    "\u0430\u0440\u0440\u04cf\u0435",
    "\u0440\u0430\u0443\u0440\u0430\u04cf",
    "\u0455\u0441\u043e\u0440\u0435",
)
OPA = "\u03bf\u03c1\u03b1"


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        # Amid Latin text: a host label, a path segment, a JSON value beside its key, an
        # argument among ASCII ones; beside Chinese; Greek too.
        (f"curl https://{APPLE}.com/login", [(APPLE, "apple")]),
        (f"cat /srv/{PAYPAL}/x", [(PAYPAL, "paypal")]),
        (f'{{"host":"{APPLE}"}}', [(APPLE, "apple")]),
        (f'{{"command": "ssh {SCOPE}"}}', [(SCOPE, "scope")]),
        (f"curl https://{APPLE}.com -d Привет", [(APPLE, "apple")]),  # prose elsewhere: a host still
        (f"你好 {APPLE}", [(APPLE, "apple")]),
        (f"ping {OPA}.example", [(OPA, "opa")]),
        # Prose: Russian words with letters that have no twin (привет, дом), and an all-twin
        # word (ухо, "ear") among Russian ones, in JSON too; Greek prose; Chinese.
        ("echo привет", []),
        ("дом", []),
        ("ухо болит", []),
        ('{"text": "ухо болит"}', []),
        ("Καλημέρα κόσμε", []),
        ("ΤΟ ΚΑΙ ΤΟ", []),
        ("echo 你好，世界", []),
    ],
)
def test_a_token_all_in_cyrillic_or_greek_look_alikes_amid_latin_text_is_found_and_prose_is_not(
    text: str, tokens: list[tuple[str, str]]
) -> None:
    found = [f for f in find_lookalikes(text) if f.kind == "look-alike script"]
    assert [(f.token, f.ascii) for f in found] == tokens
    assert len(find_lookalikes(text)) == len(tokens)


def test_every_look_alike_letter_is_cyrillic_or_greek_and_reads_as_one_ascii_letter() -> None:
    import unicodedata

    assert len(TWINS) == 55
    for c, latin in TWINS.items():
        assert unicodedata.name(c).split()[0] in ("CYRILLIC", "GREEK") and latin.isascii() and latin.isalpha(), c
    # Left out: letters Unicode maps to a small capital or a non-ASCII letter.
    assert not set("вкмнтьгκτ") & set(TWINS)


def test_the_note_names_each_character_by_code_point_and_name_and_what_it_reads_as() -> None:
    assert lookalike_note(SPOOFED) == (
        " [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A; "
        "'ｒｍ' reads 'rm' in compatibility forms: U+FF52 FULLWIDTH LATIN SMALL LETTER R, "
        "U+FF4D FULLWIDTH LATIN SMALL LETTER M]"
    )
    assert lookalike_note("echo Привет, мир") == ""
    assert lookalike_note(f"ssh {SCOPE}") == (
        " [look-alike characters: 'ѕсоре' reads 'scope' in Cyrillic letters: U+0455 CYRILLIC SMALL LETTER DZE, "
        "U+0441 CYRILLIC SMALL LETTER ES, U+043E CYRILLIC SMALL LETTER O, U+0440 CYRILLIC SMALL LETTER ER, "
        "U+0435 CYRILLIC SMALL LETTER IE]"
    )
    many = " ".join(f"x{CYRILLIC_A}{i}" for i in range(8))
    assert lookalike_note(many).endswith("; and 3 more]")


def approval_event(arguments: str) -> dict[str, Any]:
    data = {"call_id": "call_1", "name": "run_command", "arguments": arguments}
    return {"kind": "approval_requested", "seq": 3, "ts": 0.0, "run_id": "r-1", "data": data}


def test_watch_shows_the_arguments_as_they_are_then_names_their_look_alike_characters() -> None:
    raw = json.dumps({"command": SPOOFED}, ensure_ascii=False)
    line = format_event(approval_event(raw))
    assert f"awaiting approval: run_command {raw} [look-alike characters: 'pаypal' mixes scripts: U+0430" in line
    assert "U+FF52 FULLWIDTH LATIN SMALL LETTER R" in line and "(call call_1; `agentd approve r-1 call_1`" in line
    plain = json.dumps({"command": "echo Привет, мир; echo 你好，世界"}, ensure_ascii=False)
    assert "look-alike" not in format_event(approval_event(plain))


def test_a_sessions_transcript_names_the_look_alike_characters_of_a_call() -> None:
    call = {"id": "c1", "function": {"name": "run_command", "arguments": f"ping p{CYRILLIC_A}ypal.com"}}
    (line,) = _message_lines({"role": "assistant", "tool_calls": [call]})
    assert line.endswith("[look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]"), line


def test_the_cli_imports_unicodedata_only_for_text_that_is_not_ascii() -> None:
    code = (
        "import sys\n"
        "from supervisor.cli import format_event\n"
        "ev = {'kind': 'approval_requested', 'seq': 1, 'ts': 0.0, 'data': {'name': 'x', 'arguments': 'ls'}}\n"
        "format_event(ev)\n"
        "print('unicodedata' in sys.modules)\n"
        "ev['data']['arguments'] = 'p\\u0430ypal'\n"
        "format_event(ev)\n"
        "print('unicodedata' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_watch_names_the_look_alikes_of_a_tools_name_and_of_a_process_groups_command_but_not_prose() -> None:
    def event(kind: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"kind": kind, "seq": 4, "ts": 0.0, "run_id": "r-1", "data": data}

    record = {"id": "c1", "name": f"run_c{CYRILLIC_O}mmand", "state": "running", "arguments": "{}"}
    line = format_event(event("tool_call", {"record": record}))
    assert line.endswith(
        "tool run_cоmmand running [look-alike characters: 'cоmmand' mixes scripts: U+043E CYRILLIC SMALL LETTER O]"
    ), line
    group = {"pgid": 42, "kind": "command", "name": f"curl https://{APPLE}.com/login", "alive": True}
    line = format_event(event("process_group", group))
    assert line.endswith(
        f"(command curl https://{APPLE}.com/login) [look-alike characters: 'аррӏе' reads 'apple'"
        " in Cyrillic letters: U+0430 CYRILLIC SMALL LETTER A, U+0440 CYRILLIC SMALL LETTER ER, "
        "U+04CF CYRILLIC SMALL LETTER PALOCHKA, U+0435 CYRILLIC SMALL LETTER IE]"
    ), line
    prose = {"pgid": 43, "kind": "command", "name": "echo 'Привет, ухо болит' 'Καλημέρα κόσμε' '你好，世界'"}
    assert "look-alike" not in format_event(event("process_group", prose))
    plain = {"id": "c2", "name": "run_command", "state": "succeeded", "arguments": "{}"}
    assert "look-alike" not in format_event(event("tool_call", {"record": plain}))


def test_status_names_the_look_alikes_of_its_tool_calls_names(capsys: pytest.CaptureFixture[str]) -> None:
    calls = [{"id": "c1", "name": SCOPE, "state": "succeeded"}, {"id": "c2", "name": "run_command", "state": "failed"}]
    _print_run({"run_id": "r-1", "state": "completed", "tool_calls": calls})
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tool calls")]
    assert row.endswith(
        f"2: {SCOPE} succeeded, run_command failed [look-alike characters: 'ѕсоре' reads 'scope'"
        " in Cyrillic letters: U+0455 CYRILLIC SMALL LETTER DZE, U+0441 CYRILLIC SMALL LETTER ES, "
        "U+043E CYRILLIC SMALL LETTER O, U+0440 CYRILLIC SMALL LETTER ER, U+0435 CYRILLIC SMALL LETTER IE]"
    ), row
    _print_run({"run_id": "r-1", "state": "completed", "tool_calls": [{"id": "c", "name": "поиск", "state": "failed"}]})
    assert "look-alike" not in capsys.readouterr().out
