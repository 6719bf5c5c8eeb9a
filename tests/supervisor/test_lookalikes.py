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

from supervisor._lookalikes import NOTE_BUDGET_CHARS, SCAN_MAX_CHARS, TWINS, find_lookalikes, lookalike_note
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


# A note is bounded whatever a run puts in its arguments (~1 MiB): a token is quoted cut with
# its length, its characters named each once with a count, five at most, and the tokens stop
# at NOTE_BUDGET_CHARS (the rest counted). Before, a 600,000-character token came back whole,
# every code point named: a 2.4 MB note.
def test_a_huge_token_is_quoted_cut_with_its_length_and_its_characters_named_once_with_their_counts() -> None:
    note = lookalike_note("\uff52\uff4d" * 100_000)
    assert len(note.encode()) < 600, len(note.encode())
    assert note == (
        f" [look-alike characters: {'ｒｍ' * 20 + '…'!r} (200,000 characters) reads {'rm' * 20 + '…'!r}"
        " (200,000 characters) in compatibility forms: U+FF52 FULLWIDTH LATIN SMALL LETTER R ×100,000, "
        "U+FF4D FULLWIDTH LATIN SMALL LETTER M ×100,000]"
    )
    # 600,000: checked up to the bound (the note says so), named as far as it was checked.
    note = lookalike_note("\uff52\uff4d" * 300_000)
    assert len(note.encode()) < 700, len(note.encode())
    assert note.startswith(f" [look-alike characters: {'ｒｍ' * 20 + '…'!r} ({SCAN_MAX_CHARS:,} characters)")
    assert "U+FF52 FULLWIDTH LATIN SMALL LETTER R ×131,072, U+FF4D FULLWIDTH LATIN SMALL LETTER M ×131,072]" in note
    assert note.endswith(f"[look-alike check: first {SCAN_MAX_CHARS:,} of 600,000 characters only]")
    cyrillic = "".join(chr(c) for c in range(0x430, 0x44E))  # 30 letters in one Latin token
    assert lookalike_note(f"x{cyrillic}").endswith("U+0434 CYRILLIC SMALL LETTER DE, and 25 more]")


def test_a_notes_tokens_stop_at_its_budget_and_the_rest_are_counted() -> None:
    tags = "".join(chr(0xE0041 + i) for i in range(26)) * 2  # tag letters: each escaped in 10 characters
    note = lookalike_note(" ".join(f"p{CYRILLIC_A}{i}{tags}" for i in range(6)))
    assert len(note) < NOTE_BUDGET_CHARS + 100 and note.count("mixes scripts") == 4, note
    assert note.endswith("; and 2 more]") and "(55 characters)" in note


# The check reads SCAN_MAX_CHARS of a text with non-ASCII characters beyond, and says so: no
# note must not read as "nothing suspicious" for text that was not checked. ASCII beyond the
# bound holds no look-alike, so such a text is checked whole.
def test_a_check_that_stops_at_its_bound_says_so_and_ascii_beyond_it_is_checked_whole() -> None:
    prose = "Привет, мир; ухо болит. " * 12_000  # 288,000 characters of Russian prose
    cut = f" [look-alike check: first {SCAN_MAX_CHARS:,} of {len(prose) + 7:,} characters only]"
    assert lookalike_note(prose + f" p{CYRILLIC_A}ypal") == cut
    assert lookalike_note(f"curl https://p{CYRILLIC_A}ypal.com " + prose) == (
        " [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]"
        f" [look-alike check: first {SCAN_MAX_CHARS:,} of {len(prose) + 24:,} characters only]"
    )
    assert lookalike_note(prose[:96] + "x" * SCAN_MAX_CHARS) == ""
    assert lookalike_note(f"p{CYRILLIC_A}ypal " + "x" * SCAN_MAX_CHARS) == (
        " [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]"
    )
    assert find_lookalikes("x" * SCAN_MAX_CHARS + f"{CYRILLIC_A}ypal") == []


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


def test_a_calls_line_stays_short_whatever_its_arguments_hold_and_says_what_was_not_checked() -> None:
    # ~1 MiB of arguments (an event line's bound): one fullwidth token, then Russian prose
    # with a look-alike past the check's bound. Each line is the history's and watch's.
    huge = json.dumps({"command": "\uff52\uff4d" * 300_000}, ensure_ascii=False)
    call = {"id": "c1", "function": {"name": "run_command", "arguments": huge}}
    (line,) = _message_lines({"role": "assistant", "tool_calls": [call]})
    assert len(line.encode()) < 1200, len(line.encode())
    checked = SCAN_MAX_CHARS - len('run_command {"command": "')  # the name and arguments are checked as one
    assert f"[look-alike characters: {'ｒｍ' * 20 + '…'!r} ({checked:,} characters) reads" in line
    assert "U+FF52 FULLWIDTH LATIN SMALL LETTER R ×131,060, U+FF4D FULLWIDTH LATIN SMALL LETTER M ×131,059]" in line
    total = len("run_command " + huge)
    assert line.endswith(f" [look-alike check: first {SCAN_MAX_CHARS:,} of {total:,} characters only]"), line
    prose = json.dumps(
        {"command": "echo '" + "Привет, мир. " * 80_000 + f"' > p{CYRILLIC_A}ypal.txt"}, ensure_ascii=False
    )
    line = format_event(approval_event(prose))
    assert len(line) < 1000 and "look-alike characters" not in line, line
    assert f"[look-alike check: first {SCAN_MAX_CHARS:,} of {len(prose) + 12:,} characters only] (call call_1;" in line


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
        " in Cyrillic letters: U+0430 CYRILLIC SMALL LETTER A, U+0440 CYRILLIC SMALL LETTER ER ×2, "
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
