"""A stand-in runner that floods ``step_snapshot`` events (for the events benchmark).

Spec on stdin (one JSON line); its ``task`` is a JSON object:
  n: int       snapshots to emit (default 1000)
  size: int    characters of progress text in each (default 200)
  go: str      a file to wait for before flooding (so subscribers can attach first)
Emits ``runner_started``, waits for ``go`` (at most 60 s), emits the snapshots as fast as
it can, writes a completed result and exits. SIGTERM ends it at once.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from subagent.events import EventKind, encode_event, encode_result, make_event  # noqa: E402


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    b = json.loads(spec["task"])
    run_id = spec.get("run_id")
    n, size, go = int(b.get("n", 1000)), int(b.get("size", 200)), b.get("go")
    err = sys.stderr.buffer
    err.write(
        encode_event(
            make_event(EventKind.RUNNER_STARTED, pid=os.getpid(), pgid=os.getpgrp(), run_id=run_id, provider="flood")
        )
    )
    err.flush()
    deadline = time.monotonic() + 60
    while go and not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
    text = "x" * size
    for i in range(1, n + 1):
        err.write(encode_event(make_event(EventKind.STEP_SNAPSHOT, step=i, progress=text, tool_calls=[], _id=run_id)))
    err.flush()
    sys.stdout.buffer.write(
        encode_result(
            {
                "status": "completed",
                "reason": None,
                "final_text": "flooded",
                "progress": text,
                "steps": n,
                "tool_calls": [],
                "usage": {},
                "error": None,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
