"""``python -m subagent.zygote``: a pre-initialised runner that forks one runner per spawn.

The daemon starts it (``supervisor/trees/zygote.py``) with one end of a ``SOCK_SEQPACKET`` unix
socket as its stdin. It imports everything a runner may need (``runner.preload``: trio,
openai, mcp, the runner's modules), starts no thread and no event loop, freezes the
garbage collector (so a child's collections do not write to the pages it shares with the
zygote), prepares its memory for forks (``_prepare_memory``: a runner then copies fewer
of its pages, and each fork and exit handles fewer page table entries), says ``ready``, then serves one request at a time until EOF:

  daemon -> zygote: {"id", "args", "cwd", "tree_id", "cgroup_procs", "pids_procs", "memory_procs"}
                    + SCM_RIGHTS [stdin read end, stdout write end, stderr write end,
                                  environment read end]
  runner -> daemon: {"id", "pid", "ticks", "cgroup": bool, "pids": bool, "memory": bool}  or  {"id", "error"}
                    (the forked runner sends its own reply, on the zygote's socket)
  zygote -> daemon: {"id", "error"}                 a request it could not fork for
                    {"exit": pid, "code", "request"} a runner it forked has exited

A spare (``supervisor.trees.zygote.Spare``): a runner forked ahead, for a tree the daemon
has made (id, run directory, cgroup) but no run yet:

  daemon -> zygote: {"id", "spare": true, "cwd", "tree_id", "cgroup_procs", "pids_procs", "memory_procs",
                     "sandbox", "answers"}
                    + SCM_RIGHTS [the spare's end of a socket pair, its channel]
  spare  -> daemon: {"id", "pid", "ticks", "cgroup", "pids", "memory"}  (on the zygote's socket, as above)
  then, on its channel:
  daemon -> spare:  {"args", "cwd"} + SCM_RIGHTS [stdin, stdout, stderr, environment]
  spare  -> daemon: {"assigned": pid}
  daemon -> spare:  "go"  (once the run's start is journaled)

Parked, the spare has done everything that does not need its run: session, cgroup (born
there), marker, descriptors, signals, random state, its sandbox's first half
(``sandbox.prepare_ahead``: namespaces, private mounts, the Landlock ruleset but the
spec's grants), a rehearsal of a run's first steps (``runner.rehearse``); it dies with
the zygote (``PR_SET_PDEATHSIG``) until it has a run. Assigned, it takes its pipes and
environment, reads its spec (already in its stdin), finishes its sandbox, starts Trio's
loop, then waits for ``go`` before anything of the run (``runner.main``'s gate): EOF
instead (the daemon hung up or died before its journal held the start) and it exits,
having done nothing.

The runner is the zygote's child: the zygote reaps it (SIGCHLD) and reports its exit
code (and the request it was forked for: one that died before replying fails it); the
daemon sees the exit through a pidfd and takes the code from that report. If
the zygote dies first, its runners are re-parented to the daemon (a child subreaper),
which then reaps them itself. Before the reply the runner has made itself a new session,
joined its cgroup, its v1 pids group (``pids_procs``, where the daemon's per-run pids
limit lives in one) and its v1 memory group (``memory_procs``, the per-run memory limit),
before it can fork, and written its marker where
``/proc/<pid>/environ`` shows it; then it takes its pipes as fds 0-2, closes every other
descriptor, resets signal dispositions and mask, reseeds every random generator the
imports created, takes the run's environment, working directory and argv, and calls
``subagent.runner.start`` like a cold runner.

EOF on the socket (the daemon closed it, or died) ends the zygote. Stdlib only, besides
what ``preload`` imports.

Size: the zygote's end of one wire protocol (``supervisor/trees/zygote.py`` is the
other), and the fork that must happen in one process: a runner made from the zygote
(cgroup, session, descriptors, signals, random state, environment) before it runs.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final, NoReturn

from subagent._nest import NEST_ENV
from subagent.osedge import LINUX

__all__ = [
    "ENV_ROOM",
    "ENV_ROOM_VAR",
    "MARKER_ROOM",
    "MAX_MESSAGE",
    "N_FDS",
    "PLACEHOLDER_MARKER",
    "decode",
    "encode",
    "main",
]

# Largest request or reply (the run's environment is most of a request).
MAX_MESSAGE: Final = 1 << 20
# Descriptors that come with a request: the runner's stdin, stdout and stderr, and a pipe
# holding the run's environment (JSON, then EOF). The environment (a model key, say) goes
# from the daemon to the runner without passing through the zygote, whose memory every
# later runner gets a copy of.
N_FDS: Final = 4
MARKER_VAR: Final = "AGENTD_TREE"
# The zygote is started with AGENTD_TREE set to this placeholder: its bytes in the
# process's environment block are where a forked runner writes its own tree id, so that
# /proc/<runner>/environ shows the runner's marker as a cold runner's does.
MARKER_ROOM: Final = 64
PLACEHOLDER_MARKER: Final = "zygote" + "." * (MARKER_ROOM - len("zygote"))
# Room left in the zygote's environment block for a runner's own (the run's environment
# is the daemon's plus a few variables, so it fits with this much to spare).
ENV_ROOM_VAR: Final = "AGENTD_ZYGOTE_ROOM"
ENV_ROOM: Final = 16384
# "0": the zygote skips its memory preparation before ``ready`` (``_prepare_memory``).
PREPARE_VAR: Final = "AGENTD_ZYGOTE_PREPARE"
# What /proc/<pid>/cmdline says: a forked runner says what a cold one says.
_ZYGOTE_MODULE: Final = b"subagent.zygote"
_RUNNER_MODULE: Final = b"subagent.runner"
# Exit code of a child that could not become a runner (events.ExitCode.INTERNAL).
_EXIT_INTERNAL: Final = 70
_PR_SET_PDEATHSIG: Final = 1


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any] | None:
    """One message, or None when it is not a JSON object."""
    try:
        msg = json.loads(data)
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


# ----------------------------------------------------------------------------- /proc view


class _ProcView:
    """Where the kernel reads ``/proc/self/cmdline`` and ``/proc/self/environ`` from: the
    argv and environment strings at the top of the first stack. A forked runner rewrites
    them in place, as setproctitle does, so that a sweep reading its marker, a person
    reading ``ps`` and anyone reading its environment see a runner, not the zygote: first
    the marker's value (before it replies), then, once its own environment is set, the
    whole block (the zygote's environment carries ``ENV_ROOM_VAR`` to leave room)."""

    def __init__(self) -> None:
        self.module_at: int | None = None
        self.marker_at: int | None = None
        self.marker_len = 0
        self.env_at: int | None = None
        self.env_len = 0
        try:
            with open("/proc/self/stat", "rb") as f:
                raw = f.read()
            fields = raw[raw.rfind(b")") + 2 :].split()
            arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = f.read()
            with open("/proc/self/environ", "rb") as f:
                environ = f.read()
        except (OSError, ValueError, IndexError):
            return
        # Only if memory holds what the kernel shows (nothing rewrote it before us).
        if ctypes.string_at(arg_start, arg_end - arg_start) == cmdline:
            i = cmdline.find(b"\0" + _ZYGOTE_MODULE + b"\0")
            if i >= 0:
                self.module_at = arg_start + i + 1
        if ctypes.string_at(env_start, env_end - env_start) == environ:
            self.env_at, self.env_len = env_start, env_end - env_start
            needle = b"\0" + MARKER_VAR.encode() + b"="
            i = (b"\0" + environ).find(needle)
            if i >= 0:
                value_at = i + len(needle) - 1
                end = environ.find(b"\0", value_at)
                self.marker_at = env_start + value_at
                self.marker_len = (end if end >= 0 else len(environ)) - value_at

    def become(self, tree_id: str) -> None:
        """Rewrite the module name in argv and the marker's value (NUL-padded) in place."""
        if self.module_at is not None:
            ctypes.memmove(self.module_at, _RUNNER_MODULE, len(_RUNNER_MODULE))
        if self.marker_at is not None:
            value = tree_id.encode()
            if len(value) > self.marker_len:
                value = b""  # no room: show no marker rather than a wrong one
            value += b"\0" * (self.marker_len - len(value))
            ctypes.memmove(self.marker_at, value, self.marker_len)

    def show_environ(self, env: dict[str, str]) -> bool:
        """Rewrite the whole environment block to ``env`` (NUL-padded), if it fits.

        Call it only once ``os.environ`` has been rebuilt: C's ``environ`` then points at
        new strings, none into this block any more.
        """
        if self.env_at is None:
            return False
        block = b"".join(os.fsencode(k) + b"=" + os.fsencode(v) + b"\0" for k, v in env.items())
        if len(block) > self.env_len:
            return False  # no room: the zygote's block stays, with this runner's marker
        ctypes.memmove(self.env_at, block + b"\0" * (self.env_len - len(block)), self.env_len)
        return True


# ----------------------------------------------------------------------------- fork into a cgroup


class _CloneArgs(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "flags",
            "pidfd",
            "child_tid",
            "parent_tid",
            "exit_signal",
            "stack",
            "stack_size",
            "tls",
            "set_tid",
            "set_tid_size",
            "cgroup",
        )
    ]


_CLONE_INTO_CGROUP: Final = 0x200000000
_SYS_CLONE3: Final = {"x86_64": 435, "aarch64": 435}


class _Cloner:
    """``fork()`` straight into a cgroup: ``clone3(CLONE_INTO_CGROUP)``.

    A child born in the tree's cgroup never has to move there, and a move (a write to
    ``cgroup.procs``) waits for an RCU grace period whenever cgroups have been quiet for a
    moment: measured 5-19 ms per spawn here when spawns are 20 ms or more apart, 0.1 ms
    back to back. Python has no ``clone3``, so this does what ``os.fork`` does around the
    system call (``PyOS_BeforeFork``/``AfterFork_*``) and what glibc's ``fork`` does for
    the one piece of its state a raw clone leaves stale in a single-threaded process: the
    thread id cached in the thread descriptor (found once, by value; without a single
    match, or without ``clone3``, the zygote forks and the child joins its cgroup itself).
    """

    def __init__(self) -> None:
        self.enabled = False
        self._tid_at = 0
        import platform

        self._nr = _SYS_CLONE3.get(platform.machine())
        if self._nr is None or not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.pthread_self.restype = ctypes.c_void_p
            me = libc.pthread_self()
            words = (ctypes.c_int32 * 1024).from_address(me)
            pid = os.getpid()  # the main thread's id is the pid
            hits = [i for i in range(1024) if words[i] == pid]
            self._syscall = ctypes.PyDLL(None, use_errno=True).syscall  # keeps the GIL, as fork does
            self._syscall.restype = ctypes.c_long
        except (OSError, AttributeError, ValueError):
            return
        if len(hits) != 1 or me is None:
            return
        self._tid_at = me + 4 * hits[0]
        self.enabled = True

    def fork_into(self, cgroup_fd: int) -> int:
        """Like ``os.fork()``, the child born in the cgroup ``cgroup_fd`` names.

        Raises:
            OSError: clone3 refused (then ``enabled`` turns False when it cannot work here).
        """
        args = _CloneArgs(flags=_CLONE_INTO_CGROUP, exit_signal=int(signal.SIGCHLD), cgroup=cgroup_fd)
        api = ctypes.pythonapi
        api.PyOS_BeforeFork()
        pid = self._syscall(self._nr, ctypes.byref(args), ctypes.sizeof(args))
        if pid == 0:
            api.PyOS_AfterFork_Child()
            ctypes.c_int32.from_address(self._tid_at).value = os.getpid()
            return 0
        err = ctypes.get_errno()
        api.PyOS_AfterFork_Parent()
        if pid < 0:
            if err in (errno.ENOSYS, errno.EINVAL, errno.E2BIG, errno.EOPNOTSUPP):
                self.enabled = False  # not this kernel: fork and join from now on
            raise OSError(err, os.strerror(err))
        return int(pid)


# ----------------------------------------------------------------------------- the child


def _join_pids(req: dict[str, Any]) -> bool:
    """Join the run's v1 pids group (``pids_procs``: the daemon's per-run pids limit; no
    clone3 into a v1 cgroup), before this process can fork. False: none asked, or refused
    (the daemon goes on without a limit for this run)."""
    return _join_v1(req, "pids_procs")


def _join_v1(req: dict[str, Any], key: str) -> bool:
    """Join the v1 group whose ``cgroup.procs`` is ``req[key]`` (``pids_procs``,
    ``memory_procs``), before this process can fork. False: none asked, or refused."""
    procs = req.get(key)
    if not procs:
        return False
    try:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


class _Zygote:
    def __init__(self, sock: socket.socket, view: _ProcView, generators: list[random.Random]) -> None:
        self.sock = sock
        self.view = view
        self.generators = generators
        self.cloner = _Cloner()
        self.start_cwd = os.getcwd()
        self.pid = os.getpid()
        # The daemon's nest (``subagent._nest``), held, never joined here: each runner joins
        # it as it sandboxes itself (a zygote in it could not mount a runner's /proc).
        self.nest = os.environ.get(NEST_ENV)  # its descriptor's number, or why there is none
        self.nest_fd = int(self.nest) if self.nest is not None and self.nest.isdigit() else None
        try:  # loaded here: a child must not dlopen between its fork and its first step
            self._prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            self._prctl = None

    def spawn(self, req: dict[str, Any], fds: list[int]) -> int:
        """Fork a runner for ``req``; returns its pid. The runner itself sends the reply
        (on this same socket) once it leads its own session in its cgroup: the zygote is
        back at its loop at once, and the spawn waits for one process switch less."""
        pid, born_in = self._fork(req)
        if pid == 0:
            self._become(req, fds, born_in)
        return pid

    def spare(self, req: dict[str, Any], chan: int) -> int:
        """Fork a spare runner for the tree ``req`` names, talking to the daemon on
        ``chan``; returns its pid. It replies as a spawned runner does, then waits there
        for its run (``_park``)."""
        pid, born_in = self._fork(req)
        if pid == 0:
            self._park(req, chan, born_in)
        return pid

    def _fork(self, req: dict[str, Any]) -> tuple[int, bool]:
        """``os.fork()``, the child born in the cgroup ``req`` names where clone3 can."""
        cgroup_fd = -1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            procs = req.get("cgroup_procs")
            if procs and self.cloner.enabled:
                try:
                    cgroup_fd = os.open(os.path.dirname(procs), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError:
                    cgroup_fd = -1
            if cgroup_fd >= 0:
                try:
                    return self.cloner.fork_into(cgroup_fd), True
                except OSError:
                    pass  # e.g. the cgroup is gone: fork, and the child tries to join
            return os.fork(), False
        finally:
            if cgroup_fd >= 0:
                os.close(cgroup_fd)

    def _settle(self, req: dict[str, Any], born_in: bool) -> dict[str, Any]:
        """In a child: its own session, its cgroup and its v1 pids group (before it can
        fork), its marker; the reply that names it (or says why it cannot be a runner)."""
        try:
            signal.set_wakeup_fd(-1)  # the zygote's wake-up pipe is not ours to write to
            os.setsid()
            cgroup_ok = born_in
            procs = req.get("cgroup_procs")
            if procs and not born_in:
                try:  # before this process can fork: everything it starts is in the cgroup
                    fd = os.open(procs, os.O_WRONLY)
                    try:
                        os.write(fd, b"0")
                    finally:
                        os.close(fd)
                    cgroup_ok = True
                except OSError:
                    pass  # the daemon goes on without the cgroup, as for a cold runner
            # The move to a v1 pids group waits for an RCU grace period when cgroups were
            # quiet (10-30 ms: no clone3 into a v1 cgroup); joining after the reply, beside
            # the daemon's journal write, measured no faster to the run's first step.
            pids_ok = _join_pids(req)
            memory_ok = _join_v1(req, "memory_procs")  # the per-run memory limit's group
            self.view.become(str(req["tree_id"]))
            return {
                "id": req.get("id"),
                "pid": os.getpid(),
                "ticks": _start_ticks(),
                "cgroup": cgroup_ok,
                "pids": pids_ok,
                "memory": memory_ok,
            }
        except BaseException as exc:  # noqa: BLE001 - any failure is reported, never raised
            return {"id": req.get("id"), "error": f"cannot set up the runner: {exc!r}"}

    def _reply(self, reply: dict[str, Any]) -> None:
        try:
            self.sock.send(encode(reply))
        except BaseException:  # noqa: BLE001 - the daemon is gone: nobody to run for
            os._exit(_EXIT_INTERNAL)
        if "error" in reply:
            os._exit(_EXIT_INTERNAL)

    def _become(self, req: dict[str, Any], fds: list[int], born_in: bool) -> NoReturn:
        """In the forked runner: become what a cold runner is, then run. Never returns."""
        self._reply(self._settle(req, born_in))
        try:
            args = self._take(req, fds, keep=[], nest=True)
            _reset_signals()
            self._reseed()
            from subagent import runner

            runner.start(args)
        except BaseException as exc:  # noqa: BLE001 - start() ends in os._exit; this is a bug
            _die(exc)

    def _park(self, req: dict[str, Any], chan_fd: int, born_in: bool) -> NoReturn:
        """In a spare: everything a runner does before it knows its run (session, cgroup,
        marker, descriptors, signals, random state), then wait on ``chan_fd`` for the run
        (``assign``: its descriptors, working directory and argv), acknowledge it, become
        that run's runner and read its spec, sandbox itself, and take no step before the
        daemon's ``go`` (sent once the run's start is journaled). EOF first, at any point
        (the daemon closed it, or died): exit at once, having done nothing of a run.
        Never returns."""
        reply = self._settle(req, born_in)
        if "error" not in reply:
            # Until it has a run, a spare dies with the zygote (then it is nobody's spare).
            if not self._deathsig(signal.SIGKILL) or os.getppid() != self.pid:
                reply = {"id": req.get("id"), "error": "cannot tie the spare to the zygote"}
        self._reply(reply)
        assigned = False
        try:
            self.sock.detach()  # its descriptor is closed with the others below
            _close_all_but([chan_fd, *([self.nest_fd] if self.nest_fd is not None else [])])
            _reset_signals()
            self._reseed()
            chan = socket.socket(fileno=chan_fd)
            from subagent import _nest, approvals, runner, sandbox
            from subagent.emit import open_records
            from subagent.stopmark import open_marker

            # Its run directory is known: be there, as a cold runner is.
            self._chdir(req.get("cwd"))
            # Before its private /tmp may hide it (a run directory under /tmp): as a cold
            # runner opens it before its sandbox.
            answers_fd = approvals.open_channel({approvals.ANSWERS_ENV: str(req.get("answers") or "")})
            records = open_records(Path(str(req["cwd"]))) if req.get("cwd") else None
            marker_fd = open_marker(Path(str(req["cwd"]))) if req.get("cwd") else None
            ahead = None
            if isinstance(req.get("sandbox"), str):
                settings = sandbox.Settings.from_env({sandbox.SANDBOX_ENV: req["sandbox"]})
                # The run directory as its AGENTD_RUN_DIR will name it (``Ahead.fits``).
                ahead = sandbox.prepare_ahead(Path(str(req["cwd"])), settings)  # (joins the nest)
            _nest.forget()  # (not joined: no sandbox half made ahead)
            # Its first writes to the zygote's pages, made now rather than after its `go`.
            runner.rehearse()
            data, fds, _flags, _addr = socket.recv_fds(chan, MAX_MESSAGE, N_FDS)
            assignment = decode(data) if data else None
            if assignment is None or len(fds) != N_FDS:
                os._exit(0)  # discarded (or the daemon is gone): no run was ever ours
            assigned = True
            self._deathsig(0)  # a runner outlives its zygote, as a forked one does
            try:
                chan.send(encode({"assigned": os.getpid()}))
            except OSError:
                # Hung up on right after its assignment (its run was stopped before it
                # started): nothing of the run ran, not an error.
                os._exit(0)
            keep = [chan_fd, *(ahead.fds() if ahead is not None else [])]
            if answers_fd is not None:
                keep.append(answers_fd)
            if records is not None:
                keep.extend(records)
            if marker_fd is not None:
                keep.append(marker_fd)
            args = self._take(assignment, fds, keep=keep)

            def gate() -> None:
                try:
                    go = chan.recv(64)
                except OSError:
                    go = b""
                chan.close()
                if go != b"go":
                    os._exit(0)  # the daemon never journaled its start: do nothing

            runner.start(
                args,
                gate=gate,
                ahead=ahead,
                answers=lambda: answers_fd,
                records=lambda: records,
                marker=lambda: marker_fd,
            )
        except BaseException as exc:  # noqa: BLE001 - start() ends in os._exit; this is a bug
            if not assigned and _hung_up(chan_fd):
                # Given up while it was parking (the daemon stopping, say): its tree may be
                # removed already, which is what failed here. Nobody's spare: no error.
                os._exit(0)
            _die(exc)

    def _deathsig(self, signum: int) -> bool:
        if self._prctl is None:
            return False
        return bool(self._prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0)

    def _reseed(self) -> None:
        random.seed()
        for g in self.generators:
            g.seed()

    def _chdir(self, cwd: str | None) -> None:
        # (Started with ``-P`` as a cold runner is, neither has its working directory on
        # ``sys.path``: a run's tools write their run directory.)
        if cwd:
            os.chdir(cwd)

    def _take(self, req: dict[str, Any], fds: list[int], *, keep: list[int], nest: bool = False) -> list[str]:
        """Take the run's pipes as fds 0-2, close every other descriptor (but ``keep``,
        and the nest's with ``nest``: a runner that has not joined it yet), take its
        environment, working directory and argv; returns its arguments."""
        stdin, stdout, stderr, env_fd = fds
        env = _read_env(env_fd)
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        if self.sock.fileno() >= 0:
            self.sock.detach()  # its descriptor goes with the others, never closed twice
        nest_fd = self.nest_fd if nest else None
        _close_all_but([*keep, *([nest_fd] if nest_fd is not None else [])])
        os.environ.clear()
        os.environ.update(env)
        # The nest as this process holds it (the daemon's number is the daemon's).
        os.environ.pop(NEST_ENV, None)
        if nest and self.nest is not None:
            os.environ[NEST_ENV] = self.nest
        self.view.show_environ(env)
        self._chdir(req.get("cwd"))
        from subagent import runner

        args = [str(a) for a in req.get("args") or []]
        sys.argv = [runner.__file__ or "-m", *args]
        return args


def _reset_signals() -> None:
    """Signal dispositions and mask as Python sets them up at start."""
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        want: Any = signal.SIG_DFL
        if signum == signal.SIGINT:
            want = signal.default_int_handler
        elif signum in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)):
            want = signal.SIG_IGN  # as Python sets them up at start
        try:
            if signal.getsignal(signum) is not want:
                signal.signal(signum, want)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def _close_all_but(keep: list[int]) -> None:
    """Close every descriptor from 3 up, but those in ``keep``."""
    low = 3
    for fd in sorted(set(keep)):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, _max_fd())


def _hung_up(fd: int) -> bool:
    """Has the daemon closed its end of this socket (EOF waiting, no message first)?"""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        sock.setblocking(False)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # nothing to read yet (still connected), or no such descriptor
        return False
    finally:
        sock.detach()


def _die(exc: BaseException) -> NoReturn:
    try:
        os.write(2, f"error: the forked runner could not start: {exc!r}\n".encode())
    finally:
        os._exit(_EXIT_INTERNAL)


def _read_env(fd: int) -> dict[str, str]:
    """The run's environment from its pipe: one JSON object of strings, then EOF."""
    buf = bytearray()
    while chunk := os.read(fd, 65536):
        buf += chunk
    env = json.loads(buf)
    if not isinstance(env, dict):
        raise ValueError("the environment is not a JSON object")
    return {str(k): str(v) for k, v in env.items()}


def _start_ticks() -> int:
    """This process's start time in clock ticks: with its pid, its identity."""
    me = LINUX.stat(os.getpid())
    if me is None:
        raise OSError("cannot read /proc/self/stat")
    return me.start_ticks


def _reap_exited(requests: dict[int, Any]) -> list[dict[str, Any]]:
    """Reap every runner that has exited: one exit report each, naming the request it
    was forked for (a runner that died before it replied fails that request)."""
    out: list[dict[str, Any]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)  # every child of ours is a runner
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append({"exit": pid, "code": os.waitstatus_to_exitcode(status), "request": requests.pop(pid, None)})


def _max_fd() -> int:
    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


# ----------------------------------------------------------------------------- main


def _exit_if_the_daemon_hangs_up(sock: socket.socket) -> Any:
    """While the imports run: exit at once if the daemon dies (or closes the socket).

    The imports take seconds (many more on a loaded machine) and the daemon sends nothing
    before ``ready``, so anything readable on the socket meanwhile is its hang-up: SIGIO
    (``O_ASYNC``) says so in the middle of an import, and the zygote of a daemon killed
    while it started ends then, not once its imports are done. Returns the undo.
    """

    def on_io(_signum: int | None, _frame: Any) -> None:
        try:
            if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                os._exit(0)
        except BlockingIOError:
            pass
        except OSError:
            os._exit(0)

    previous = signal.signal(signal.SIGIO, on_io)
    flags = fcntl.fcntl(sock, fcntl.F_GETFL)
    fcntl.fcntl(sock, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(sock, fcntl.F_SETFL, flags | os.O_ASYNC)
    on_io(None, None)  # it may have gone before O_ASYNC was set

    def undo() -> None:
        fcntl.fcntl(sock, fcntl.F_SETFL, flags)
        signal.signal(signal.SIGIO, previous)

    return undo


_FILLERS: list[object] = []  # the allocator's free blocks, held for the zygote's life


def _prepare_memory() -> None:
    """Make each runner cost less (``osedge._memory``): the small-object allocator's free
    blocks taken (a runner's new objects then land in fresh pools, not in holes on pages
    it shares with the zygote), malloc's free space returned, and the anonymous memory
    put in huge pages (fewer page table entries for each fork to copy and each exit to
    take down). Best effort: any failure leaves the zygote as it was. The benchmarks'
    baselines set ``AGENTD_ZYGOTE_PREPARE``: ``0`` none of it, ``trim``, ``collapse``
    (trim and huge pages, no filling)."""
    how = os.environ.get(PREPARE_VAR, "1")
    if how == "0":
        return
    try:
        from subagent.osedge._memory import fill_small_object_holes, prepare_for_forks

        if how not in ("trim", "collapse"):
            fill_small_object_holes(_FILLERS)
        prepare_for_forks(collapse=how != "trim")
    except Exception:  # noqa: BLE001, S110 - an optimisation: never worth failing the zygote
        pass


def main() -> int:
    started = time.monotonic()
    # Our stdin is the socket. Move it away from fd 0, which a runner takes for its pipe.
    sock = socket.socket(fileno=os.dup(0))
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    view = _ProcView()
    stop_watching = _exit_if_the_daemon_hangs_up(sock)
    try:
        from subagent import runner

        runner.preload()
        generators = [o for o in gc.get_objects() if isinstance(o, random.Random)]
        threads = _threads()
        if threads != 1:
            raise RuntimeError(f"{threads} threads after the imports: a fork would lose them")
    except Exception as exc:  # noqa: BLE001 - reported to the daemon, which starts cold runners
        stop_watching()
        try:
            sock.send(encode({"ready": False, "error": f"{type(exc).__name__}: {exc}"}))
        except OSError:
            return 0  # the daemon is gone (it stopped while we imported): nobody to tell
        return 1
    # A runner's exit wakes the loop below (the handler itself does nothing).
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)
    zygote = _Zygote(sock, view, generators)
    gc.collect()
    gc.freeze()
    _prepare_memory()  # (seconds on a loaded machine: still watching for the hang-up)
    stop_watching()
    hello = {
        "ready": True,
        "pid": os.getpid(),
        "import_s": round(time.monotonic() - started, 3),
        "proc_view": view.marker_at is not None and view.module_at is not None,
        "clone_into_cgroup": zygote.cloner.enabled,
    }
    try:
        sock.send(encode(hello))
    except OSError:
        return 0  # the daemon stopped while we prepared: exit quietly, as below
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    requests: dict[int, Any] = {}  # runner pid -> the request id it was forked for
    while True:
        try:
            for report in _reap_exited(requests):
                sock.send(encode(report))
        except OSError:
            return 0  # the daemon is gone: its runners are its own (or init's)
        ready = {fd for fd, _ev in poller.poll()}
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, N_FDS)
        except ConnectionError:
            return 0
        if not data:
            for fd in fds:
                os.close(fd)
            return 0  # the daemon closed its end, or died: its runners are its own
        req = decode(data)
        reply: dict[str, Any] | None = None
        try:
            if req is None:
                reply = {"id": None, "error": "expected a JSON object"}
            elif not isinstance(req.get("tree_id"), str):
                reply = {"id": req.get("id"), "error": "expected a tree_id"}
            elif req.get("spare"):
                if len(fds) != 1:
                    reply = {"id": req.get("id"), "error": f"expected 1 descriptor, got {len(fds)}"}
                else:
                    requests[zygote.spare(req, fds[0])] = req.get("id")  # the spare replies itself
            elif len(fds) != N_FDS:
                reply = {"id": req.get("id"), "error": f"expected {N_FDS} descriptors, got {len(fds)}"}
            else:
                requests[zygote.spawn(req, fds)] = req.get("id")  # the runner replies itself
        except OSError as exc:  # fork failed (EAGAIN, ENOMEM): the daemon starts it cold
            reply = {"id": req.get("id") if req else None, "error": f"cannot fork: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        if reply is not None:
            try:
                sock.send(encode(reply))
            except OSError:
                return 0


if __name__ == "__main__":
    code = main()
    # Without the interpreter's teardown of every module imported ahead (openai, mcp...):
    # ~1 s here, which a daemon's stop waited out, and then killed.
    sys.stderr.flush()
    os._exit(code)
