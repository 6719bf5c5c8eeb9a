"""The suite's leak check touches only what a test started, and still catches what it leaks.

An inner pytest session runs one test that leaves a Chromium-like process behind (it
double-forks, calls ``setsid()`` and clears its environment, so it carries no marker).
While that test runs, this test starts a decoy with the same kind of command line outside
the inner session. The inner leak check must name and end the leaker, and never see or
signal the decoy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import _read_stat

ROOT = Path(__file__).resolve().parent.parent
FAKE_CHROMIUM = "/usr/lib/chromium/chromium"
INNER_TIMEOUT_S = 120

INNER = textwrap.dedent(
    """
    import os, subprocess, time

    def test_leaves_a_chromium_like_process_behind():
        # Double fork + setsid + empty environment: no marker, reparented to the reaper.
        subprocess.run(
            ["/bin/sh", "-c", "(setsid env -i /bin/bash -c 'exec -a {fake} sleep 300' </dev/null >/dev/null 2>&1 &)"],
            check=True,
        )
        with open(os.environ["DECOY_FIFO"]) as f:  # blocks until the outer test writes
            decoy = int(f.read())
        os.kill(decoy, 0)  # the decoy runs while this test ends
    """
).format(fake=FAKE_CHROMIUM)


def test_a_decoy_outside_the_suite_survives_and_the_leaker_is_caught(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    fifo = tmp_path / "decoy.fifo"
    os.mkfifo(fifo)
    env = {k: v for k, v in os.environ.items() if k != "AGENTD_TEST_REAPER"}
    env["DECOY_FIFO"] = str(fifo)
    env["PYTHONPATH"] = str(ROOT)
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         "-c", str(ROOT / "pyproject.toml"), "-p", "tests.conftest", str(tmp_path / "test_inner.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    decoy = None
    try:
        with open(fifo, "w") as f:  # opens once the inner test is waiting on it
            decoy = subprocess.Popen(
                ["/bin/bash", "-c", f"exec -a {FAKE_CHROMIUM} sleep 300"],
                env={"PATH": os.environ["PATH"]},
            )
            f.write(str(decoy.pid))
        out, _ = inner.communicate(timeout=INNER_TIMEOUT_S)
        assert inner.returncode == 1, out
        assert "processes left behind by this test" in out, out
        assert FAKE_CHROMIUM in out, out
        assert f"{decoy.pid} " not in out, f"the decoy {decoy.pid} was reported:\n{out}"
        assert decoy.poll() is None, "the inner suite's leak check signalled the decoy"
        reported = [int(pid) for pid in re.findall(r"(\d+) '" + re.escape(FAKE_CHROMIUM), out)]
        assert reported, out
        assert decoy.pid not in reported
        for pid in reported:  # the inner leak check ended what it found
            st = _read_stat(pid)
            assert st is None or st[2] == "Z", f"the inner leak check left its leaker {pid} alive"
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        if decoy is not None:
            decoy.kill()
            decoy.wait()
