"""Binding a run's grants back under its private tmpfs, in a mount namespace of a child
(``unshare --mount``, root): what is bound is the descriptor that was checked, and a
read-only grant is read-only all the way down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent

_SWAP_AT_OPEN = r"""
import ctypes, os, sys
from subagent import _isolate
from subagent.sandbox import SandboxError, _refuse_protected

priv, state = sys.argv[1], sys.argv[2]
grant, decoy = f"{priv}/grant", f"{priv}/decoy"  # decoy: a link into the state dir
libc = ctypes.CDLL(None, use_errno=True)
real_open = os.open

def swap_then_open(path, flags, *args):
    # Another run swaps the grant for the link just as the runner opens it to bind it.
    if path == grant:
        assert libc.renameat2(-100, grant.encode(), -100, decoy.encode(), 2) == 0  # RENAME_EXCHANGE
    return real_open(path, flags, *args)

os.open = swap_then_open
try:
    _isolate.private_mounts(tmpfs=[priv], read_only=[], keep=[grant], check=_refuse_protected([state], [grant]))
except SandboxError as exc:
    print("refused:", exc)
else:
    print("bound:", sorted(os.listdir(grant)))
"""

_NESTED_MOUNT = r"""
import os, sys
from subagent import _isolate

priv, grant = sys.argv[1], sys.argv[2]
_isolate.private_mounts(tmpfs=[priv], read_only=[], keep_read_only=[grant])
for target in (f"{grant}/file", f"{grant}/mnt/file"):
    try:
        with open(target, "a") as f:
            f.write("x")
        print(target, "written")
    except OSError as exc:
        print(target, exc.strerror)
"""


def in_a_mount_namespace(program: str, *args: str, first: str | None = None) -> str:
    """``program`` (python) run in a mount namespace of its own; ``first``: a shell
    command run there before it. Its stdout."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a mount namespace of its own)")
    python = [sys.executable, "-c", program, *args]
    argv = python if first is None else ["sh", "-c", f'{first} && exec "$@"', "sh", *python]
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_grant_swapped_for_a_link_into_the_state_dir_as_it_is_bound_is_refused(tmp_path: Path) -> None:
    # It was checked by name, then opened again to be bound: a swap in between bound the
    # daemon's state dir into the run, writable (a probe won 11 runs in 150).
    state = tmp_path / "state"
    state.mkdir()
    (state / "token").write_text("secret")
    priv = tmp_path / "priv"
    (priv / "grant").mkdir(parents=True)
    (priv / "decoy").symlink_to(state)
    out = in_a_mount_namespace(_SWAP_AT_OPEN, str(priv), str(state))
    assert out.startswith("refused:") and "which no run may reach" in out, out


def test_a_mount_inside_a_read_only_grant_is_read_only_too(tmp_path: Path) -> None:
    # One remount made the grant's own mount read-only, not one mounted inside it (a
    # tmpfs at /run/user/UID under a grant of /run/user).
    priv = tmp_path / "priv"
    grant = priv / "grant"
    (grant / "mnt").mkdir(parents=True)
    (grant / "file").write_text("")
    out = in_a_mount_namespace(_NESTED_MOUNT, str(priv), str(grant), first=f"mount -t tmpfs none {grant / 'mnt'}")
    assert out.splitlines() == [
        f"{grant}/file Read-only file system",
        f"{grant}/mnt/file Read-only file system",
    ], out


_FILES = r"""
import errno, os, sys
from subagent import _isolate

a, b, most = sys.argv[1], sys.argv[2], int(sys.argv[3])
done = []
_isolate.shared_tmpfs([a, b], 1, done)
n = 0
try:
    while n < most:  # (unbounded, the kernel's default took minutes and gigabytes)
        open(f"{a}/{n}", "w").close()  # empty: no block of the budget
        n += 1
    print("a", n, "none")
except OSError as exc:
    print("a", n, errno.errorcode[exc.errno])
try:
    open(f"{b}/x", "w").close()
    print("b written")
except OSError as exc:
    print("b", errno.errorcode[exc.errno])
"""


def test_the_private_tmpfs_bounds_its_files_too(tmp_path: Path) -> None:
    # Empty files take none of the size bound but ~1 KiB of kernel memory each: the
    # kernel's default inode count (half the RAM's pages) let a run hold gigabytes there.
    from subagent._isolate import TMPFS_INODES_PER_MIB, TMPFS_MIN_INODES

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    most = max(TMPFS_MIN_INODES, 1 * TMPFS_INODES_PER_MIB)
    out = in_a_mount_namespace(_FILES, str(tmp_path / "a"), str(tmp_path / "b"), str(most + 1000)).split()
    assert out[0] == "a" and out[2] == "ENOSPC" and most - 16 <= int(out[1]) <= most, out
    assert out[3:] == ["b", "ENOSPC"], out  # one count for the dirs together
