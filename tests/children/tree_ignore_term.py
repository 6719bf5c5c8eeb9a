"""A runner stand-in that ignores SIGTERM: prints "ready" on stdout, then waits forever.

Only SIGKILL (or cgroup.kill) ends it.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
while True:
    signal.pause()
