"""A runner stand-in shaped like a browser: helpers that show no marker outlive their parent.

The leader forks a "browser" that leads a session of its own and keeps the marker; the
browser starts a "helper" through an intermediate that exits at once (so the helper's
parent is gone), and the helper execs with an environment that lacks AGENTD_TREE (as
Chromium's helpers show none: setproctitle reuses the area). The helper stays in the
browser's session and ignores SIGTERM. Prints {"leader": pid, "browser": pid, "helper": pid}.
"""

import json
import os
import signal
import sys

r, w = os.pipe()
if os.fork() == 0:  # the browser
    os.setsid()
    os.close(r)
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:  # the helper
            env = {"AGENTD_TEST_MARK": os.environ.get("AGENTD_TEST_MARK", "")}
            code = (
                "import os, signal\n"
                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                f"os.write({w}, f'helper {{os.getpid()}}\\n'.encode()); os.close({w})\n"
                "while True: signal.pause()\n"
            )
            os.set_inheritable(w, True)
            os.execve(sys.executable, [sys.executable, "-c", code], env)
        os._exit(0)
    os.waitpid(middle, 0)
    os.write(w, f"browser {os.getpid()}\n".encode())
    os.close(w)
    while True:
        signal.pause()
os.close(w)
pids = {"leader": os.getpid()}
with os.fdopen(r) as reports:
    for line in reports:
        kind, pid = line.split()
        pids[kind] = int(pid)
print(json.dumps(pids), flush=True)
while True:
    signal.pause()
