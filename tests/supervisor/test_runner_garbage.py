"""A runner's garbage harms nothing: a real daemon, real runners writing hostile lines.

JSON that Python's decoder reads but the daemon could not keep (a timestamp or deadline no
float holds, NaN, an integer SQLite cannot bind, nesting beyond the recursion limit) ended its run's supervision: the run
was recorded ``failed`` (``internal``) and the result its runner wrote was lost. Each such
line is now a ``stderr`` note (or the event, the value it could not keep made null, a
timestamp the daemon's time);
the run ends as its runner said, with its result, and the other runs never notice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.supervisor.real_daemon import Client, real_daemon

DEEP = "[" * 5000 + "]" * 5000  # beyond the decoder's recursion limit
DEEP_NAN = "[" * 900 + "NaN" + "]" * 900  # decoded, then no reply could encode it
# Each line, and the start of the ``stderr`` note it leaves (None: none, the event is kept).
HOSTILE_LINES = {
    "a timestamp no float holds": ('{"event":"log","level":"info","message":"t","ts":1' + "0" * 400 + "}", None),
    "a NaN timestamp": ('{"event":"log","level":"info","message":"t","ts":NaN}', None),
    "nesting beyond the recursion limit": ('{"event":"log","level":"info","message":' + DEEP + "}", "json nested"),
    "nesting 900 deep holding a NaN": ('{"event":"log","level":"info","message":' + DEEP_NAN + "}", "json nested"),
    # Integers SQLite cannot bind (beyond 64 bits, or int() of a huge float), a deadline
    # no float holds (1 and 400 zeros).
    "a process group beyond 64 bits": (
        '{"event":"process_group","pgid":1' + "0" * 21 + ',"pid":5,"kind":"command","name":"x","alive":true}',
        "bad process_group event",
    ),
    "a process group of 1e300": (
        '{"event":"process_group","pgid":1e300,"pid":5,"kind":"command","name":"x","alive":true}',
        "bad process_group event",
    ),
    "a tool-call step of 1e300": (
        '{"event":"tool_call","record":{"id":"t1","name":"n","state":"running","step":1e300}}',
        "bad tool_call event",
    ),
    "an approval deadline no float holds": (
        '{"event":"approval_requested","call_id":"c1","name":"t","arguments":"{}","step":1,"timeout_s":5,'
        '"deadline":1' + "0" * 400 + '}\n{"event":"approval_answered","call_id":"c1","decision":"approved"}',
        None,
    ),
}


def task(**behaviour: Any) -> dict[str, Any]:
    return {"task": json.dumps({"wait": False, **behaviour})}


async def ended(c: Client, run_id: str) -> dict[str, Any]:
    end = await c.wait_end(run_id)
    status: dict[str, Any] = await c.ok("status", run_id=run_id)
    assert status["state"] == end["state"]
    return status


@pytest.mark.parametrize("what", list(HOSTILE_LINES))
async def test_a_runners_unkeepable_event_line_is_noted_and_its_run_ends_with_its_result(
    tmp_path: Path, what: str
) -> None:
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        bystander = (await c.ok("spawn", spec=task(wait=True)))["run_id"]
        await c.wait_kind(bystander, "step_snapshot")
        line, note = HOSTILE_LINES[what]
        run_id = (await c.ok("spawn", spec=task(stderr_raw=[line])))["run_id"]
        status = await ended(c, run_id)
        assert status["state"] == "completed", status.get("error")
        assert status["result"]["final_text"] == "done"
        # Every event of the run can be read back (a page, a replay from the start).
        events = (await c.ok("events", run_id=run_id))["events"]
        kinds = [e["kind"] for e in events]
        assert "runner_started" in kinds and kinds[-1] == "state", kinds
        assert any(e["kind"] == "log" and e["data"].get("message") == "after the raw lines" for e in events)
        assert all(isinstance(e["ts"], float) for e in events)
        noted = [e["data"]["problem"] for e in events if e["kind"] == "stderr"]
        assert noted == [] if note is None else (len(noted) == 1 and noted[0].startswith(note)), noted
        assert (await c.ok("status", run_id=bystander))["state"] == "running"
        await c.ok("cancel", run_id=bystander)
        assert (await c.wait_end(bystander))["state"] == "cancelled"
        assert d.alive()
    assert "supervision failed" not in d.log_text()


async def test_a_result_nested_beyond_the_recursion_limit_is_no_result_not_a_failed_supervision(
    tmp_path: Path,
) -> None:
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        run_id = (await c.ok("spawn", spec=task(stdout_raw='{"status":"completed","x":' + DEEP + "}\n")))["run_id"]
        status = await ended(c, run_id)
        assert status["state"] == "failed"
        assert status["reason"] == "runner_died", status
        assert "without a result" in status["error"]["message"]
        # It exited 0: a failed run's error code said "completed" (exit code 0's name).
        assert status["error"]["code"] == "no_result", status["error"]
        with trio.fail_after(10):
            assert (await c.ok("ping"))["pong"] is True
    assert "supervision failed" not in d.log_text()


async def test_a_result_after_more_junk_on_stdout_than_the_daemon_keeps_is_still_the_runs_result(
    tmp_path: Path,
) -> None:
    # The daemon kept the first 16 MiB of a runner's stdout and dropped the rest, though
    # the result is the last JSON line: a runner that wrote 20 MiB of junk, then its
    # result, ended ``failed`` (runner_died: "no result object on stdout").
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        bystander = (await c.ok("spawn", spec=task(wait=True)))["run_id"]
        await c.wait_kind(bystander, "step_snapshot")
        run_id = (await c.ok("spawn", spec=task(stdout_junk_mib=20)))["run_id"]
        status = await ended(c, run_id)
        assert status["state"] == "completed", status.get("error")
        assert status["result"]["final_text"] == "done"
        assert status["partial"] is False
        assert (await c.ok("status", run_id=bystander))["state"] == "running"
        assert d.alive()
    assert "supervision failed" not in d.log_text()


@pytest.mark.parametrize(
    ("fields", "stopped"),
    [
        ({"error": "the model broke"}, True),
        ({"unapplied_steering": 5}, True),
        ({"reason": ["x"]}, False),
        ({"tool_calls": 5}, False),
    ],
    ids=["error text", "unapplied_steering number", "reason list", "tool_calls number"],
)
async def test_a_result_field_of_the_wrong_type_is_kept_as_text_and_the_result_is_not_lost(
    tmp_path: Path, fields: dict[str, Any], stopped: bool
) -> None:
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        bystander = (await c.ok("spawn", spec=task(wait=True)))["run_id"]
        await c.wait_kind(bystander, "step_snapshot")
        run_id = (await c.ok("spawn", spec=task(wait=stopped, result_fields=fields)))["run_id"]
        if stopped:
            # A steer the runner never reads (it reads no input after its spec) is
            # unapplied at its end: the daemon adds it to the result's unapplied_steering.
            await c.wait_kind(run_id, "step_snapshot")
            assert (await c.ok("steer", run_id=run_id, text="also this"))["accepted"] is True
            await c.ok("cancel", run_id=run_id)
        status = await ended(c, run_id)
        assert status["state"] == ("cancelled" if stopped else "completed"), status.get("error")
        result = status["result"]
        # The runner's own result (a partial snapshot has no status), whole.
        assert result is not None and result.get("status") == status["state"], status
        assert result["progress"] == "step 1 done. "
        if stopped:
            assert "also this" in result["unapplied_steering"]
        name = next(iter(fields))
        assert result["malformed_fields"] == [name]
        if name == "error":
            assert result["error"] == {"code": "malformed_error", "message": '"the model broke"'}
        if name == "reason":
            assert status["reason"] == result["reason"] == '["x"]'
        assert (await c.ok("status", run_id=bystander))["state"] == "running"
        assert d.alive()
    assert "supervision failed" not in d.log_text()
    assert "cannot be stored as it is" not in d.log_text()


async def test_a_result_record_the_store_cannot_keep_is_left_out_and_the_result_kept(tmp_path: Path) -> None:
    # int(1e300) is beyond what SQLite binds: its write failed, and the whole run with it.
    records = [
        {"id": "t1", "name": "n", "state": "succeeded", "step": 1e300},
        {"id": "t2", "name": "n", "state": "succeeded", "step": 2},
    ]
    async with real_daemon(tmp_path / "state") as d, d.connect() as c:
        run_id = (await c.ok("spawn", spec=task(result_fields={"tool_calls": records})))["run_id"]
        status = await ended(c, run_id)
        assert status["state"] == "completed", status.get("error")
        assert status["result"]["final_text"] == "done"
        assert [t["id"] for t in status["tool_calls"]] == ["t2"]
    assert "bad tool-call record in the result" in d.log_text()
    assert "supervision failed" not in d.log_text()


async def test_an_event_whose_time_was_replaced_is_journaled_once_across_a_daemon_restart(tmp_path: Path) -> None:
    # A restarted daemon journals from a re-adopted runner's events file what its journal
    # lacks, telling events apart by kind, time and data: an event whose ``ts`` was no
    # number got the daemon's time at each read, so the second daemon journaled it again.
    lines = [
        '{"event":"log","level":"info","message":"ts text","ts":"noon"}',
        '{"event":"log","level":"info","message":"ts NaN","ts":NaN}',
        '{"event":"log","level":"info","message":"no ts"}',
    ]
    state = tmp_path / "state"
    async with real_daemon(state) as d1:
        async with d1.connect() as c:
            run_id = (await c.ok("spawn", spec=task(wait=True, events_file=True, stderr_raw=lines)))["run_id"]
            await c.wait_kind(run_id, "step_snapshot")
            first = [e for e in (await c.ok("events", run_id=run_id))["events"] if e["kind"] == "log"]
            assert [e["data"].get("ts_replaced") for e in first] == [True, True, True, None], first
        d1.proc.kill()  # SIGKILL: the runner goes on, its events file holds every line
        await d1.proc.wait()
    async with real_daemon(state) as d2, d2.connect() as c:
        assert (await c.ok("status", run_id=run_id))["live"] is True
        await c.ok("cancel", run_id=run_id)
        await c.wait_end(run_id)
        events = (await c.ok("events", run_id=run_id))["events"]
        logged = [e["data"]["message"] for e in events if e["kind"] == "log"]
        assert logged == ["ts text", "ts NaN", "no ts", "after the raw lines"], logged
