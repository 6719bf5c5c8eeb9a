"""One fault harms one run: hostile frames, a journal that cannot be written, fds run out.

Real daemon processes (``real_daemon``) on real SQLite files, real runner trees (the
stand-in runner) and a real websocket; the in-process ones inject a bug into one run's
bookkeeping. In every case the daemon stays up, the other live runs go on and end
normally, and nothing is ``lost``.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

from supervisor.config import Config
from supervisor.core._lifecycle import Lifecycle
from supervisor.core.runs import RunManager
from supervisor.daemon import serve
from tests.conftest import mounted_tmpfs, require
from tests.supervisor.real_daemon import Client, real_daemon
from tests.supervisor.test_runs import FAKE, task, tree_alive

WAIT_S = 20.0


def spec(**behaviour: Any) -> dict[str, Any]:
    return {"task": json.dumps(behaviour)}


async def running_pair(c: Client) -> tuple[str, str]:
    """Two runs that wait for a stop, both past their first snapshot."""
    a = (await c.ok("spawn", spec=spec(snapshots=1)))["run_id"]
    b = (await c.ok("spawn", spec=spec(snapshots=1, log_on_usr1=True)))["run_id"]
    for run in (a, b):
        assert (await c.wait_kind(run, "step_snapshot"))["op"] == "event"
    return a, b


async def stop_and_check(c: Client, *runs: str) -> None:
    for run in runs:
        assert (await c.ok("cancel", run_id=run))["was_active"] is True
    for run in runs:
        assert (await c.wait_end(run, WAIT_S))["state"] == "cancelled"


# --------------------------------------------------------------------------- hostile handshakes

BAD_HANDSHAKES = [
    b"Sec-WebSocket-Protocol: \xe9\r\n",
    b"Sec-WebSocket-Protocol: agentd-dashboard, agentd-session.\xff\xfe\r\n",
]


async def test_a_handshake_the_websocket_library_cannot_parse_harms_nothing(tmp_path: Path) -> None:
    # A byte outside ASCII in a comma-split header raised in trio-websocket's reader
    # (wsproto decodes such headers as ASCII), before any handler or token check: the error
    # ended the server, the daemon and every run. No token was needed.
    with trio.fail_after(60):
        async with real_daemon(tmp_path / "state") as d, d.connect() as c:
            a, b = await running_pair(c)
            host, port = d.url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
            for extra in (*BAD_HANDSHAKES, b"Connection: Upgrade, \xe9\r\n"):
                stream = await trio.open_tcp_stream(host, int(port))
                connection = b"" if extra.startswith(b"Connection") else b"Connection: Upgrade\r\n"
                await stream.send_all(
                    b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n" + connection
                    + b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                    + extra + b"\r\n"
                )  # fmt: skip
                while await stream.receive_some(65536):  # closed by the daemon, not a crash
                    pass
                await stream.aclose()
            assert d.alive(), d.log_text()[-2000:]
            assert (await c.ok("status", run_id=a))["state"] == "running"
            await stop_and_check(c, a, b)
            assert d.alive()
    assert "a connection failed before or during its handshake" in d.log_text()


# --------------------------------------------------------------------------- hostile strings

SURROGATE_FRAMES = [
    '{"id":"s","op":"cancel","run_id":"RUN","reason":"\\ud800"}',
    '{"id":"s","op":"cancel","session_id":"\\udfff"}',
    '{"id":"s","op":"status","run_id":"RUN\\ud800"}',
    '{"id":"s","op":"list","session_id":"\\ud800x"}',
    '{"id":"s","op":"events","run_id":"\\udc00"}',
    '{"id":"s","op":"subscribe","run_id":"\\ud800"}',
    '{"id":"s","op":"steer","run_id":"RUN","text":"go \\udbff"}',
    '{"id":"s","op":"steer","run_id":"\\ud800","text":"go"}',
    '{"id":"s","op":"spawn","spec":{"task":"x"},"session_id":"\\ud800"}',
    '{"id":"s","op":"spawn","spec":{"task":"\\ud800"}}',
    '{"id":"s","op":"spawn","spec":{"task":"x","\\ud800":1}}',
]


async def test_lone_surrogates_are_bad_args_at_the_edge_and_every_live_run_goes_on(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with trio.fail_after(60):
        async with real_daemon(state) as d, d.connect() as c:
            a, b = await running_pair(c)
            for frame in SURROGATE_FRAMES:
                await c.send_raw(frame.replace("RUN", a))
                reply = await c.next_reply()
                assert reply["ok"] is False and reply["error"]["code"] == "bad_args", (frame, reply)
                assert "surrogate" in reply["error"]["message"]
            # More than a grace later (the daemon used to exit one grace after such a
            # cancel): everything still there, on the same connection.
            await c.ok("ping")
            for run in (a, b):
                st = await c.ok("status", run_id=run)
                assert st["state"] == "running" and psutil.pid_exists(st["pid"])
            await stop_and_check(c, a, b)
            assert d.alive()
        async with real_daemon(state) as d, d.connect() as c:  # and after a restart: not lost
            for run in (a, b):
                assert (await c.ok("status", run_id=run))["state"] == "cancelled"


# --------------------------------------------------------------------------- in-process faults


class InProcess:
    def __init__(self, manager: RunManager) -> None:
        self.m = manager


@pytest.fixture
async def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[InProcess]:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent.parent.parent))
    config = Config.load(state_dir=tmp_path / "state", runner_command=tuple(FAKE), grace_s=0.5, environ={})
    stop = trio.Event()
    async with trio.open_nursery() as n:
        info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
        yield InProcess(info["manager"])
        stop.set()


async def first(m: RunManager, run_id: str, kind: str) -> dict[str, Any]:
    async with m.subscribe(run_id) as live:
        for e in await m.events_after(run_id, 0):
            if e["kind"] == kind:
                return e
        async for e in live:
            if e["kind"] == kind:
                return e
    raise AssertionError(f"run {run_id} ended before a {kind!r} event")


async def test_a_bug_in_one_runs_bookkeeping_ends_that_run_alone_with_its_tree_stopped(
    daemon: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = daemon.m
    with trio.fail_after(WAIT_S):
        other = (await m.spawn(task(snapshots=1)))["run_id"]
        await first(m, other, "step_snapshot")
        victim: dict[str, str] = {}
        real_on_event = Lifecycle.on_event

        async def on_event(self: Lifecycle, run: Any, tree: Any, item: Any) -> None:
            if run.run_id == victim.get("id") and getattr(item, "kind", None) == "step_snapshot":
                raise RuntimeError("injected bookkeeping bug")
            await real_on_event(self, run, tree, item)

        monkeypatch.setattr(Lifecycle, "on_event", on_event)
        r = await m.spawn(task(snapshots=1, tree=True))
        victim["id"] = r["run_id"]
        st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "failed" and st["error"]["code"] == "internal"
    assert "injected bookkeeping bug" in st["error"]["message"]
    assert st["receipt"]["path_b"]["survivors"] == []  # its whole tree was stopped
    assert tree_alive(st["tree_id"]) == []
    assert (await m.status(other))["state"] == "running"  # the other run goes on
    with trio.fail_after(WAIT_S):
        await m.cancel(other)
        assert (await m.wait_terminal(other))["state"] == "cancelled"


async def test_a_terminal_fact_that_cannot_be_stored_as_it_is_is_stored_minimal(
    daemon: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = daemon.m
    real_finish = m.journal.finish
    calls: list[str] = []

    async def finish(run_id: str, state: Any, **kw: Any) -> bool:
        calls.append(run_id)
        if len(calls) == 1:
            raise TypeError("injected: this fact cannot be encoded")
        return await real_finish(run_id, state, **kw)

    monkeypatch.setattr(m.journal, "finish", finish)
    with trio.fail_after(WAIT_S):
        r = await m.spawn(task(wait=False))
        st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "completed" and st["reason"] == "internal"
    assert st["error"]["code"] == "internal"
    assert calls == [r["run_id"], r["run_id"]]


async def test_a_lone_surrogate_reaching_the_run_manager_is_stored_escaped(daemon: InProcess) -> None:
    m = daemon.m
    with trio.fail_after(WAIT_S):
        r = await m.spawn(task(snapshots=1))
        await first(m, r["run_id"], "step_snapshot")
        await m.cancel(r["run_id"], reason="stop \ud800")
        st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled" and st["reason"] == "stop \\ud800"


# --------------------------------------------------------------------------- journal unwritable


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted for the test (root only), unmounted after it."""
    with mounted_tmpfs(tmp_path, 4) as mnt:
        yield mnt


def fill(path: Path) -> None:
    # Unbuffered: a buffered file kept what a short write left, and its close raised ENOSPC
    # (how much was left depended on the space the journal took: it failed after schema v6).
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass


async def until(check: Any, timeout_s: float = WAIT_S) -> Any:
    """Poll a condition the daemon changes on its own clock (its 1 s journal retry)."""
    with trio.fail_after(timeout_s):
        while not (value := await check()):
            await trio.sleep(0.05)
        return value


async def journal_state(c: Client) -> dict[str, Any]:
    return (await c.ok("status"))["summary"]["journal"]


async def test_a_full_journal_degrades_the_daemon_keeps_every_fact_and_loses_no_run(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    state = small_tmpfs / "state"
    notify = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await notify.bind(str(tmp_path / "notify"))
    env = {"AGENTD_RUNS_DIR": str(tmp_path / "runs"), "NOTIFY_SOCKET": str(tmp_path / "notify")}
    filler = small_tmpfs / "filler"

    async def status_line(prefix: str) -> str:  # what systemd would show
        while True:
            for field in (await notify.recv(4096)).decode().splitlines():
                if field.startswith("STATUS=" + prefix):
                    return field

    with notify, trio.fail_after(90):
        async with real_daemon(state, env=env) as d, d.connect() as c:
            a, b = await running_pair(c)
            assert (await journal_state(c))["writable"] is True
            fill(filler)  # the journal's filesystem is full from here on
            reply = await c.ok("cancel", run_id=a)
            assert reply["was_active"] is True and "not durable yet" in reply["warning"]
            end = await c.wait_end(a, WAIT_S)
            assert end["state"] == "cancelled"
            journal = await journal_state(c)
            assert journal["writable"] is False and "full" in journal["error"]
            assert journal["pending_writes"] > 0
            st = await c.ok("status", run_id=a)
            assert st["state"] == "cancelled" and st["journal"].startswith("pending")
            refused = await c.call("spawn", spec=spec(snapshots=1))
            assert refused["ok"] is False and refused["error"]["code"] == "refused"
            assert "journal cannot be written" in refused["error"]["message"]
            assert (await c.ok("status"))["summary"]["accepting"] is False  # as the refusal says
            b_status = await c.ok("status", run_id=b)
            assert b_status["state"] == "running" and psutil.pid_exists(b_status["pid"])
            # A steer is refused: it is journaled before it reaches the runner, as an answer is.
            steer = await c.ok("steer", run_id=b, text="while degraded")
            assert steer["accepted"] is False and "cannot be journaled" in steer["why"], steer
            # An event of the live run's, handed out and waiting for the journal: status and
            # list say its number (they said the journal's: behind what `events` gives).
            pidfd = os.pidfd_open(b_status["pid"])  # the runner this test's daemon started, pinned
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGUSR1)
            finally:
                os.close(pidfd)
            await c.wait_for(b, lambda m: m.get("kind") == "log" and m["data"].get("message") == "usr1")
            b_last = (await c.ok("events", run_id=b))["events"][-1]["seq"]
            assert (await c.ok("status", run_id=b))["last_seq"] == b_last
            listed = {r["id"]: r for r in (await c.ok("list"))["runs"]}
            assert listed[b]["last_seq"] == b_last
            assert "degraded" in d.log_text()
            assert "journal not writable" in await status_line("degraded")

            filler.unlink()  # space again: what waited is written
            await until(lambda: _writable(c))
            assert "live run" in await status_line("running")  # healthy again
            assert (await c.ok("status"))["summary"]["accepting"] is True
            st = await c.ok("status", run_id=a)
            assert st["state"] == "cancelled" and "journal" not in st
            seqs = [e["seq"] for e in (await c.ok("events", run_id=a))["events"]]
            assert seqs == list(range(1, len(seqs) + 1))
            await stop_and_check(c, b)
            assert d.alive()
        async with real_daemon(state, env=env) as d, d.connect() as c:  # durable: not lost
            for run in (a, b):
                st = await c.ok("status", run_id=run)
                assert st["state"] == "cancelled", st
            events = (await c.ok("events", run_id=a))["events"]
            assert events[-1]["kind"] == "state" and events[-1]["data"]["state"] == "cancelled"


async def _writable(c: Client) -> bool:
    return bool((await journal_state(c))["writable"])


@pytest.fixture
def ext4_turning_read_only(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A small ext4 on a loop device, mounted ``errors=remount-ro`` (root only).

    Yields its mount point and its ``trigger_fs_error`` file: writing there raises an ext4
    error, and the filesystem turns read-only at once, open files included, as a real
    one does on a disk fault. (A read-only remount is refused while the journal is open
    for writing, and ``chattr +i`` does not reach a file already open, on tmpfs.)
    """
    require(os.geteuid() == 0, "root, to set up a loop device")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 * 1024 * 1024)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    require(made.returncode == 0, f"mkfs.ext4 ({made.stderr.decode().strip()})")
    attached = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
    require(attached.returncode == 0, f"a free loop device ({attached.stderr.strip()})")
    loop = attached.stdout.strip()
    try:
        mounted = subprocess.run(["mount", "-o", "errors=remount-ro", loop, str(mnt)], capture_output=True)
        require(mounted.returncode == 0, f"mount -t ext4 ({mounted.stderr.decode().strip()})")
        try:
            trigger = Path("/sys/fs/ext4") / Path(loop).name / "trigger_fs_error"
            require(trigger.exists(), f"{trigger} (ext4's error trigger)")
            yield mnt, trigger
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
    finally:
        subprocess.run(["losetup", "--detach", loop], check=False)


async def test_a_journal_whose_filesystem_turns_read_only_degrades_the_daemon_and_spares_every_run(
    tmp_path: Path, ext4_turning_read_only: tuple[Path, Path]
) -> None:
    mnt, trigger = ext4_turning_read_only
    state = mnt  # the daemon's log goes beside it (real_daemon), off the faulty filesystem
    probe = mnt / "probe"
    probe.write_text("written before the fault\n")
    with trio.fail_after(90):
        async with real_daemon(state, env={"AGENTD_RUNS_DIR": str(tmp_path / "runs")}) as d, d.connect() as c:
            a, b = await running_pair(c)
            assert (await journal_state(c))["writable"] is True
            trigger.write_text("agentd test: the journal's filesystem turns read-only\n")
            with pytest.raises(OSError) as fault:  # the filesystem's word, beside the daemon's
                probe.write_text("after the fault")
            assert fault.value.errno == errno.EROFS
            reply = await c.ok("cancel", run_id=a)  # run A's stop needs a write: it is answered
            assert reply["was_active"] is True and "not durable yet" in reply["warning"]
            assert (await c.wait_end(a, WAIT_S))["state"] == "cancelled"
            journal = await journal_state(c)
            assert journal["writable"] is False and journal["error"], journal
            assert journal["pending_writes"] > 0
            st = await c.ok("status", run_id=a)
            assert st["state"] == "cancelled" and st["journal"].startswith("pending")
            refused = await c.call("spawn", spec=spec(snapshots=1))
            assert refused["ok"] is False and refused["error"]["code"] == "refused"
            assert "journal cannot be written" in refused["error"]["message"]
            assert "degraded" in d.log_text()
            # Run B, which the fault did not touch, runs on and ends as asked.
            b_status = await c.ok("status", run_id=b)
            assert b_status["state"] == "running" and psutil.pid_exists(b_status["pid"])
            assert not [r for r in (await c.ok("list"))["runs"] if r["state"] == "lost"]
            await stop_and_check(c, b)
            assert (await c.ok("status", run_id=b))["state"] == "cancelled"
            assert d.alive()
            await c.ok("ping")  # and serves on
    # Stopped with the filesystem still read-only: it ends as asked, and says what its
    # memory held that the journal never got.
    assert d.proc.returncode == 0, d.log_text()[-3000:]
    unwritten = [line for line in d.log_text().splitlines() if "never reached the journal" in line]
    assert {run for run in (a, b) if any(f"run {run}:" in line for line in unwritten)} == {a, b}, unwritten


# --------------------------------------------------------------------------- fd exhaustion

NOFILE = 128


def low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_a_connection_flood_at_a_low_nofile_limit_leaves_the_daemon_and_its_runs_whole(
    tmp_path: Path,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    flood_n = 3 * NOFILE
    if soft < flood_n + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, flood_n + 256), hard))
    socks: list[socket.socket] = []
    try:
        with trio.fail_after(90):
            async with real_daemon(tmp_path / "state", preexec_fn=low_nofile) as d, d.connect() as c:
                a, b = await running_pair(c)
                host, port = d.url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
                peak = 0
                for i in range(flood_n):  # held open, never a byte sent
                    s = socket.socket()
                    s.setblocking(False)
                    try:
                        s.connect((host, int(port)))
                    except BlockingIOError:
                        pass
                    socks.append(s)
                    if i % 32 == 0:
                        await trio.lowlevel.checkpoint()  # let the daemon accept (it is another process)
                        peak = max(peak, open_fds(d.pid))
                # On the connection it had before: it serves, spawns and stops.
                quick = (await c.ok("spawn", spec=spec(wait=False)))["run_id"]
                assert (await c.wait_end(quick, WAIT_S))["state"] == "completed"
                info = (await c.ok("ping"))["connection_limits"]
                # Beyond the cap each newcomer closed the oldest silent one (or was refused).
                assert info["refused"] + info["evicted"] > 0 and info["total"] < NOFILE
                peak = max(peak, open_fds(d.pid))
                assert peak < NOFILE
                await stop_and_check(c, a)
                for s in socks:
                    s.close()
                socks.clear()

                async def slots_free() -> bool:  # handshakes in flight end by their timeout
                    return (await c.ok("ping"))["connection_limits"]["open"] == 1

                await until(slots_free)
                async with d.connect() as fresh:  # a new client gets in again
                    assert (await fresh.ok("status", run_id=b))["state"] == "running"
                await stop_and_check(c, b)
                assert d.alive()
    finally:
        for s in socks:
            s.close()


def test_a_proc_scan_without_a_free_fd_fails_softly_and_is_retried() -> None:
    # In a child whose fd limit is what it has open already: every /proc scan fails with
    # EMFILE. The reaping pass logs it and returns; a second pass works once fds are free.
    code = """
import logging, os, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from supervisor.trees.containment import Containment
c = Containment.setup(cgroups="off")
spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(3)]
used = len(os.listdir("/proc/self/fd")) - 1  # the listing counts its own fd
resource.setrlimit(resource.RLIMIT_NOFILE, (used, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
c._pass(note=True)  # a pass that reads the daemon's children: must not raise
for fd in spare:
    os.close(fd)
c._pass(note=True)
c.close()
print("alive")
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent.parent)),
    )
    assert done.returncode == 0, done.stderr
    assert "a /proc scan failed" in done.stdout and "Too many open files" in done.stdout
    assert done.stdout.strip().endswith("alive")


# --------------------------------------------------------------------------- group records


async def test_status_shows_a_runs_groups_ended_once_its_receipt_saw_the_tree_dead(daemon: InProcess) -> None:
    m = daemon.m
    with trio.fail_after(WAIT_S):
        r = await m.spawn(task(snapshots=1, group=True))
        await first(m, r["run_id"], "step_snapshot")
        live = await m.status(r["run_id"])
        assert [g["alive"] for g in live["groups"]] == [True]
        await m.cancel(r["run_id"])
        st = await m.wait_terminal(r["run_id"])
    assert st["state"] == "cancelled" and st["receipt"]["path_b"]["survivors"] == []
    (group,) = st["groups"]
    assert group["alive"] is False and group["ended_at"] is not None
    assert group["added_at"] <= group["ended_at"] <= st["ended_at"]
