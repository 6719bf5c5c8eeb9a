from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor import protocol
from supervisor.errors import ControlProtocolError, RunNotFound, SpawnError
from supervisor.protocol import BadRequest, ErrorCode, decode_request

MAX = 1024 * 1024


def dec(obj: object) -> protocol.Request | BadRequest:
    return decode_request(json.dumps(obj), max_bytes=MAX)


def test_a_spawn_request_decodes_with_its_arguments() -> None:
    req = dec({"id": 7, "op": "spawn", "spec": {"task": "x"}, "session_id": "s", "timeout_s": 3})
    assert req == protocol.SpawnRequest(7, {"task": "x"}, "s", 3.0)


def test_a_spawn_model_key_is_a_secret_that_never_shows_itself() -> None:
    key = "sk-test-do-not-print-1234"
    req = dec({"id": 1, "op": "spawn", "spec": {"task": "x"}, "model_key": key})
    assert isinstance(req, protocol.SpawnRequest) and isinstance(req.model_key, protocol.Secret)
    assert req.model_key.reveal() == key
    for text in (repr(req), str(req.model_key), json.dumps(req._asdict(), default=str)):
        assert key not in text and "redacted" in text


@pytest.mark.parametrize("bad", ["", "  ", 42, "a\nb", "a\x00b", "k" * (protocol.MAX_MODEL_KEY_CHARS + 1)])
def test_a_bad_model_key_is_refused_without_echoing_it(bad: object) -> None:
    req = dec({"id": 1, "op": "spawn", "spec": {"task": "x"}, "model_key": bad})
    assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_ARGS and "model_key" in req.message
    if isinstance(bad, str) and bad.strip():
        assert bad not in req.message


def test_defaults_fill_optional_arguments() -> None:
    assert dec({"id": "a", "op": "list"}) == protocol.ListRequest("a", 50, None, None)
    assert dec({"op": "events", "run_id": "r"}) == protocol.EventsRequest(None, "r", 0, 1000)
    assert dec({"op": "subscribe", "run_id": "r", "after_seq": 4}) == protocol.SubscribeRequest(None, "r", 4)
    assert dec({"op": "cancel", "run_id": "r"}) == protocol.CancelRequest(None, "r", None, "user")
    assert dec({"op": "cancel", "run_ids": ["a", "b"], "reason": "x"}) == protocol.CancelRequest(
        None, None, None, "x", run_ids=("a", "b")
    )
    # A session's cancel naming its turn: the pair (a daemon from before it refused the pair).
    assert dec({"op": "cancel", "session_id": "s", "run_id": "r"}) == protocol.CancelRequest(None, "r", "s", "user")
    assert dec({"op": "status"}) == protocol.StatusRequest(None, None)
    assert dec({"id": 1, "op": "ping"}) == protocol.PingRequest(1)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("{not json", ErrorCode.BAD_JSON),
        ("[1, 2]", ErrorCode.BAD_MESSAGE),
        ('"op"', ErrorCode.BAD_MESSAGE),
        ("null", ErrorCode.BAD_MESSAGE),
        ('{"id": 1}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "explode"}', ErrorCode.UNKNOWN_OP),
        ('{"id": 1, "op": "status", "run_id": 5}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "status", "run_id": "  "}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "spawn"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "spawn", "spec": "task"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "spawn", "spec": {}, "timeout_s": -1}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "spawn", "spec": {}, "timeout_s": true}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "spawn", "spec": {}, "timeout_s": NaN}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "ping", "x": -Infinity}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "session_id": "s", "run_ids": ["r"]}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "session_id": "s", "run_id": "r", "run_ids": ["r"]}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "session_id": "s", "run_id": ""}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_id": "r", "run_ids": ["r"]}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": []}', ErrorCode.BAD_ARGS),
        # A client's cancel may not claim a reason agentd gives its own stops.
        ('{"id": 1, "op": "cancel", "run_id": "r", "reason": "signalled"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "session_id": "s", "reason": "timeout"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": ["r"], "reason": "disk_full"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": "r"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": ["r", 5]}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": ["r", " "]}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "cancel", "run_ids": [' + ", ".join(['"r"'] * 10_001) + "]}", ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "list", "limit": 0}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "list", "limit": "5"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "list", "state": "sleeping"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "events", "run_id": "r", "after_seq": -1}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "subscribe"}', ErrorCode.BAD_ARGS),
        ('{"id": 1, "op": "unsubscribe"}', ErrorCode.BAD_ARGS),
    ],
)
def test_bad_messages_become_error_values_not_exceptions(text: str, code: ErrorCode) -> None:
    req = decode_request(text, max_bytes=MAX)
    assert isinstance(req, BadRequest)
    assert req.code == code, req.message
    assert req.message


def test_an_error_value_keeps_the_request_id_when_there_is_one() -> None:
    req = decode_request('{"id": "abc", "op": "nope"}', max_bytes=MAX)
    assert isinstance(req, BadRequest) and req.id == "abc"
    for constant in ("NaN", "Infinity", "-Infinity"):  # as docs/control-protocol.md says (it was id null)
        req = decode_request('{"id": 4, "op": "ping", "x": ' + constant + "}", max_bytes=MAX)
        assert isinstance(req, BadRequest) and (req.id, req.code) == (4, ErrorCode.BAD_ARGS)


def test_deeply_nested_json_is_a_bad_json_reply_not_a_recursion_error() -> None:
    req = decode_request("[" * 50_000 + "]" * 50_000, max_bytes=10 * MAX)
    assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_JSON


def test_more_containers_than_the_bound_are_refused_before_parsing() -> None:
    n = protocol.MAX_CONTAINERS
    ok = decode_request(json.dumps({"id": 1, "op": "ping", "x": [[] for _ in range(n - 2)]}), max_bytes=10 * MAX)
    assert not isinstance(ok, BadRequest), ok  # the message, its x and n - 2 arrays: n
    # Brackets in text are text: a megabyte of them is not counted.
    assert not isinstance(
        decode_request(json.dumps({"id": 1, "op": "ping", "x": "[{" * n}), max_bytes=10 * MAX), BadRequest
    )
    # The probe's megabyte of nested brackets: ~500k arrays, refused with its id.
    u = "[" * 63 + "]" * 63
    req = decode_request('{"id": 7, "op": "ping", "a": [' + ",".join([u] * (10**6 // 127)) + "]}", max_bytes=10 * MAX)
    assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_ARGS and req.id == 7
    assert f"at most {n} objects and arrays" in req.message


def _depth(shape: str) -> int:
    depth = deepest = 0
    for c in shape:
        depth += 1 if c == "(" else -1
        deepest = max(deepest, depth)
    return deepest


_balanced = st.recursive(
    st.just(""), lambda inner: st.lists(inner.map(lambda s: f"({s})"), max_size=3).map("".join), max_leaves=400
)


@settings(max_examples=300, deadline=None, database=None)
@given(_balanced, st.integers(0, 70))
def test_the_depth_check_agrees_with_counting_brackets(shape: str, pad: int) -> None:
    shape = "(" * pad + shape + ")" * pad  # deep enough to reach the bound now and then
    assert protocol._too_deep(shape.encode()) == (_depth(shape) > protocol.MAX_DEPTH)


def test_the_depth_check_is_one_pass_however_deep_the_containers_go() -> None:
    # It was MAX_DEPTH regex passes over the text: a megabyte of brackets 64 deep held the
    # event loop ~0.6 s, ten times as long as as many brackets 1 deep. Now both are one pass.
    def best(shape: bytes) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            protocol._too_deep(shape)
            times.append(time.perf_counter() - start)
        return min(times)

    deep = b"(" + (b"(" * 63 + b")" * 63) * 4000 + b")"
    flat = b"(" + b"()" * 63 * 4000 + b")"
    assert not protocol._too_deep(deep) and protocol._too_deep(b"(" + deep + b")")
    assert best(deep) < 4 * best(flat)


@pytest.mark.parametrize(
    ("x", "ok"),
    [
        ("[]", True),
        ("[" * 63 + "]" * 63, True),  # 64 deep with the message itself
        ("[" * 64 + "]" * 64, False),
        ("[" + "[" * 10 + "{}" + "]" * 10 + ", " + "[" * 63 + "]" * 63 + "]", False),  # the deep one second
        (json.dumps(["[[[[" * 100, '\\"[{' * 100, "]"]), True),  # brackets in text are text
        (json.dumps([{} for _ in range(50_000)]), True),  # many, shallow
        ("[" + ",".join(["[" * 62 + "]" * 62] * 1000) + "]", True),  # many, 64 deep
        ("[" + ",".join(["[" * 62 + "]" * 62] * 1000 + ["[" * 63 + "]" * 63]) + "]", False),  # the last one 65
        (json.dumps([{"a": "]]]]}}}}" * 20, "b": ['\\"' * 10, "[" * 70]}]), True),  # escapes in text
        ('{"a":[{"b":' * 21 + "1" + "}]}" * 21, True),  # 64 deep with the message itself
        ('{"a":[{"b":' * 21 + "[]" + "}]}" * 21, False),
        ('"\\ud800"', False),  # a lone surrogate, escaped
        ('{"\\udfff": 1}', False),  # in a key
        ('"\\ud83d\\ude00"', True),  # a pair is a character
    ],
)
def test_what_a_message_may_hold_deep_and_wide(x: str, ok: bool) -> None:
    req = decode_request(f'{{"id": 1, "op": "ping", "x": {x}}}', max_bytes=10 * MAX)
    assert isinstance(req, BadRequest) is not ok, req
    if not ok:
        assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_ARGS and req.id == 1


def test_invalid_utf8_in_a_binary_frame_is_bad_json() -> None:
    req = decode_request(b'{"op": "ping", "x": "\xff"}', max_bytes=MAX)
    assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_JSON


def test_a_message_over_the_limit_is_too_large_and_keeps_a_leading_id() -> None:
    big = json.dumps({"id": 42, "op": "spawn", "spec": {"task": "x" * 2000}})
    req = decode_request(big, max_bytes=1000)
    assert isinstance(req, BadRequest) and req.code == ErrorCode.TOO_LARGE and req.id == 42
    assert "1000" in req.message


def test_the_size_limit_counts_utf8_bytes_not_characters() -> None:
    text = json.dumps({"op": "ping", "pad": "é" * 600}, ensure_ascii=False)
    assert len(text) < 1000 < len(text.encode())
    req = decode_request(text, max_bytes=1000)
    assert isinstance(req, BadRequest) and req.code == ErrorCode.TOO_LARGE


@pytest.mark.parametrize(
    ("head", "expected"),
    [('{"id": "x1", "op"', "x1"), ('{"id":12,', 12), ('{"op": "ping", "id": 3', None), ("garbage", None)],
)
def test_sniff_id_finds_only_a_leading_id(head: str, expected: object) -> None:
    assert protocol.sniff_id(head + " " * 10) == expected


def test_replies_and_pushed_messages_round_trip_as_json() -> None:
    assert json.loads(protocol.encode_reply(1, {"a": 1})) == {"id": 1, "ok": True, "result": {"a": 1}}
    assert json.loads(protocol.encode_error("q", ErrorCode.NOT_FOUND, "no")) == {
        "id": "q",
        "ok": False,
        "error": {"code": "not_found", "message": "no"},
    }
    ev = json.loads(protocol.encode_event("1", "r", {"seq": 3, "ts": 1.5, "kind": "log", "data": {"m": 1}}))
    assert ev == {"op": "event", "sub": "1", "run_id": "r", "seq": 3, "ts": 1.5, "kind": "log", "data": {"m": 1}}
    end = json.loads(protocol.encode_end("1", "r", "completed", 9))
    assert end == {"op": "end", "sub": "1", "run_id": "r", "state": "completed", "last_seq": 9}
    req = json.loads(protocol.encode_request(5, "list", limit=3, state=None))
    assert req == {"id": 5, "op": "list", "limit": 3}


def test_backend_errors_map_to_codes_and_back() -> None:
    assert protocol.error_code_for(RunNotFound("r1"))[0] == ErrorCode.NOT_FOUND
    assert protocol.error_code_for(SpawnError("bad"))[0] == ErrorCode.BAD_SPEC
    code, message = protocol.error_code_for(KeyError("secret detail"))
    assert code == ErrorCode.INTERNAL and "secret" not in message
    err = protocol.error_from_reply({"code": "not_found", "message": "x"}, run_id="r1")
    assert isinstance(err, RunNotFound) and err.run_id == "r1"
    assert isinstance(protocol.error_from_reply({"code": "bad_spec", "message": "x"}), SpawnError)
    other = protocol.error_from_reply({"code": "bad_args", "message": "m"})
    assert isinstance(other, ControlProtocolError) and other.code == "bad_args"


def test_decode_server_message_refuses_non_objects() -> None:
    assert protocol.decode_server_message('{"a": 1}') == {"a": 1}
    with pytest.raises(ControlProtocolError):
        protocol.decode_server_message("[1]")
    with pytest.raises(ControlProtocolError):
        protocol.decode_server_message("nope")


def test_the_protocol_module_imports_no_trio() -> None:
    code = "import sys, supervisor.protocol; print(sorted(m for m in ('trio', 'trio_websocket') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, database=None)
@given(
    op=st.sampled_from([*[str(o) for o in protocol.Op], "nope", ""]) | st.integers() | st.none(),
    args=st.dictionaries(
        st.sampled_from(
            ["id", "run_id", "session_id", "spec", "after_seq", "limit", "state", "sub", "timeout_s", "reason"]
        ),
        _json_values,
        max_size=6,
    ),
)
def test_any_json_object_decodes_to_a_request_or_an_error_value(op: object, args: dict[str, object]) -> None:
    req = decode_request(json.dumps({**args, "op": op}), max_bytes=MAX)
    assert isinstance(req, (BadRequest, *protocol.Request.__args__))  # type: ignore[attr-defined]
    if isinstance(req, BadRequest):
        assert isinstance(req.code, ErrorCode) and req.message


@settings(max_examples=150, deadline=None, database=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_any_bytes_or_text_decode_without_raising(message: bytes | str) -> None:
    decode_request(message, max_bytes=100)


def test_a_steer_request_needs_a_run_and_some_text() -> None:
    req = dec({"id": 7, "op": "steer", "run_id": "r-1", "text": "look at b"})
    assert isinstance(req, protocol.SteerRequest)
    assert (req.run_id, req.text) == ("r-1", "look at b")
    for bad in ({"run_id": "r-1"}, {"run_id": "r-1", "text": "  "}, {"text": "x"}):
        got = dec({"id": 8, "op": "steer", **bad})
        assert isinstance(got, BadRequest) and got.code == ErrorCode.BAD_ARGS


# --------------------------------------------------------------------------- total decoding

DEEP_ID = '{"id": ' + "[" * 975 + "]" * 975 + ', "op": "ping"}'


@pytest.mark.parametrize(
    ("text", "expected_id", "words"),
    [
        ('{"id":"s","op":"cancel","run_id":"r-1","reason":"\\ud800"}', "s", "surrogate"),
        ('{"id":"s","op":"status","run_id":"\\udfff"}', "s", "'run_id'"),
        ('{"id":"s","op":"spawn","spec":{"task":"x","\\ud800":1}}', "s", "key"),
        ('{"id":"s","op":"spawn","spec":{"task":"x"},"timeout_s":' + "9" * 310 + "}", "s", "310 digits"),
        ('{"id":"s","op":"spawn","spec":{"task":"x","limits":{"max_steps":1' + "0" * 300 + "}}}", "s", "64 bits"),
        ('{"id":"s","op":"spawn","spec":{"task":"x"},"timeout_s":1e300}', "s", "timeout_s"),
        ('{"id":1e999,"op":"ping"}', None, "finite"),
        ('{"id":"s","op":"events","run_id":"r","after_seq":-9223372036854775809}', "s", "64 bits"),
        (DEEP_ID, None, "nested"),
        ('{"id":{"a":1},"op":"ping"}', None, "'id'"),
        ('{"id":"\\ud800","op":"ping"}', None, "surrogate"),
    ],
)
def test_what_would_fail_later_is_refused_at_the_edge_as_bad_args(text: str, expected_id: object, words: str) -> None:
    req = decode_request(text, max_bytes=MAX)
    assert isinstance(req, BadRequest), req
    # Nesting near the recursion limit: the parser may give up first (bad_json), else the
    # depth check does; the stack depth of the caller decides which.
    assert req.code == ErrorCode.BAD_ARGS or (words == "nested" and req.code == ErrorCode.BAD_JSON), req
    assert req.id == expected_id and words in req.message, req
    reply = protocol.encode_error(req.id, req.code, req.message)
    json.loads(reply, parse_constant=_refuse)  # the reply itself is strict JSON


def _refuse(name: str) -> object:
    raise ValueError(name)


def test_paired_surrogates_and_escaped_backslashes_are_fine() -> None:
    assert dec({"id": "x", "op": "steer", "run_id": "r", "text": "\U0001f600"}) == protocol.SteerRequest(
        "x", "r", "\U0001f600"
    )
    req = decode_request('{"id":"a\\\\ud800","op":"ping"}', max_bytes=MAX)  # a backslash, then text
    assert req == protocol.PingRequest("a\\ud800")


def test_replies_never_carry_nan_or_infinity() -> None:
    text = protocol.encode_reply(1, {"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5})
    assert json.loads(text, parse_constant=_refuse) == {
        "id": 1,
        "ok": True,
        "result": {"a": None, "b": [None, None], "c": 1.5},
    }


def test_encoding_a_value_nested_beyond_the_recursion_limit_is_a_value_error() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested"):
        protocol.encode_reply(1, deep)


def test_sniff_id_never_returns_what_cannot_be_echoed() -> None:
    assert protocol.sniff_id('{"id": "\\ud800", "op": "x"') is None


def test_the_conversation_and_approval_ops_decode_with_their_arguments() -> None:
    assert dec({"id": 1, "op": "approve", "run_id": "r", "call_id": "c"}) == protocol.ApproveRequest(1, "r", "c")
    assert dec({"op": "deny", "run_id": "r", "call_id": "c", "reason": " nope "}) == protocol.DenyRequest(
        None, "r", "c", "nope"
    )
    assert dec({"op": "deny", "run_id": "r", "call_id": "c"}) == protocol.DenyRequest(None, "r", "c", None)
    assert dec({"op": "history", "session_id": "s"}) == protocol.HistoryRequest(None, "s")
    page = dec({"op": "history", "session_id": "s", "before_turn": 4, "max_bytes": 1000})
    assert page == protocol.HistoryRequest(None, "s", before_turn=4, max_bytes=1000)
    assert dec({"op": "history", "session_id": "s", "after_turn": 0}).after_turn == 0  # type: ignore[union-attr]
    assert dec({"op": "sessions"}) == protocol.SessionsRequest(None, 50)
    assert dec({"op": "session_close", "session_id": "s"}) == protocol.SessionCloseRequest(None, "s")
    req = dec({"op": "spawn", "spec": {"task": "x"}, "session_id": "s", "interrupt": True})
    assert isinstance(req, protocol.SpawnRequest) and req.interrupt is True
    assert dec({"op": "spawn", "spec": {"task": "x"}}).interrupt is False  # type: ignore[union-attr]


def test_a_spawn_and_a_list_carry_an_idempotency_key_validated_like_an_id() -> None:
    req = dec({"op": "spawn", "spec": {"task": "x"}, "key": "f-1"})
    assert isinstance(req, protocol.SpawnRequest) and req.key == "f-1"
    assert dec({"op": "spawn", "spec": {"task": "x"}}).key is None  # type: ignore[union-attr]
    assert dec({"op": "list", "key": "f-1"}) == protocol.ListRequest(None, key="f-1")
    for op in ("spawn", "list"):
        for bad in ("", "  ", 5, "k" * (protocol.MAX_ID_CHARS + 1)):
            out = dec({"id": 3, "op": op, "spec": {"task": "x"}, "key": bad})
            assert isinstance(out, BadRequest) and out.code == ErrorCode.BAD_ARGS and "'key'" in out.message, out


@pytest.mark.parametrize(
    "msg",
    [
        {"op": "approve", "run_id": "r"},
        {"op": "approve", "call_id": "c"},
        {"op": "deny", "run_id": "r", "call_id": "c", "reason": 5},
        {"op": "deny", "run_id": "r", "call_id": "c", "reason": "x" * (protocol.MAX_DENY_REASON_CHARS + 1)},
        {"op": "history"},
        {"op": "history", "session_id": "s", "before_turn": 2, "after_turn": 1},
        {"op": "history", "session_id": "s", "before_turn": 0},
        {"op": "history", "session_id": "s", "after_turn": -1},
        {"op": "history", "session_id": "s", "after_turn": "3"},
        {"op": "history", "session_id": "s", "max_bytes": 0},
        {"op": "sessions", "limit": 0},
        {"op": "session_close", "session_id": ""},
        {"op": "spawn", "spec": {"task": "x"}, "session_id": "s", "interrupt": "yes"},
        {"op": "spawn", "spec": {"task": "x"}, "interrupt": True},  # interrupt what? no session
    ],
)
def test_bad_conversation_and_approval_requests_are_bad_args(msg: dict[str, object]) -> None:
    req = dec({"id": 9, **msg})
    assert isinstance(req, BadRequest) and req.code == ErrorCode.BAD_ARGS and req.id == 9
