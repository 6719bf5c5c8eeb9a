"""The fleet on a local Ray cluster of three nodes: the acceptance of issue 13.

One cluster for the module (starting one costs seconds): a head and a node offering
browser runs, one node without (``browser: 0``), four run slots each. Tests run in file
order; the node-loss test comes late because it takes a node away, and `fleet down`
last because it takes every node's daemon down.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import JOURNAL_FILE
from supervisor.control.client import Client, Unauthorized
from tests.conftest import require
from tests.fleet.cluster import SLOTS_PER_NODE, FleetCluster, alive, trees_of, wait_state


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetCluster]:
    require(importlib.util.find_spec("ray") is not None, "ray (pip install 'agentd[fleet]')")
    fc = FleetCluster.start()
    try:
        yield fc
    finally:
        fc.stop()


@pytest.fixture(autouse=True)
def front(fleet: FleetCluster) -> Iterator[None]:
    fleet.start_front()
    try:
        yield
    finally:
        fleet.stop_front()


def spec(behaviour: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A run for the stand-in runner: ``behaviour`` is what it does (see fake_runner.py)."""
    return {"task": json.dumps(behaviour or {}), **extra}


def test_fleet_up_starts_one_agentd_per_node_pinned_there(fleet: FleetCluster) -> None:
    agents = fleet.agents()
    assert set(agents) == set(fleet.nodes)
    assert len({a["state_dir"] for a in agents.values()}) == 3
    assert len({a["pid"] for a in agents.values()}) == 3
    for node_id, info in agents.items():
        assert info["node_id"] == node_id
        assert info["slots"] == SLOTS_PER_NODE
        assert bool(info["browser"]) == (node_id in fleet.browser_nodes)
        with fleet.node_client(node_id) as c:
            assert c.ping()["pid"] == info["pid"]
    # Idempotent: a second `up` finds the same agents and daemons.
    again = json.loads(
        fleet.cli("--json", "fleet", "up", "--address", fleet.address, "--node-dir", str(fleet.node_dir)).stdout
    )
    assert {n["node_id"]: n["pid"] for n in again["nodes"]} == {k: v["pid"] for k, v in agents.items()}


def wait_terminal(client: Any, run_id: str) -> str:
    """Follow a run through the fleet to its end; its terminal state."""
    follow = client.follow(run_id, after_seq=2**62)
    for _ in follow:
        pass
    assert follow.state is not None
    return follow.state


def test_thirty_runs_land_by_resources_each_in_its_nodes_daemon(fleet: FleetCluster) -> None:
    with fleet.client() as c:
        plain = [c.spawn(spec({"wait": False}))["run_id"] for _ in range(20)]
        browser = [c.spawn(spec({"wait": False}, browser=True))["run_id"] for _ in range(10)]
        assert len(set(plain + browser)) == 30
        for run_id in plain + browser:
            assert wait_terminal(c, run_id) == "completed"
        statuses = {r: c.status(r) for r in plain + browser}
    no_browser = set(fleet.nodes) - fleet.browser_nodes
    assert not [r for r in browser if statuses[r]["node"] in no_browser]
    assert {s["node"] for s in statuses.values()} == set(fleet.nodes)  # all three used
    agents = fleet.agents()
    for st in statuses.values():
        # The run is the node daemon's own: in its journal, under its containment.
        with fleet.node_client(st["node"]) as nc:
            node_row = nc.status(st["node_run_id"])
        assert node_row["state"] == "completed"
        assert node_row["containment"] in ("cgroup", "subreaper+sweep", "group")
        assert node_row["run_dir"].startswith(agents[st["node"]]["state_dir"])
        assert st["containment"] == node_row["containment"]
        assert st["pid"] == node_row["pid"]


FLEET_ONLY = {"id", "run_id", "node", "node_run_id", "node_alive", "lease", "demand", "live"}


def test_cancel_through_the_fleet_keeps_the_nodes_contract_and_every_view_matches_its_journal(
    fleet: FleetCluster,
) -> None:
    with fleet.client() as c:
        run_id = c.spawn(spec({"tree": True, "snapshots": 2}))["run_id"]
        events = []
        for ev in c.follow(run_id):  # until the runner has started its tree and snapshots
            events.append(ev)
            if ev["kind"] == "step_snapshot" and ev["data"]["step"] == 2:
                break
        running = c.status(run_id)
    assert running["state"] == "running" and running["node_alive"] is True
    node_id, node_run_id = running["node"], running["node_run_id"]
    tree_pid = next(int(e["data"]["message"].split()[-1]) for e in events if e["kind"] == "log")
    assert alive(running["pid"]) and alive(tree_pid)

    r = fleet.cli("--fleet", "--json", "cancel", run_id, check=False)
    assert r.returncode == 7, r.stderr  # the run's outcome: cancelled
    reply = json.loads(r.stdout.splitlines()[0])
    assert reply["was_active"] is True and reply["state"] == "cancelled"
    assert not alive(running["pid"]) and not alive(tree_pid)

    status = json.loads(fleet.cli("--fleet", "--json", "status", run_id).stdout)
    with fleet.node_client(node_id) as nc:
        node_row = nc.status(node_run_id)
        node_events = list(nc.iter_events(node_run_id))
    assert status["state"] == "cancelled" and status["reason"] == "user"
    assert status["receipt"]["path_b"]["survivors"] == []
    # The node's own record, through the fleet: receipt, tool calls, containment, all of it.
    assert {k: v for k, v in status.items() if k not in FLEET_ONLY} == {
        k: v for k, v in node_row.items() if k not in FLEET_ONLY
    }
    logs = [json.loads(line) for line in fleet.cli("--fleet", "--json", "logs", run_id).stdout.splitlines()]
    assert [(e["seq"], e["kind"], e["data"]) for e in logs] == [(e["seq"], e["kind"], e["data"]) for e in node_events]
    assert all(e["run_id"] == run_id for e in logs)
    watch = fleet.cli("--fleet", "--json", "watch", run_id, check=False)
    assert watch.returncode == 7  # cancelled
    watched = [json.loads(line) for line in watch.stdout.splitlines()]
    assert [e["seq"] for e in watched[:-1]] == [e["seq"] for e in node_events]
    assert watched[-1] == {"end": True, "run_id": run_id, "state": "cancelled", "last_seq": node_events[-1]["seq"]}
    listed = json.loads(fleet.cli("--fleet", "--json", "list", "--limit", "100").stdout)["runs"]
    row = next(r for r in listed if r["id"] == run_id)
    assert (row["state"], row["node"], row["node_run_id"]) == ("cancelled", node_id, node_run_id)
    again = json.loads(fleet.cli("--fleet", "--json", "cancel", run_id, check=False).stdout.splitlines()[0])
    assert again["was_active"] is False and again["state"] == "cancelled"


UPGRADE = (
    "GET /{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
)
# The front's handshake bound is 5 s (control.Limits.handshake_s): a refusal closed
# before this did not wait for it.
CLOSED_WITHIN_S = 3.0


def _handshake(port: int, query: str = "", extra: str = "") -> tuple[bytes, bool]:
    """Send a websocket upgrade to the front over raw TCP: (its reply, closed by the front).

    A refusal is read to its end; an accepted upgrade only to its status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN_S) as sock:
        sock.sendall(UPGRADE.format(query=query, extra=extra).encode())
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
                if data.startswith(b"HTTP/1.1 101 "):
                    return data, False
        except TimeoutError:
            return data, False
    return data, True


def test_the_front_refuses_a_missing_or_wrong_token_and_a_foreign_origin_and_closes_the_connection(
    fleet: FleetCluster,
) -> None:
    endpoint = json.loads((fleet.front_dir / "daemon.json").read_text())
    port = int(endpoint["url"].rsplit(":", 1)[1].strip("/"))
    token = (fleet.front_dir / "token").read_text().strip()
    bearer = f"Authorization: Bearer {token}\r\n"
    refused = {
        "no token": ("", "", 401),
        "wrong bearer token": ("", "Authorization: Bearer wrong\r\n", 401),
        "wrong ?token=": ("?token=wrong", "", 401),
        "foreign origin": ("", bearer + "Origin: http://evil.example\r\n", 403),
        "foreign origin, ?token=": (f"?token={token}", "Origin: http://evil.example\r\n", 403),
    }
    for what, (query, extra, status) in refused.items():
        reply, closed = _handshake(port, query, extra)
        assert reply.split(b" ", 2)[1] == str(status).encode(), (what, reply)
        assert closed, f"{what}: the front left the refused connection open"
    accepted, closed = _handshake(port, "", bearer)
    assert accepted.startswith(b"HTTP/1.1 101 "), accepted
    with fleet.client() as c:  # the front goes on serving
        assert c.ping()["pid"] == endpoint["pid"]
    with pytest.raises(Unauthorized, match="wrong token"), Client(endpoint["url"], "wrong", timeout_s=30) as bad:
        bad.ping()


def test_steering_through_the_front_reaches_the_runner_on_its_node(fleet: FleetCluster) -> None:
    with fleet.client() as c:
        run_id = c.spawn(spec({"echo_steer": True}))["run_id"]
        wait_state(c, run_id, "running")
        for ev in c.follow(run_id):  # the runner reads its input from here on
            if ev["kind"] == "step_snapshot":
                break
        r = fleet.cli("--fleet", "--json", "steer", run_id, "look at the logs first")
        reply = json.loads(r.stdout)
        assert (reply["run_id"], reply["accepted"]) == (run_id, True), reply
        seen = []
        for ev in c.follow(run_id):
            seen.append((ev["kind"], ev["data"].get("message") or ev["data"].get("text")))
            if ev["kind"] == "log" and ev["data"]["message"].startswith("steered: "):
                break
        assert ("steer_sent", "look at the logs first") in seen
        assert seen[-1] == ("log", "steered: look at the logs first")
        st = c.status(run_id)
        c.cancel(run_id)
        assert wait_terminal(c, run_id) == "cancelled"
        late = fleet.cli("--fleet", "--json", "steer", run_id, "too late", check=False)
    assert late.returncode == 5  # refused
    assert json.loads(late.stdout) == {
        "run_id": run_id,
        "accepted": False,
        "state": "cancelled",
        "why": "the run has ended",
    }
    with fleet.node_client(st["node"]) as nc:  # on its node, as its own daemon journaled it
        node_events = [e for e in nc.iter_events(st["node_run_id"]) if e["kind"] in ("steer_sent", "log")]
    assert ("steer_sent", {"text": "look at the logs first"}) in [(e["kind"], e["data"]) for e in node_events]


def _node_run_count(fleet: FleetCluster) -> int:
    total = 0
    for node_id in fleet.agents():
        with fleet.node_client(node_id) as nc:
            total += len(nc.list_runs(limit=1000))
    return total


def test_a_full_fleet_queues_in_ray_and_a_run_cancelled_while_queued_never_starts(fleet: FleetCluster) -> None:
    slots = SLOTS_PER_NODE * len(fleet.agents())
    with fleet.client() as c:
        holding = [c.spawn(spec())["run_id"] for _ in range(slots)]
        for run_id in holding:
            wait_state(c, run_id, "running")
        on_nodes = _node_run_count(fleet)

        queued = c.spawn(spec())["run_id"]
        st = c.status(queued)
        assert (st["state"], st["node"], st["node_run_id"]) == ("queued", None, None)
        reply = c.cancel(queued)
        assert reply["was_active"] is True
        assert wait_terminal(c, queued) == "cancelled"
        st = c.status(queued)
        assert st["node"] is None and st["node_run_id"] is None
        assert "never started" in json.dumps(c.events(queued))
        assert _node_run_count(fleet) == on_nodes  # it never reached a node

        waiting = c.spawn(spec())["run_id"]
        assert c.status(waiting)["state"] == "queued"
        freed = c.status(holding[0])["node"]
        assert c.cancel(holding[0])["was_active"] is True
        started = wait_state(c, waiting, "running")
        assert started["node"] == freed  # the only node with a free slot
        out = c.cancel_many(holding + [waiting])  # (a session has one live turn: not a group)
        assert sorted(r["run_id"] for r in out["runs"] if r["was_active"]) == sorted(holding[1:] + [waiting])
        for run_id in holding + [waiting]:
            assert wait_terminal(c, run_id) == "cancelled"


def test_the_front_killed_and_restarted_loses_nothing_and_writes_no_second_terminal_fact(fleet: FleetCluster) -> None:
    from supervisor.fleet._index import Index
    from supervisor.fleet._serve import INDEX_FILE

    slots = SLOTS_PER_NODE * len(fleet.agents())
    with fleet.client() as c:
        done = c.spawn(spec({"wait": False}))["run_id"]
        assert wait_terminal(c, done) == "completed"
        live = [c.spawn(spec())["run_id"] for _ in range(slots)]
        for run_id in live:
            wait_state(c, run_id, "running")
        queued = c.spawn(spec())["run_id"]
        placed = {r: c.status(r) for r in live}
    fleet.kill_front()
    # A front killed between a run's terminal fact and freeing its lease left the lease:
    # the next front frees it (it held a slot for good).
    from ray.util.placement_group import placement_group, placement_group_table

    from supervisor.fleet._front import LEASE_PREFIX

    left = placement_group([{"CPU": 0.01}], name=LEASE_PREFIX + done, lifetime="detached")

    # While no front watches: one run ends on its node (a stop sent there directly).
    ended = live[0]
    with fleet.node_client(placed[ended]["node"]) as nc:
        assert nc.cancel(placed[ended]["node_run_id"])["was_active"] is True
    fleet.start_front()
    deadline = time.monotonic() + 60
    while placement_group_table(left)["state"] != "REMOVED":
        assert time.monotonic() < deadline, placement_group_table(left)
        time.sleep(0.05)

    everyone = [done, queued, *live]
    with fleet.client() as c:
        assert wait_terminal(c, ended) == "cancelled"
        assert c.status(done)["state"] == "completed"
        assert c.status(queued)["state"] in ("queued", "starting", "running")  # it took the freed slot
        for run_id in live[1:]:
            st = c.status(run_id)
            assert st["state"] == "running" and st["node_run_id"] == placed[run_id]["node_run_id"]
        c.cancel_many([queued, *live])
        for run_id in everyone:
            wait_terminal(c, run_id)
        states = {r: c.status(r)["state"] for r in everyone}
    assert states[done] == "completed"
    assert all(states[r] == "cancelled" for r in [queued, *live])
    index = Index(fleet.front_dir / INDEX_FILE)
    try:
        for run_id in everyone:
            assert index.get(run_id)["state"] == states[run_id]  # type: ignore[index]
            assert index.terminal_event_count(run_id) == 1, run_id
    finally:
        index.close()


def test_a_node_that_joins_later_gets_its_agentd_and_takes_runs(fleet: FleetCluster) -> None:
    import time

    import ray

    from supervisor.fleet import node_resources
    from supervisor.fleet._agent import NAMESPACE, agent_name

    node = fleet.cluster.add_node(
        node_ip_address="127.0.0.1",
        num_cpus=4,
        object_store_memory=80 * 1024 * 1024,
        resources=node_resources(SLOTS_PER_NODE, browser=False),
    )
    try:
        with fleet.client() as c:
            # The front sees it join (Ray's node table) and starts its agent and daemon.
            deadline = time.monotonic() + 60
            while not any(n["node_id"] == node.node_id and n["agentd"] for n in c.status()["summary"]["nodes"]):
                assert time.monotonic() < deadline, "the new node got no agentd"
                time.sleep(0.1)  # polling the front's view, bounded
            # Only the new node has 2 CPUs to give.
            run_id = c.spawn(spec({"wait": False}, resources={"cpu": 2}))["run_id"]
            assert wait_terminal(c, run_id) == "completed"
            st = c.status(run_id)
        assert st["node"] == node.node_id
        info = ray.get(ray.get_actor(agent_name(node.node_id), namespace=NAMESPACE).info.remote(), timeout=60)
        assert st["run_dir"].startswith(info["state_dir"])
    finally:
        fleet.cluster.remove_node(node)  # graceful: its daemon gets its stop and ends


def test_a_node_lost_with_live_runs_turns_them_lost_with_partial_results_and_spares_the_rest(
    fleet: FleetCluster,
) -> None:
    import time

    import psutil

    slots = SLOTS_PER_NODE * len(fleet.agents())
    with fleet.client() as c:
        runs = [c.spawn(spec({"snapshots": 1}))["run_id"] for _ in range(slots)]
        for run_id in runs:
            for ev in c.follow(run_id):
                if ev["kind"] == "step_snapshot":
                    break
        where = {r: c.status(r)["node"] for r in runs}
        head = fleet.cluster.head_node.node_id
        victim = next(n for n in fleet.nodes if n != head)
        doomed = [r for r in runs if where[r] == victim]
        spared = [r for r in runs if where[r] != victim]
        assert len(doomed) == SLOTS_PER_NODE

        # The machine dies: its daemon says nothing more (frozen, as if gone with it),
        # Ray's raylet there is killed without notice.
        daemon = psutil.Process(fleet.agents()[victim]["pid"])
        daemon.suspend()
        try:
            t0 = time.monotonic()
            fleet.cluster.remove_node(fleet.nodes[victim], allow_graceful=False)
            for run_id in doomed:
                assert wait_terminal(c, run_id) == "lost"
            assert time.monotonic() - t0 < 10.0
        finally:
            # Not a real machine: let its daemon finish the stop it was sent (its
            # agent died, so it got SIGTERM), so that nothing outlives the test.
            daemon.resume()
        for run_id in doomed:
            st = c.status(run_id)
            assert st["state"] == "lost" and st["node_alive"] is False
            assert st["partial"] is True and st["result"]["progress"] == "step 1 done. "
            assert st["error"]["code"] == "node_lost"
            states = [e["data"]["state"] for e in c.events(run_id) if e["kind"] == "state"]
            assert states.count("lost") == 1 and states[-1] == "lost"
            again = c.cancel(run_id)
            assert again["was_active"] is False and again["state"] == "lost" and "dead" in again["why"]
        for run_id in spared:
            st = c.status(run_id)
            assert st["state"] == "running" and st["node_alive"] is True
        # New runs go to the nodes that remain (two slots freed there first).
        for run_id in spared[:2]:
            c.cancel(run_id)
            assert wait_terminal(c, run_id) == "cancelled"
        fresh = [c.spawn(spec())["run_id"] for _ in range(2)]
        for run_id in fresh:
            assert wait_state(c, run_id, "running")["node"] != victim
        c.cancel_many(spared + fresh)
        for run_id in spared + fresh:
            assert wait_terminal(c, run_id) == "cancelled"


def _node_record(state_dir: str, node_run_id: str) -> dict[str, Any]:
    """A run's row in a node daemon's journal file, read-only (its daemon is gone)."""
    db = sqlite3.connect(f"file:{Path(state_dir) / JOURNAL_FILE}?mode=ro", uri=True)
    try:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT state, reason, receipt FROM runs WHERE id = ?", (node_run_id,)).fetchone()
        terminal = db.execute(
            "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'state' AND json_extract(data, '$.state') = ?",
            (node_run_id, row["state"]),
        ).fetchone()[0]
    finally:
        db.close()
    return {
        "state": row["state"],
        "reason": row["reason"],
        "receipt": json.loads(row["receipt"] or "null"),
        "terminal_events": terminal,
    }


def test_fleet_down_cancels_every_live_run_with_its_receipt_and_leaves_nothing(fleet: FleetCluster) -> None:
    """Last (it takes every node's daemon down): `agentd fleet down` with live runs on
    every node is each node's `systemctl stop`: every run cancelled, with its receipt."""
    import psutil

    from supervisor.fleet._index import Index
    from supervisor.fleet._serve import INDEX_FILE

    agents = fleet.agents()
    slots = SLOTS_PER_NODE * len(agents)
    with fleet.client() as c:
        runs = [c.spawn(spec({"tree": True}))["run_id"] for _ in range(slots)]
        trees = trees_of(c, runs)  # once each runner has started its tree
        placed = {r: c.status(r) for r in runs}
    assert {st["node"] for st in placed.values()} == set(agents)  # every node has live runs
    # Every process of it: the daemons, the runners, their trees (setsid and double-forked).
    procs = [psutil.Process(a["pid"]) for a in agents.values()]
    procs += [psutil.Process(st["pid"]) for st in placed.values()]
    procs += [psutil.Process(pid) for pid in trees.values()]
    procs += [child for p in list(procs) for child in p.children(recursive=True)]
    assert len(procs) >= len(agents) + 2 * slots

    down = json.loads(fleet.cli("--json", "fleet", "down", "--address", fleet.address, timeout=120).stdout)
    assert sorted(n["node_id"] for n in down["nodes"]) == sorted(agents)
    assert all(n["exit_code"] == 0 for n in down["nodes"]), down
    assert [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []

    for st in placed.values():  # each node's own journal: its daemon's stop, with receipts
        record = _node_record(agents[st["node"]]["state_dir"], st["node_run_id"])
        assert (record["state"], record["reason"], record["terminal_events"]) == ("cancelled", "shutdown", 1)
        assert record["receipt"]["cancel_reason"] == "shutdown", record["receipt"]
        assert record["receipt"]["path_b"]["survivors"] == [], record["receipt"]
    # The front, still serving, agrees: cancelled for the same reason, one terminal fact each.
    with fleet.client() as c:
        for run_id in runs:
            assert wait_terminal(c, run_id) == "cancelled"
            st = c.status(run_id)
            assert (st["state"], st["reason"], st["live"]) == ("cancelled", "shutdown", False), st
    index = Index(fleet.front_dir / INDEX_FILE)
    try:
        assert [index.terminal_event_count(r) for r in runs] == [1] * len(runs)
    finally:
        index.close()
    # The fleet stays down: the front takes no run it could only fail (it took them, and
    # each ended `failed`, `no_agent`), and a front started again does not bring the
    # agents back (it did: a node without an agent gets one, but not after `fleet down`).
    with fleet.client() as c:
        refused = _refused_spawn(c)
    assert "the fleet is down" in refused and "agentd fleet up" in refused, refused
    fleet.stop_front()
    fleet.start_front()
    with fleet.client() as c:
        refused = _refused_spawn(c)
    assert "the fleet is down" in refused, refused
    assert fleet.agents() == {}


def _refused_spawn(c: Client) -> str:
    """The front's refusal of a spawn, once it has read that the fleet is down (it reads
    Ray's store every NODE_POLL_S): its message."""
    from supervisor.errors import AgentdError

    deadline = time.monotonic() + 30
    while True:
        try:
            run_id = c.spawn(spec())["run_id"]
        except AgentdError as exc:
            return str(exc)
        assert wait_terminal(c, run_id) == "failed"  # taken before it knew: no agent to run it
        assert time.monotonic() < deadline, "the front kept taking runs after `fleet down`"
