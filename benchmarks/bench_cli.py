"""CLI round trip: a cold ``agentd status <run>`` process against a running daemon.

Each sample is a fresh process (``.venv/bin/agentd status RUN_ID``) from exec to exit,
with the environment a user's shell gives it (no ``PYTHONPATH``). Baselines, interleaved
sample by sample, with the same interpreter: ``python -c pass``, ``python -c 'import
click'`` and ``python -c 'import click, wsproto, h11'`` (the libraries the CLI is built
on: a floor for any command that talks to the daemon). The tree's bytecode is written
first (``compile_tree``), as an installed package has it; one more series compiles the
tree's modules from source at every call (a copy without bytecode under
``PYTHONDONTWRITEBYTECODE``: how a harness that sets that variable measured it).

``--baseline-tree DIR`` times another checkout's ``agentd status RUN_ID``, interleaved
pair by pair: with ``DIR/.venv`` (its own ``scripts/setup``) its own console script,
interpreter and install mode; without one, this venv's script on ``PYTHONPATH=DIR``
(e.g. ``git archive main supervisor subagent | tar -x -C DIR``). The median of the
per-pair differences is robust to a load that changes during the run. The CLI's heaviest
imports (``-X importtime``) show where its time goes.

    .venv/bin/python benchmarks/bench_cli.py [--quick] [--reps N] [--baseline-tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    AGENTD,
    PY,
    ROOT,
    compile_tree,
    final_sweep,
    header,
    install_mark,
    line,
    machine,
    row,
    summary,
    write_json,
)
from benchmarks._daemon_proc import DaemonProc  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, float]:
    """Wall time exec to exit, exit code, and the process's CPU time (user + system)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, p.returncode, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def import_profile(argv: list[str], env: dict[str, str], top: int = 8) -> list[tuple[str, float]]:
    """The top-level imports of a command with their cumulative time (-X importtime)."""
    p = subprocess.run(
        [PY, "-X", "importtime", *argv],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    rows = []
    for ln in p.stderr.splitlines():
        if not ln.startswith("import time:") or ln.count("|") != 2:
            continue
        _, cum, raw = ln[len("import time:") :].split("|")
        try:
            cum_us = int(cum.strip())
        except ValueError:
            continue
        if len(raw) - len(raw.lstrip(" ")) == 1:  # top level: one space; nested ones are indented
            rows.append((raw.strip(), cum_us / 1e6))
    total = sum(c for _, c in rows)
    rows.sort(key=lambda r: -r[1])
    return [("(all top-level imports)", total)] + rows[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 samples: for the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="samples of each (default 30)")
    ap.add_argument(
        "--baseline-tree",
        default=None,
        help="another checkout's root (with its own .venv, or only its "
        "supervisor/ and subagent/): its `agentd status RUN_ID`, interleaved",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 30)
    mark = install_mark()
    m = machine()
    line(f"bench_cli on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {"machine": m, "reps": reps}
    compile_tree()
    d = None
    tmp = tempfile.TemporaryDirectory(prefix="agentd-bench-cli-")
    try:
        d = DaemonProc(Path(tmp.name) / "state")
        # A user's shell: no PYTHONPATH (install_mark sets one for the daemon's children).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["AGENTD_STATE_DIR"] = str(d.state_dir)
        # This tree's modules compiled from source at every call (the libraries' and the
        # stdlib's bytecode as installed): a copy of its sources, first on the path, where
        # no bytecode is ever written.
        nopyc = Path(tmp.name) / "sources"
        for pkg in ("supervisor", "subagent"):
            shutil.copytree(ROOT / pkg, nopyc / pkg, ignore=shutil.ignore_patterns("__pycache__", "static", "*.md"))
        nopyc_env = dict(env, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(nopyc))
        with d.client() as c:
            run_id = c.spawn(
                {"task": "benchmark", "model": {"provider": "scripted", "script": {"turns": [], "final": "ok"}}}
            )["run_id"]
        rc_first = subprocess.run(
            [AGENTD, "status", run_id],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        if rc_first.returncode != 0:
            line(f"  !! agentd status failed: {rc_first.stderr.decode(errors='replace')[-500:]}")
        samples: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        codes: set[int] = set()

        def sample(name: str, argv: list[str], env: dict[str, str]) -> None:
            wall, rc, used = timed(argv, env)
            samples.setdefault(name, []).append(wall)
            cpu.setdefault(name, []).append(used)
            codes.add(rc)

        base_argv: list[str] = []
        base_env = None
        if args.baseline_tree:
            base = Path(args.baseline_tree).resolve()
            own = base / ".venv" / "bin" / "agentd"
            base_argv = [str(own) if own.exists() else AGENTD, "status", run_id]
            # Its own venv finds its own tree; this venv's script finds it on PYTHONPATH.
            base_env = dict(env) if own.exists() else dict(env, PYTHONPATH=str(base))
            if own.exists():
                compile_tree(base, str(base / ".venv" / "bin" / "python"))
            line(f"  baseline tree {base}: {'its own venv' if own.exists() else 'this venv, PYTHONPATH'}")
            timed(base_argv, base_env)  # a first run reads its files into the page cache
        for _ in range(reps):
            sample("status", [AGENTD, "status", run_id], env)
            if base_env is not None:
                sample("status_baseline_tree", base_argv, base_env)
            sample("status_json", [AGENTD, "--json", "status", run_id], env)
            sample("status_daemon", [AGENTD, "status"], env)
            sample("status_nopyc", [AGENTD, "status", run_id], nopyc_env)
            sample("pass", [PY, "-c", "pass"], env)
            sample("click", [PY, "-c", "import click"], env)
            sample("libs", [PY, "-c", "import click, wsproto, h11"], env)
        header(f"cold CLI process, {reps} samples each (interleaved); wall time, and the process's CPU time")

        def show(label: str, name: str, note: str = "") -> None:
            c = summary(cpu[name])
            line(row(label, summary(samples[name]), f"cpu p50 {c['p50'] * 1000:.1f} min {c['min'] * 1000:.1f}" + note))

        show("agentd status RUN_ID", "status", f"  exit codes {sorted(codes)}")
        show("agentd --json status RUN_ID", "status_json")
        show("agentd status (the daemon, no run id)", "status_daemon")
        show("agentd status RUN_ID, compiled at every call", "status_nopyc")
        show("baseline: python -c pass", "pass")
        show("baseline: python -c 'import click'", "click")
        show("baseline: python -c 'import click, wsproto, h11'", "libs")
        if base_env is not None:
            show(f"baseline: agentd status RUN_ID from {args.baseline_tree}", "status_baseline_tree")
            diffs = [a - b for a, b in zip(samples["status"], samples["status_baseline_tree"])]
            cdiffs = [a - b for a, b in zip(cpu["status"], cpu["status_baseline_tree"])]
            out["status_minus_baseline_tree_p50"] = statistics.median(diffs)
            out["status_minus_baseline_tree_cpu_p50"] = statistics.median(cdiffs)
            line(
                f"  this tree minus the baseline tree, median of {len(diffs)} interleaved pairs: "
                f"{statistics.median(diffs) * 1000:+.1f} ms wall, {statistics.median(cdiffs) * 1000:+.1f} ms cpu"
            )
        prof = import_profile([AGENTD, "status", run_id], env)
        line("  heaviest imports of `agentd status` (-X importtime, cumulative, one sample):")
        for name, s in prof:
            line(f"    {name:<40} {s * 1000:7.1f} ms")
        out.update(
            {
                "samples": samples,
                "cpu": cpu,
                "imports": prof,
                "summary": {k: summary(v) for k, v in samples.items()},
                "cpu_summary": {k: summary(v) for k, v in cpu.items()},
            }
        )
    finally:
        if d is not None:
            d.stop()
        tmp.cleanup()
        header("cleanup")
        out["survivors"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
