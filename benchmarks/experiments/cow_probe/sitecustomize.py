"""Experiment only (``cow_cost.py --phases``): page faults and CPU of forked runners by phase.

Python imports this ``sitecustomize`` when its directory is on ``PYTHONPATH``; it acts in
a runner zygote only (``python -m subagent.zygote``): once the zygote's ``preload`` is
done it wraps a few functions so that each forked runner records ``getrusage`` (minor
faults, user and system CPU) at: its first Python step after the fork (``fork``), its
reply sent, its environment read, its signals reset, before reseeding, ``runner.start``,
before and after its sandbox, its ``step_started``, its command running, its
``stop_requested``, and ``os._exit``; then writes them to ``$COW_PROBE_DIR/<pid>`` (opened before the sandbox, which
may not let the runner write there).
The wrappers' own cost is in the figures (a few Python calls per phase).
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

OUT = os.environ.get("COW_PROBE_DIR", "")
_marks: list[tuple[str, int, float, float]] = []
_fd = -1  # opened at runner.start: before its sandbox, after the zygote closed every descriptor


def mark(label: str) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    _marks.append((label, ru.ru_minflt, ru.ru_utime, ru.ru_stime))


def _dump() -> None:
    try:
        os.write(_fd, "".join(f"{m[0]} {m[1]} {m[2]:.6f} {m[3]:.6f}\n" for m in _marks).encode())
    except OSError:
        pass


def _install() -> None:
    import random

    from subagent import emit, runner, sandbox

    zygote: Any = sys.modules["__main__"]
    orig_become = zygote._Zygote._become

    def become(self: Any, *a: Any, **k: Any) -> Any:
        mark("fork")
        return orig_become(self, *a, **k)

    zygote._Zygote._become = become
    orig_read_env = zygote._read_env

    def read_env(fd: int) -> Any:
        mark("reply_sent")
        r = orig_read_env(fd)
        mark("env_read")
        return r

    zygote._read_env = read_env
    orig_clear = os.environ.clear

    def clear() -> None:
        mark("signals_reset")
        orig_clear()

    os.environ.clear = clear  # type: ignore[method-assign]
    orig_seed = random.seed

    def seed(*a: Any, **k: Any) -> None:
        mark("environ_cwd_argv")
        orig_seed(*a, **k)

    random.seed = seed
    orig_start = runner.start

    def start(*a: Any, **k: Any) -> Any:
        global _fd
        mark("reseeded")
        try:
            _fd = os.open(os.path.join(OUT, str(os.getpid())), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            pass
        return orig_start(*a, **k)

    runner.start = start
    orig_enter = sandbox.enter

    def enter(*a: Any, **k: Any) -> Any:
        mark("spec_read")
        r = orig_enter(*a, **k)
        mark("sandbox")
        return r

    sandbox.enter = enter
    orig_emit = emit.Emitter.emit
    seen: set[str] = set()

    def em(self: Any, kind: Any, /, **data: Any) -> None:
        orig_emit(self, kind, **data)
        k = str(kind)
        if k == "tool_call" and data.get("record", {}).get("state") == "running":
            k = "command_running"
        if k not in seen and k in ("step_started", "command_running", "stop_requested"):
            seen.add(k)
            mark(k)

    emit.Emitter.emit = em  # type: ignore[method-assign]
    orig_exit = os._exit

    def _exit(code: int) -> Any:
        mark("exit")
        _dump()
        orig_exit(code)

    os._exit = _exit  # type: ignore[assignment]


if OUT and "subagent.zygote" in sys.orig_argv:
    import subagent.runner as _runner

    _orig_preload = _runner.preload

    def _preload() -> None:
        _orig_preload()
        _install()

    _runner.preload = _preload
