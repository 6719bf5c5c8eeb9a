"""Per-run memory and pids limits under the real unit (cgroup v2 only, ``Delegate=yes``).

The daemon runs as agentd.service (installed by scripts/install-systemd) with
``run_memory_max_mib`` 64 and ``run_pids_max`` 40. It moves itself out of the unit's
cgroup into its leaf ``supervisor/`` beside its runs' subtree (``trees/_placement.py``),
so the kernel lets ``+memory`` be enabled for the runs; checked here under systemd 252:
where the daemon is, where its runs are, that the unit's cgroup holds no process, that
``status`` shows the limits, and that a daemon killed with SIGKILL is started again by
systemd into its leaf again. Where the unit's cgroup offers the memory and pids
controllers (a pure cgroup v2 host), a run that allocates past its limit is OOM-killed
inside itself while another run completes, a runner killed so ends ``failed`` /
``memory_limit``, and a run that forks past its limit gets EAGAIN. A hybrid host (this
one: memory and pids are bound to its v1 hierarchies, so the container's cgroup v2 has
neither) skips those three and says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.systemd.agentd_support import CLIENT, STATE_DIR, UNIT, cli, install, poll, require_daemon, stop_and_check
from tests.systemd.container import CHECKOUT, Container, python_in_container
from tests.systemd.test_sandbox import daemon_pid, gated, open_gate, outputs, spawn, wait_end

pytestmark = pytest.mark.systemd

UNIT_CG = "/sys/fs/cgroup/system.slice/agentd.service"
LEAF = f"{UNIT_CG}/supervisor"
LIMIT_MIB = 64
PIDS_MAX = 40
ALLOC = CHECKOUT / "tests" / "children" / "allocate.py"
FORKER = CHECKOUT / "tests" / "children" / "fork_until_refused.py"
DROP_IN = f"/run/systemd/system/{UNIT}.d/50-limits.conf"


@pytest.fixture(scope="module")
def agentd(container: Container) -> Iterator[Container]:
    require_daemon()
    install(container)
    container.write(
        DROP_IN,
        f"[Service]\nEnvironment=AGENTD_RUN_MEMORY_MAX_MIB={LIMIT_MIB} AGENTD_RUN_PIDS_MAX={PIDS_MAX}\n",
    )
    container.systemctl("daemon-reload")
    container.systemctl("start", UNIT, timeout_s=60)
    yield container
    stop_and_check(container)
    container.systemctl("reset-failed", UNIT, check=False)
    container.run(["rm", "-f", DROP_IN])


def cgroup_of(c: Container, pid: int | str) -> str:
    line = next(x for x in c.run(["cat", f"/proc/{pid}/cgroup"]).stdout.splitlines() if x.startswith("0::"))
    return "/sys/fs/cgroup" + line[3:]


def offered(c: Container) -> set[str]:
    return set(c.run(["cat", f"{UNIT_CG}/cgroup.controllers"]).stdout.split())


def need(c: Container, controller: str) -> None:
    if controller not in offered(c):
        pytest.skip(
            f"the unit's cgroup v2 offers no {controller} controller here (a hybrid host binds it to its "
            "cgroup v1 hierarchy, so no container on it can have it in v2)"
        )


def summary(c: Container) -> dict[str, Any]:
    return dict(cli(c, "status")["summary"])


def test_the_daemon_sits_in_its_leaf_beside_its_runs_and_status_shows_the_limits(agentd: Container) -> None:
    c = agentd
    pid = daemon_pid(c)
    assert cgroup_of(c, pid) == LEAF
    assert c.run(["cat", f"{UNIT_CG}/cgroup.procs"]).stdout.split() == []  # an inner node now
    s = summary(c)
    assert s["daemon_cgroup"] == LEAF
    subtree = s["cgroup_subtree"]
    assert re.fullmatch(rf"{UNIT_CG}/agentd-\d+-[0-9a-f]+", subtree), subtree
    here = offered(c)
    assert s["memory_limit"]["max_mib"] == LIMIT_MIB and s["pids_limit"]["max"] == PIDS_MAX, s
    assert s["memory_limit"]["mode"] == ("v2" if "memory" in here else None), (s, here)
    assert s["pids_limit"]["mode"] == ("v2" if "pids" in here else None), (s, here)
    run_id, run_dir = gated(c)
    st = cli(c, "status", run_id)
    tree = cgroup_of(c, st["pid"])
    assert tree == f"{subtree}/{st['tree_id']}", tree
    zygote = s["zygote"].get("pid")
    if zygote:  # forked by the daemon after its move: in the leaf too, not among the runs
        assert cgroup_of(c, zygote) == LEAF
    if "memory" in here:
        assert c.run(["cat", f"{tree}/memory.max"]).stdout.strip() == str(LIMIT_MIB << 20)
    if "pids" in here:
        assert c.run(["cat", f"{tree}/pids.max"]).stdout.strip() == str(PIDS_MAX)
    assert open_gate(c, run_id, run_dir)["state"] == "completed"


def _alloc(mib: int, gate: str = "") -> str:
    wait = f" --wait-before {gate}" if gate else ""
    return f"{python_in_container()} {ALLOC} {mib}{wait}; echo exit=$?"


def test_a_run_allocating_past_its_limit_is_oom_killed_inside_it_while_another_completes(agentd: Container) -> None:
    c = agentd
    need(c, "memory")
    pid = daemon_pid(c)
    other_id, other_dir = gated(c)
    run_id = spawn(c, {"task": "hog", **_script([_alloc(384)])})
    st = wait_end(c, run_id)
    other = open_gate(c, other_id, other_dir)
    assert st["state"] == "completed", st  # the command was killed, the run went on
    (out,) = outputs(st)
    assert "exit=137" in out, out  # SIGKILL, by the kernel, inside the run
    memory = st["receipt"]["memory"]
    assert memory["max"] == LIMIT_MIB << 20 and memory["oom_kills"] >= 1, memory
    assert other["state"] == "completed" and daemon_pid(c) == pid
    assert other["receipt"]["memory"]["oom_kills"] == 0


def test_a_runner_the_oom_killer_kills_ends_failed_memory_limit(agentd: Container) -> None:
    c = agentd
    need(c, "memory")
    run_id = spawn(c, {"task": "hog", **_script([_alloc(384, "go")])})
    st = poll("the runner's command to start",
              lambda: (s := cli(c, "status", run_id)).get("run_dir") and s.get("tool_calls") and s,
              timeout_s=60)  # fmt: skip
    c.sh(f"echo 1000 >/proc/{st['pid']}/oom_score_adj")  # the runner: the OOM killer's first choice
    c.run(["touch", f"{st['run_dir']}/go"])
    end = wait_end(c, run_id)
    assert (end["state"], end["reason"]) == ("failed", "memory_limit"), end
    assert end["receipt"]["memory"]["oom_kills"] >= 1, end["receipt"]


def test_a_run_forking_past_its_limit_gets_eagain_while_another_is_fine(agentd: Container) -> None:
    c = agentd
    need(c, "pids")
    other_id, other_dir = gated(c)
    run_id = spawn(c, {"task": "fork", **_script([f"{python_in_container()} {FORKER} 500"])})
    st = wait_end(c, run_id)
    other = open_gate(c, other_id, other_dir)
    (out,) = outputs(st)
    assert st["state"] == "completed" and "errno 11" in out, (st["state"], out)  # EAGAIN
    assert st["receipt"]["pids"]["hit"] >= 1 and st["receipt"]["pids"]["max"] == PIDS_MAX, st["receipt"]
    assert other["state"] == "completed"


def test_a_daemon_killed_is_started_again_into_its_leaf_and_its_runs_have_their_limits(agentd: Container) -> None:
    # KillMode=mixed: systemd kills what the dead daemon left (its runs end `lost`) and
    # starts it again in a fresh unit cgroup; the new daemon moves into its leaf again.
    c = agentd
    first = daemon_pid(c)
    before = int(c.show(UNIT, "NRestarts")["NRestarts"])
    run_id, _run_dir = gated(c)
    old_subtree = summary(c)["cgroup_subtree"]
    c.run(["kill", "-KILL", str(first)])
    s = poll(
        "the restart",
        lambda: (
            (s := c.show(UNIT, "NRestarts", "ActiveState", "MainPID"))["NRestarts"] == str(before + 1)
            and s["ActiveState"] == "active"
            and s
        ),
        timeout_s=60,
        every_s=0.2,
    )
    second = int(s["MainPID"])
    assert second != first and cgroup_of(c, second) == LEAF
    assert c.run(["test", "-e", old_subtree], check=False).returncode != 0  # systemd removed it
    assert poll("the run's end", lambda: (r := cli(c, "status", run_id))["state"] != "running" and r)["state"] == "lost"
    new_id, new_dir = gated(c)
    st = cli(c, "status", new_id)
    tree = cgroup_of(c, st["pid"])
    assert tree.startswith(summary(c)["cgroup_subtree"] + "/"), tree
    if "memory" in offered(c):
        assert c.run(["cat", f"{tree}/memory.max"]).stdout.strip() == str(LIMIT_MIB << 20)
    assert open_gate(c, new_id, new_dir)["state"] == "completed"
    assert json.loads(c.run([python_in_container(), CLIENT, "run", STATE_DIR, run_id]).stdout)["state"] == "lost"


def _script(commands: list[str]) -> dict[str, Any]:
    turns = [{"tool_calls": [{"name": "run_command", "arguments": {"command": cmd}}]} for cmd in commands]
    return {"model": {"provider": "scripted", "script": {"turns": turns, "final": "done"}}}
