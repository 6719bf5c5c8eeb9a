"""Shared helpers for the benchmark scripts: statistics, tables, process bookkeeping.

Every benchmark marks everything it starts with ``AGENTD_BENCH_MARK=<uuid>`` in the
environment (the daemon and the runner pass ``AGENTD_*`` variables on to every child), so
at the end it can find whatever is left, wherever it was re-parented, print it as a
survivor and end it by PID. Figures are printed, never asserted.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
AGENTD = str(ROOT / ".venv" / "bin" / "agentd")
CHILDREN = ROOT / "tests" / "children"
BENCH_CHILDREN = Path(__file__).resolve().parent / "children"

MARK_VAR = "AGENTD_BENCH_MARK"
TREE_VAR = "AGENTD_BENCH_TREE"  # per baseline tree: finds its members after a killpg


# ----------------------------------------------------------------------------- stats


def remove_run_dir(path: str | Path, *, records_only: bool = False) -> None:
    """A baseline runner's directory, and the records a runner writes beside it (its
    events and result files: ``subagent.emit.record_paths``), which a temporary
    directory's own cleanup leaves behind in /tmp (``records_only``: those alone)."""
    import shutil

    from subagent.emit import record_paths

    run_dir = Path(path)
    if not records_only:
        shutil.rmtree(run_dir, ignore_errors=True)
    for record in record_paths(run_dir):
        record.unlink(missing_ok=True)


def summary(xs: Sequence[float]) -> dict[str, Any]:
    """n, median, p95, min, max and stdev of a sample (seconds in, seconds out)."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return {"n": 0}
    return {
        "n": len(xs),
        "p50": statistics.median(xs),
        "p95": percentile(xs, 95),
        "min": xs[0],
        "max": xs[-1],
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of an already sorted sample."""
    if not sorted_xs:
        return float("nan")
    k = max(0, min(len(sorted_xs) - 1, math.ceil(p / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]


def ms(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x * 1000:.1f}"


def row(label: str, s: dict[str, Any], note: str = "") -> str:
    if not s.get("n"):
        return f"  {label:<52} (no data) {note}"
    return (
        f"  {label:<52} p50 {ms(s['p50']):>8} ms  p95 {ms(s['p95']):>8} ms  "
        f"min {ms(s['min']):>7}  max {ms(s['max']):>8}  sd {ms(s['stdev']):>7}  n={s['n']}"
        + (f"  {note}" if note else "")
    )


def header(title: str) -> None:
    print(f"\n== {title}", flush=True)


def line(text: str) -> None:
    print(text, flush=True)


def compile_tree(root: Path = ROOT, python: str = PY) -> None:
    """Write the bytecode of a checkout's ``supervisor`` and ``subagent`` (``__pycache__``).

    An installed package has it (pip compiles what it installs) and a tree gets it on its
    first run, unless ``PYTHONDONTWRITEBYTECODE`` is set, as it may be in a test harness:
    then every process compiles the modules it imports from source (~13 ms of a cold
    ``agentd status``). compileall writes it either way; figures measure the usual case.
    """
    import subprocess

    dirs = [str(root / d) for d in ("supervisor", "subagent") if (root / d).is_dir()]
    subprocess.run([python, "-m", "compileall", "-q", *dirs], check=True, stdout=subprocess.DEVNULL)


# ----------------------------------------------------------------------------- machine


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                model = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_total = mem_avail = None
    try:
        for ln in Path("/proc/meminfo").read_text().splitlines():
            if ln.startswith("MemTotal:"):
                mem_total = int(ln.split()[1]) * 1024
            elif ln.startswith("MemAvailable:"):
                mem_avail = int(ln.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "mem_total_gib": round(mem_total / 2**30, 1) if mem_total else None,
        "mem_available_gib": round(mem_avail / 2**30, 1) if mem_avail else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


def mem_available_bytes() -> int:
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.startswith("MemAvailable:"):
            return int(ln.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- marks


def install_mark() -> str:
    """Give this process (and so everything it starts) a fresh benchmark mark."""
    mark = uuid.uuid4().hex
    os.environ[MARK_VAR] = mark
    # The runner's children get PYTHONPATH so child scripts can import the project.
    pp = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + pp if pp else "")
    return mark


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read()
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class PidId:
    """A pid with its start time in clock ticks: a recycled pid is not the same process."""

    pid: int
    ticks: int


def read_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) from /proc/<pid>/stat, or None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2 :].split()
    return rest[0].decode(), int(rest[19])


def alive(p: PidId) -> bool:
    st = read_stat(p.pid)
    return st is not None and st[1] == p.ticks and st[0] not in ("Z", "X")


class Deaths:
    """When each of a set of processes exits, as events: a pidfd each (opened now, checked
    against the start time), polled by a thread; no walk of /proc that would compete for
    the CPU with what it measures. ``start(t0)``, then ``wait(timeout)``; ``dead_at`` maps
    pid -> seconds after t0 (zombies are dead: a pidfd turns readable at the exit)."""

    def __init__(self, procs: Iterable[PidId]) -> None:
        import select
        import threading

        self.fds: dict[int, int] = {}
        for p in procs:
            try:
                fd = os.pidfd_open(p.pid)
            except OSError:
                continue
            if alive(p):
                self.fds[fd] = p.pid
            else:
                os.close(fd)
        self.dead_at: dict[int, float] = {}
        self._poller = select.poll()
        for fd in self.fds:
            self._poller.register(fd, select.POLLIN)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._t0 = 0.0
        self._stop = False

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._thread.start()

    def _watch(self) -> None:
        left = len(self.fds)
        while left and not self._stop:
            for fd, _ev in self._poller.poll(100):
                self._poller.unregister(fd)
                self.dead_at[self.fds[fd]] = time.perf_counter() - self._t0
                left -= 1

    @property
    def all_dead(self) -> bool:
        return len(self.dead_at) == len(self.fds)

    def left(self) -> list[int]:
        return [pid for pid in self.fds.values() if pid not in self.dead_at]

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join(5)
        for fd in self.fds:
            os.close(fd)


def pids_with(var: str, value: str, *, exclude: Iterable[int] = ()) -> list[PidId]:
    """Live (non-zombie) processes whose environment holds ``var=value``."""
    needle = f"{var}={value}\0".encode()
    skip = set(exclude) | {os.getpid()}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in skip or not _environ_has(pid, needle):
            continue
        st = read_stat(pid)
        if st is not None and st[0] not in ("Z", "X"):
            out.append(PidId(pid, st[1]))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "(gone)"


def kill_all(procs: Iterable[PidId]) -> None:
    for p in procs:
        if alive(p):
            try:
                os.kill(p.pid, signal.SIGKILL)
            except OSError:
                pass


def wait_dead(procs: Sequence[PidId], timeout_s: float, poll_s: float = 0.002) -> tuple[float | None, list[PidId]]:
    """Poll until none of ``procs`` runs. Returns (seconds it took or None, still alive)."""
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    left = [p for p in procs if alive(p)]
    while left:
        if time.perf_counter() >= deadline:
            return None, left
        time.sleep(poll_s)
        left = [p for p in left if alive(p)]
    return time.perf_counter() - t0, []


def final_sweep(mark: str, *, exclude: Iterable[int] = (), settle_s: float = 3.0) -> list[dict[str, Any]]:
    """Find every process still carrying the mark, print and end them. Returns survivors.

    Waits up to ``settle_s`` first: a process already killed may take a moment to be gone.

    Raises:
        ValueError: an empty mark (``install_mark``'s is a fresh uuid): it names no run of
            this benchmark, and could match another's processes.
    """
    if not mark:
        raise ValueError("final_sweep needs this benchmark's mark (install_mark), not an empty one")
    deadline = time.monotonic() + settle_s
    left = pids_with(MARK_VAR, mark, exclude=exclude)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    survivors = [{"pid": p.pid, "cmdline": cmdline(p.pid)} for p in left]
    if survivors:
        line(f"  !! {len(survivors)} processes left behind by this benchmark; killing them:")
        for s in survivors[:20]:
            line(f"     pid {s['pid']}: {s['cmdline']}")
        kill_all(left)
    else:
        line("  cleanup: no process of this benchmark left")
    return survivors


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def quick_or(quick: bool, small: Any, full: Any) -> Any:
    return small if quick else full
