"""agentd beside supervisord, each driven through its own CLI the way a user drives it.

The same programs, the same grace, for every supervisor; medians of several reps, printed
side by side. Every supervisor is up at once and each scenario runs for each in turn (the
one-at-a-time reps interleaved), so that a figure and its baseline see the same load. supervisord (PyPI ``supervisor``,
which shares its import name with this project's package) is installed by this script in
a venv of its own (``~/.cache/agentd-bench/supervisor-venv``; ``--peer-venv`` to move it),
never in the project's ``.venv``.

Figures, for each supervisor:
- spawn -> program running, one at a time: from exec of the CLI command (``agentd spawn
  --spec F`` / ``supervisorctl start pN``) until the program has written its ready file;
  the CLI's own exit time beside it;
- the same for N programs at once (N CLI commands started together) -> all running;
- the same for N programs in one CLI command (``agentd spawn --spec F1 ... --spec FN`` /
  ``supervisorctl start p1 ... pN``) -> all running;
- stop -> a well-behaved tree dead (sh + two sleeps, all exit on SIGTERM): from exec of
  ``agentd cancel RUN`` / ``supervisorctl stop pN`` until no process of the tree runs;
- survivors: a program that leaves a ``setsid`` child and a double-forked ``setsid`` one,
  stopped the same way; what still runs 1 s after the tree's group is dead;
- the daemon's CPU over 10 s idle with N programs running (psutil, all threads), its RSS,
  and the per-program overhead (agentd: each run's runner process, USS; supervisord: the
  growth of its own RSS per program).

agentd runs as ``agentd serve`` (its own process) in two configurations: ``zygote`` (the
default: runners forked by the zygote) and ``cold`` (``AGENTD_ZYGOTE=off``: a new Python
per runner). A program is the run's one ``run_command``; under supervisord it is the
program's ``command``. Grace: agentd ``grace_s`` = supervisord ``stopwaitsecs``
(``stopasgroup``/``killasgroup`` on, its best effort for trees). ``--agentd-tree DIR`` adds
``agentd-before``: another checkout's daemon and CLI (``DIR/.venv``, its ``scripts/setup``),
measured in the same run, in turn with the others (a before/after).

The CLI commands run with the environment of a user's shell (no ``PYTHONPATH``) and the
tree's bytecode written (``compile_tree``), as an installed package has it.

Cleanup: supervisord and agentd are ended by the PIDs this script started them with;
every process started carries ``AGENTD_BENCH_MARK`` and the final sweep ends any survivor
by PID (escapers included, once counted).

    .venv/bin/python benchmarks/bench_peers.py [--quick] [--reps N] [--burst N] [--only agentd,supervisord]
        [--agentd-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from benchmarks._common import (  # noqa: E402
    AGENTD,
    compile_tree,
    final_sweep,
    header,
    install_mark,
    line,
    machine,
    ms,
    summary,
    write_json,
)
from benchmarks._daemon_proc import DaemonProc  # noqa: E402

SUPERVISOR_VERSION = "4.3.0"
DEFAULT_PEER_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentd-bench" / "supervisor-venv"
POLL_S = 0.001
READY_TIMEOUT_S = 60.0
DEAD_TIMEOUT_S = 30.0
# Idle CPU is measured once the daemon spent less than this in one second (the tail of the
# burst's bookkeeping), waiting at most SETTLE_MAX_S for it.
SETTLED_CPU_S = 0.02
SETTLE_MAX_S = 30.0


# ----------------------------------------------------------------------------- programs


def tree_program(ready: Path, token: str) -> str:
    """sh + two sleeps in one group; every one exits on SIGTERM; ready once all exist."""
    return f"sleep 99999{token}1 & sleep 99999{token}2 & echo $$ > {ready}.tmp && mv {ready}.tmp {ready}; wait"


def escaper_program(ready: Path, token: str) -> str:
    """Also a setsid() child and a double-forked setsid() one: out of the group and session."""
    return (
        f"sleep 99999{token}1 & setsid sleep 99999{token}2 & ( setsid sleep 99999{token}3 & ); "
        f"echo $$ > {ready}.tmp && mv {ready}.tmp {ready}; wait"
    )


def new_token() -> str:
    return "." + uuid.uuid4().hex[:10].translate(str.maketrans("abcdef", "123456")) + "0"


def procs_with_token(token: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(token in a for a in cmd) and cmd[0] != "/bin/sh":
                out.append(p)
        except psutil.Error:
            continue
    return out


def group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_file(path: Path, t0: float, timeout_s: float = READY_TIMEOUT_S) -> float | None:
    deadline = t0 + timeout_s
    while not path.exists():
        if time.perf_counter() > deadline:
            return None
        time.sleep(POLL_S)
    return time.perf_counter() - t0


def wait_all_dead(procs: list[psutil.Process], t0: float, timeout_s: float = DEAD_TIMEOUT_S) -> float | None:
    deadline = t0 + timeout_s
    left = [p for p in procs if alive(p)]
    while left:
        if time.perf_counter() > deadline:
            return None
        time.sleep(POLL_S)
        left = [p for p in left if alive(p)]
    return time.perf_counter() - t0


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    took = time.perf_counter() - t0
    if done.returncode not in (0, 7):  # agentd cancel exits 7 for "run cancelled"
        raise RuntimeError(
            f"{shlex.join(argv)} exited {done.returncode}: {(done.stdout + done.stderr).decode(errors='replace')[-500:]}"
        )
    return took, done.stdout.decode(errors="replace")


def ready_pgid(path: Path) -> int:
    return int(path.read_text().strip())


# ----------------------------------------------------------------------------- supervisors


class Peer:
    name = ""
    grace_s = 2.0
    env: dict[str, str] | None = None  # for its CLI commands

    def spawn_argv(self, key: str, command: str) -> list[str]:
        raise NotImplementedError

    def spawned(self, key: str, out: str) -> None:  # note what the spawn printed (agentd: the run id)
        pass

    def bulk_spawn_argv(self, keys: list[str], commands: list[str]) -> list[str]:
        raise NotImplementedError

    def bulk_spawned(self, keys: list[str], out: str) -> None:
        pass

    def has_bulk_spawn(self) -> bool:
        return True

    def stop_argv(self, key: str) -> list[str]:
        raise NotImplementedError

    @property
    def daemon_pid(self) -> int:
        raise NotImplementedError

    def overhead(self, ready_files: list[Path]) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        raise NotImplementedError


class Agentd(Peer):
    def __init__(self, workdir: Path, name: str, *, grace_s: float, tree: Path | None = None, **settings: Any) -> None:
        """``tree``: another checkout with its own .venv (its daemon and its CLI)."""
        self.name = name
        self.grace_s = grace_s
        self.specs = workdir / f"{name}-specs"
        self.specs.mkdir(parents=True)
        self.ready_dir = workdir / f"{name}-ready"  # made by Bench; granted to every run
        self.agentd = AGENTD if tree is None else str(tree / ".venv" / "bin" / "agentd")
        # The other checkout's daemon imports its own tree, not the one on this PYTHONPATH.
        daemon_env = None if tree is None else dict(os.environ, PYTHONPATH=str(tree))
        self.daemon = DaemonProc(
            workdir / f"{name}-state",
            agentd=self.agentd,
            env=daemon_env,
            grace_s=grace_s,
            max_concurrent=512,
            **settings,
        )
        # The CLI as a user's shell runs it: no PYTHONPATH.
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env["AGENTD_STATE_DIR"] = str(self.daemon.state_dir)
        self.runs: dict[str, str] = {}

    def wait_zygote(self, timeout_s: float = 120.0) -> float | None:
        t0 = time.perf_counter()
        with self.daemon.client() as c:
            while time.perf_counter() - t0 < timeout_s:
                z = ((c.status().get("summary") or {}).get("zygote") or {}).get("state")
                if z in ("ready", "off"):
                    return time.perf_counter() - t0 if z == "ready" else None
                time.sleep(0.05)
        return None

    def spawn_argv(self, key: str, command: str) -> list[str]:
        spec = {
            "task": "benchmark program",
            "model": {
                "provider": "scripted",
                "script": {
                    "turns": [{"tool_calls": [{"name": "run_command", "arguments": {"command": command}}]}],
                    "final": "ok",
                },
            },
            "limits": {"command_timeout_s": 3600},
            # The program writes its ready file outside the run's own dir: granted, as a
            # user grants a run what it needs beyond it (the run sandbox, issue 16).
            "sandbox": {"write": [str(self.ready_dir)]},
        }
        path = self.specs / f"{key}.json"
        path.write_text(json.dumps(spec))
        return [self.agentd, "--json", "spawn", "--spec", str(path)]

    def spawned(self, key: str, out: str) -> None:
        self.runs[key] = json.loads(out.strip().splitlines()[-1])["run_id"]

    def bulk_spawn_argv(self, keys: list[str], commands: list[str]) -> list[str]:
        argv = [self.agentd, "--json", "spawn"]
        for key, command in zip(keys, commands):
            argv += self.spawn_argv(key, command)[-2:]  # --spec FILE
        return argv

    def has_bulk_spawn(self) -> bool:
        """Whether this CLI's spawn takes several --spec (an older one keeps the last)."""
        done = subprocess.run([self.agentd, "spawn", "--help"], env=self.env, capture_output=True, text=True)
        return "Repeat it" in done.stdout

    def bulk_spawned(self, keys: list[str], out: str) -> None:
        lines = out.strip().splitlines()
        for key, ln in zip(keys, lines, strict=True):
            self.runs[key] = json.loads(ln)["run_id"]

    def stop_argv(self, key: str) -> list[str]:
        return [self.agentd, "--json", "cancel", self.runs[key]]

    @property
    def daemon_pid(self) -> int:
        return self.daemon.pid

    def overhead(self, ready_files: list[Path]) -> dict[str, Any]:
        """Each program's runner (the parent of its sh): USS and RSS, MiB."""
        uss, rss = [], []
        for f in ready_files:
            try:
                runner = psutil.Process(ready_pgid(f)).parent()
                if runner is None:
                    continue
                mem = runner.memory_full_info()
                uss.append(mem.uss / 2**20)
                rss.append(mem.rss / 2**20)
            except (psutil.Error, OSError, ValueError):
                continue
        if not uss:
            line(f"  !! no runner to measure; the daemon's log ends with: {self.daemon.log_tail(1500)}")
        return {"runner_uss_mib": summary(uss), "runner_rss_mib": summary(rss)}

    def close(self) -> None:
        self.daemon.stop(timeout_s=60)


class Supervisord(Peer):
    def __init__(self, workdir: Path, venv: Path, *, grace_s: float, programs: list[tuple[str, str]]) -> None:
        self.name = "supervisord"
        self.grace_s = grace_s
        self.dir = workdir / "supervisord"
        self.dir.mkdir(parents=True)
        self.conf = self.dir / "supervisord.conf"
        sections = [
            "[unix_http_server]\nfile=%(here)s/supervisor.sock\n",
            "[supervisord]\nlogfile=%(here)s/supervisord.log\npidfile=%(here)s/supervisord.pid\n"
            "nodaemon=true\nchildlogdir=%(here)s\nloglevel=warn\n",
            "[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n",
            "[supervisorctl]\nserverurl=unix://%(here)s/supervisor.sock\n",
        ]
        for key, command in programs:
            sections.append(
                f"[program:{key}]\ncommand=/bin/sh -c {shlex.quote(command)}\nautostart=false\nautorestart=false\n"
                f"startsecs=0\nstopsignal=TERM\nstopwaitsecs={grace_s:g}\nstopasgroup=true\nkillasgroup=true\n"
                "stdout_logfile=NONE\nstderr_logfile=NONE\n"
            )
        # supervisord's config reads "%" as interpolation and " ;" as a comment.
        assert not any("%" in c or " ;" in c for _k, c in programs), programs
        self.conf.write_text("\n".join(sections))
        # -I: its own venv only. This project's package is also named `supervisor`, and the
        # benchmark's PYTHONPATH (or the working directory) would shadow supervisord's.
        py = [str(venv / "bin" / "python"), "-I", "-m"]
        self.ctl = py + ["supervisor.supervisorctl", "-c", str(self.conf)]
        self.log = open(self.dir / "stdout.log", "wb")
        self.p = subprocess.Popen(
            py + ["supervisor.supervisord", "-c", str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            if self.p.poll() is not None:
                self.log.flush()
                raise RuntimeError(
                    f"supervisord exited {self.p.returncode}: {(self.dir / 'stdout.log').read_text()[-1000:]}"
                )
            if subprocess.run(self.ctl + ["pid"], capture_output=True).stdout.strip().isdigit():
                break
            if time.monotonic() > deadline:
                raise RuntimeError("supervisord did not come up in 30 s")
            time.sleep(0.05)

    def spawn_argv(self, key: str, command: str) -> list[str]:
        return self.ctl + ["start", key]

    def bulk_spawn_argv(self, keys: list[str], commands: list[str]) -> list[str]:
        return self.ctl + ["start", *keys]

    def stop_argv(self, key: str) -> list[str]:
        return self.ctl + ["stop", key]

    @property
    def daemon_pid(self) -> int:
        return self.p.pid

    def close(self) -> None:
        if self.p.poll() is None:
            subprocess.run(self.ctl + ["shutdown"], capture_output=True, timeout=60)
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)  # the pid we started it with
                self.p.wait()
        self.log.close()


def ensure_supervisor_venv(venv: Path) -> Path:
    exe = venv / "bin" / "python"
    if exe.exists():
        got = subprocess.run(
            [str(exe), "-I", "-m", "supervisor.supervisord", "--version"], capture_output=True, text=True
        ).stdout.strip()
        if got.splitlines()[-1:] == [SUPERVISOR_VERSION]:
            return venv
        line(f"  {exe} says {got!r}, not {SUPERVISOR_VERSION}")
    line(f"  installing supervisor=={SUPERVISOR_VERSION} into its own venv {venv} (not the project's .venv)")
    base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
    subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"supervisor=={SUPERVISOR_VERSION}"], check=True)
    return venv


# ----------------------------------------------------------------------------- scenarios


class Bench:
    def __init__(self, peer: Peer, workdir: Path, programs: dict[str, tuple[str, str]]) -> None:
        self.peer = peer
        self.ready_dir = workdir / f"{peer.name}-ready"
        self.ready_dir.mkdir()
        self.programs = programs  # key -> (command, token)

    def ready(self, key: str) -> Path:
        return self.ready_dir / key

    def spawn(self, key: str, t0: float | None = None) -> dict[str, Any]:
        command, _token = self.programs[key]
        self.ready(key).unlink(missing_ok=True)
        t0 = time.perf_counter() if t0 is None else t0
        cli_s, out = run_cli(self.peer.spawn_argv(key, command), self.peer.env)
        self.peer.spawned(key, out)
        running = wait_file(self.ready(key), t0)
        return {"cli_s": cli_s, "running_s": running}

    def stop(self, key: str, t0: float | None = None) -> dict[str, Any]:
        members = group_members(ready_pgid(self.ready(key)))
        t0 = time.perf_counter() if t0 is None else t0
        cli_s, _out = run_cli(self.peer.stop_argv(key), self.peer.env)
        dead = wait_all_dead(members, t0)
        return {"cli_s": cli_s, "dead_s": dead, "members": len(members)}

    def sequential(self, keys: list[str]) -> dict[str, Any]:
        spawns, stops = [], []
        for key in keys:
            spawns.append(self.spawn(key))
            stops.append(self.stop(key))
        return {"spawn": spawns, "stop": stops}

    def burst(self, keys: list[str]) -> dict[str, Any]:
        results: dict[str, dict[str, Any]] = {}
        t0 = time.perf_counter()

        def one(key: str) -> None:
            results[key] = self.spawn(key, t0)

        threads = [threading.Thread(target=one, args=(k,)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        running = [r["running_s"] for r in results.values()]
        return {
            "all_running_s": None if None in running else max(running),
            "running": running,
            "cli": [r["cli_s"] for r in results.values()],
        }

    def bulk(self, keys: list[str]) -> dict[str, Any]:
        """N programs started by one CLI command -> all running."""
        for key in keys:
            self.ready(key).unlink(missing_ok=True)
        t0 = time.perf_counter()
        cli_s, out = run_cli(self.peer.bulk_spawn_argv(keys, [self.programs[k][0] for k in keys]), self.peer.env)
        self.peer.bulk_spawned(keys, out)
        running = [wait_file(self.ready(k), t0) for k in keys]
        return {"all_running_s": None if None in running else max(running), "running": running, "cli_s": cli_s}

    def stop_all(self, keys: list[str]) -> dict[str, Any]:
        members = [m for k in keys for m in group_members(ready_pgid(self.ready(k)))]
        t0 = time.perf_counter()
        threads = [threading.Thread(target=run_cli, args=(self.peer.stop_argv(k), self.peer.env)) for k in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"all_dead_s": wait_all_dead(members, t0), "members": len(members)}

    def idle(self, seconds: float) -> dict[str, Any]:
        d = psutil.Process(self.peer.daemon_pid)
        settle = time.perf_counter() + SETTLE_MAX_S
        while time.perf_counter() < settle:  # until the spawns' tail work is done
            a = d.cpu_times()
            time.sleep(1.0)
            b = d.cpu_times()
            if (b.user - a.user) + (b.system - a.system) < SETTLED_CPU_S:
                break
        c0 = d.cpu_times()
        t0 = time.perf_counter()
        time.sleep(seconds)
        c1 = d.cpu_times()
        wall = time.perf_counter() - t0
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        mem = d.memory_full_info()
        return {"cpu_per_10s": cpu * 10.0 / wall, "rss_mib": mem.rss / 2**20, "uss_mib": mem.uss / 2**20}

    def survivors(self, key: str) -> dict[str, Any]:
        _command, token = self.programs[key]
        self.spawn(key)
        escapers_seen = procs_with_token(token)
        stop = self.stop(key)
        time.sleep(1.0)
        left = [p for p in procs_with_token(token) if alive(p)]
        for p in left:  # ours: they carry this run's unique sleep token and the bench mark
            try:
                p.kill()
            except psutil.Error:
                pass
        return {"survivors": len(left), "seen": len(escapers_seen), "stop_dead_s": stop["dead_s"]}


# ----------------------------------------------------------------------------- main


# Program key prefixes of each rep of the burst (N CLI commands) and of the bulk spawn (one).
BURST_PREFIXES = ("b", "c")
BULK_PREFIXES = ("m", "n")


def programs_for(name: str, workdir: Path, args: argparse.Namespace) -> dict[str, tuple[str, str]]:
    """key -> (shell command, its unique token): s* one at a time, b* and c* the bursts, m*
    and n* the bursts in one command, e* escapers."""
    ready_dir = workdir / f"{name}-ready"
    programs: dict[str, tuple[str, str]] = {}
    kinds = [("s", args.reps, tree_program), ("e", args.escapers, escaper_program)]
    reps = args.burst_reps
    kinds += [(prefix, args.burst, tree_program) for prefix in (*BURST_PREFIXES[:reps], *BULK_PREFIXES[:reps])]
    for prefix, count, make in kinds:
        for i in range(count):
            tok = new_token()
            programs[f"{prefix}{i}"] = (make(ready_dir / f"{prefix}{i}", tok), tok)
    return programs


def run_all(benches: list[Bench], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every scenario for every supervisor in turn, one-at-a-time reps interleaved, so that
    each figure's baseline ran under the same load (the machine is shared)."""
    outs: list[dict[str, Any]] = []
    for b in benches:
        outs.append(
            {
                "name": b.peer.name,
                "daemon_idle_empty": {"rss_mib": psutil.Process(b.peer.daemon_pid).memory_info().rss / 2**20},
            }
        )
        b.spawn("s0")  # warm the page cache and the CLI's imports
        b.stop("s0")
    seq: list[dict[str, list[dict[str, Any]]]] = [{"spawn": [], "stop": []} for _ in benches]
    for i in range(args.reps):
        for b, acc in zip(benches, seq):
            acc["spawn"].append(b.spawn(f"s{i}"))
            acc["stop"].append(b.stop(f"s{i}"))
    for out, acc in zip(outs, seq):
        out["sequential"] = acc
        out["bursts"], out["bulks"] = [], []
    # The bursts, one supervisor after the other, in turn forward then backward (a load
    # that drifts during the run weighs on every supervisor alike); each its own programs.
    for rep, prefix in enumerate(BURST_PREFIXES[: args.burst_reps]):
        keys = [f"{prefix}{i}" for i in range(args.burst)]
        order = list(zip(benches, outs))[:: 1 if rep % 2 == 0 else -1]
        for b, out in order:
            out["bursts"].append(b.burst(keys))
            line(
                f"  {b.peer.name}: {args.burst} at once -> all running in {fmt_s(out['bursts'][-1]['all_running_s'])} "
                f"(load {os.getloadavg()[0]:.2f})"
            )
        if rep == 0:
            for b, out in zip(benches, outs):  # every supervisor holds its N programs now
                out["idle"] = b.idle(args.idle)
                out["overhead"] = b.peer.overhead([b.ready(k) for k in keys])
        for b, out in order:
            stopped = b.stop_all(keys)
            if rep == 0:
                out["stop_all"] = stopped
    for rep, prefix in enumerate(BULK_PREFIXES[: args.burst_reps]):
        keys = [f"{prefix}{i}" for i in range(args.burst)]
        for b, out in list(zip(benches, outs))[:: 1 if rep % 2 == 0 else -1]:
            if not b.peer.has_bulk_spawn():
                line(f"  {b.peer.name}: its CLI starts one program per command; no bulk figure")
                continue
            out["bulks"].append(b.bulk(keys))
            line(
                f"  {b.peer.name}: {args.burst} in one command -> all running in "
                f"{fmt_s(out['bulks'][-1]['all_running_s'])} (load {os.getloadavg()[0]:.2f})"
            )
            b.stop_all([k for k in keys if b.ready(k).exists()])
    for _, out in zip(benches, outs):
        out["survivors"] = []
    for i in range(args.escapers):
        for b, out in zip(benches, outs):
            out["survivors"].append(b.survivors(f"e{i}"))
    return outs


def med(xs: list[float | None]) -> float | None:
    s = summary([x for x in xs if x is not None])
    return s.get("p50")


def fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f} s" if x >= 1 else f"{ms(x)} ms")


def each(reps: list[dict[str, Any]], key: str) -> str:
    if not reps:
        raise KeyError(key)
    return " / ".join(fmt_s(r[key]) for r in reps)


def mean_of(reps: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in reps]
    return None if not xs or None in xs else sum(xs) / len(xs)


def table(results: list[dict[str, Any]]) -> None:
    names = [r["name"] for r in results]
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, f: Callable[[dict[str, Any]], str]) -> None:
        vals = []
        for r in results:
            try:
                vals.append(f(r))
            except (KeyError, TypeError, ValueError):
                vals.append("-")
        rows.append((label, vals))

    add(
        "spawn -> program running, one at a time (p50)",
        lambda r: fmt_s(med([s["running_s"] for s in r["sequential"]["spawn"]])),
    )
    add("  of which the CLI command itself (p50)", lambda r: fmt_s(med([s["cli_s"] for s in r["sequential"]["spawn"]])))
    add("N spawns at once -> all running (each rep)", lambda r: each(r["bursts"], "all_running_s"))
    add("  p50 of the N (first rep)", lambda r: fmt_s(med(r["bursts"][0]["running"])))
    add("N spawns in one CLI command -> all running (each rep)", lambda r: each(r["bulks"], "all_running_s"))
    add("  of which the CLI command itself", lambda r: each(r["bulks"], "cli_s"))
    add("stop -> a well-behaved tree dead (p50)", lambda r: fmt_s(med([s["dead_s"] for s in r["sequential"]["stop"]])))
    add("  of which the CLI command itself (p50)", lambda r: fmt_s(med([s["cli_s"] for s in r["sequential"]["stop"]])))
    add("stop N at once -> all dead", lambda r: fmt_s(r["stop_all"]["all_dead_s"]))
    add("survivors (setsid + double fork), all reps", lambda r: str(sum(s["survivors"] for s in r["survivors"])))
    add("daemon CPU per 10 s idle, N programs", lambda r: f"{r['idle']['cpu_per_10s'] * 1000:.1f} ms")
    add(
        "daemon RSS, N programs / none",
        lambda r: f"{r['idle']['rss_mib']:.1f} / {r['daemon_idle_empty']['rss_mib']:.1f} MiB",
    )
    add(
        "per-program overhead",
        lambda r: (
            f"runner USS {r['overhead']['runner_uss_mib']['p50']:.1f} MiB (RSS {r['overhead']['runner_rss_mib']['p50']:.1f})"
            if r["overhead"]
            else f"{(r['idle']['rss_mib'] - r['daemon_idle_empty']['rss_mib']) * 1024 / max(1, len(r['bursts'][0]['running'])):.0f} KiB of daemon RSS"
        ),
    )
    width = max(len(lbl) for lbl, _ in rows)
    cols = [max(len(n), *(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
    line("  " + " " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols)))
    for lbl, vals in rows:
        line("  " + lbl.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds): for the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="one-at-a-time spawn/stop repetitions (default 7)")
    ap.add_argument("--burst", type=int, default=None, help="programs started at once (default 50)")
    ap.add_argument("--escapers", type=int, default=None, help="survivor reps (default 3)")
    ap.add_argument(
        "--burst-reps",
        type=int,
        default=None,
        choices=(1, 2),
        help="reps of each burst, the second in reverse order (default 2; --quick: 1)",
    )
    ap.add_argument("--idle", type=float, default=None, help="idle CPU window, seconds (default 10)")
    ap.add_argument("--grace", type=float, default=2.0, help="stop grace for every supervisor (default 2 s)")
    ap.add_argument(
        "--only",
        default=None,
        help="which to run, comma-separated (default agentd,agentd-cold,supervisord; --quick: agentd,supervisord)",
    )
    ap.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV, help="where supervisord's own venv lives")
    ap.add_argument(
        "--agentd-tree",
        type=Path,
        default=None,
        help="another checkout with its own .venv: adds agentd-before (its daemon and CLI, zygote on) to the run",
    )
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()
    args.reps = args.reps or (2 if args.quick else 7)
    args.burst = args.burst or (3 if args.quick else 50)
    args.escapers = args.escapers or (1 if args.quick else 3)
    args.burst_reps = args.burst_reps or (1 if args.quick else 2)
    args.idle = args.idle or (2.0 if args.quick else 10.0)
    args.only = args.only or ("agentd,supervisord" if args.quick else "agentd,agentd-cold,supervisord")
    mark = install_mark()
    m = machine()
    line(
        f"bench_peers on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}; "
        f"grace {args.grace:g} s, N={args.burst}, reps {args.reps}"
    )
    out: dict[str, Any] = {"machine": m, "args": {k: str(v) for k, v in vars(args).items()}, "peers": []}
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    if args.agentd_tree is not None and "agentd-before" not in only:
        only.insert(1 if only[:1] == ["agentd"] else 0, "agentd-before")
    compile_tree()
    benches: list[Bench] = []
    try:
        with tempfile.TemporaryDirectory(prefix="agentd-bench-peers-") as tmp:
            work = Path(tmp)
            peers: list[Peer] = []
            try:
                for name in only:
                    header(f"starting {name}")
                    progs = programs_for(name, work, args)
                    if name == "supervisord":
                        try:
                            venv = ensure_supervisor_venv(args.peer_venv)
                        except (OSError, subprocess.CalledProcessError) as exc:
                            line(f"  !! supervisord skipped: cannot install supervisor=={SUPERVISOR_VERSION} ({exc})")
                            continue
                        peer: Peer = Supervisord(
                            work, venv, grace_s=args.grace, programs=[(k, c) for k, (c, _t) in progs.items()]
                        )
                    elif name in ("agentd", "agentd-cold", "agentd-before"):
                        tree = None
                        if name == "agentd-before":
                            if args.agentd_tree is None:
                                raise SystemExit("error: agentd-before needs --agentd-tree DIR")
                            tree = args.agentd_tree.resolve()
                            compile_tree(tree, str(tree / ".venv" / "bin" / "python"))
                        a = Agentd(
                            work, name, grace_s=args.grace, tree=tree, zygote="off" if name == "agentd-cold" else "auto"
                        )
                        if name in ("agentd", "agentd-before"):
                            waited = a.wait_zygote()
                            line(f"  zygote ready after {waited if waited is None else round(waited, 2)} s")
                        peer = a
                    else:
                        raise SystemExit(
                            f"error: unknown supervisor {name!r} (expected agentd, agentd-cold, agentd-before, supervisord)"
                        )
                    peers.append(peer)
                    benches.append(Bench(peer, work, progs))
                header("measuring, every supervisor in turn")
                t0 = time.perf_counter()
                out["peers"] = run_all(benches, args)
                line(f"  done in {time.perf_counter() - t0:.1f} s; load {os.getloadavg()[0]:.2f}")
            finally:
                for peer in peers:
                    peer.close()
            header(f"side by side (N={args.burst}, grace {args.grace:g} s, load now {os.getloadavg()[0]:.2f})")
            table(out["peers"])
            sup = next((r for r in out["peers"] if r["name"] == "supervisord"), None)
            zyg = next((r for r in out["peers"] if r["name"] == "agentd"), None)
            if sup and zyg:
                a1 = med([s["running_s"] for s in zyg["sequential"]["spawn"]])
                s1 = med([s["running_s"] for s in sup["sequential"]["spawn"]])
                ab, sb = mean_of(zyg["bursts"], "all_running_s"), mean_of(sup["bursts"], "all_running_s")
                if a1 and s1:
                    line(f"  agentd / supervisord, spawn -> running one at a time: {a1 / s1:.2f}x (target <= 0.5x)")
                if ab and sb:
                    line(
                        f"  agentd / supervisord, {args.burst} at once -> all running (mean of reps): {ab / sb:.2f}x "
                        "(target <= 0.5x)"
                    )
                am, sm = mean_of(zyg["bulks"], "all_running_s"), mean_of(sup["bulks"], "all_running_s")
                if am and sm:
                    line(f"  agentd / supervisord, {args.burst} in one CLI command -> all running: {am / sm:.2f}x")
                if am and sb:
                    line(
                        f"  agentd, {args.burst} in one CLI command / supervisord, {args.burst} CLI commands: {am / sb:.2f}x"
                    )
    finally:
        header("cleanup")
        out["survivors_at_end"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
