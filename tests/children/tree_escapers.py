"""A runner stand-in whose descendants try every way out of its process group.

It forks, each descendant reporting its pid back over a pipe:
  group     a grandchild that stays in the leader's group
  setsid    a descendant in a session of its own
  daemon    a double-forked daemon (fork, setsid, fork, the middle one exits)
  stopped   (--stop) a setsid() descendant that SIGSTOPs itself: SIGTERM cannot end it
  scrubbed  (--scrubbed) a double-forked, setsid() daemon that execs with an empty
            environment and its stdio on /dev/null: no marker, no pipe, so only a cgroup
            can find it
then prints one JSON line {"leader": pid, "group": pid, ...} on stdout.
--ignore-term: the leader and every descendant ignore SIGTERM.
--exit-leader: the leader exits right after printing (its descendants stay).
--leader-honours-term: the leader alone dies of SIGTERM (its descendants still ignore it).
"""

import json
import os
import signal
import sys

args = set(sys.argv[1:])
if "--ignore-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

report_r, report_w = os.pipe()


def wait_forever(stop=False):
    os.close(report_r)
    os.close(report_w)
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        signal.pause()


def report(kind):
    os.write(report_w, f"{kind} {os.getpid()}\n".encode())


def spawn(kind, setsid=False, double=False, stop=False, scrub=False):
    pid = os.fork()
    if pid:
        return pid
    try:
        if setsid:
            os.setsid()
        if double:
            if os.fork():
                os._exit(0)
        if scrub:
            # A real daemon's detachment: its stdio leaves the runner's pipes too (a pipe
            # holder would still be found through the pipe).
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execve(
                sys.executable,
                [
                    sys.executable,
                    "-c",
                    "import os, signal\n"
                    f"os.write({report_w}, f'scrubbed {{os.getpid()}}\\n'.encode())\n"
                    f"os.close({report_w})\n"
                    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                    "while True: signal.pause()",
                ],
                {},
            )
        report(kind)
        wait_forever(stop)
    finally:
        os._exit(1)


os.set_inheritable(report_w, True)
children = {
    "group": spawn("group"),
    "setsid": spawn("setsid", setsid=True),
    "daemon": spawn("daemon", setsid=True, double=True),
}
if "--stop" in args:
    children["stopped"] = spawn("stopped", setsid=True, stop=True)
if "--scrubbed" in args:
    children["scrubbed-middle"] = spawn("scrubbed", setsid=True, double=True, scrub=True)
os.close(report_w)

pids = {"leader": os.getpid()}
with os.fdopen(report_r) as reports:
    for line in reports:
        kind, pid = line.split()
        pids[kind] = int(pid)
# The middle processes of the double forks exit at once: reap them.
os.waitpid(children["daemon"], 0)
if "scrubbed-middle" in children:
    os.waitpid(children["scrubbed-middle"], 0)
if "stopped" in children:
    os.waitpid(children["stopped"], os.WUNTRACED)  # returns once it is stopped
if "--leader-honours-term" in args:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
print(json.dumps(pids), flush=True)
if "--exit-leader" in args:
    sys.exit(0)
while True:
    signal.pause()
