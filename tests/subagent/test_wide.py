"""Which derived grants are too wide to give a run whole (``subagent._wide``), and what a
Chromium or a ``sys.path`` entry kept in one is narrowed to. The runs themselves:
tests/e2e/test_sandbox_homes.py and tests/e2e/test_browser_sandbox.py."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from subagent import _wide
from subagent.tools import browser_setup


def test_a_home_what_holds_one_the_root_and_shared_tmp_are_too_wide_not_the_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home" / "u"
    (home / "project").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    assert _wide.too_wide(str(home)) == "the home directory of the daemon's user ($HOME)"
    assert "holding the home directory" in str(_wide.too_wide(str(tmp_path / "home")))
    assert _wide.too_wide("/") is not None and _wide.too_wide("/tmp") is not None
    assert _wide.too_wide(str(home / "project")) is None  # inside a home: what was asked for
    assert _wide.too_wide("/usr/bin") is None  # a home ('/bin' is 'sync''s), but every run reads it


def test_a_sys_path_entry_too_wide_is_not_granted_its_modules_and_packages_read_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "u"
    for rel in ("mod.py", "ext.abi3.so", "pkg/__init__.py", "__pycache__/mod.cpython-311.pyc", "notes.txt"):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("x")
    (home / "Documents").mkdir()
    (home / ".config").mkdir()
    (home / "linked.py").symlink_to(home / "notes.txt")
    monkeypatch.setenv("HOME", str(home))
    got = _wide.narrow_runtime([str(home), "/usr/lib"], [str(home)])
    assert set(got.imports) == {str(home)}
    assert sorted(got.imports[str(home)]) == ["__pycache__", "ext.abi3.so", "mod.py", "pkg"]
    inside = {os.path.relpath(p, home) for p in got.read if p.startswith(str(home))}
    assert inside == {"mod.py", "ext.abi3.so", "pkg", "__pycache__"}
    assert "/usr/lib" in got.read
    [note] = got.problems
    assert str(home) in note and "home directory" in note
    # Not on sys.path (a prefix that is a home): not granted at all.
    assert _wide.narrow_runtime([str(home)], []).read == []
    # The checkout is agentd's own code: whole, whatever it is.
    assert _wide.narrow_runtime([str(home)], [str(home)], keep=[str(home)]).read == [str(home)]


def _chromium(d: Path, *more: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    exe = d / "chrome"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    for name in more:
        (d / name).write_text("x")
    return exe


def test_chromium_in_its_own_directory_gets_it_whole_in_or_as_a_home_or_bin_only_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "u"
    monkeypatch.setenv("HOME", str(home))
    node, mcp = Path("/usr/bin/node"), tmp_path / "node_modules" / "@playwright" / "mcp" / "cli.js"
    own = _chromium(tmp_path / "opt" / "chrome-linux64", "resources.pak")
    assert browser_setup.chromium_narrowed(own) is None
    assert str(own.parent) in browser_setup.read_paths(node, mcp, own)
    for where in (home, home / "bin", home / ".local" / "bin", home / "Downloads" / "chrome-linux"):
        exe = _chromium(where, "resources.pak", "icudtl.dat", "wallet.dat", "notes.txt")
        assert browser_setup.chromium_narrowed(exe) is not None, where
        got = browser_setup.read_paths(node, mcp, exe)
        assert str(where) not in got
        assert {p for p in got if p.startswith(str(where) + "/") and "/" not in p[len(str(where)) + 1 :]} == {
            str(where / n) for n in ("chrome", "resources.pak", "icudtl.dat")
        }, got
    assert "inside the home directory" in str(
        browser_setup.chromium_narrowed(home / "Downloads" / "chrome-linux" / "chrome")
    )


def test_inside_a_home_is_any_passwd_entrys_or_home_but_not_a_home_that_is_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = [pwd.struct_passwd(("svc", "x", 1, 1, "", "/", "/bin/false")),
             pwd.struct_passwd(("ann", "x", 2, 2, "", str(tmp_path / "ann"), "/bin/sh"))]  # fmt: skip
    monkeypatch.setattr(pwd, "getpwall", lambda: users)
    monkeypatch.setenv("HOME", str(tmp_path / "daemon"))
    assert _wide.within_home(str(tmp_path / "ann" / "Downloads" / "chrome-linux")) == (
        f"inside the home directory of user 'ann' ({str(tmp_path / 'ann')!r})"
    )
    assert "($HOME)" in str(_wide.within_home(str(tmp_path / "daemon" / ".cache" / "ms-playwright")))
    assert _wide.within_home(str(tmp_path / "ann")) is None  # the home itself: ``too_wide``'s
    assert _wide.within_home(str(tmp_path / "opt" / "chromium")) is None  # '/' is svc's home: not counted
    assert _wide.within_home("/usr/games/x") is None  # 'games''s home, but every run reads it
