"""A run's own namespaces under the real unit: what Landlock does not cover, kept apart.

Landlock refuses a run every open of another run's files, but not a ``connect()`` to a
unix socket there (a tool's server, Chromium's SingletonSocket in its run directory), and
System V IPC has no path at all. Outside the unit each run has its own user, mount and IPC
namespace, the daemon's directories covered in its view; the unit refused every namespace
(``RestrictNamespaces=yes``), and a uid 0 without capabilities cannot map itself into one
anyway (Linux 5.12+ asks CAP_SETFCAP of it): there a run connected to another run's socket
and attached its segments. The unit now allows the namespaces and mounts a run makes for
itself and CAP_SETFCAP (docs/systemd.md, "Hardening"). A procfs of the run's own stays out
of reach (the service's PID namespace is the host's): ``status`` says so, and it is so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from subagent import _nest, _quotas
from subagent.sandbox import PROC_SHARED
from tests.e2e.test_sandbox import command, scripted
from tests.systemd.agentd_support import STATE_DIR, UNIT, cli, poll
from tests.systemd.container import Container, python_in_container
from tests.systemd.test_sandbox import ENV_FILE, daemon_pid, outputs, spawn, wait_end
from tests.systemd.test_sandbox import agentd as agentd  # noqa: F401 - the fixture

pytestmark = pytest.mark.systemd

KEY = 0x7A3E51  # the SysV key the listening run makes a segment under

# Run A, in its run directory: a System V segment under KEY, a unix socket that prints
# whatever reaches it, until the test opens its gate (a file ``go``).
LISTEN = r"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
print("segment=%d" % libc.shmget(%KEY%, 4096, 0o1600), flush=True)
s = socket.socket(socket.AF_UNIX)
s.bind("listening.sock")
s.listen(1)
s.settimeout(0.05)
while not os.path.exists("go"):
    try:
        c, _ = s.accept()
        print("got=" + c.recv(100).decode(), flush=True)
    except socket.timeout:
        pass
""".replace("%KEY%", str(KEY))
# Run B: connect to A's socket (argv[1]); find A's segment by its key, and among the
# segments its IPC namespace lists; read A's runner's and the daemon's command lines.
PROBE = r"""
import ctypes, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    s.sendall(b"from-another-run")
    print("connect=0")
except OSError as exc:
    print("connect=%d" % exc.errno)
found = libc.shmget(%KEY%, 0, 0)
print("shmget=%s" % ("0" if found >= 0 else ctypes.get_errno()))
listed = [line.split()[0] for line in open("/proc/sysvipc/shm").read().splitlines()[1:]]
print("listed=%d" % (str(%KEY%) in listed))
for name, pid in (("other", sys.argv[2]), ("daemon", sys.argv[3])):
    try:
        open("/proc/%s/cmdline" % pid).read()
        print(name + "_cmdline=0")
    except OSError as exc:
        print("%s_cmdline=%d" % (name, exc.errno))
""".replace("%KEY%", str(KEY))


def _lines(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line and " " not in line)


@pytest.fixture(scope="module")
def pair(agentd: Container) -> Iterator[dict[str, Any]]:  # noqa: F811
    """A listening run and a probing one, once for the module: their statuses and lines."""
    c, py = agentd, python_in_container()
    other_id = spawn(c, scripted([command(f"{py} -c '{LISTEN}'")]))

    def listening() -> dict[str, Any] | None:
        s: dict[str, Any] = cli(c, "status", other_id)
        sock = f"{s.get('run_dir')}/listening.sock"
        return s if s.get("run_dir") and c.run(["test", "-S", sock], check=False).returncode == 0 else None

    st = poll("the listening run's socket", listening, timeout_s=60)
    assert st is not None
    run_dir = str(st["run_dir"])
    run_id = spawn(c, scripted([command(f"{py} -c '{PROBE}' {run_dir}/listening.sock {st['pid']} {daemon_pid(c)}")]))
    probe = wait_end(c, run_id)
    c.run(["touch", f"{run_dir}/go"])
    other = wait_end(c, other_id)
    assert probe["state"] == other["state"] == "completed", (probe, other)
    yield {"probe": probe, "other": other, "lines": _lines(outputs(probe)[0]), "other_out": outputs(other)[0]}


def test_a_run_cannot_connect_to_a_socket_in_another_runs_directory(pair: dict[str, Any]) -> None:
    # ENOENT: the daemon's directories are an empty tmpfs in the run's view, its own
    # run directory bound back; nothing of the other run's is there to connect to.
    assert pair["lines"].get("connect") == "2", pair["lines"]
    assert "from-another-run" not in pair["other_out"], pair["other_out"]


def test_runs_do_not_share_system_v_ipc(pair: dict[str, Any]) -> None:
    assert pair["other_out"].count("segment=") == 1 and "segment=-1" not in pair["other_out"], pair["other_out"]
    assert pair["lines"].get("shmget") == "2", pair["lines"]  # ENOENT: no such key in its namespace
    assert pair["lines"].get("listed") == "0", pair["lines"]


def test_status_says_the_runs_namespaces_are_in_place_and_proc_is_shared(pair: dict[str, Any]) -> None:
    for st in (pair["probe"], pair["other"]):
        sandbox = st["sandbox"]
        assert sandbox["mode"] == "landlock", sandbox
        assert sandbox["identity"] == "uid 0 on the host, uid 65000 in its own user namespace, no capabilities"
        for private in ("/tmp", "/var/tmp", "/dev/shm", "/run", "/dev/pts", STATE_DIR):
            assert private in sandbox["private"], sandbox
        # What is missing, and why: a /proc of its own (the service's PID namespace is the
        # host's), and the caps of its own user namespace and the daemon's nest (the unit's
        # ProtectKernelTunables= keeps /proc/sys read-only in every namespace of the service).
        problems = sandbox["problems"]
        (problem,) = [p for p in problems if p.startswith("the daemon's /proc")]
        assert "CAP_SYS_ADMIN" in problem, problem
        rest = [p for p in problems if p != problem]
        assert len(rest) == 2, problems
        assert any(p.startswith(_quotas.UNCAPPED) for p in rest), problems
        assert any(p.startswith(_nest.UNBOUNDED) for p in rest), problems
        assert sandbox["proc"] == PROC_SHARED
    # What status says of /proc is so: the other run's runner and the daemon are in sight.
    assert pair["lines"].get("other_cmdline") == pair["lines"].get("daemon_cmdline") == "0", pair["lines"]


def test_with_the_sandbox_off_a_runs_tools_hold_no_capability(agentd: Container) -> None:  # noqa: F811
    # The unit keeps CAP_SETFCAP for a runner's user namespace; a runner that makes none
    # (sandbox = off) drops it too, so no tool holds it (NoNewPrivileges: not at an execve).
    c = agentd
    env = c.run(["cat", ENV_FILE]).stdout
    c.write(ENV_FILE, env + "AGENTD_SANDBOX=off\n", mode="0600")
    c.systemctl("restart", UNIT, timeout_s=60)
    try:
        assert c.run(["grep", "^CapEff", f"/proc/{daemon_pid(c)}/status"]).stdout.split()[1] == "0000000080000000"
        st = wait_end(c, spawn(c, scripted([command("grep ^Cap /proc/self/status")])))
    finally:
        c.write(ENV_FILE, env, mode="0600")
        c.systemctl("restart", UNIT, timeout_s=60)
    assert st["sandbox"]["mode"] == "none" and "sandbox = off" in st["sandbox"]["why"], st["sandbox"]
    caps = dict(line.split(":") for line in outputs(st)[0].splitlines() if line.startswith("Cap"))
    assert {k: v.strip() for k, v in caps.items() if k in ("CapPrm", "CapEff", "CapAmb")} == dict.fromkeys(
        ("CapPrm", "CapEff", "CapAmb"), "0000000000000000"
    ), caps
