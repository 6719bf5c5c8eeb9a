"""Hard links to a protected file, on real Landlocked processes: a run cannot make one
(every way of linking or renaming a file it has no rule for is refused), one beside the
protected file is skipped as the file is, and one elsewhere is reported (``_links``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from subagent import _landlock, _links
from subagent._landlock import FS_READ, Grant, plan_rules
from tests import conftest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = [sys.prefix, sys.base_prefix, str(REPO), "/usr", "/lib", "/lib64", "/etc", "/proc"]

# argv: repo, the writable tree, the protected file, the runtime's paths (json).
CHILD = r"""
import ctypes, json, os, sys
sys.path.insert(0, sys.argv[1])
from subagent import _landlock
from subagent._landlock import FS_READ, FS_WRITE, Grant, plan_rules
tree, secret = sys.argv[2], sys.argv[3]
grants = [Grant(p, FS_READ) for p in json.loads(sys.argv[4])] + [Grant(tree, FS_WRITE)]
_landlock.restrict_self(plan_rules(grants, [secret]), abi=_landlock.abi_version())
libc = ctypes.CDLL(None, use_errno=True)
w, here = os.path.join(tree, "w"), os.path.dirname(secret)
def link_empty_path():  # linkat(fd, "", ..., AT_EMPTY_PATH) of an O_PATH descriptor
    fd = os.open(secret, os.O_PATH)
    if libc.linkat(fd, b"", -100, os.path.join(w, "by-fd").encode(), 0x1000) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
out = {}
for name, fn in [
    ("read", lambda: open(secret).read()),
    ("link_elsewhere", lambda: os.link(secret, os.path.join(w, "l"))),
    ("link_beside", lambda: os.link(secret, os.path.join(here, "l"))),
    ("link_by_proc_fd", lambda: os.link(f"/proc/self/fd/{os.open(secret, os.O_PATH)}", os.path.join(w, "p"))),
    ("link_empty_path", link_empty_path),
    ("rename", lambda: os.rename(secret, os.path.join(w, "r"))),
    ("read_beside", lambda: open(os.path.join(here, "beside")).read()),
    ("read_elsewhere", lambda: open(os.path.join(w, "elsewhere")).read()),
]:
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.strerror
print(json.dumps(out))
"""


def _landlocked(tree: Path, secret: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), str(tree), str(secret), json.dumps(RUNTIME)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    got: dict[str, str] = json.loads(out)
    return got


def _secret(tree: Path) -> Path:
    (tree / "prot").mkdir(parents=True)
    (tree / "w").mkdir()
    secret = tree / "prot" / "secret"
    secret.write_text("secret-content")
    secret.chmod(0o600)
    return secret


def test_a_run_cannot_link_a_protected_file_into_a_tree_it_writes(tmp_path: Path) -> None:
    """On the same filesystem, in a tree the run writes (the daemon is root here, which
    ``protected_hardlinks`` lets link any file): Landlock refuses to link or move a file
    the run has no rule for (``REFER`` on its directory, ``MAKE_REG`` beside it)."""
    conftest.require(_landlock.abi_version() >= 2, "Landlock ABI 2 (REFER)")
    secret = _secret(tmp_path / "t")
    got = _landlocked(tmp_path / "t", secret)
    exdev, eacces = os.strerror(18), os.strerror(13)
    assert got == {
        "read": eacces,
        "link_elsewhere": exdev,
        "link_beside": eacces,
        "link_by_proc_fd": exdev,
        "link_empty_path": exdev,
        "rename": eacces,
        "read_beside": "No such file or directory",
        "read_elsewhere": "No such file or directory",
    }, got
    assert sorted(os.listdir(tmp_path / "t" / "w")) == [] and secret.stat().st_nlink == 1


def test_a_link_beside_a_protected_file_is_refused_one_elsewhere_is_reported(tmp_path: Path) -> None:
    """A link made before (an operator's): beside the protected file it is skipped as the
    file is (the run read it before); elsewhere in the tree it is readable, which
    ``linked_protected`` says for the granted trees on the file's filesystem."""
    conftest.require(_landlock.abi_version() >= 2, "Landlock ABI 2 (REFER)")
    tree = tmp_path / "t"
    secret = _secret(tree)
    os.link(secret, tree / "prot" / "beside")
    os.link(secret, tree / "w" / "elsewhere")
    got = _landlocked(tree, secret)
    assert got["read"] == got["read_beside"] == os.strerror(13), got
    assert got["read_elsewhere"] == "ok", got  # the limit, documented (README: protected paths)
    problems = _links.linked_protected([str(secret)], [str(tree), "/proc"])
    assert len(problems) == 1 and repr(str(secret)) in problems[0] and "3 hard links" in problems[0], problems
    assert f"({tree})" in problems[0], problems  # /proc is another filesystem: not named


def test_only_protected_files_with_links_on_a_granted_filesystem_are_reported(tmp_path: Path) -> None:
    secret = _secret(tmp_path / "t")
    assert _links.linked_protected([str(secret)], [str(tmp_path)]) == []  # one link
    os.link(secret, tmp_path / "t" / "w" / "l")
    assert _links.linked_protected([str(secret)], ["/proc"]) == []  # no grant on its filesystem
    assert _links.linked_protected([str(tmp_path / "t" / "prot")], [str(tmp_path)]) == []  # a directory
    # A grant holding a mount of the file's filesystem (here: the tree's own mount, or "/").
    assert _links.linked_protected([str(secret)], ["/"]) != []


def test_plan_rules_skips_other_links_to_a_protected_file_on_the_way_to_it(tmp_path: Path) -> None:
    secret = _secret(tmp_path / "t")
    os.link(secret, tmp_path / "t" / "prot" / "beside")
    (tmp_path / "t" / "prot" / "other").write_text("x")
    rules = plan_rules([Grant(str(tmp_path), FS_READ)], [str(secret)])
    paths = {Path(g.path).relative_to(tmp_path).as_posix() for g in rules}
    assert paths == {"t/w", "t/prot/other"}, paths


def test_a_grant_that_names_another_link_to_a_protected_file_is_refused(tmp_path: Path) -> None:
    from subagent.sandbox import check_grants

    secret = tmp_path / "prot" / "secret"
    secret.parent.mkdir()
    secret.write_text("secret-content")
    (tmp_path / "data").mkdir()
    copy = tmp_path / "data" / "copy"
    os.link(secret, copy)
    (tmp_path / "data" / "plain").write_text("open-content")
    why = check_grants([str(copy)], [], [str(secret)])
    assert why is not None and "another hard link to" in why and str(secret) in why
    assert check_grants([], [str(copy)], [str(secret)]) is not None  # a write grant too
    # A symlink to it resolves to the link: refused the same way.
    (tmp_path / "sym").symlink_to(copy)
    assert check_grants([str(tmp_path / "sym")], [], [str(secret)]) is not None
    # Other files, and the directory holding the link (reported, not refused: _links), pass.
    assert check_grants([str(tmp_path / "data" / "plain")], [], [str(secret)]) is None
    assert check_grants([str(tmp_path / "data")], [], [str(secret)]) is None
