"""Two daemons, one in a PID namespace of its own: neither removes the other's cgroup subtree.

A daemon used to decide that another daemon's ``agentd-<pid>`` subtree was stale when
that pid did not run in *its* PID namespace, and two daemons that were both pid 1 of
their namespaces shared a name. Now every subtree has a unique name and its owner holds a
flock on it, which holds across namespaces. Real daemons; the namespaced one runs under
``unshare --pid --fork --mount-proc`` (root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import trio

from supervisor.trees import _cgroupfs
from tests.conftest import require
from tests.supervisor.real_daemon import Client, Daemon, real_daemon

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
WAIT_S = 20.0


def can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run([*UNSHARE, "true"], capture_output=True)
    return done.returncode == 0


async def subtree(c: Client) -> Path:
    summary = (await c.ok("status"))["summary"]
    assert summary["containment"] == "cgroup", summary
    return Path(summary["cgroup_subtree"])


async def runs_in_its_cgroup(c: Client, root: Path) -> None:
    import json

    run_id = (await c.ok("spawn", spec={"task": json.dumps({"wait": False})}))["run_id"]
    assert (await c.wait_end(run_id, WAIT_S))["state"] == "completed"
    st = await c.ok("status", run_id=run_id)
    assert st["containment"] == "cgroup" and Path(st["cgroup"]).parent == root, st


async def stop_inner(d: Daemon) -> None:
    """SIGTERM the namespaced daemon itself (not unshare), and wait for both to end."""
    children = Path(f"/proc/{d.pid}/task/{d.pid}/children").read_text().split()
    assert len(children) == 1, children
    os.kill(int(children[0]), signal.SIGTERM)
    with trio.fail_after(WAIT_S):
        await d.proc.wait()


async def test_two_daemons_one_in_its_own_pid_namespace_never_remove_each_others_subtree(tmp_path: Path) -> None:
    require(can_unshare(), "root and unshare --pid")
    own = _cgroupfs.own_cgroup_dir()
    require(own is not None and os.access(own, os.W_OK), "a writable cgroup2 mount")
    with trio.fail_after(90):
        async with real_daemon(tmp_path / "a") as a, a.connect() as ca:
            a_root = await subtree(ca)
            hour_ago = time.time() - 3600
            os.utime(a_root, (hour_ago, hour_ago))  # however old it looks
            async with real_daemon(tmp_path / "b", argv_prefix=UNSHARE) as b:
                async with b.connect() as cb:
                    assert b.info["pid"] == 1  # pid 1 of its namespace; a's pid means nothing there
                    b_root = await subtree(cb)
                    async with real_daemon(tmp_path / "b2", argv_prefix=UNSHARE) as b2:
                        async with b2.connect() as cb2:
                            assert b2.info["pid"] == 1
                            b2_root = await subtree(cb2)
                            assert len({a_root, b_root, b2_root}) == 3  # two pid 1s, two names
                            assert a_root.is_dir() and b_root.is_dir() and b2_root.is_dir()
                            for c, root in ((ca, a_root), (cb, b_root), (cb2, b2_root)):
                                await runs_in_its_cgroup(c, root)
                        await stop_inner(b2)
                    assert not b2_root.exists()  # its owner removed it on the way out
                    async with real_daemon(tmp_path / "c"):  # and one more outside, after both
                        assert a_root.is_dir() and b_root.is_dir()
                    await runs_in_its_cgroup(ca, a_root)
                    await runs_in_its_cgroup(cb, b_root)
                await stop_inner(b)
            assert a_root.is_dir()
            assert (await ca.ok("status"))["summary"]["containment_problem"] is None
