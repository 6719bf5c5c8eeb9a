"""A runner stand-in that exits at once while a descendant keeps its stdout open.

The descendant (in a session of its own, ignoring SIGTERM) prints "holder <pid>" and
then waits forever with stdout still open; the leader prints "leader done" and exits 0.
"""

import os
import signal
import sys

r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.close(r)
    print(f"holder {os.getpid()}", flush=True)
    os.close(w)
    while True:
        signal.pause()
os.close(w)
os.read(r, 1)  # EOF once the holder has printed its line
print("leader done", flush=True)
sys.exit(0)
