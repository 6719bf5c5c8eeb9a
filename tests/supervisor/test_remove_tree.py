"""A run's directory goes whole when its run ends, whatever modes the run left in it.

``remove_tree`` in a real process of an unprivileged uid (root's removal ignores modes):
a tree with directories that uid may not write or read is removed, and a link in it to a
read-only directory outside is not followed (that directory keeps its mode).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent.parent

CHILD = """
import os, sys
from pathlib import Path
from supervisor.trees.pool import remove_tree

base = Path(sys.argv[1])
run, outside = base / "run", base / "outside"
outside.mkdir()
(outside / "keep").write_text("x")
os.chmod(outside, 0o555)
mod = run / "home" / "go" / "pkg" / "mod" / "x@v1" / "sub"
mod.mkdir(parents=True)
(mod / "x.go").write_text("package x")
(mod / "out").symlink_to(outside)
(run / "locked" / "in").mkdir(parents=True)
for d in (mod, mod.parent, run / "home" / "go" / "pkg" / "mod", run / "home" / "go"):
    os.chmod(d, 0o555)
os.chmod(run / "locked", 0)
print(remove_tree(run), run.exists(), oct(os.stat(outside).st_mode & 0o777), (outside / "keep").exists())
"""


def test_a_run_dir_the_run_left_read_only_is_removed_and_no_link_in_it_is_followed() -> None:
    conftest.require(os.geteuid() == 0, "root, to run the removal as another uid")
    conftest.require(shutil.which("setpriv") is not None, "setpriv (util-linux)")
    pw = pwd.getpwnam("nobody")
    # Not under pytest's tmp_path: root's, which that uid cannot enter.
    base = Path(tempfile.mkdtemp(prefix="agentd-test-", dir=tempfile.gettempdir()))
    try:
        os.chown(base, pw.pw_uid, pw.pw_gid)
        argv = ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--"]
        argv += [sys.executable, "-c", CHILD, str(base)]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        shutil.rmtree(base, ignore_errors=True)  # root's removal: whatever is left
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "0o555", "True"], done.stdout
