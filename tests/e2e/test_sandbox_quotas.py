"""A run and the kernel's per-user quotas it shares with the host's processes of its uid.

A root daemon's run is uid 0 on the host: its inotify instances, its namespaces, its
message queues and its keys were charged to the quota of the host's root (the kernel's
counts are per user, and hierarchical across user namespaces), so one run could take
all 128 of root's inotify instances (the daemon's ``cgroup.events`` watches, systemd's)
or fill root's key quota. Now the runner lowers its own user namespace's limits and its
rlimits, mounts its devpts with a ``max=``, and a seccomp filter refuses the key calls
(``subagent/_quotas.py``, ``subagent/_seccomp.py``). Small numbers only: each count the
probe tries is a few past the run's cap and far below the host's limit.

The daemon runs in-process (``tests/e2e/test_sandbox.py``'s fixture), its runners cold
and forked from a zygote's spare (the limits are set in the spare's half).
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from subagent import _quotas
from tests import conftest
from tests.e2e.sandbox_daemon import lines, sandboxed_daemon
from tests.e2e.test_sandbox import CHILDREN, SCENARIO_S, Daemon, command, outputs, scripted
from tests.e2e.test_sandbox import landlock as landlock  # noqa: F401 - the fixture
from tests.supervisor.test_zygote_spare import spare_ready

PROBE = str(CHILDREN / "quota_probe.py")
# What the probe tries: a few past each cap, far below the host's limit (root's 128 inotify
# instances, 819200 bytes of message queues, 3072 ptys for all devpts instances but the
# host's, ~96k namespaces of each kind).
TRY_INOTIFY = _quotas.INOTIFY_INSTANCES + 8
TRY_QUEUES = 32  # of ~8.2 KiB each: ~270 KiB
TRY_PTYS = _quotas.PTYS + 16
TRY_UTS = _quotas.NAMESPACES + 8


@pytest.fixture(params=["off", "auto"])
async def daemon(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Daemon]:
    async with sandboxed_daemon(tmp_path, monkeypatch, request.param) as d:
        yield d


async def _probe(daemon: Daemon) -> tuple[dict[str, str], str, dict[str, Any]]:
    argv = f"{sys.executable} {PROBE} {TRY_INOTIFY} {TRY_QUEUES} {TRY_PTYS} {TRY_UTS}"
    with trio.fail_after(SCENARIO_S):
        r = await daemon.m.spawn(scripted([command(argv)]))
        st = await daemon.m.wait_terminal(r["run_id"])
    (out,) = outputs(st)
    return lines(out), out, st


async def test_a_run_takes_no_more_than_its_share_of_its_uids_kernel_quotas(daemon: Daemon) -> None:
    seen, out, st = await _probe(daemon)
    sandbox = st["sandbox"]
    assert "problems" not in sandbox, sandbox
    # inotify: the run's own user namespace allows it INOTIFY_INSTANCES, not root's 128,
    # and none of its processes can raise that (no CAP_SYS_RESOURCE there; /proc/sys is
    # read-only to it).
    assert seen.get("inotify_opened") == str(_quotas.INOTIFY_INSTANCES), out
    assert seen.get("inotify_errno") == "EMFILE", out
    assert seen.get("inotify_max_seen") == str(_quotas.INOTIFY_INSTANCES), out
    assert seen.get("inotify_raise") not in (None, "0"), out
    # Keys: refused, as by a kernel without them; root's key count (the run's line of
    # /proc/key-users is the host's root's) did not move.
    assert seen.get("add_key_errno") == seen.get("keyctl_errno") == "ENOSYS", out
    assert seen.get("keys_before") == seen.get("keys_after"), out
    # POSIX message queues: the run's RLIMIT_MSGQUEUE, which it cannot raise.
    assert seen.get("mq_limit") == str(_quotas.MSGQUEUE_BYTES), out
    assert seen.get("mq_errno") == "EMFILE", out
    assert 0 < int(seen.get("mq_made", "0")) <= _quotas.MSGQUEUE_BYTES // 8192 < TRY_QUEUES, out
    assert seen.get("mq_raise") == "EPERM", out
    assert seen.get("sigpending_limit") == str(_quotas.SIGPENDING), out
    # Terminals: its devpts holds PTYS (the ones the kernel keeps for the host's aside).
    assert seen.get("ptys_opened") == str(_quotas.PTYS), out
    assert seen.get("ptys_errno") == "ENOSPC", out
    # Namespaces it makes (in a user namespace of its own, inside the run's): at the cap.
    assert seen.get("uts_made") == str(_quotas.NAMESPACES), out
    assert seen.get("uts_errno") == "ENOSPC", out
    # What status says.
    assert {
        "add_key",
        "request_key",
        "keyctl",
        "clone3",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
    } <= set(sandbox["denied_syscalls"]), sandbox
    quotas = sandbox["quotas"]
    assert quotas["max_inotify_instances"] == _quotas.INOTIFY_INSTANCES, quotas
    assert quotas["RLIMIT_MSGQUEUE"] == _quotas.MSGQUEUE_BYTES, quotas
    assert quotas["ptys"] == _quotas.PTYS, quotas
    if daemon.config.zygote != "off":
        zygote = (await daemon.m.summary())["zygote"]
        assert zygote["spares"]["used"] == 1 and zygote["cold_fallbacks"] == 0, zygote


async def test_the_cap_is_each_runs_own(daemon: Daemon) -> None:
    """Two runs one after the other each get the whole cap: what a run held is given back
    when it ends (nothing of it survives), and one run's share is not another's."""
    conftest.require(os.path.exists("/proc/sys/user/max_inotify_instances"), "per-user-namespace limits")
    for _ in range(2):
        if daemon.config.zygote != "off":
            await spare_ready(daemon.m)
        seen, out, _st = await _probe(daemon)
        assert seen.get("inotify_opened") == str(_quotas.INOTIFY_INSTANCES), out
        assert seen.get("uts_made") == str(_quotas.NAMESPACES), out
