"""The benchmark scripts still run: each in its tiny ``--quick`` mode, all at once.

No figure is asserted (benchmarks print figures; they never fail on one). What must hold:
each script exits 0, writes its JSON, logs no traceback, and reports its cleanup (every process it started
is gone; the suite's leftover guard checks that too, through AGENTD_TEST_MARK).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["spawn", "stop", "scale", "cli", "events", "subscriptions", "zygote", "peers", "fleet"]
TIMEOUT_S = 240.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the benchmarks read /proc")
def test_every_benchmark_runs_in_quick_mode(tmp_path: Path) -> None:
    procs = {}
    for name in SCRIPTS:
        out = tmp_path / f"{name}.json"
        log = open(tmp_path / f"{name}.log", "wb")
        procs[name] = (
            subprocess.Popen(
                [sys.executable, str(ROOT / "benchmarks" / f"bench_{name}.py"), "--quick", "--json", str(out)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            out,
            log,
        )
    deadline = time.monotonic() + TIMEOUT_S
    failures = []
    for name, (p, out, log) in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        text = (tmp_path / f"{name}.log").read_text(errors="replace")
        if p.returncode != 0 or not out.exists():
            failures.append(f"bench_{name} exited {p.returncode}:\n{text[-3000:]}")
            continue
        data = json.loads(out.read_text())
        if not isinstance(data, dict) or "cleanup:" not in text:
            failures.append(f"bench_{name} wrote no figures or no cleanup line:\n{text[-3000:]}")
        elif "Traceback" in text:
            # A figure of runs that all failed is no figure (bench_zygote's spare runs once
            # failed at a changed signature and it still exited 0).
            at = text.index("Traceback")
            failures.append(f"bench_{name} logged a traceback:\n{text[at : at + 3000]}")
    assert not failures, "\n\n".join(failures)


def test_a_final_sweep_without_the_benchmarks_mark_is_refused() -> None:
    """An empty mark would match any process whose mark variable is empty: not ours."""
    from benchmarks._common import final_sweep

    with pytest.raises(ValueError, match="mark"):
        final_sweep("")
