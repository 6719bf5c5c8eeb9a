"""Acceptance: a tool call that needs a person's OK waits for it, and a stop ends the wait.

Real daemon processes, the real runner with the scripted model, a real journal. The call
is a ``run_command`` that leaves a side-effect file in a directory granted to the run, so
"the tool never ran" is a file that is absent, not a record's word.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent.emit import record_paths
from tests.e2e.test_conversations import Session
from tests.supervisor.test_restart_stop import daemon, kill9, wait_call_running

SCENARIO_S = 60.0
AGENTD = str(Path(sys.executable).with_name("agentd"))


def approval_spec(shared: Path, *, timeout_s: float | None = None, final: str = "done") -> dict[str, Any]:
    side_effect = shared / "side-effect"
    script = {
        "turns": [
            {
                "text": "Writing it.",
                "tool_calls": [
                    {"name": "run_command", "id": "call_w", "arguments": {"command": f"echo wrote > {side_effect}"}}
                ],
            }
        ],
        "final": final,
    }
    approval: dict[str, Any] = {"commands": ["echo wrote*"]}
    if timeout_s is not None:
        approval["timeout_s"] = timeout_s
    return {
        "task": "write the file",
        "model": {"provider": "scripted", "script": script},
        "approval": approval,
        "sandbox": {"write": [str(shared)]},
    }


def asked(msg: dict[str, Any]) -> bool:
    return msg["kind"] == "approval_requested"


def awaiting(msg: dict[str, Any]) -> bool:
    return msg["kind"] == "state" and msg["data"]["state"] == "awaiting_approval"


async def test_an_approved_call_runs(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=approval_spec(shared)))["run_id"]
            request = await s.wait(rid, asked)
            await s.wait(rid, awaiting)
            waiting = await c.call("status", run_id=rid)
            assert not (shared / "side-effect").exists()  # it waits: nothing ran yet
            answer = await c.call("approve", run_id=rid, call_id="call_w")
            final = await s.end(rid)
            again = await s.reply("approve", run_id=rid, call_id="call_w")
    assert request is not None and request["data"]["name"] == "run_command"
    assert json.loads(request["data"]["arguments"])["command"].startswith("echo wrote")
    assert waiting["state"] == "awaiting_approval"
    (pending,) = waiting["approvals"]
    assert pending["call_id"] == "call_w" and pending["name"] == "run_command" and pending["deadline"] > 0
    assert answer["decision"] == "approved"
    assert final["state"] == "completed"
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("succeeded", "approved")
    assert (shared / "side-effect").read_text() == "wrote\n"
    assert again["ok"] is False and again["error"]["code"] == "refused"


async def denied_run(tmp_path: Path, shared: Path, reason: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run whose gated call is denied with ``reason``: its end and its events."""
    shared.mkdir()
    spec = approval_spec(shared, final="The tool said: {{last_output}}")
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await s.wait(rid, awaiting)
            await c.call("deny", run_id=rid, call_id="call_w", reason=reason)
            final = await s.end(rid)
            events = (await c.call("events", run_id=rid))["events"]
    return final, events


async def test_a_denied_call_never_runs_and_the_model_is_told_why_and_goes_on(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    final, events = await denied_run(tmp_path, shared, "not on a Friday")
    assert final["state"] == "completed"
    assert final["result"]["final_text"] == "The tool said: denied by the user: not on a Friday"
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"], call["approval_reason"]) == ("rejected", "denied", "not on a Friday")
    assert not (shared / "side-effect").exists()
    states = [e["data"]["state"] for e in events if e["kind"] == "state"]
    assert states == ["queued", "starting", "running", "awaiting_approval", "running", "completed"]


async def test_the_longest_deny_reason_the_protocol_accepts_reaches_the_model_whole(tmp_path: Path) -> None:
    # 1000 emoji: ~4 KB of UTF-8, more escaped; the model got 500 of them, the journal 1000.
    reason = "\U0001f600" * 1000
    final, events = await denied_run(tmp_path, tmp_path / "shared", reason)
    assert final["result"]["final_text"] == f"The tool said: denied by the user: {reason}"
    (call,) = final["tool_calls"]
    assert call["approval_reason"] == reason
    (sent,) = [e["data"] for e in events if e["kind"] == "approval_sent"]
    (answered,) = [e["data"] for e in events if e["kind"] == "approval_answered"]
    assert sent["reason"] == answered["reason"] == reason


async def test_an_approval_answers_one_call_though_the_model_repeats_its_id(tmp_path: Path) -> None:
    # A model may give several calls one id (a server that sends none gets call_auto_N
    # again every step): each call that needs approval still waits for its own answer.
    shared = tmp_path / "shared"
    shared.mkdir()
    files = [shared / f"f{i}" for i in range(3)]

    def call(i: int) -> dict[str, Any]:
        return {"name": "run_command", "id": "x", "arguments": {"command": f"echo wrote {i} > {files[i]}"}}

    spec = approval_spec(shared)
    spec["model"]["script"] = {"turns": [{"tool_calls": [call(0), call(1)]}, {"tool_calls": [call(2)]}]}

    def asked_for(call_id: str) -> Callable[[dict[str, Any]], bool]:
        return lambda m: asked(m) and m["data"]["call_id"] == call_id

    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await s.wait(rid, asked_for("x"))
            await c.call("approve", run_id=rid, call_id="x")
            second = await s.wait(rid, asked_for("x_2"))
            second_ran = files[1].exists()
            await c.call("deny", run_id=rid, call_id="x_2", reason="one at a time")
            third = await s.wait(rid, asked_for("x_3"))
            await c.call("cancel", run_id=rid)
            final = await s.end(rid)
    assert second is not None and third is not None and not second_ran
    assert final["state"] == "cancelled"
    calls = {r["id"]: r for r in final["tool_calls"]}
    assert sorted(calls) == ["x", "x_2", "x_3"]
    assert (calls["x"]["state"], calls["x"]["approval"]) == ("succeeded", "approved")
    assert (calls["x_2"]["state"], calls["x_2"]["approval"]) == ("rejected", "denied")
    assert (calls["x_3"]["state"], calls["x_3"]["approval"]) == ("rejected", "rejected")
    assert [f.exists() for f in files] == [True, False, False]


async def test_a_call_the_model_gave_an_id_approve_refuses_is_renamed_and_can_be_answered(tmp_path: Path) -> None:
    # approve/deny refuse blank ids and ids over 256 characters: the runner renames such an
    # id, so no call waits unanswerable until its approval times out.
    shared = tmp_path / "shared"
    shared.mkdir()
    spec = approval_spec(shared)
    (first,) = spec["model"]["script"]["turns"][0]["tool_calls"]
    second = {**first, "id": "w" * 300, "arguments": {"command": f"echo wrote > {shared / 'second'}"}}
    spec["model"]["script"]["turns"][0]["tool_calls"] = [{**first, "id": " "}, second]
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=spec))["run_id"]
            blank = await s.wait(rid, asked)
            assert blank is not None
            await c.call("approve", run_id=rid, call_id=blank["data"]["call_id"])
            long = await s.wait(rid, lambda m: asked(m) and m["data"]["call_id"] != blank["data"]["call_id"])
            assert long is not None
            await c.call("deny", run_id=rid, call_id=long["data"]["call_id"], reason="no")
            final = await s.end(rid)
    assert final["state"] == "completed"
    calls = [(r["id"], r["state"], r["approval"]) for r in final["tool_calls"]]
    assert calls == [
        (blank["data"]["call_id"], "succeeded", "approved"),
        (long["data"]["call_id"], "rejected", "denied"),
    ]
    assert all(0 < len(cid) <= 256 and cid.strip() == cid for cid, _, _ in calls)
    assert (shared / "side-effect").read_text() == "wrote\n" and not (shared / "second").exists()


def assert_rejected_for(call: dict[str, Any], events: list[dict[str, Any]], why: str) -> None:
    """The call a stop rejected names the daemon's reason for the stop (its stop marker's),
    not the runner's ``signal``: in its record and in the ``approval_answered`` event."""
    assert call["approval_reason"] == why, call
    assert call["reason"].startswith(f"stopped_while_awaiting_approval: the run was stopped ({why})"), call
    (answered,) = [e["data"] for e in events if e["kind"] == "approval_answered"]
    assert (answered["call_id"], answered["decision"], answered["reason"]) == ("call_w", "rejected", why), answered


async def test_a_cancel_while_awaiting_approval_rejects_the_call_and_cancels_the_run(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=approval_spec(shared)))["run_id"]
            await s.wait(rid, awaiting)
            await c.call("cancel", run_id=rid)
            final = await s.end(rid)
            late = await s.reply("approve", run_id=rid, call_id="call_w")
            events = (await c.call("events", run_id=rid))["events"]
    assert (final["state"], final["reason"]) == ("cancelled", "user")
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("rejected", "rejected")
    assert_rejected_for(call, events, "user")
    assert call["output"] is None and call["started_at"] is None
    assert call["stop_effect"] == "rejected_awaiting_approval"
    assert not (shared / "side-effect").exists()
    assert late["ok"] is False and late["error"]["code"] == "refused"


async def test_an_approval_that_times_out_cancels_the_run_with_its_own_reason(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with trio.fail_after(SCENARIO_S):
        async with daemon(tmp_path / "state", grace_s=5.0) as (_d, c):
            rid = (await c.call("spawn", spec=approval_spec(shared, timeout_s=1.0)))["run_id"]
            final = await Session(c).end(rid)
            events = (await c.call("events", run_id=rid))["events"]
    assert (final["state"], final["reason"], final["cancel_reason"]) == (
        "cancelled",
        "approval_timeout",
        "approval_timeout",
    )
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("rejected", "rejected")
    assert_rejected_for(call, events, "approval_timeout")
    assert not (shared / "side-effect").exists()


async def killed_while_awaiting(state: Path, shared: Path) -> str:
    """A run whose call ``call_w`` awaits approval, its daemon then ``kill -9``ed: its id."""
    async with daemon(state, grace_s=5.0) as (d1, c):
        rid = str((await c.call("spawn", spec=approval_spec(shared)))["run_id"])
        await Session(c).wait(rid, awaiting)
        await kill9(d1, c)
    return rid


async def test_a_pending_approval_survives_a_daemon_kill_and_the_call_runs_once_approved(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        rid = await killed_while_awaiting(state, shared)
        async with daemon(state, grace_s=5.0) as (_d2, c):
            s = Session(c)
            waiting = await c.call("status", run_id=rid)
            await c.call("approve", run_id=rid, call_id="call_w")
            final = await s.end(rid)
    assert waiting["state"] == "awaiting_approval" and [a["call_id"] for a in waiting["approvals"]] == ["call_w"]
    assert final["state"] == "completed"
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("succeeded", "approved")
    assert (shared / "side-effect").read_text() == "wrote\n"


async def test_watch_shows_the_call_awaiting_approval_with_its_arguments_and_how_to_answer_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0) as (_d, c):
            rid = (await c.call("spawn", spec=approval_spec(shared)))["run_id"]
            watch = await trio.lowlevel.open_process(
                [AGENTD, "--state-dir", str(state), "watch", rid], stdout=subprocess.PIPE, start_new_session=True
            )
            try:
                assert watch.stdout is not None
                out = b""
                while b"awaiting approval" not in out or not out.endswith(b"\n"):
                    chunk = await watch.stdout.receive_some()
                    assert chunk, f"watch ended before it showed the call: {out.decode()}"
                    out += chunk
                await c.call("approve", run_id=rid, call_id="call_w")
                while chunk := await watch.stdout.receive_some():
                    out += chunk
                code = await watch.wait()
            finally:
                if watch.returncode is None:
                    watch.kill()
                    await watch.wait()
    lines = out.decode().splitlines()
    (line,) = [ln for ln in lines if "awaiting approval" in ln]
    command = f"echo wrote > {shared / 'side-effect'}"
    assert f"awaiting approval: run_command {json.dumps({'command': command}, separators=(',', ':'))}" in line, line
    assert f"`agentd approve {rid} call_w` or `agentd deny {rid} call_w --reason TEXT`" in line, line
    assert any("approval: call call_w approved" in ln for ln in lines), lines
    assert lines[-1] == f"run {rid} completed" and code == 0
    assert (shared / "side-effect").read_text() == "wrote\n"


async def test_status_names_the_look_alike_characters_of_a_call_awaiting_approval_and_json_keeps_it_raw(
    tmp_path: Path,
) -> None:
    # A prompt-injected model asks to approve a host with a Cyrillic "а" (read "paypal")
    # and a fullwidth "ｒｍ" (read "rm"): the person sees them as they are, then named.
    arguments = json.dumps({"command": "curl https://p\u0430ypal.com/x; \uff52\uff4d -rf /tmp/x"}, ensure_ascii=False)
    call = {"name": "run_command", "id": "call_s", "arguments": arguments}
    script = {"turns": [{"text": "asking", "tool_calls": [call]}], "final": "done"}
    spec = {"task": "t", "model": {"provider": "scripted", "script": script}, "approval": {"tools": ["run_command"]}}
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0) as (_d, c):
            s = Session(c)
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await s.wait(rid, awaiting)
            agentd = [AGENTD, "--state-dir", str(state)]
            human = await trio.run_process([*agentd, "status", rid], capture_stdout=True)
            raw = await trio.run_process([*agentd, "--json", "status", rid], capture_stdout=True)
            await c.call("deny", run_id=rid, call_id="call_s")
            await s.end(rid)
    (line,) = [ln for ln in human.stdout.decode().splitlines() if ln.startswith("awaiting")]
    assert line.endswith(
        f"call call_s: run_command {arguments} [look-alike characters: 'p\u0430ypal' mixes scripts: "
        "U+0430 CYRILLIC SMALL LETTER A; '\uff52\uff4d' reads 'rm' in compatibility forms: "
        "U+FF52 FULLWIDTH LATIN SMALL LETTER R, U+FF4D FULLWIDTH LATIN SMALL LETTER M] (approve or deny)"
    ), line
    (pending,) = json.loads(raw.stdout)["approvals"]
    assert pending["arguments"] == arguments and b"look-alike" not in raw.stdout


async def test_a_daemon_killed_before_the_run_moved_to_awaiting_approval_moves_it_at_its_restart(
    tmp_path: Path,
) -> None:
    # The approval request is journaled, then the run's move to awaiting_approval: a daemon
    # killed between the two left a re-adopted run "running" with a call awaiting (not in
    # `list --state awaiting_approval`). The kill is made at that point by taking the
    # move out of the journal while no daemon runs.
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        rid = await killed_while_awaiting(state, shared)
        db = sqlite3.connect(state / "agentd.sqlite3")
        with db:
            (seq,) = db.execute(
                "SELECT max(seq) FROM events WHERE run_id = ? AND kind = 'state'"
                " AND json_extract(data, '$.state') = 'awaiting_approval'",
                (rid,),
            ).fetchone()
            db.execute("DELETE FROM events WHERE run_id = ? AND seq >= ?", (rid, seq))
            db.execute("UPDATE runs SET state = 'running' WHERE id = ?", (rid,))
        db.close()
        async with daemon(state, grace_s=5.0) as (_d2, c):
            s = Session(c)
            waiting = await c.call("status", run_id=rid)
            listed = await c.call("list", state="awaiting_approval")
            await c.call("approve", run_id=rid, call_id="call_w")
            final = await s.end(rid)
    assert waiting["state"] == "awaiting_approval" and [a["call_id"] for a in waiting["approvals"]] == ["call_w"]
    assert [r["id"] for r in listed["runs"]] == [rid]
    assert final["state"] == "completed"
    assert (shared / "side-effect").read_text() == "wrote\n"


@pytest.mark.parametrize("first", ["approve", "status", "list"])
async def test_an_approval_asked_while_the_daemon_was_down_is_answerable_as_soon_as_it_is_back(
    tmp_path: Path, first: str
) -> None:
    # The runner asks while no daemon runs: the request is only in its events file. The
    # restarted daemon serves before it has read that file; an approve sent at once must
    # wait for the run's catch-up, not be refused as "not awaiting approval", a status at
    # once must say what the run is doing (awaiting), not what it was ("running"), and a
    # list at once (which does not wait) must say which rows may be behind.
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    flag = shared / "go"
    spec = approval_spec(shared)
    gate = f"while [ ! -e {flag} ]; do sleep 0.02; done; echo gate"
    # Then many events before the request: the restarted daemon's catch-up takes a while.
    busy = [{"name": "run_command", "id": f"call_b{i}", "arguments": {"command": "true"}} for i in range(40)]
    gate_call = {"name": "run_command", "id": "call_g", "arguments": {"command": gate}}
    spec["model"]["script"]["turns"].insert(0, {"text": "Waiting.", "tool_calls": [gate_call, *busy]})
    spec["sandbox"]["read"] = [str(shared)]
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await wait_call_running(c, rid, "call_g")
            run_dir = Path((await c.call("status", run_id=rid))["run_dir"])
            await kill9(d1, c)
        flag.touch()  # on to the gated call, with no daemon reading its pipe
        events_file = record_paths(run_dir)[0]
        while b'"approval_requested"' not in events_file.read_bytes():
            await trio.sleep(0.02)
        async with daemon(state, grace_s=5.0) as (_d2, c):
            s = Session(c)
            if first == "status":
                st = await s.reply("status", run_id=rid)
                assert st["result"]["state"] == "awaiting_approval", st["result"]["state"]
                assert [a["call_id"] for a in st["result"]["approvals"]] == ["call_w"]
                assert "catching_up" not in st["result"]
            if first == "list":  # does not wait: a row not caught up says so, never a stale "running"
                (row,) = (await s.reply("list"))["result"]["runs"]
                assert row.get("catching_up") is True or row["state"] == "awaiting_approval", row
            answer = await s.reply("approve", run_id=rid, call_id="call_w")
            assert answer["ok"] is True, answer
            final = await s.end(rid)
    assert answer["result"]["decision"] == "approved"
    assert final["state"] == "completed", final
    *_, call = final["tool_calls"]
    assert call["id"] == "call_w" and (call["state"], call["approval"]) == ("succeeded", "approved")
    assert (shared / "side-effect").read_text() == "wrote\n"


async def test_an_answer_sent_before_a_daemon_kill_is_the_calls_answer_for_the_next_daemon(tmp_path: Path) -> None:
    # An approve went into the run's channel and was journaled (`approval_sent`), and the
    # client told so; the daemon was then killed before its runner acted on it (here:
    # frozen). The next daemon restored the call as awaiting an answer from its record
    # alone: it took a deny too, said "denied", while the runner took the first answer
    # (the approve) and ran the call.
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0) as (d1, c):
            rid = str((await c.call("spawn", spec=approval_spec(shared)))["run_id"])
            await Session(c).wait(rid, awaiting)
            runner = (await c.call("status", run_id=rid))["pid"]
            pidfd = os.pidfd_open(runner)  # the runner this test's daemon started, pinned
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGSTOP)  # it reads no answer yet
                approved = await c.call("approve", run_id=rid, call_id="call_w")
                await kill9(d1, c)
                async with daemon(state, grace_s=5.0) as (_d2, c):
                    s = Session(c)
                    waiting = await c.call("status", run_id=rid)
                    deny = await s.reply("deny", run_id=rid, call_id="call_w", reason="changed my mind")
                    signal.pidfd_send_signal(pidfd, signal.SIGCONT)
                    final = await s.end(rid)
            finally:
                os.close(pidfd)
    assert approved["decision"] == "approved"
    assert deny["ok"] is False and deny["error"]["code"] == "refused", deny
    assert [(a["call_id"], a.get("answer_sent")) for a in waiting["approvals"]] == [("call_w", "approve")]
    assert "answered already (approve)" in deny["error"]["message"]
    assert final["state"] == "completed", final
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("succeeded", "approved")
    assert (shared / "side-effect").read_text() == "wrote\n"


@pytest.mark.parametrize("frozen", [False, True], ids=["runner-reading", "runner-frozen"])
async def test_an_answer_whose_daemon_died_between_journaling_and_sending_it_is_the_answer_and_is_sent(
    tmp_path: Path, frozen: bool
) -> None:
    # The daemon dies (SIGKILL) between the two steps of an answer: its journal write and
    # its write into the run's channel (``AGENTD_TEST_HOLD_AT=approval_between``); the
    # client was told nothing. The channel first and the journal after: the next daemon
    # had no record of the approve, took a deny (replied "denied") while the runner took
    # the approve and ran the call. Now the journal first: the next daemon refuses a
    # second answer, and sends the journaled one again, which the runner never had
    # (reading) or may have had (frozen: it takes the first answer and ignores the rest).
    shared = tmp_path / "shared"
    shared.mkdir()
    state = tmp_path / "state"
    with trio.fail_after(SCENARIO_S):
        async with daemon(state, grace_s=5.0, test_hold_at="approval_between") as (d1, c):
            rid = str((await c.call("spawn", spec=approval_spec(shared)))["run_id"])
            await Session(c).wait(rid, awaiting)
            st = await c.call("status", run_id=rid)
            events_file = record_paths(Path(st["run_dir"]))[0]
            pidfd = os.pidfd_open(st["pid"])  # the runner this test's daemon started, pinned
            try:
                if frozen:
                    signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
                c.n += 1
                await c.ws.send_message(json.dumps({"id": c.n, "op": "approve", "run_id": rid, "call_id": "call_w"}))
                assert d1.stdout is not None
                out = b""
                while b"at approval_between" not in out:
                    chunk = await d1.stdout.receive_some()
                    assert chunk, out
                    out += chunk
                await kill9(d1, c)
                if not frozen:  # nothing reached the runner, which reads at once
                    assert b'"approval_answered"' not in events_file.read_bytes()
                    assert not (shared / "side-effect").exists()
                async with daemon(state, grace_s=5.0) as (_d2, c):
                    s = Session(c)
                    waiting = await c.call("status", run_id=rid)
                    deny = await s.reply("deny", run_id=rid, call_id="call_w", reason="changed my mind")
                    if frozen:
                        signal.pidfd_send_signal(pidfd, signal.SIGCONT)
                    final = await s.end(rid)
                    events = (await c.call("events", run_id=rid))["events"]
            finally:
                os.close(pidfd)
    assert deny["ok"] is False and deny["error"]["code"] == "refused", deny
    if frozen:  # the runner cannot have acted on it yet: the journal's word holds the call
        assert [(a["call_id"], a.get("answer_sent")) for a in waiting["approvals"]] == [("call_w", "approve")]
        assert "answered already (approve)" in deny["error"]["message"], deny
    else:  # held as answered, or acted on already (the answer sent again)
        assert [(a["call_id"], a.get("answer_sent")) for a in waiting["approvals"]] in ([("call_w", "approve")], [])
    assert final["state"] == "completed", final
    (call,) = final["tool_calls"]
    assert (call["state"], call["approval"]) == ("succeeded", "approved")
    assert (shared / "side-effect").read_text() == "wrote\n"
    kinds = [e["kind"] for e in events]
    assert kinds.count("approval_sent") == 1 and kinds.count("approval_answered") == 1, kinds
