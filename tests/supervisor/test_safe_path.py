"""A run's directory is never first on its runner's ``sys.path`` (``config.module_argv``).

Seen (a probe): the daemon started ``python -m subagent.runner`` in the run's directory,
which ``-m`` puts first on ``sys.path``, and a forked runner had its run directory put
there by the zygote to match. The run's tools write that directory: a module they left
there under a name the runner imported later would have run inside the runner (its model
key, its results). No such late import was seen; the order itself was the hole. Real
processes: the exact command lines the daemon starts, in a directory holding a planted
``subagent`` package that says so if it is imported.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.config import Config, module_argv

CHECKOUT = str(Path(__file__).resolve().parents[2])
PLANTED_EXIT = 97


def plant(where: Path) -> Path:
    pkg = where / "subagent"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"import sys\nprint('PLANTED', flush=True)\nsys.exit({PLANTED_EXIT})\n")
    return where


@pytest.mark.parametrize("module", ["subagent.runner", "subagent.zygote"])
def test_a_module_left_in_the_working_directory_is_not_imported_by_the_daemons_commands(
    tmp_path: Path, module: str
) -> None:
    cwd = plant(tmp_path / "run")
    argv = Config().runner_argv if module == "subagent.runner" else module_argv(sys.executable, module)
    # Nothing on stdin (the runner: no spec; the zygote: no daemon): each ends at once, by itself.
    proc = subprocess.run(
        argv,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": CHECKOUT},
    )
    assert b"PLANTED" not in proc.stdout and proc.returncode != PLANTED_EXIT, (proc.returncode, proc.stdout)


def test_a_forked_runner_does_not_put_its_run_directory_on_sys_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # The zygote's own step at a fork (``_Zygote._chdir``), in a process of its own.
    script = (
        "import os, sys, types\n"
        "import subagent.zygote as z\n"
        "before = list(sys.path)\n"
        "z._Zygote._chdir(types.SimpleNamespace(sys_path0=sys.path[0]), sys.argv[1])\n"
        "assert os.getcwd() == sys.argv[1]\n"
        "print(sys.argv[1] in sys.path, sys.path == before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", script, str(run_dir)],
        capture_output=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": CHECKOUT},
        check=True,
    )
    assert out.stdout.split() == [b"False", b"True"], out
