"""A stand-in runner for daemon tests: speaks the wire format, behaves as told.

The behaviour comes from the spec's ``task``, a JSON object:
  snapshots: int      step_snapshot events to emit before waiting (default 1)
  ignore_term: bool   ignore SIGTERM (then only SIGKILL ends it)
  wait: bool          after the snapshots, block until SIGTERM (default true)
  exit_code: int      exit code when it ends by itself (default 0)
  no_result: bool     never write the final JSON
  garbage: bool       write non-JSON noise on stderr first
  tree: bool          start tests/children/tree_family.py-like descendants
  hold_stdout: bool   leave a detached grandchild holding stdout open after exit
  group: bool         start a server in a process group of its own, announced with a
                      process_group event (as an MCP server is); it ignores SIGTERM
  hold_stdout_scrubbed: bool  the same, with an empty environment (no marker) and
                      ignoring SIGTERM: only the pipe it holds ties it to the run
  echo_steer: bool    while it waits, log each steering line from stdin ("steered: <text>")
  log_on_usr1: bool   emit a log event ("usr1") on each SIGUSR1: an event when a test asks
  stderr_raw: [str]   lines written as they are on stderr after runner_started (latin-1:
                      "\xff" is the byte 0xff), then a log event ("after the raw lines")
  events_file: bool   also append every stderr line to its events file (as a real runner
                      does), for a restarted daemon to read
  result_fields: obj  fields to put in the result as they are (after its own)
  stdout_raw: str     write this on stdout instead of a result (latin-1, as stderr_raw)
  stdout_junk_mib: int  a line of this many MiB of junk on stdout before the result
  failed_before_stop: bool  on SIGTERM, end as a runner whose own failure was decided just
                      before the stop reached it: result failed (model_error), flagged so
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from subagent.emit import record_paths
from subagent.events import EventKind, encode_event, encode_result, make_event

stop = False


def on_term(signum, frame):  # noqa: ARG001
    global stop
    stop = True


events_file = None  # the events file, when the task says to write it too


def write_err(data: bytes) -> None:
    sys.stderr.buffer.write(data)
    sys.stderr.buffer.flush()
    if events_file is not None:
        events_file.write(data)
        events_file.flush()


def emit(kind, **data):
    write_err(encode_event(make_event(kind, **data)))


def echo_steering() -> None:
    for line in sys.stdin:
        emit(EventKind.LOG, level="info", message=f"steered: {json.loads(line)['steer']}")


def main() -> None:
    if "--warm" in sys.argv:
        emit(EventKind.LOG, level="info", message="warm: waiting for the spec on stdin", warm=True)
    line = sys.stdin.readline()
    if not line:
        sys.exit(2)  # EOF before a spec: a warm runner the daemon no longer needs
    spec = json.loads(line)
    b = json.loads(spec["task"]) if spec.get("task", "").startswith("{") else {}
    run_id = spec["run_id"]
    if b.get("events_file"):
        global events_file
        events_file = record_paths(Path(os.environ["AGENTD_RUN_DIR"]))[0].open("ab")
    if b.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_term)
    if b.get("log_on_usr1"):
        signal.signal(signal.SIGUSR1, lambda *_: emit(EventKind.LOG, level="info", message="usr1"))
    if b.get("garbage"):
        sys.stderr.write("Traceback (most recent call last):\n  garbage {{{\n")
        sys.stderr.flush()
    emit(EventKind.RUNNER_STARTED, pid=os.getpid(), pgid=os.getpgrp(), run_id=run_id, provider="fake")
    if b.get("stderr_raw"):
        write_err(b"".join(line.encode("latin-1") + b"\n" for line in b["stderr_raw"]))
        emit(EventKind.LOG, level="info", message="after the raw lines")
    if b.get("tree"):
        # a grandchild in our group, a setsid() one, a double-forked one
        code = (
            "import os,time,subprocess,sys\n"
            "subprocess.Popen([sys.executable,'-c','import time; time.sleep(300)'])\n"
            "subprocess.Popen([sys.executable,'-c','import os,time; os.setsid(); time.sleep(300)'])\n"
            "if os.fork()==0:\n"
            "    os.setsid()\n"
            "    if os.fork()==0:\n"
            "        time.sleep(300)\n"
            "    os._exit(0)\n"
            "time.sleep(300)\n"
        )
        p = subprocess.Popen([sys.executable, "-c", code])
        emit(EventKind.LOG, level="info", message=f"tree started {p.pid}")
    if b.get("hold_stdout"):
        subprocess.Popen(
            [sys.executable, "-c", "import os,time; os.setsid(); time.sleep(300)"],
            stdout=sys.stdout,
        )
    if b.get("group"):
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)",
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
        )
        data = {"pgid": server.pid, "pid": server.pid, "kind": "mcp_server", "name": "fake", "alive": True}
        sys.stderr.buffer.write(encode_event(make_event(EventKind.PROCESS_GROUP, **data)))
        sys.stderr.buffer.flush()
    if b.get("hold_stdout_scrubbed"):
        # The runner goes on only once the holder has left the session and the
        # environment (it says so on a pipe), so nothing but the pipe ties it to the run.
        r, w = os.pipe()
        code = (
            "import os, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"os.write({w}, b'x'); os.close({w})\n"
            "time.sleep(300)\n"
        )
        holder = subprocess.Popen(
            ["/usr/bin/setsid", sys.executable, "-c", code], stdout=sys.stdout, env={}, pass_fds=(w,)
        )
        os.close(w)
        os.read(r, 1)
        os.close(r)
        emit(EventKind.LOG, level="info", message=f"holder {holder.pid}")
    progress = ""
    for i in range(1, int(b.get("snapshots", 1)) + 1):
        progress += f"step {i} done. "
        emit(EventKind.STEP_SNAPSHOT, step=i, progress=progress, tool_calls=[], _id=run_id)
    if b.get("echo_steer"):
        threading.Thread(target=echo_steering, daemon=True).start()
    if b.get("wait", True):
        while not stop:
            signal.pause()
    if b.get("no_result"):
        sys.exit(int(b.get("exit_code", 0)))
    if stop and b.get("failed_before_stop"):
        error = {"code": "model_error", "message": "the model failed"}
        result = {"status": "failed", "reason": "model_error", "progress": progress, "tool_calls": [], "error": error}
        sys.stdout.buffer.write(encode_result({**result, "failed_before_stop": True}))
        sys.stdout.buffer.flush()
        sys.exit(5)
    if "stdout_raw" in b:
        sys.stdout.buffer.write(b["stdout_raw"].encode("latin-1"))
        sys.stdout.flush()
        sys.exit(int(b.get("exit_code", 0)))
    if b.get("stdout_junk_mib"):
        for _ in range(int(b["stdout_junk_mib"])):
            sys.stdout.buffer.write(b"\x00junk" * (1 << 18))
        sys.stdout.buffer.write(b"\n")
    status = "cancelled" if stop else "completed"
    sys.stdout.buffer.write(
        encode_result(
            {
                "status": status,
                "reason": "signal" if stop else None,
                "final_text": "done" if not stop else None,
                "progress": progress,
                "steps": int(b.get("snapshots", 1)),
                "tool_calls": [],
                "usage": {},
                "error": None,
                **b.get("result_fields", {}),
            }
        )
    )
    sys.stdout.flush()
    sys.exit(3 if stop else int(b.get("exit_code", 0)))


if __name__ == "__main__":
    main()
