"""Acceptance 5: the README's demo command runs green (real daemon, runner, Chromium)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import trio

from tests import browser_support as bs

ROOT = Path(__file__).resolve().parent.parent.parent
# The whole demo: setup (a no-op when installed), a daemon, two browser runs (seconds).
DEMO_TIMEOUT_S = 240.0


@pytest.mark.chromium
async def test_the_demo_runs_green_and_leaves_nothing(no_process_left_behind: str) -> None:
    bs.require_browser()
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.pop("AGENTD_STATE_DIR", None)
    with trio.fail_after(DEMO_TIMEOUT_S):
        proc = await trio.run_process(
            [str(ROOT / "scripts" / "demo")],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
        )
    out = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    assert "The top story on the Harbor Gazette: Lighthouse keeper spots 42 dolphins" in out
    # The demo itself fails unless the second run's watch ended "cancelled" (exit code 7).
    assert "state: cancelled" in out and "progress so far:" in out and "browser_snapshot" in out
    assert "nothing left running" in out
    state = re.search(r"state dir (/tmp/agd\.\w+)", out)
    assert state is not None
    assert not Path(state.group(1)).exists(), "the demo's state dir was not removed"
    await trio.to_thread.run_sync(bs.wait_no_browser_left, no_process_left_behind, [state.group(1) + "/"])
