"""A real systemd for tests: the tree built by ``tests/systemd/prepare``, booted with nspawn.

``Container.boot()`` starts ``systemd-nspawn -b`` on the cached bookworm tree with a volatile
overlay (nothing written inside survives), no network but loopback, and read-only binds of
the checkout, its .venv, node_modules and the venv's base interpreter (a pyenv Python lives
under /root/.pyenv) at the same paths, so the container runs this checkout's code. Commands
run inside with ``nsenter -t <container PID 1> -a`` and get a clean environment plus the
caller's ``AGENTD_*`` variables (the suite's leak check finds them by ``AGENTD_TEST_MARK``).

Boot is awaited on a notify socket, not by polling: with ``--notify-ready=yes`` nspawn sends
READY=1 once the container's systemd has finished booting. ``shutdown()`` powers the
container off and then checks, by PID namespace, that nothing of it is left: units inside
never carry the test mark, so the suite-wide check cannot see them.

nspawn runs in a cgroup of its own under the caller's (removed afterwards), so containers of
concurrent test sessions do not share a cgroup tree; this host may have no systemd at all.
The container's systemd runs on cgroup v2 alone whenever the host has a cgroup2 mount, even
on a hybrid host (``cgroup_mode``), since that is what current systems run.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
PREPARE = CHECKOUT / "tests" / "systemd" / "prepare"
DEFAULT_ROOT = Path("/var/cache/agentd-test/bookworm-systemd")
STAMP_NAME = ".agentd-test-prepared"

CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

LANDLOCK_SYSCALLS = ("landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self")
BOOT_TIMEOUT_S = 60.0
SHUTDOWN_TIMEOUT_S = 30.0


def image_root() -> Path:
    return Path(os.environ.get("AGENTD_TEST_SYSTEMD_ROOT") or DEFAULT_ROOT)


def prepared(root: Path | None = None) -> bool:
    return (image_root() if root is None else root).joinpath(STAMP_NAME).is_file()


def venv_python() -> Path:
    return CHECKOUT / ".venv" / "bin" / "python"


def read_only_binds() -> list[Path]:
    """The host paths the container needs, each bound read-only at the same path."""
    binds = [CHECKOUT]
    for name in (".venv", "node_modules"):
        p = CHECKOUT / name
        if p.exists() and p.resolve() != p.absolute():  # a symlink out of the checkout
            binds.append(p.resolve())
    # The venv's interpreter: .venv/bin/python -> e.g. /root/.pyenv/versions/3.11.7/bin/python3.11.
    # Under /usr it is Debian's python3, which the image has itself (same release).
    real = venv_python().resolve()
    prefix = real.parent.parent
    if not str(prefix).startswith("/usr"):
        binds.append(prefix)
    out: list[Path] = []
    for b in binds:
        if not any(b == o or o in b.parents for o in out):
            out.append(b)
    return out


def editable_override(workdir: Path, dest: str = "") -> list[str]:
    """nspawn options that make the venv's editable install name this checkout inside the
    container, where the venv's ``__editable__.*.pth`` names another one (a git worktree
    sharing the main checkout's venv): that checkout is not bound inside, so without this
    the daemon would fail to import (or run other code). A file naming this checkout is
    bound over the .pth, for the units, the runners and the CLI alike; nothing otherwise.
    ``dest``: the same inside a root at that path (``hostroot_args``'s overlay)."""
    args: list[str] = []
    venv = (CHECKOUT / ".venv").resolve()  # bound inside at this (real) path
    for pth in sorted((venv / "lib").glob("python*/site-packages/__editable__.*.pth")):
        try:
            text = pth.read_text().strip()
        except OSError:
            continue
        if not text.startswith("/") or "\n" in text or Path(text) == CHECKOUT:
            continue
        ours = workdir / pth.name
        ours.write_text(f"{CHECKOUT}\n")
        args.append(f"--bind-ro={ours}:{dest}{pth}")
    return args


HOSTROOT = "/hostroot"


def cgroup_mode() -> str:
    """How the container's systemd sees cgroups: "unified" (cgroup v2 only, as on current
    distributions and, with this, also on a hybrid host like this one) or "host" (whatever
    nspawn picks from the host). AGENTD_TEST_SYSTEMD_CGROUP overrides."""
    want = os.environ.get("AGENTD_TEST_SYSTEMD_CGROUP", "unified")
    if want == "unified":
        try:
            with open("/proc/self/mountinfo") as f:
                if any(" - cgroup2 " in line for line in f):
                    return "unified"
        except OSError:
            pass
    return "host"


def hostroot_args(extra_paths: Iterable[Path] = (), dest: str = HOSTROOT) -> list[str]:
    """nspawn options that put a writable, throw-away overlay of the host's root file system
    at ``dest`` inside the container (plus read-only binds for the paths that live on other
    file systems). A unit with ``RootDirectory=/hostroot`` then runs the host's own Chromium,
    node and venv under the container's systemd and the unit's hardening."""
    args = [f"--overlay=/::{dest}"]
    root_dev = os.stat("/").st_dev
    for p in [*read_only_binds(), *extra_paths]:
        if p.exists() and os.stat(p).st_dev != root_dev:
            args.append(f"--bind-ro={p}:{dest}{p}")
    return args


def namespace_of(pid: int, ns: str = "pid") -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{ns}")
    except OSError:
        return None


def processes_in_namespace(ns_id: str, ns: str = "pid") -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and namespace_of(int(entry), ns) == ns_id:
            found.append(int(entry))
    return found


def describe_pids(pids: Iterable[int]) -> str:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmd = "(gone)"
        out.append(f"{pid} {cmd[:100]!r}")
    return "; ".join(out)


class ContainerError(RuntimeError):
    pass


@dataclass
class Container:
    root: Path
    workdir: Path  # host dir for nspawn's log and notify socket
    binds_ro: Sequence[Path] = field(default_factory=read_only_binds)
    extra_args: Sequence[str] = ()  # more systemd-nspawn options
    name: str = field(default_factory=lambda: f"agentd-test-{uuid.uuid4().hex[:8]}")
    proc: subprocess.Popen[bytes] | None = None
    leader: int | None = None  # the container's PID 1, as seen from the host
    pidns: str | None = None
    boot_s: float | None = None
    _cgroups: list[Path] = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.workdir / "nspawn.log"

    # ------------------------------------------------------------------ lifecycle

    def boot(self, timeout_s: float = BOOT_TIMEOUT_S) -> None:
        """Start the container and return once its systemd reports the boot finished."""
        t0 = time.monotonic()
        notify_path = self.workdir / "nspawn-notify"
        ready = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            ready.bind(str(notify_path))
            argv = [
                "systemd-nspawn",
                "--quiet",
                "--boot",
                f"--directory={self.root}",
                f"--machine={self.name}",
                "--register=no",
                "--keep-unit",
                "--volatile=overlay",
                "--private-network",
                "--console=read-only",
                "--notify-ready=yes",
                "--link-journal=no",
                # nspawn's own seccomp allowlist (systemd 252) predates Landlock, which a
                # booted host allows: without these, every run in the container would be
                # unsandboxed and the unit's sandbox could not be tested.
                f"--system-call-filter={' '.join(LANDLOCK_SYSCALLS)}",
                *[f"--bind-ro={p}" for p in self.binds_ro],
                *editable_override(self.workdir),
                *self.extra_args,
                # A root overlaid at DEST (hostroot_args) sees the host's .pth: overlaid too.
                *[
                    a
                    for x in self.extra_args
                    if x.startswith("--overlay=/::")
                    for a in editable_override(self.workdir, x[13:])
                ],
            ]
            argv = self._in_own_cgroup(argv)
            env = {"PATH": os.environ.get("PATH", CONTAINER_PATH), "NOTIFY_SOCKET": str(notify_path)}
            if cgroup_mode() == "unified":
                env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            self._wait_ready(ready, t0 + timeout_s)
        except BaseException:
            ready.close()
            self.shutdown(check=False)
            raise
        ready.close()
        try:
            self.leader = self._find_leader(t0 + timeout_s)
            self.pidns = namespace_of(self.leader)
            state = self.run(
                ["systemctl", "is-system-running", "--wait"],
                check=False,
                timeout_s=max(1.0, t0 + timeout_s - time.monotonic()),
            )
            if state.stdout.strip() != "running":
                failed = self.run(["systemctl", "--failed", "--no-legend"], check=False).stdout
                raise ContainerError(f"container booted {state.stdout.strip()!r}; failed units: {failed}")
        except BaseException:
            self.shutdown(check=False)
            raise
        self.boot_s = time.monotonic() - t0

    def _wait_ready(self, sock: socket.socket, deadline: float) -> None:
        assert self.proc is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ContainerError(f"container did not boot in time; log:\n{self.log()}")
            sock.settimeout(min(left, 0.5))
            try:
                msg = sock.recv(4096)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise ContainerError(
                        f"systemd-nspawn exited with {self.proc.returncode}; log:\n{self.log()}"
                    ) from None
                continue
            if b"READY=1" in msg.split(b"\n"):
                return

    def _find_leader(self, deadline: float) -> int:
        """The container's PID 1: a descendant of nspawn whose NSpid ends in 1."""
        assert self.proc is not None
        while time.monotonic() < deadline:
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/status") as f:
                        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                except OSError:
                    continue
                nspid = status.get("NSpid", "").split()
                if len(nspid) >= 2 and nspid[-1] == "1" and int(status["PPid"]) == self.proc.pid:
                    return int(entry)
            if self.proc.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited; log:\n{self.log()}")
        raise ContainerError("cannot find the container's PID 1")

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S, *, check: bool = True) -> None:
        """Power the container off; with ``check``, fail if any of its processes survive."""
        problems: list[str] = []
        if self.proc is not None and self.proc.poll() is None:
            # nspawn turns SIGTERM into SIGRTMIN+3 for PID 1: an orderly poweroff.
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                problems.append(f"systemd-nspawn did not exit within {timeout_s} s of SIGTERM")
                self._kill_hard()
        if self.pidns is not None:
            deadline = time.monotonic() + 5.0
            left = processes_in_namespace(self.pidns)
            while left and time.monotonic() < deadline:
                time.sleep(0.05)
                left = processes_in_namespace(self.pidns)
            if left:
                problems.append(f"container processes left: {describe_pids(left)}")
                self._kill_hard()
        self._remove_cgroups()
        if check and problems:
            raise ContainerError("; ".join(problems) + f"\nlog:\n{self.log()}")

    def _kill_hard(self) -> None:
        # SIGKILL of a PID namespace's init kills every process in it.
        if self.leader is not None:
            try:
                os.kill(self.leader, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # --------------------------------------------------------------- cgroup of nspawn

    def _in_own_cgroup(self, argv: list[str]) -> list[str]:
        """Wrap argv so nspawn starts in a fresh child of our cgroup, in every hierarchy
        that tracks processes (v2, and v1 name=systemd on a hybrid host)."""
        procs_files: list[Path] = []
        try:
            for mount, path in _tracking_cgroups():
                d = mount / path.lstrip("/") / self.name
                d.mkdir()
                self._cgroups.append(d)
                procs_files.append(d / "cgroup.procs")
        except OSError:
            self._remove_cgroups()
            return argv  # no cgroup of our own: nspawn uses ours
        script = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
        return ["sh", "-c", script, "sh", str(len(procs_files)), *map(str, procs_files), *argv]

    def _remove_cgroups(self) -> None:
        for top in self._cgroups:
            for dirpath, _dirs, _files in sorted(os.walk(top, topdown=False), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass
        self._cgroups = [d for d in self._cgroups if d.exists()]

    # ------------------------------------------------------------------ inside

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": CONTAINER_PATH,
            "LANG": "C.UTF-8",
            "SYSTEMD_PAGER": "cat",
            "SYSTEMD_COLORS": "0",
            "HOME": "/root",
            "TERM": "dumb",
        }
        env.update({k: v for k, v in os.environ.items() if k.startswith("AGENTD_")})
        env.pop("AGENTD_TEST_SYSTEMD_ROOT", None)
        if extra:
            env.update(extra)
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        if self.leader is None:
            raise ContainerError("container is not running")
        return ["nsenter", "-t", str(self.leader), "-a", *argv]

    def run(
        self,
        argv: Sequence[str],
        *,
        check: bool = True,
        timeout_s: float = 30.0,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the container and wait for it (bounded)."""
        r = subprocess.run(
            self.command(argv),
            input=input,
            capture_output=True,
            text=True,
            env=self.env(env),
            timeout=timeout_s,
        )
        if check and r.returncode != 0:
            raise ContainerError(f"{shlex.join(argv)} exited {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}")
        return r

    def sh(self, script: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return self.run(["sh", "-ec", script], **kw)  # type: ignore[arg-type]

    def systemctl(self, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", *args], **kw)  # type: ignore[arg-type]

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def watch_watchdog(self, unit: str, periods: int = 3) -> list[int]:
        """Watch a unit with WatchdogSec= for ``periods`` full periods; fail the moment it is
        not active or has restarted. Returns the distinct WatchdogTimestampMonotonic values
        seen (one per WATCHDOG=1 that systemd took; sampling may miss some under load)."""
        period_s = _seconds(self.show(unit, "WatchdogUSec")["WatchdogUSec"])
        assert period_s > 0, f"{unit} has no watchdog"
        seen: list[int] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < periods * period_s + 0.2:
            s = self.show(unit, "ActiveState", "WatchdogTimestampMonotonic", "NRestarts", "Result")
            assert (s["ActiveState"], s["NRestarts"], s["Result"]) == ("active", "0", "success"), (
                s,
                self.journal(unit),
            )
            ts = int(s["WatchdogTimestampMonotonic"])
            if not seen or ts != seen[-1]:
                seen.append(ts)
            time.sleep(0.1)
        return seen

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        self.run(["sh", "-ec", 'mkdir -p "$(dirname "$1")"; cat >"$1"; chmod "$2" "$1"', "sh", path, mode], input=text)

    def journal(self, unit: str, *, after: str | None = None) -> str:
        """The unit's journal; ``after``: only what came after that cursor (``cursor``)."""
        since = ["--after-cursor", after] if after else []
        return self.run(["journalctl", "-u", unit, "--no-pager", "-o", "short-monotonic", *since], check=False).stdout

    def cursor(self) -> str:
        """The journal's cursor now: ``journal(after=...)`` then shows only what follows."""
        out = self.run(["journalctl", "-n", "0", "--show-cursor", "--no-pager"], check=False).stdout
        _before, found, cursor = out.strip().rpartition("-- cursor: ")
        assert found and cursor, f"no journal cursor in {out!r}"
        return cursor

    def host_pid(self, container_pid: int) -> int | None:
        """The host PID of a process known by its PID inside the container."""
        assert self.pidns is not None
        for pid in processes_in_namespace(self.pidns):
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("NSpid:") and int(line.split()[-1]) == container_pid:
                            return pid
            except OSError:
                continue
        return None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"


def _seconds(timespan: str) -> float:
    """A systemctl show timespan ("1s", "500ms", "1min 30s", "infinity", "0") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
    if timespan in {"", "0", "infinity"}:
        return 0.0
    total = 0.0
    for part in timespan.split():
        num = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        total += float(num) * units[part[len(num) :] or "s"]
    return total


def _tracking_cgroups() -> list[tuple[Path, str]]:
    """(mount point, our path) for the cgroup v2 hierarchy and a v1 name=systemd one."""
    mounts: dict[str, Path] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, opts = (right.split() + ["", "", ""])[:3]
            mountpoint = Path(left.split()[4])
            if fstype == "cgroup2" and "v2" not in mounts:
                mounts["v2"] = mountpoint
            elif fstype == "cgroup" and "name=systemd" in opts.split(","):
                mounts["name=systemd"] = mountpoint
    out = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _hid, controllers, path = line.rstrip("\n").split(":", 2)
            key = "v2" if controllers == "" else controllers
            if key in mounts:
                out.append((mounts[key], path))
    if not out:
        raise OSError("no cgroup hierarchy found")
    return out


def python_in_container() -> str:
    """The venv interpreter path (bound at the same path inside)."""
    return str(venv_python())


if __name__ == "__main__":  # manual use: boot, print facts, shut down
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        c = Container(image_root(), Path(d))
        c.boot()
        print(f"booted in {c.boot_s:.2f} s, PID 1 = {c.leader}", file=sys.stderr)
        print(c.run(["systemd-analyze"]).stdout)
        t = time.monotonic()
        c.shutdown()
        print(f"shut down in {time.monotonic() - t:.2f} s", file=sys.stderr)
