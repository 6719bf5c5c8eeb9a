"""What a stop did to the run's tools, in words, for the stop receipt. Pure: records in, lines out.

The runner writes each call's stop policy and effect in its record (``on_stop``,
``stop_effect``, ``stop_to_end_s``; see ``subagent.events.ToolCallRecord``); the daemon
writes them for calls its settling closed (a runner killed at the grace). This turns
them into the receipt's ``tools`` entries, e.g. "interrupted `run_command` after 40 ms",
"read-only MCP call `read_file` abandoned", "destructive call `write_file` allowed to
finish; it finished 1.2 s after the stop".
"""

from __future__ import annotations

import signal
from collections.abc import Iterable, Mapping
from typing import Any

from subagent.events import StopEffect, StopPolicy

__all__ = ["describe_tool_stops", "duration_text", "runner_death"]


def duration_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _after(rec: Mapping[str, Any], cancel_wall: float | None) -> float | None:
    """Seconds from the cancel (the daemon's clock) to the call's end; else from the stop
    as the runner saw it (its SIGTERM may come after path A ended the command)."""
    finished = rec.get("finished_at")
    if rec.get("stop_effect") == StopEffect.BACKGROUND_ENDED:
        finished = None  # the call ended before the stop; its background command after it
    if cancel_wall is not None and isinstance(finished, (int, float)):
        return max(0.0, float(finished) - cancel_wall)
    after = rec.get("stop_to_end_s")
    return float(after) if isinstance(after, (int, float)) else None


def _line(rec: Mapping[str, Any], after: float | None) -> str | None:
    name = str(rec.get("name") or "?")
    effect = rec.get("stop_effect")
    took = f" after {duration_text(float(after))}" if isinstance(after, (int, float)) else ""
    finished = (
        f" {duration_text(float(after))} after the stop" if isinstance(after, (int, float)) else " after the stop"
    )
    if effect == StopEffect.INTERRUPTED:
        return f"interrupted `{name}`{took}"
    if effect == StopEffect.ABANDONED:
        return f"read-only MCP call `{name}` abandoned (notifications/cancelled sent)"
    if effect == StopEffect.CANCEL_UNANSWERED:
        return f"MCP call `{name}` told to stop (notifications/cancelled); no answer, abandoned{took}"
    if effect == StopEffect.FINISHED_AFTER_STOP:
        if rec.get("on_stop") == StopPolicy.FINISH:
            what = "a command the spec lets finish" if name == "run_command" else "destructive call"
            return f"{what} `{name}` allowed to finish; it finished{finished}"
        return f"`{name}` told to stop; it answered{finished}"
    if effect == StopEffect.BACKGROUND_ENDED:
        return f"background command of `{name}` ended by the stop{took}"
    if effect == StopEffect.REJECTED_AWAITING_APPROVAL:
        return f"`{name}` was awaiting approval: rejected, it never ran"
    if effect == StopEffect.GRACE_RAN_OUT:
        return f"`{name}` was still running when the grace ran out; the runner was killed; its outcome is unknown"
    if effect == StopEffect.RUNNER_DIED:
        return f"`{name}` was still running when the runner died during the stop (not killed by agentd); its outcome is unknown"
    return None


def describe_tool_stops(
    records: Iterable[Mapping[str, Any]], *, cancel_wall: float | None = None
) -> list[dict[str, Any]]:
    """One entry per call a stop reached, then one for the calls that never started.

    ``cancel_wall``: when the daemon took the cancel (wall clock); times are counted from it.
    """
    out: list[dict[str, Any]] = []
    never: list[str] = []
    for rec in records:
        if rec.get("stop_effect") == StopEffect.STOPPED_BEFORE_START:
            never.append(str(rec.get("name") or "?"))
            continue
        after = _after(rec, cancel_wall)
        text = _line(rec, after)
        if text is not None:
            out.append(
                {
                    "id": rec.get("id"),
                    "name": rec.get("name"),
                    "on_stop": rec.get("on_stop"),
                    "effect": rec.get("stop_effect"),
                    "after_s": None if after is None else round(after, 4),
                    "text": text,
                }
            )
    if never:
        names = ", ".join(f"`{n}`" for n in never)
        text = f"{len(never)} call{'s' if len(never) > 1 else ''} never started: {names}"
        out.append({"effect": str(StopEffect.STOPPED_BEFORE_START), "count": len(never), "text": text})
    return out


def runner_death(code: int | None, memory: Mapping[str, Any] | None, *, gone: bool = False) -> str:
    """How a runner that left no result ended, when the daemon did not kill it (its exit
    code; ``memory``: the receipt's, whose OOM kills name the kernel's OOM killer;
    ``gone``: it had ended when path B began, e.g. while no daemon ran)."""
    if code == -signal.SIGKILL and memory is not None and (memory.get("oom_kills") or memory.get("failcnt")):
        return "killed by the kernel's OOM killer at the run's memory limit"
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}, which agentd did not send"
    if code is not None:
        return f"exit code {code}"
    return "it was gone when agentd's stop came to end it" if gone else "no exit status"
