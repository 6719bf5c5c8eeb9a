"""A local Ray cluster of several nodes on this machine, with the fleet on it.

``FleetCluster.start`` brings up a head and nodes on loopback (``ray.cluster_utils``),
each advertising agentd's resources, runs ``agentd fleet up`` as a user would, and joins
as a driver; ``start_front`` runs the front (``agentd fleet serve``), one per test (a
test may kill and restart it: what it starts, it ends). ``stop`` ends it all:
the front, ``agentd fleet down`` (every node daemon's own stop), the driver, the nodes,
then checks by pid that every process it started is gone. Nodes run a stand-in runner
(``tests/children/fake_runner.py``): the runner is not what these tests are about.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.control.client import Client
from tests.conftest import ProcId, descendants, kill_exactly, root_pid

AGENTD = str(Path(sys.executable).with_name("agentd"))
FAKE_RUNNER = Path(__file__).resolve().parent.parent / "children" / "fake_runner.py"
SLOTS_PER_NODE = 4
# Ray's health checks, fast: a node killed without notice is declared dead in ~1-2 s.
SYSTEM_CONFIG = {
    "health_check_period_ms": 300,
    "health_check_failure_threshold": 3,
    "health_check_timeout_ms": 500,
    "prestart_worker_first_driver": False,
    "enable_worker_prestart": False,
}
ENV = {
    # Ray resolves 127.0.0.1 to the host's address unless it runs "local only": keep it
    # all on loopback (head, nodes, drivers, workers inherit this environment).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "AGENTD_GRACE_S": "2",
    "AGENTD_RUNNER_COMMAND": f"{sys.executable} {FAKE_RUNNER}",
}
START_TIMEOUT_S = 120.0
RAY_NODE_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")


@dataclass
class FleetCluster:
    root: Path
    cluster: Any  # ray.cluster_utils.Cluster; None until it is up
    nodes: dict[str, Any]  # node id -> ray Node
    browser_nodes: set[str]
    front: subprocess.Popen[bytes] | None = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    before: set[ProcId] = field(default_factory=set)
    gcs_address: str | None = None  # as it was at the start (Ray forgets it while its GCS is down)
    gcs_restarted: bool = False

    @property
    def address(self) -> str:
        return self.gcs_address or str(self.cluster.address)

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def node_dir(self) -> Path:
        return self.root / "nodes"

    @property
    def front_dir(self) -> Path:
        return self.state_dir / "fleet"

    # ---------------------------------------------------------------- setup

    @classmethod
    def start(
        cls,
        *,
        nodes: int = 3,
        no_browser: int = 1,
        slots: int = SLOTS_PER_NODE,
        system_config: dict[str, Any] | None = None,
        gcs_on_disk: bool = False,
    ) -> FleetCluster:
        """``gcs_on_disk``: the head's GCS keeps its tables on disk (RocksDB, under the
        cluster's root), so a test can kill it and start it again (``restart_gcs``)."""
        root = Path(tempfile.mkdtemp(prefix="agf-", dir="/tmp"))
        (root / "ray").mkdir()
        saved = {k: os.environ.get(k) for k in (*ENV, "RAY_TMPDIR")}
        before = set(descendants(root_pid()))
        # Before Ray is imported: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import.
        os.environ.update(ENV)
        # Ray writes the address of its "current cluster" under its default temp dir
        # (RAY_TMPDIR/ray, else /tmp/ray): ours, never the host's /tmp/ray (a fresh
        # machine has none, and a Cluster that cannot write it fails with its head up).
        os.environ["RAY_TMPDIR"] = str(root)
        fc = cls(root, None, {}, set(), saved_env=saved, before=before)
        system_config = {**SYSTEM_CONFIG, **(system_config or {})}
        if gcs_on_disk:
            system_config.update(gcs_storage="rocksdb", gcs_storage_path=str(root / "gcs"))
        try:
            import ray
            from ray.cluster_utils import Cluster

            from supervisor.fleet import node_resources

            common = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
            fc.cluster = cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    **common,
                    "include_dashboard": False,
                    "temp_dir": str(root / "ray"),
                    "resources": node_resources(slots, browser=True),
                    "_system_config": system_config,
                },
            )
            fc.nodes[cluster.head_node.node_id] = cluster.head_node
            fc.browser_nodes.add(cluster.head_node.node_id)
            for i in range(1, nodes):
                browser = i > no_browser
                node = cluster.add_node(**common, resources=node_resources(slots, browser=browser))
                fc.nodes[node.node_id] = node
                if browser:
                    fc.browser_nodes.add(node.node_id)
            cluster.wait_for_nodes()
            fc.gcs_address = str(cluster.address)
            ray.init(address=cluster.address, namespace="agentd", log_to_driver=False)
            fc.cli("fleet", "up", "--address", fc.address, "--node-dir", str(fc.node_dir), timeout=START_TIMEOUT_S)
        except BaseException:
            fc.stop()
            raise
        return fc

    def start_front(self) -> None:
        log = open(self.root / "front.log", "ab")
        self.front = subprocess.Popen(
            [
                AGENTD,
                "--state-dir",
                str(self.state_dir),
                "fleet",
                "serve",
                "--address",
                self.address,
                "--node-dir",
                str(self.node_dir),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                info = json.loads((self.front_dir / "daemon.json").read_text())
                if info.get("pid") == self.front.pid:
                    return
            except (OSError, ValueError):
                pass
            if self.front.poll() is not None:
                raise AssertionError(f"the front exited: {(self.root / 'front.log').read_text()[-3000:]}")
            time.sleep(0.05)  # a file another process writes; polled with a deadline
        raise AssertionError("the front did not publish its endpoint in time")

    def stop_front(self) -> None:
        """SIGTERM: the front alone ends; runs go on on their nodes."""
        if self.front is not None and self.front.poll() is None:
            self.front.send_signal(signal.SIGTERM)
            try:
                self.front.wait(30)
            except subprocess.TimeoutExpired:
                self.front.kill()
                self.front.wait()
        self.front = None

    def kill_front(self) -> None:
        assert self.front is not None
        self.front.send_signal(signal.SIGKILL)
        self.front.wait(10)

    def kill_gcs(self) -> None:
        """The head's GCS dies (SIGKILL, through Ray's own record of the process)."""
        self.cluster.head_node.kill_gcs_server()

    def restart_gcs(self) -> None:
        """The head's GCS starts again on its tables (``gcs_on_disk``)."""
        self.gcs_restarted = True
        self.cluster.head_node.start_gcs_server()

    # ---------------------------------------------------------------- use

    def cli(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [AGENTD, "--state-dir", str(self.state_dir), *args], capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode != 0:
            raise AssertionError(f"agentd {' '.join(args)} exited {r.returncode}: {r.stderr}")
        return r

    def client(self) -> Client:
        return Client(state_dir=self.front_dir, timeout_s=60)

    def agents(self) -> dict[str, dict[str, Any]]:
        import ray

        from supervisor.fleet._agent import list_agents

        return {node_id: ray.get(a.info.remote(), timeout=60) for node_id, a in list_agents()}

    def node_client(self, node_id: str) -> Client:
        info = self.agents()[node_id]
        return Client(info["url"], info["token"], timeout_s=60)

    # ---------------------------------------------------------------- teardown

    def stop(self) -> None:
        import ray

        try:
            self.stop_front()
            if ray.is_initialized():
                try:
                    self.cli("fleet", "down", "--address", self.address, timeout=120, check=False)
                finally:
                    ray.shutdown()
        finally:
            if self.cluster is not None:  # None: its start failed (what it started is ended below)
                self.cluster.shutdown()
            for k, v in self.saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            # Everything started since setup must be gone: by pid, bounded.
            deadline = time.monotonic() + 20
            left = self._leftovers()
            if self.gcs_restarted:
                # After a GCS restart each node's Ray agents (dashboard, runtime env) outlive
                # their raylet by tens of seconds: ours (found by pid, started since setup),
                # ended here, not counted.
                for p in left:
                    if _name(p.pid).split(" ", 1)[-1].startswith(RAY_NODE_AGENTS):
                        kill_exactly(p)
                left = self._leftovers()
            while left and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self._leftovers()
            for p in left:
                kill_exactly(p)
            shutil.rmtree(self.root, ignore_errors=True)
            if left:
                raise AssertionError(f"the fleet left processes behind: {[_name(p.pid) for p in left]}")

    def _leftovers(self) -> list[ProcId]:
        me = os.getpid()
        return [p for p, st in descendants(root_pid()).items() if p not in self.before and st != "Z" and p.pid != me]


def _name(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:100]}"
    except psutil.Error:
        return f"{pid} (gone)"


def wait_state(client: Client, run_id: str, wanted: str) -> dict[str, Any]:
    """The run's status once its events reach the state ``wanted``."""
    for ev in client.follow(run_id):
        if ev["kind"] == "state" and ev["data"]["state"] == wanted:
            return client.status(run_id)
    raise AssertionError(f"run {run_id} ended without reaching {wanted!r}")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def trees_of(client: Client, runs: list[str]) -> dict[str, int]:
    """Each run's tree leader, once its runner (the stand-in, ``{"tree": true}``) says it
    started it (its ``tree started PID`` log line)."""
    trees: dict[str, int] = {}
    for run_id in runs:
        for ev in client.follow(run_id):
            if ev["kind"] == "log" and ev["data"]["message"].startswith("tree started"):
                trees[run_id] = int(ev["data"]["message"].split()[-1])
                break
    return trees
