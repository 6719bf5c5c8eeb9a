"""Experiment: stop scenario (d) (a command that leaves setsid/double-forked descendants
holding its output pipe) with the runner's post-exit pipe wait as it is (0.5 s) and with
it at 0 (a stand-in for "end the command's group and marked escapers first, then drain").

Runs ``bench_stop.scenario_d`` against an in-process daemon whose runner is
``runner_with_patch.py`` (the real runner, one constant patched through the environment).
No file is edited.

    .venv/bin/python benchmarks/experiments/command_drain.py [REPS]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import trio  # noqa: E402

from benchmarks._common import PY, final_sweep, install_mark  # noqa: E402
from benchmarks._daemon import in_process_daemon, quiet_logs  # noqa: E402
from benchmarks.bench_stop import scenario_d  # noqa: E402

WRAPPER = str(Path(__file__).resolve().parent / "runner_with_patch.py")


async def main(reps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for label, drain in (("as it is (0.5 s)", ""), ("post-exit wait 0", "0")):
            os.environ["BENCH_COMMAND_DRAIN_S"] = drain
            async with in_process_daemon(
                Path(tmp) / (drain or "default"), grace_s=10.0, runner_command=(PY, WRAPPER)
            ) as d:
                print(f"\n#### runner's DRAIN_AFTER_EXIT_S: {label}")
                await scenario_d(d["manager"], reps, 10.0)


if __name__ == "__main__":
    quiet_logs("--verbose" in sys.argv)
    mark = install_mark()
    reps = int(next((a for a in sys.argv[1:] if a.isdigit()), "3"))
    try:
        trio.run(main, reps)
    finally:
        final_sweep(mark)
