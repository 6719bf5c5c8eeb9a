"""The fleet while Ray's head loses its GCS (the cluster's control store) and gets it back.

A cluster of its own, per test (a GCS started again is the test's process): a head and two nodes, two run slots each, the GCS keeping its tables
on disk so that it can be killed and started again (``gcs_on_disk``). Every Ray process
of the cluster, the front and this test process (a Ray driver) included, gives up and
exits when the GCS stays away longer than Ray's reconnect timeout: the test's waits during
the outage are bounded well under it, and the GCS is started again in a ``finally``.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from supervisor.control.client import Client
from tests.conftest import require
from tests.fleet.cluster import FleetCluster, alive, trees_of, wait_state

SLOTS = 2
# Ray's own (60 s, its default): every Ray process exits after the GCS is away this long.
GCS_RECONNECT_S = 60
# Bounds each wait while the GCS is down (a run's end, a request's reply).
OUTAGE_WAIT_S = 10.0


@pytest.fixture
def fleet() -> Iterator[FleetCluster]:
    require(importlib.util.find_spec("ray") is not None, "ray (pip install 'agentd[fleet]')")
    fc = FleetCluster.start(
        nodes=3, slots=SLOTS, gcs_on_disk=True, system_config={"gcs_rpc_server_reconnect_timeout_s": GCS_RECONNECT_S}
    )
    try:
        fc.start_front()
        yield fc
    finally:
        fc.stop()


def spec(behaviour: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"task": json.dumps(behaviour or {})}


def wait_terminal(client: Client, run_id: str) -> str:
    follow = client.follow(run_id, after_seq=2**62)
    for _ in follow:
        pass
    assert follow.state is not None
    return follow.state


class Follower:
    """A run followed to its end through the front, in a thread: a wait that may be
    bounded while the GCS is down and joined once it is back."""

    def __init__(self, fleet: FleetCluster, run_id: str) -> None:
        self.state: str | None = None
        self.error: BaseException | None = None
        self._fleet, self._run_id = fleet, run_id
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            with self._fleet.client() as c:
                self.state = wait_terminal(c, self._run_id)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def test_while_the_gcs_is_down_status_cancel_and_spawn_answer_and_a_cancelled_run_ends_for_real(
    fleet: FleetCluster,
) -> None:
    head = fleet.cluster.head_node.node_id
    with fleet.client() as c:
        runs = [c.spawn(spec({"tree": True}))["run_id"] for _ in range(SLOTS * len(fleet.nodes))]
        trees = trees_of(c, runs)  # once each runner has started its tree
        placed = {r: c.status(r) for r in runs}
        queued = c.spawn(spec())["run_id"]
        assert c.status(queued)["state"] == "queued"
    victim = next(r for r in runs if placed[r]["node"] != head)  # on a node that stays up
    followers: list[Follower] = []
    fleet.kill_gcs()
    try:
        with Client(state_dir=fleet.front_dir, timeout_s=OUTAGE_WAIT_S) as c:
            assert c.status(victim)["state"] == "running"
            assert c.status(queued)["state"] == "queued"
            reply = c.cancel(victim)
            assert reply["was_active"] is True, reply
            followers.append(Follower(fleet, victim))
            # Its end reaches a watcher while the GCS is down: it was held until Ray
            # answered the removal of the run's lease (forever, had the GCS not come back).
            assert followers[-1].join(OUTAGE_WAIT_S), "the cancelled run's end did not reach its watcher"
            assert followers[-1].state == "cancelled", followers[-1].error
            assert not alive(placed[victim]["pid"]) and not alive(trees[victim])
            assert c.status(victim)["state"] == "cancelled"
            fresh = c.spawn(spec())["run_id"]  # taken: it waits on its lease, as a queued run does
            assert c.status(fresh)["state"] == "queued"
            reply = c.cancel(fresh)  # and never starts
            assert (reply["was_active"], reply["state"]) == (True, "queued"), reply
    finally:
        fleet.restart_gcs()
        for f in followers:
            f.join(GCS_RECONNECT_S)
    with fleet.client() as c:
        # The slot the cancel freed goes to the run queued first, once Ray can place it.
        started = wait_state(c, queued, "running")
        assert started["node"] == placed[victim]["node"]
        assert wait_terminal(c, fresh) == "cancelled"
        assert c.status(fresh)["node"] is None and "never started" in json.dumps(c.events(fresh))
        for run_id in runs:
            if run_id != victim:
                st = c.status(run_id)
                assert (st["state"], st["node_run_id"]) == ("running", placed[run_id]["node_run_id"])
                assert alive(trees[run_id])
        everyone = [*runs, queued]
        c.cancel_many(everyone)
        assert {r: wait_terminal(c, r) for r in everyone} == dict.fromkeys(everyone, "cancelled")
    assert [r for r in runs if alive(trees[r])] == []
