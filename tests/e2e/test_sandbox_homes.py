"""A runner whose ``sys.path`` names a home: the run reads what Python imports from it,
not the rest of the home.

The runner grants itself what it needs to keep running, every ``sys.path`` entry among
it: a ``PYTHONPATH`` naming the daemon user's home gave every run all of it (its
``.bash_history``, ``.config``, project files). The daemon runs in-process with ``HOME``
and ``PYTHONPATH`` naming a home made for the test (in the real home, outside the run's
private /tmp: Landlock alone keeps it out); real runners, cold and forked ahead (a
zygote's spare), run a command that reads there and a Python that imports from there.
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
        f"PYTHONPATH={home} {sys.executable} -c 'import probe_mod, probe_pkg; print(probe_mod.VALUE, probe_pkg.VALUE)'",
    ])  # fmt: skip
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(scripted([command(probe)]))
        st = await daemon.m.wait_terminal(r["run_id"])
    assert st["state"] == "completed", st  # the runner started and ran with its grants
    [out] = outputs(st)
    assert SECRET not in out, out
    lines = dict(
        line.split("=", 1) for line in out.splitlines() if line.split("=", 1)[0] in ("history", "notes", "config")
    )
    assert lines == {"history": "1", "notes": "1", "config": "1"}, out
    assert "module-imported package-imported" in out, out  # listed, and what Python imports read
    sandbox = st["sandbox"]
    assert str(home) not in sandbox["read"] and str(home / "probe_pkg") in sandbox["read"], sandbox["read"]
    notes = [p for p in sandbox.get("problems", []) if str(home) in p]
    assert notes and "home directory" in notes[0] and "probe_pkg" in notes[0], json.dumps(sandbox, indent=1)
