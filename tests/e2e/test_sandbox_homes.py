"""A runner whose ``sys.path`` names a home: the run reads what Python imports from it,
not the rest of the home, and cannot list it.

The runner grants itself what it needs to keep running, every ``sys.path`` entry among
it: a ``PYTHONPATH`` naming the daemon user's home gave every run all of it (its
``.bash_history``, ``.config``, project files), then the listing of it (every name in
it, ``~/.ssh``'s keys' among them). The daemon runs in-process with ``HOME`` and
``PYTHONPATH`` naming a home made for the test (in the real home, outside the run's
private /tmp: Landlock alone keeps it out); real runners, cold and forked ahead (a
zygote's spare), run a command that reads and lists there, and the runner itself imports
from there after its sandbox (``SITECUSTOMIZE``: as it starts its tool's command).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from supervisor.config import Config
from supervisor.daemon import serve
from tests.e2e.test_sandbox import SCENARIO_S, Daemon, command, outputs, scripted
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parent.parent.parent
SECRET = "agentd-home-secret-3c9e"
# Names in the home that only a listing shows (the probe names them nowhere).
UNNAMED = ("unnamed-home-file-5b1d", "unnamed-ssh-key-9e2c")
# Python imports ``sitecustomize`` from the home (on the runner's sys.path) as the zygote
# or a cold runner starts. Its audit hook, as the runner starts a tool's process (after
# its sandbox), imports a module and a package from the home and tries to list it there,
# in the runner's own process, and writes what it saw in the run's directory. The import
# system's caches dropped first, as when the home changed since the runner started (a
# file saved there: a new mtime), which the import system sees as a directory to list again.
SITECUSTOMIZE = """
import importlib, os, sys

def _probe(event, args):
    env = args[3] if event == "subprocess.Popen" else None
    if not env or "AGENTD_RUN_DIR" not in env:
        return
    fresh = "probe_mod" not in sys.modules and "probe_pkg" not in sys.modules
    importlib.invalidate_caches()
    try:
        import probe_mod, probe_pkg
        got = probe_mod.VALUE + "," + probe_pkg.VALUE
    except ImportError as exc:
        got = repr(exc)
    try:
        listed = str(len(os.listdir(os.path.dirname(os.path.abspath(__file__)))))
    except OSError as exc:
        listed = type(exc).__name__
    with open(os.path.join(env["AGENTD_RUN_DIR"], "runner-probe.txt"), "w") as f:
        f.write(f"runner_fresh={fresh}\\nrunner_imports={got}\\nrunner_listdir={listed}\\n")

sys.addaudithook(_probe)
"""


@pytest.fixture
def home() -> Iterator[Path]:
    """A home of the test's own, in the real one (removed after): its secrets, a module
    and a package Python may import from it."""
    path = Path(tempfile.mkdtemp(prefix="agentd-test-home-", dir=Path.home()))
    try:
        (path / ".bash_history").write_text(f"export TOKEN={SECRET}\n")
        (path / ".config" / "app").mkdir(parents=True)
        (path / ".config" / "app" / "token").write_text(SECRET + "\n")
        (path / "notes.txt").write_text(SECRET + "\n")
        (path / "probe_mod.py").write_text("VALUE = 'module-imported'\n")
        (path / "probe_pkg").mkdir()
        (path / "probe_pkg" / "__init__.py").write_text("VALUE = 'package-imported'\n")
        (path / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (path / ".ssh").mkdir()
        (path / ".ssh" / "id_agentd_test").write_text(SECRET + "\n")
        (path / UNNAMED[0]).write_text(SECRET + "\n")
        (path / ".ssh" / UNNAMED[1]).write_text(SECRET + "\n")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["off", "auto"], ids=["cold", "zygote"])
async def daemon(
    request: pytest.FixtureRequest, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{home}")
    config = Config.load(
        state_dir=tmp_path / "state", runner_python=sys.executable, grace_s=3, environ={}, sandbox="required",
        zygote=request.param,
    )  # fmt: skip
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield Daemon(info["manager"], config, info)
        stop.set()


async def test_a_pythonpath_naming_the_home_gives_the_run_its_modules_not_the_home(daemon: Daemon, home: Path) -> None:
    probe = "\n".join([
        f"cat {home}/.bash_history; echo history=$?",
        f"cat {home}/notes.txt; echo notes=$?",
        f"cat {home}/.config/app/token; echo config=$?",
        f"cat {home}/.ssh/id_agentd_test; echo ssh=$?",
        f"ls {home}; echo ls=$?",
        f"ls {home}/.ssh; echo ls_ssh=$?",
        f"{sys.executable} -c 'import os; os.listdir(\"{home}\")' 2>&1 | tail -1",
        'cat "$AGENTD_RUN_DIR/runner-probe.txt"',
    ])  # fmt: skip
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(scripted([command(probe)]))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st  # the runner started and ran with its grants
    [out] = outputs(st)
    assert SECRET not in out, out
    assert not [n for n in UNNAMED if n in out], out  # no name listed
    keys = ("history", "notes", "config", "ssh", "ls", "ls_ssh")
    lines = dict(line.split("=", 1) for line in out.splitlines() if line.split("=", 1)[0] in keys)
    assert lines == {"history": "1", "notes": "1", "config": "1", "ssh": "1", "ls": "2", "ls_ssh": "2"}, out
    assert f"PermissionError: [Errno 13] Permission denied: '{home}'" in out, out
    # The runner, after its sandbox, imported from the home (not before: fresh) and could
    # not list it either.
    runner = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("runner_"))
    assert runner == {
        "runner_fresh": "True",
        "runner_imports": "module-imported,package-imported",
        "runner_listdir": "PermissionError",
    }, out
    sandbox = st["sandbox"]
    assert str(home) not in sandbox["read"] and str(home / "probe_pkg") in sandbox["read"], sandbox["read"]
    notes = [p for p in sandbox.get("problems", []) if str(home) in p]
    assert notes and "home directory" in notes[0] and "probe_pkg" in notes[0], json.dumps(sandbox, indent=1)
    assert "may not list it" in notes[0], notes
