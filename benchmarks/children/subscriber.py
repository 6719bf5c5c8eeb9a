"""One websocket subscriber for the events benchmark: ``subscriber.py URL TOKEN RUN_ID``.

Follows the run (replay, then live, until it ends) with the stdlib client; prints
``ready`` once its subscription delivered a first event, then at the end one JSON line:
{"count": step_snapshots received, "first": wall time of the first, "last": of the last,
"events": all events, "state": the run's terminal state}.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from supervisor.control.client import Client  # noqa: E402


def main() -> None:
    url, token, run_id = sys.argv[1:4]
    count = events = 0
    first = last = None
    ready = False
    with Client(url, token, timeout_s=60) as c:
        f = c.follow(run_id, reconnect=False)
        for ev in f:
            events += 1
            if not ready:
                print("ready", flush=True)
                ready = True
            if ev.get("kind") == "step_snapshot":
                now = time.time()
                count += 1
                first = now if first is None else first
                last = now
    print(json.dumps({"count": count, "first": first, "last": last, "events": events, "state": f.state}), flush=True)


if __name__ == "__main__":
    main()
