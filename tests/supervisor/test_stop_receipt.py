"""The stop receipt's words for what a stop did to each tool (pure)."""

from __future__ import annotations

from supervisor.core._stop_receipt import describe_tool_stops, duration_text

T = 1_700_000_000.0


def rec(name: str, effect: str | None, **more: object) -> dict[str, object]:
    return {"id": f"c-{name}", "name": name, "stop_effect": effect, **more}


def test_each_effect_is_said_plainly_with_times_counted_from_the_cancel() -> None:
    records = [
        rec("done_before", None, state="succeeded"),
        rec("run_command", "interrupted", on_stop="interrupt", finished_at=T + 0.04, stop_to_end_s=0.0),
        rec("read_file", "abandoned", on_stop="abandon", finished_at=T + 0.2),
        rec("tidy", "cancel_unanswered", on_stop="cancel", finished_at=T + 1.1),
        rec("write_file", "finished_after_stop", on_stop="finish", finished_at=T + 1.2),
        rec("navigate", "finished_after_stop", on_stop="cancel", finished_at=T + 0.3),
        rec("slow_write", "grace_ran_out", on_stop="finish"),
        rec("rm_tmp", "rejected_awaiting_approval", state="rejected"),  # (it was left out)
        rec("next", "stopped_before_start"),
        rec("after", "stopped_before_start"),
    ]
    texts = [t["text"] for t in describe_tool_stops(records, cancel_wall=T)]
    assert texts == [
        "interrupted `run_command` after 40 ms",
        "read-only MCP call `read_file` abandoned (notifications/cancelled sent)",
        "MCP call `tidy` told to stop (notifications/cancelled); no answer, abandoned after 1.1 s",
        "destructive call `write_file` allowed to finish; it finished 1.2 s after the stop",
        "`navigate` told to stop; it answered 300 ms after the stop",
        "`slow_write` was still running when the grace ran out; the runner was killed; its outcome is unknown",
        "`rm_tmp` was awaiting approval: rejected, it never ran",
        "2 calls never started: `next`, `after`",
    ]


def test_without_the_cancel_time_the_runners_own_figure_is_used() -> None:
    (entry,) = describe_tool_stops([rec("run_command", "interrupted", stop_to_end_s=0.5, finished_at=T)])
    assert entry["text"] == "interrupted `run_command` after 500 ms" and entry["after_s"] == 0.5
    assert describe_tool_stops([rec("x", None, state="succeeded")]) == []
    assert duration_text(0.0404) == "40 ms" and duration_text(12.34) == "12.3 s"


def test_a_runner_that_died_during_the_stop_is_said_so_not_the_grace() -> None:
    from supervisor.core._stop_receipt import runner_death

    (line,) = describe_tool_stops([{"id": "a", "name": "run_command", "stop_effect": "runner_died"}])
    assert line["text"] == (
        "`run_command` was still running when the runner died during the stop (not killed by agentd); "
        "its outcome is unknown"
    )
    oom = {"max": 1 << 27, "peak": 1 << 27, "failcnt": 3, "oom_kills": 1}
    assert runner_death(-9, oom) == "killed by the kernel's OOM killer at the run's memory limit"
    assert runner_death(-9, {**oom, "failcnt": 0, "oom_kills": 0}) == "killed by SIGKILL, which agentd did not send"
    assert runner_death(-11, None) == "killed by SIGSEGV, which agentd did not send"
    assert runner_death(70, None) == "exit code 70" and runner_death(None, None) == "no exit status"
    assert runner_death(None, None, gone=True) == "it was gone when agentd's stop came to end it"
