"""A daemon as its own process (``agentd serve``) for benchmarks that measure its CPU/RSS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks._common import AGENTD


class DaemonProc:
    """``agentd serve`` on a fresh state dir; ``stop()`` sends SIGTERM and waits."""

    def __init__(
        self,
        state_dir: Path,
        *,
        nice: int = 0,
        agentd: str = AGENTD,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        """``agentd``: the console script (another checkout's, for a before/after);
        ``env``: its environment (default: this process's)."""
        self.state_dir = state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env, AGENTD_STATE_DIR=str(state_dir))
        for k, v in settings.items():
            env["AGENTD_" + k.upper()] = str(v)
        self.log_path = state_dir.parent / f"{state_dir.name}.log"
        self.log = open(self.log_path, "wb")
        self.p = subprocess.Popen(
            [agentd, "serve", "--log-level", "warning"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.nice(nice)) if nice else None,
        )
        self.pid = self.p.pid
        endpoint = state_dir / "daemon.json"
        deadline = time.monotonic() + 30
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"agentd serve exited with {self.p.returncode}: {self.log_tail()}")
            try:
                info = json.loads(endpoint.read_text())
                if info.get("pid") == self.pid:
                    self.url = info["url"]
                    break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"agentd serve did not come up in 30 s: {self.log_tail()}")
            time.sleep(0.05)
        self.token = (state_dir / "token").read_text().strip()

    def client(self, timeout_s: float = 120.0) -> Any:
        from supervisor.control.client import Client

        return Client(self.url, self.token, state_dir=self.state_dir, timeout_s=timeout_s)

    def wait_zygote(self, timeout_s: float = 120.0) -> float | None:
        """Seconds until the daemon's runner zygote was ready; None if it has none."""
        t0 = time.monotonic()
        with self.client(timeout_s=30) as c:
            while time.monotonic() - t0 < timeout_s:
                state = ((c.status().get("summary") or {}).get("zygote") or {}).get("state")
                if state == "ready":
                    return time.monotonic() - t0
                if state in (None, "off", "failed"):
                    return None
                time.sleep(0.05)
        return None

    def helper_pids(self) -> list[int]:
        """The daemon's own helper processes: its runner zygote and the spare runners the
        zygote keeps parked (forked ahead, no run's yet: they carry the mark and live as
        long as the zygote). No run's members; a spare a spawn takes is one from then on."""
        try:
            with self.client(timeout_s=30) as c:
                z = (c.status().get("summary") or {}).get("zygote") or {}
        except Exception:  # noqa: BLE001 - an older daemon, or none: no helper known
            return []
        spares = (z.get("spares") or {}).get("pids") or []
        return [p for p in [z.get("pid"), *spares] if isinstance(p, int)]

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.p.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()
        return self.p.returncode
