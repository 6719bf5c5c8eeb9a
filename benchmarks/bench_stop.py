"""Stop latency and completeness: cancel -> terminal state, cancel -> whole tree dead.

Scenarios (the daemon runs in this process, ``serve``):
  a  a real runner whose model is mid-stream (``subagent.model.fake_openai`` holds the stream
     open; provider openai, OPENAI_API_KEY=x, base_url of the fake)
  b  stop inside a running command: a real runner inside ``run_command`` (``echo started;
     sleep 300``; interrupted by the stop, its default policy)
  m  stop inside a read-only MCP call: a real runner inside ``read_slowly``
     (``readOnlyHint``) of ``tests/children/mcp_stop_server.py``: abandoned, with
     notifications/cancelled
  c  a runner that ignores SIGTERM (``tests/children/fake_runner.py``), grace 2 s: the
     effective grace and how far past it the tree is dead
  d  a real runner whose ``run_command`` starts ``tests/children/tree_escapers.py``
     (a grandchild in the group, a setsid() one, a double-forked daemon)
  d2 a stand-in runner that itself forks the same kinds of escapers
     (``fake_runner.py`` with ``tree``) and exits on SIGTERM: only the daemon's sweep
     can find them
Baseline for each, in the same run: the same tree started with ``Popen`` (new session)
and stopped with ``killpg``: SIGTERM, wait up to the same grace for the leader, SIGKILL
the group, then watch the tree for 1 s; what still runs is a survivor.

"tree dead" is observed here by polling every member (found by its marker before the
cancel) every 2 ms; the daemon's own figure (``receipt.cancel_to_tree_dead_s``) is shown
beside it. For b and m, "tool dead" is the running tool's own process group (the
command's, or the MCP server's) polled the same way, and "beyond the tool's death" is how
much later the whole tree was dead (target: p50 under 100 ms, 0 survivors).

    .venv/bin/python benchmarks/bench_stop.py [--quick] [--reps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from benchmarks._common import (  # noqa: E402
    CHILDREN,
    PY,
    TREE_VAR,
    PidId,
    alive,
    final_sweep,
    header,
    install_mark,
    kill_all,
    line,
    machine,
    pids_with,
    remove_run_dir,
    row,
    summary,
    wait_dead,
    write_json,
)
from benchmarks._daemon import in_process_daemon, quiet_logs, scripted_spec, show_warnings, wait_event  # noqa: E402
from subagent.model.fake_openai import FakeOpenAI  # noqa: E402

FAKE_RUNNER = [PY, str(CHILDREN / "fake_runner.py")]
STOP_SERVER = str(CHILDREN / "mcp_stop_server.py")
LONG_COMMAND = "echo started; sleep 300"  # (b): a stop interrupts it
COMMAND_S = 2.0  # (d): the command's own duration
CANCEL_INTO_S = 0.5  # (d): how far into the command the cancel comes
# (d): the escapers' leader exits at once; its setsid/double-forked descendants stay; the
# command itself goes on for COMMAND_S (its own step), and is let finish by the stop.
ESCAPERS = f"{PY} {CHILDREN / 'tree_escapers.py'} --exit-leader; sleep {COMMAND_S:g}"
HANG_SCRIPT = {"turns": [{"text": "Let me think about this for a long while", "hang": True}]}


class Watcher(threading.Thread):
    """Polls a fixed set of processes from a start mark until none runs (or timeout)."""

    def __init__(self, procs: list[PidId], timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.procs = procs
        self.timeout_s = timeout_s
        self.t0 = 0.0
        self.dead_after: float | None = None
        self.left: list[PidId] = []
        self.go = threading.Event()

    def start_at(self, t0: float) -> None:
        self.t0 = t0
        self.go.set()

    def run(self) -> None:
        self.go.wait()
        took, self.left = wait_dead(self.procs, self.timeout_s)
        if took is not None:
            self.dead_after = time.perf_counter() - self.t0


async def stable_members(var: str, value: str, at_least: int, timeout_s: float = 20.0) -> list[PidId]:
    """Members of a tree once at least ``at_least`` run and the set stopped growing."""
    last: list[PidId] = []
    with trio.move_on_after(timeout_s):
        while True:
            now = await trio.to_thread.run_sync(lambda: pids_with(var, value))
            if len(now) >= at_least and {p.pid for p in now} == {p.pid for p in last}:
                return now
            last = now
            await trio.sleep(0.1)
    return last


# ----------------------------------------------------------------------------- agentd


async def daemon_stop(
    m: Any,
    spec: dict[str, Any],
    ready: Callable[[Any, str], Any],
    *,
    members_at_least: int = 1,
) -> dict[str, Any]:
    r = await m.spawn(spec)
    run_id = r["run_id"]
    extra = await ready(m, run_id) or {}
    st0 = await m.status(run_id)
    tree_id = st0["tree_id"]
    members = await stable_members("AGENTD_TREE", tree_id, members_at_least)
    w = Watcher(members, timeout_s=30)
    w.start()
    tool = extra.get("tool_pgid")
    tw = Watcher([p for p in members if _pgid(p.pid) == tool], timeout_s=30) if tool else None
    if tw is not None:
        tw.start()
    t0 = time.perf_counter()
    cancel_wall = time.time()
    w.start_at(t0)
    if tw is not None:
        tw.start_at(t0)
    await m.cancel(run_id)
    st = await m.wait_terminal(run_id)
    t_term = time.perf_counter() - t0
    await trio.to_thread.run_sync(w.join, 35)
    if tw is not None:
        await trio.to_thread.run_sync(tw.join, 35)
        extra["cancel_to_tool_dead"] = tw.dead_after
        if tw.dead_after is not None and w.dead_after is not None:
            extra["beyond_tool"] = w.dead_after - tw.dead_after
    survivors = await trio.to_thread.run_sync(lambda: pids_with("AGENTD_TREE", tree_id))
    kill_all(survivors)
    receipt = st.get("receipt") or {}
    pb = receipt.get("path_b") or {}
    calls = (st.get("result") or {}).get("tool_calls") or []
    return {
        "state": str(st["state"]),
        "partial": st.get("partial"),
        "members": len(members),
        "cancel_to_terminal": t_term,
        "cancel_to_tree_dead": w.dead_after,
        "receipt_cancel_to_tree_dead": receipt.get("cancel_to_tree_dead_s"),
        "waited_s": pb.get("waited_s"),
        "escalated": pb.get("escalated"),
        "receipt_survivors": pb.get("survivors"),
        "survivors": [p.pid for p in survivors] + [p.pid for p in w.left if alive(p)],
        "tool_states": [c.get("state") for c in calls],
        "tool_summary": receipt.get("tool_summary"),
        "cancel_wall": cancel_wall,
        **extra,
    }


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# ----------------------------------------------------------------------------- baseline


class Bare:
    """A tree started with Popen in a new session; its stderr events read by a thread."""

    def __init__(self, argv: list[str], stdin_text: str, env_extra: dict[str, str] | None = None) -> None:
        self.tree = uuid.uuid4().hex
        self.dir = tempfile.mkdtemp(prefix="agentd-bench-stop-")
        # AGENTD_TREE too: a runner passes it (not TREE_VAR) on to its tools' allowlisted env.
        env = dict(
            os.environ,
            AGENTD_RUN_DIR=self.dir,
            TMPDIR=self.dir,
            AGENTD_TREE=self.tree,
            **{TREE_VAR: self.tree},
            **(env_extra or {}),
        )
        self.p = subprocess.Popen(
            argv,
            cwd=self.dir,
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert self.p.stdin is not None
        self.p.stdin.write(stdin_text.encode())
        self.p.stdin.close()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for raw in self.p.stderr:
            try:
                self.events.put(json.loads(raw))
            except ValueError:
                pass

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 30) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if pred(ev):
                return ev
        return None

    def members(self) -> list[PidId]:
        found = {p.pid: p for p in pids_with(TREE_VAR, self.tree) + pids_with("AGENTD_TREE", self.tree)}
        return list(found.values())

    def killpg_stop(self, grace_s: float, tool_pgid: int | None = None) -> dict[str, Any]:
        members = self.members()
        tool = Watcher([p for p in members if _pgid(p.pid) == tool_pgid], timeout_s=grace_s + 5) if tool_pgid else None
        t0 = time.perf_counter()
        if tool is not None:
            tool.start()
            tool.start_at(t0)
        os.killpg(self.p.pid, signal.SIGTERM)
        escalated = False
        try:
            self.p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            escalated = True
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.p.wait()
        leader_exit = time.perf_counter() - t0
        waited = leader_exit
        took, left = wait_dead(members, timeout_s=1.0)
        dead = None if took is None else leader_exit + took
        out = {
            "members": len(members),
            "leader_exit": leader_exit,
            "cancel_to_tree_dead": dead,
            "escalated": escalated,
            "waited_s": waited if escalated else None,
            "survivors": [p.pid for p in left],
        }
        if tool is not None:
            tool.join(grace_s + 6)
            out["cancel_to_tool_dead"] = tool.dead_after
            if tool.dead_after is not None and dead is not None:
                out["beyond_tool"] = dead - tool.dead_after
        kill_all(left + self.members())
        remove_run_dir(self.dir)
        return out


def _ev(kind: str, pred: Callable[[dict[str, Any]], bool] | None = None) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("event") == kind and (pred is None or pred(e))


def _running_call(e: dict[str, Any]) -> bool:
    return (e.get("record") or {}).get("state") == "running"


# ----------------------------------------------------------------------------- scenarios


def report(
    label: str, d: list[dict[str, Any]], b: list[dict[str, Any]], *, grace: float | None = None
) -> dict[str, Any]:
    def col(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    header(label)
    line(row("agentd: cancel -> terminal state", summary(col(d, "cancel_to_terminal"))))
    line(row("agentd: cancel -> tree dead (observed)", summary(col(d, "cancel_to_tree_dead"))))
    line(row("agentd: cancel -> tree dead (daemon's receipt)", summary(col(d, "receipt_cancel_to_tree_dead"))))
    if any(r.get("cancel_to_tool_dead") is not None for r in d):
        line(row("agentd: cancel -> the tool's group dead", summary(col(d, "cancel_to_tool_dead"))))
        line(row("agentd: tree dead beyond the tool's death", summary(col(d, "beyond_tool")), "(target p50 < 100 ms)"))
    if any(r.get("own_step_left") is not None for r in d):
        line(row("agentd: the command's own time left at cancel", summary(col(d, "own_step_left"))))
        line(row("agentd: tree dead beyond the command's own step", summary(col(d, "beyond_own_step"))))
    if grace is not None:
        line(row("agentd: effective grace (receipt waited_s)", summary(col(d, "waited_s"))))
        line(
            row(
                f"agentd: tree dead beyond the grace ({grace:g} s)",
                summary([x - grace for x in col(d, "cancel_to_tree_dead")]),
            )
        )
    line(row("baseline killpg: leader exited", summary(col(b, "leader_exit"))))
    line(
        row(
            "baseline killpg: tree dead",
            summary(col(b, "cancel_to_tree_dead")),
            f"({sum(1 for r in b if r['survivors'])}/{len(b)} reps never fully dead)",
        )
    )
    if any(r.get("cancel_to_tool_dead") is not None for r in b):
        line(row("baseline killpg: the tool's group dead", summary(col(b, "cancel_to_tool_dead"))))
        line(row("baseline killpg: tree dead beyond the tool's death", summary(col(b, "beyond_tool"))))
    if grace is not None:
        line(row("baseline killpg: effective grace", summary(col(b, "waited_s"))))
    states = sorted({r["state"] for r in d})
    tools = sorted({s for r in d for s in r.get("tool_states", [])})
    line(
        f"  agentd: terminal states {states}, partial {sorted({bool(r.get('partial')) for r in d})}, "
        f"tool calls {tools or '-'}, members per tree {sorted({r['members'] for r in d})}"
    )
    summaries = sorted({r["tool_summary"] for r in d if r.get("tool_summary")})
    if summaries:
        line(f"  agentd receipts: {summaries[:3]}")
    line(
        f"  survivors: agentd {sum(len(r['survivors']) for r in d)} over {len(d)} reps; "
        f"baseline killpg {sum(len(r['survivors']) for r in b)} over {len(b)} reps "
        f"(members per tree {sorted({r['members'] for r in b})})"
    )
    return {"agentd": d, "baseline": b, "warnings": show_warnings(line)}


async def scenario_a(m: Any, reps: int, fake: FakeOpenAI, grace: float) -> dict[str, Any]:
    spec = {
        "task": "benchmark",
        "model": {"provider": "openai", "name": "fake-model", "base_url": fake.base_url},
        "builtin_tools": [],
    }

    def n_hanging() -> int:
        return sum(1 for r in fake.chat_requests if r.hanging)

    async def ready(m: Any, run_id: str) -> None:
        before = n_hanging_box[0]
        with trio.fail_after(60):
            while n_hanging() <= before:
                await trio.sleep(0.01)
        n_hanging_box[0] = n_hanging()

    n_hanging_box = [n_hanging()]
    d, b = [], []
    for _ in range(reps):
        d.append(await daemon_stop(m, spec, ready))

        def base() -> dict[str, Any]:
            before = n_hanging()
            x = Bare([PY, "-m", "subagent.runner"], json.dumps(spec) + "\n")
            deadline = time.monotonic() + 60
            while n_hanging() <= before and time.monotonic() < deadline:
                time.sleep(0.01)
            return x.killpg_stop(grace)

        b.append(await trio.to_thread.run_sync(base))
        n_hanging_box[0] = n_hanging()
    closed = sum(1 for r in fake.chat_requests if r.client_closed)
    out = report("(a) model mid-stream (openai provider, fake server hangs the stream)", d, b)
    line(f"  fake server: {closed}/{len(fake.chat_requests)} streams closed by the client before their end")
    return out


def _group_of(ev: dict[str, Any] | None) -> int | None:
    return (ev or {}).get("data", {}).get("pgid") if ev and "data" in ev else (ev or {}).get("pgid")


def _sleeping(pgid: int) -> bool:
    """The command's shell runs ``sleep``: its ``echo started`` is written."""
    try:
        with open(f"/proc/{pgid}/task/{pgid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return True
    for k in kids:
        try:
            with open(f"/proc/{k}/comm") as f:
                if f.read().strip() == "sleep":
                    return True
        except OSError:
            continue
    return False


async def scenario_b(m: Any, reps: int, grace: float) -> dict[str, Any]:
    spec = scripted_spec([{"tool_calls": [{"name": "run_command", "arguments": {"command": LONG_COMMAND}}]}])

    async def ready(m: Any, run_id: str) -> dict[str, Any]:
        ev = await wait_event(m, run_id, "process_group", pred=lambda e: e["data"].get("alive"), timeout_s=30)
        pgid = _group_of(ev)
        with trio.move_on_after(10):
            while pgid is not None and not _sleeping(pgid):
                await trio.sleep(0.005)
        return {"tool_pgid": pgid}

    d, b = [], []
    for _ in range(reps):
        d.append(await daemon_stop(m, spec, ready, members_at_least=3))

        def base() -> dict[str, Any]:
            x = Bare([PY, "-m", "subagent.runner"], json.dumps(spec) + "\n")
            ev = x.wait_event(_ev("process_group", lambda e: bool(e.get("alive"))))
            pgid = _group_of(ev)
            deadline = time.monotonic() + 10
            while pgid is not None and not _sleeping(pgid) and time.monotonic() < deadline:
                time.sleep(0.005)
            return x.killpg_stop(grace, tool_pgid=pgid)

        b.append(await trio.to_thread.run_sync(base))
    return report(f"(b) stop inside a running command `{LONG_COMMAND}` (interrupted: its default policy)", d, b)


async def scenario_m(m: Any, reps: int, grace: float, tmp: Path) -> dict[str, Any]:
    logs = tmp / "mcp-logs"  # granted to the runs (a run's sandbox reaches only its own dir)
    logs.mkdir(exist_ok=True)

    def spec_for(log: Path) -> dict[str, Any]:
        spec = scripted_spec([{"tool_calls": [{"name": "read_slowly", "arguments": {}}]}])
        spec["mcpServers"] = {"stop": {"command": PY, "args": [STOP_SERVER], "env": {"MCP_STOP_LOG": str(log)}}}
        spec["sandbox"] = {"write": [str(logs)]}
        return spec

    def started(log: Path) -> bool:
        try:
            return "start read_slowly" in log.read_text()
        except OSError:
            return False

    d, b = [], []
    for i in range(reps):
        log = logs / f"mcp-{i}-agentd.log"
        spec = spec_for(log)

        async def ready(m: Any, run_id: str, log: Path = log) -> dict[str, Any]:
            ev = await wait_event(
                m, run_id, "process_group", pred=lambda e: e["data"].get("kind") == "mcp_server", timeout_s=30
            )
            with trio.move_on_after(30):
                while not started(log):
                    await trio.sleep(0.005)
            return {"tool_pgid": _group_of(ev)}

        r = await daemon_stop(m, spec, ready, members_at_least=2)
        r["server_told"] = "notifications/cancelled" in (log.read_text() if log.exists() else "")
        d.append(r)
        blog = logs / f"mcp-{i}-baseline.log"
        bspec = spec_for(blog)

        def base(bspec: dict[str, Any] = bspec, blog: Path = blog) -> dict[str, Any]:
            x = Bare([PY, "-m", "subagent.runner"], json.dumps(bspec) + "\n")
            ev = x.wait_event(_ev("process_group", lambda e: e.get("kind") == "mcp_server"))
            deadline = time.monotonic() + 30
            while not started(blog) and time.monotonic() < deadline:
                time.sleep(0.005)
            return x.killpg_stop(grace, tool_pgid=_group_of(ev))

        b.append(await trio.to_thread.run_sync(base))
    out = report("(m) stop inside a read-only MCP call (`read_slowly`, readOnlyHint: abandoned)", d, b)
    line(f"  the server received notifications/cancelled: {sum(1 for r in d if r.get('server_told'))}/{len(d)} reps")
    return out


async def scenario_c(m: Any, reps: int, grace: float) -> dict[str, Any]:
    spec = {"task": json.dumps({"ignore_term": True, "snapshots": 1})}

    async def ready(m: Any, run_id: str) -> None:
        await wait_event(m, run_id, "step_snapshot", timeout_s=30)

    d, b = [], []
    for _ in range(reps):
        d.append(await daemon_stop(m, spec, ready))

        def base() -> dict[str, Any]:
            x = Bare(FAKE_RUNNER, json.dumps({"run_id": "bench", **spec}) + "\n")
            x.wait_event(_ev("step_snapshot"))
            return x.killpg_stop(grace)

        b.append(await trio.to_thread.run_sync(base))
    return report(f"(c) runner ignores SIGTERM, grace {grace:g} s", d, b, grace=grace)


async def scenario_d(m: Any, reps: int, grace: float) -> dict[str, Any]:
    spec = scripted_spec([{"tool_calls": [{"name": "run_command", "arguments": {"command": ESCAPERS}}]}])

    async def ready(m: Any, run_id: str) -> dict[str, Any]:
        ev = await wait_event(m, run_id, "tool_call", pred=lambda e: _running_call(e["data"]), timeout_s=30)
        started = ((ev or {}).get("data") or {}).get("record", {}).get("started_at") or time.time()
        await trio.sleep(max(0.0, started + CANCEL_INTO_S - time.time()))
        return {"cmd_started_wall": started}

    d, b = [], []
    for _ in range(reps):
        r = await daemon_stop(m, spec, ready, members_at_least=5)
        left = max(0.0, r["cmd_started_wall"] + COMMAND_S - r["cancel_wall"])
        r["own_step_left"] = left
        if r["cancel_to_tree_dead"] is not None:
            r["beyond_own_step"] = r["cancel_to_tree_dead"] - (left if "succeeded" in r["tool_states"] else 0.0)
        d.append(r)

        def base() -> dict[str, Any]:
            x = Bare([PY, "-m", "subagent.runner"], json.dumps(spec) + "\n")
            ev = x.wait_event(_ev("tool_call", _running_call))
            started = (ev or {}).get("record", {}).get("started_at") or time.time()
            deadline = time.monotonic() + 20
            while len(x.members()) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(max(0.0, started + CANCEL_INTO_S - time.time()))
            return x.killpg_stop(grace)

        b.append(await trio.to_thread.run_sync(base))
    return report(
        f"(d) real runner, run_command leaves setsid + double-forked descendants, then `sleep {COMMAND_S:g}`; "
        f"cancelled {CANCEL_INTO_S:g} s in",
        d,
        b,
    )


async def scenario_d2(m: Any, reps: int, grace: float) -> dict[str, Any]:
    spec = {"task": json.dumps({"tree": True})}

    async def ready(m: Any, run_id: str) -> None:
        await wait_event(m, run_id, "log", timeout_s=30)

    d, b = [], []
    for _ in range(reps):
        d.append(await daemon_stop(m, spec, ready, members_at_least=5))

        def base() -> dict[str, Any]:
            x = Bare(FAKE_RUNNER, json.dumps({"run_id": "bench", **spec}) + "\n")
            x.wait_event(_ev("log"))
            deadline = time.monotonic() + 20
            while len(x.members()) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)  # let the descendants reach their setsid()
            return x.killpg_stop(grace)

        b.append(await trio.to_thread.run_sync(base))
    return report("(d2) stand-in runner forks group, setsid and double-forked descendants", d, b)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    reps = args.reps
    with tempfile.TemporaryDirectory(prefix="agentd-bench-stop-") as tmp:
        fake = FakeOpenAI(HANG_SCRIPT).start_in_thread()
        os.environ["OPENAI_API_KEY"] = "x"
        try:
            async with in_process_daemon(Path(tmp) / "real", grace_s=args.grace) as d:
                line(f"\ncontainment: {d['manager'].containment.mode}; grace {args.grace:g} s for a, b, d")
                m = d["manager"]
                out["a"] = await scenario_a(m, reps, fake, args.grace)
                os.environ.pop("OPENAI_API_KEY", None)
                out["b"] = await scenario_b(m, reps, args.grace)
                out["m"] = await scenario_m(m, reps, args.grace, Path(tmp))
                out["d"] = await scenario_d(m, reps, args.grace)
        finally:
            os.environ.pop("OPENAI_API_KEY", None)
            await trio.to_thread.run_sync(fake.stop)
        g = args.stubborn_grace
        async with in_process_daemon(Path(tmp) / "fake", grace_s=g, runner_command=tuple(FAKE_RUNNER)) as d:
            m = d["manager"]
            out["c"] = await scenario_c(m, max(1, min(reps, args.stubborn_reps)), g)
            out["d2"] = await scenario_d2(m, reps, g)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one repetition each (seconds): for the smoke test")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per scenario (default 5)")
    ap.add_argument("--stubborn-reps", type=int, default=3, help="repetitions of (c), 2 s each (default 3)")
    ap.add_argument(
        "--grace", type=float, default=None, help="the daemon's grace for a, b, d (default 10; --quick: 0.5)"
    )
    ap.add_argument(
        "--stubborn-grace", type=float, default=None, help="the grace for c and d2 (default 2; --quick: 0.5)"
    )
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--verbose", action="store_true", help="show the daemon's warnings")
    args = ap.parse_args()
    args.reps = args.reps or (1 if args.quick else 5)
    if args.grace is None:
        args.grace = 0.5 if args.quick else 10.0
    if args.stubborn_grace is None:
        args.stubborn_grace = 0.5 if args.quick else 2.0
    quiet_logs(args.verbose)
    mark = install_mark()
    m = machine()
    line(f"bench_stop on {m['cpus']} x {m['cpu']}, {m['mem_total_gib']} GiB, load {m['loadavg'][0]:.2f}")
    out: dict[str, Any] = {}
    try:
        out = trio.run(main_async, args)
    finally:
        header("cleanup")
        out["survivors_at_exit"] = final_sweep(mark)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
