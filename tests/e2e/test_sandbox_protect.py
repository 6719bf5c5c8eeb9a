"""A protected path that is a file, in a directory a run reads: the run cannot read it.

The default protected paths include files (``/etc/shadow``, ``/etc/gshadow``,
``/etc/sudoers``, the SSH host keys), and ``sandbox_protect`` may name one (README: "add
such paths to ``sandbox_protect``"). The Landlock rules skipped a protected directory in
a granted tree but granted a protected file like any other: a root daemon's run read the
host's ``/etc/shadow`` (uid 0 on the host, its owner). Here a ``sandbox_protect`` file
beside a readable one, in a directory the spec grants; runners cold and forked from a
zygote's spare (the rules are planned in the spare's half).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.e2e.sandbox_daemon import sandboxed_daemon
from tests.e2e.test_sandbox import SCENARIO_S, Daemon, command, outputs, scripted
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture


@pytest.fixture(params=["off", "auto"])
async def daemon(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "open.txt").write_text("open-content\n")
    (data / "secret.txt").write_text("secret-content\n")
    async with sandboxed_daemon(tmp_path, monkeypatch, request.param, sandbox_protect=(str(data / "secret.txt"),)) as d:
        yield d


async def test_a_protected_file_in_a_granted_directory_cannot_be_read(daemon: Daemon, tmp_path: Path) -> None:
    data = tmp_path / "data"
    cmd = f"cat {data}/open.txt; cat {data}/secret.txt || echo secret-refused"
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(scripted([command(cmd)], sandbox={"read": [str(data)]}))
        st = await daemon.m.wait_terminal(r["run_id"])
    (out,) = outputs(st)
    assert st["sandbox"]["mode"] == "landlock", st["sandbox"]
    assert str(data / "secret.txt") in st["sandbox"]["protected"], st["sandbox"]
    assert "open-content" in out, out  # its sibling is granted
    assert "secret-content" not in out and "secret-refused" in out and "Permission denied" in out, out
    assert (data / "secret.txt").read_text() == "secret-content\n"


async def test_another_hard_link_to_a_protected_file_is_refused_beside_it_and_reported_elsewhere(
    daemon: Daemon, tmp_path: Path
) -> None:
    """A rule follows the file, not its path: another hard link to a protected file in a
    granted tree is readable through that link. One in a directory on the way to the
    protected file is skipped as the file is; one elsewhere is not looked for (a walk of
    every granted tree): ``status`` says so in ``sandbox.problems`` (before, it said nothing)."""
    data = tmp_path / "data"
    (data / "sub").mkdir()
    os.link(data / "secret.txt", data / "beside.txt")
    os.link(data / "secret.txt", data / "sub" / "elsewhere.txt")
    cmd = f"cat {data}/beside.txt || echo beside-refused; cat {data}/sub/elsewhere.txt; cat {data}/open.txt"
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(scripted([command(cmd)], sandbox={"read": [str(data)]}))
        st = await daemon.m.wait_terminal(r["run_id"])
    (out,) = outputs(st)
    assert st["sandbox"]["mode"] == "landlock", st["sandbox"]
    assert "beside-refused" in out and "open-content" in out, out
    assert out.count("secret-content") == 1, out  # through the link elsewhere: the limit documented
    problems = st["sandbox"].get("problems", [])
    assert any(str(data / "secret.txt") in p and "3 hard links" in p and str(data) in p for p in problems), problems
