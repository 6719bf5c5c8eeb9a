"""A run that fills the disk harms that run only (``supervisor.core.diskguard``).

The end-to-end test puts a daemon's state dir (journal, run dirs) on a small tmpfs it
mounts (root only) and runs real runners (scripted model): one runs ``dd`` until the
disk is full, two wait at a gate. The filler is stopped, reason ``disk_full``, its run
dir removed; the journal is writable again, a spawn is accepted, the other two complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
import trio.testing

from supervisor.cli import _print_run, format_event
from supervisor.config import Config
from supervisor.core import diskguard
from supervisor.core._run import Run
from supervisor.core.diskguard import (
    BLAME_MIN_BYTES,
    DISK_FULL_REASON,
    DiskGuard,
    choose_run,
    min_free_inodes,
    space_held,
    usage_held,
)
from supervisor.core.runs import RunManager
from supervisor.core.sessions import SessionDesk
from supervisor.core.token import CancelToken
from supervisor.daemon import serve
from supervisor.errors import ConfigError
from supervisor.states import RunState
from supervisor.store.journal import Journal
from tests.conftest import mounted_tmpfs
from tests.supervisor.test_restart import Client
from tests.supervisor.test_restart_stop import daemon
from tests.supervisor.test_runs_real import gated_script
from tests.supervisor.test_stop_tools import command_alive, wait_event

MiB = 1024 * 1024

# --------------------------------------------------------------------------- the choice


def test_the_run_holding_the_most_is_chosen() -> None:
    held = {"a": 3 * MiB, "b": 40 * MiB, "c": 12 * MiB}
    assert choose_run(held, min_free=64 * MiB) == "b"


def test_no_run_is_chosen_when_none_holds_a_share_of_the_mark() -> None:
    # The disk went full with files no run holds (the host's): stopping the biggest run
    # (7 MiB, under 1/8 of a 256 MiB mark) would not bring the space back.
    assert choose_run({"a": 7 * MiB, "b": 1 * MiB}, min_free=256 * MiB) is None
    assert choose_run({"a": 32 * MiB, "b": 1 * MiB}, min_free=256 * MiB) == "a"
    # A small mark still asks for a run holding something worth stopping it for.
    assert choose_run({"a": BLAME_MIN_BYTES - 1}, min_free=MiB) is None
    assert choose_run({}, min_free=MiB) is None


def test_a_tie_goes_to_the_first_run() -> None:
    assert choose_run({"a": 5 * MiB, "b": 5 * MiB}, min_free=MiB) == "a"


def test_space_held_counts_a_runs_files_and_not_what_its_links_point_to(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "tmp" / "deep").mkdir(parents=True)
    (run_dir / "tmp" / "deep" / "a").write_bytes(os.urandom(3 * MiB))
    (run_dir / "b").write_bytes(os.urandom(MiB))
    outside = tmp_path / "outside"
    outside.write_bytes(os.urandom(5 * MiB))
    (run_dir / "link").symlink_to(outside)
    dev = os.stat(tmp_path).st_dev
    held = space_held([run_dir, tmp_path / "gone"], dev)
    assert 4 * MiB <= held < 4 * MiB + 256 * 1024
    assert space_held([run_dir], dev + 1) == 0  # another filesystem: not entered


def test_usage_held_counts_a_runs_inodes_each_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "d").mkdir(parents=True)
    for i in range(5):
        (run_dir / "d" / str(i)).touch()
    os.link(run_dir / "d" / "0", run_dir / "again")  # one inode, two names
    (run_dir / "link").symlink_to(tmp_path)
    dev = os.stat(tmp_path).st_dev
    assert usage_held([run_dir], dev)[1] == 1 + 1 + 5 + 1  # run, d, five files, the link itself
    assert usage_held([run_dir], dev + 1) == (0, 0)


def test_the_inode_mark_is_the_share_of_the_inodes_that_the_byte_mark_is_of_the_bytes(tmp_path: Path) -> None:
    config = Config.load(state_dir=tmp_path, disk_min_free_mib=2, disk_min_free_percent=0, environ={})
    assert min_free_inodes(config, 64 * MiB, 4000) == 125
    assert min_free_inodes(config, MiB, 4000) == 4000  # a mark past the size: all of them
    assert min_free_inodes(config, 64 * MiB, 0) == 0  # no fixed number of inodes (btrfs)
    off = Config.load(state_dir=tmp_path, disk_min_free_mib=0, disk_min_free_percent=0, environ={})
    assert min_free_inodes(off, 64 * MiB, 4000) == 0


# --------------------------------------------------------------------------- end to end


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs mounted for the test (root only), unmounted after it."""
    with mounted_tmpfs(tmp_path, 24) as mnt:
        yield mnt


def scripted(script: dict[str, Any]) -> dict[str, Any]:
    return {"task": "t", "model": {"provider": "scripted", "script": script}}


FILL = 'dd if=/dev/zero of="$TMPDIR/fill" bs=64k; echo filled; sleep 600'
# The same into a file it deleted first and keeps open (the shell's fd 3, dd's stdout):
# no path leads to the space, no walk of the run dir finds it, ``df`` shows it gone.
FILL_DELETED = 'exec 3>"$TMPDIR/fill"; rm "$TMPDIR/fill"; dd if=/dev/zero bs=64k >&3; echo filled; sleep 600'


async def until(check: Any, timeout_s: float = 20.0) -> Any:
    """Poll what the daemon changes on its own clock (its 1 s journal retry)."""
    with trio.fail_after(timeout_s):
        while not (value := await check()):
            await trio.sleep(0.05)
        return value


@pytest.mark.parametrize(
    ("noticed_by", "fill"),
    [("tick", FILL), ("journal_full", FILL), ("tick", FILL_DELETED)],
    ids=["tick", "journal_full", "deleted_but_open"],
)
async def test_a_run_that_fills_the_disk_is_stopped_and_the_others_go_on(
    disk: Path, monkeypatch: pytest.MonkeyPatch, noticed_by: str, fill: str
) -> None:
    """``tick``: the guard's slow timer while runs are live finds the disk full (nothing
    else wakes the daemon: ``dd`` makes no event). ``journal_full``: no timer; a journal
    write that fails for want of space makes the guard look at once. ``deleted_but_open``:
    the filler writes into a file it deleted (held open by two of its processes): the
    guard counts it through their descriptors, once."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if noticed_by == "journal_full":
        monkeypatch.setattr(diskguard, "TICK_S", 3600.0)
    config = Config.load(state_dir=disk / "state", grace_s=2, disk_min_free_mib=2, disk_min_free_percent=0, environ={})
    stop = trio.Event()
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
            m: RunManager = info["manager"]
            a, b = [(await m.spawn(scripted(gated_script([]))))["run_id"] for _ in range(2)]
            for run in (a, b):
                await wait_event(m, run, command_alive)
            filler = (
                await m.spawn(
                    scripted(
                        {
                            "turns": [
                                {
                                    "text": "Filling.",
                                    "tool_calls": [{"name": "run_command", "arguments": {"command": fill}}],
                                }
                            ],
                            "final": "never",
                        }
                    )
                )
            )["run_id"]
            await wait_event(m, filler, command_alive)
            filler_dir = Path((await m.status(filler))["run_dir"])
            if noticed_by == "journal_full":
                await until(lambda: _full(disk))
                # A journal write for another run (a steer's, journaled before it is sent)
                # fails (SQLITE_FULL): the steer is refused, and the disk guard looks.
                refused = await m.steer(a, "go on")
                assert refused["accepted"] is False and "cannot be journaled" in refused["why"], refused

            with trio.fail_after(30):
                st = await m.wait_terminal(filler)
            assert st["state"] == "cancelled" and st["reason"] == DISK_FULL_REASON, st
            detail = st["receipt"]["stop_detail"]
            assert detail["reason"] == DISK_FULL_REASON and detail["held_bytes"] > 10 * MiB
            if fill == FILL_DELETED:  # all of it through the descriptors; the inode once
                assert 10 * MiB < detail["held_deleted_bytes"] <= detail["held_bytes"] < 24 * MiB, detail
            else:
                assert detail["held_deleted_bytes"] == 0, detail
            assert detail["free_bytes"] < detail["min_free_bytes"] == 2 * MiB
            assert st["result"] is not None  # its progress is kept, as for any stop
            kinds = [e["kind"] for e in await m.events_after(filler, 0)]
            assert DISK_FULL_REASON in kinds

            # Its space comes back: its run dir goes as every run's does; the journal can
            # be written again and spawns are taken.
            await until(lambda: _gone(filler_dir))
            await until(lambda: _journal_writable(m))
            summary = await m.summary()
            assert summary["accepting"] is True
            assert summary["disk"]["runs_stopped"] == 1 and summary["disk"]["last_stop"]["run_id"] == filler
            # The others went on throughout, and end as they would have.
            for run in (a, b):
                assert (await m.status(run))["state"] == "running"
                (Path((await m.status(run))["run_dir"]) / "go").touch()
            for run in (a, b):
                assert (await m.wait_terminal(run))["state"] == "completed"
            d = (await m.spawn(scripted({"turns": [], "final": "after"})))["run_id"]
            done = await m.wait_terminal(d)
            assert done["state"] == "completed" and done["result"]["final_text"] == "after"
            st = await m.status(filler)
            assert st["state"] == "cancelled" and st["reason"] == DISK_FULL_REASON and "journal" not in st
            stop.set()


# Empty files until the filesystem has no inode left: no space taken, yet no other run
# could make a file, and no spawn its run dir.
FILL_INODES = (
    "python3 -c 'import os\n"
    'd, i = os.environ["TMPDIR"], 0\n'
    "try:\n"
    '    while True: open(f"{d}/f{i}", "x").close(); i += 1\n'
    'except OSError as e: print("made", i, e)\'; sleep 600'
)


async def test_a_run_that_uses_up_the_inodes_is_stopped_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard looked at free bytes only: a run that made empty files until the state
    # dir's filesystem had no inode left was never stopped (its files take no space),
    # while every spawn failed ('could not start the runner: No space left on device')
    # and the other runs could make no file in their own run dirs.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setattr(diskguard, "TICK_S", 0.5)
    with mounted_tmpfs(tmp_path, 64, inodes=4000) as disk:
        config = Config.load(
            state_dir=disk / "state", grace_s=2, disk_min_free_mib=2, disk_min_free_percent=0, environ={}
        )
        stop = trio.Event()
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                info = await n.start(lambda task_status: serve(config, stop=stop, task_status=task_status))
                m: RunManager = info["manager"]
                a = (await m.spawn(scripted(gated_script([]))))["run_id"]
                await wait_event(m, a, command_alive)
                fill = [
                    {"text": "Filling.", "tool_calls": [{"name": "run_command", "arguments": {"command": FILL_INODES}}]}
                ]
                filler = (await m.spawn(scripted({"turns": fill, "final": "never"})))["run_id"]
                await wait_event(m, filler, command_alive)
                filler_dir = Path((await m.status(filler))["run_dir"])
                with trio.fail_after(30):
                    st = await m.wait_terminal(filler)
                assert st["state"] == "cancelled" and st["reason"] == DISK_FULL_REASON, st
                detail = st["receipt"]["stop_detail"]
                assert detail["short_of"] == "inodes" and detail["total_inodes"] == 4000, detail
                # 4000 inodes, a mark of 2 MiB of 64: 1/32 of them, 125.
                assert detail["min_free_inodes"] == 125 and detail["free_inodes"] < 125, detail
                assert 2000 < detail["held_inodes"] <= 4000 and detail["next_most_inodes"] < 100, detail
                assert "inodes free of 4000" in detail["message"], detail
                # Its inodes come back with its run dir: the other run makes its file and
                # ends as it would have, and a spawn is taken and completes.
                await until(lambda: _gone(filler_dir))
                assert (await m.status(a))["state"] == "running"
                (Path((await m.status(a))["run_dir"]) / "go").touch()
                assert (await m.wait_terminal(a))["state"] == "completed"
                d = (await m.spawn(scripted({"turns": [], "final": "after"})))["run_id"]
                assert (await m.wait_terminal(d))["state"] == "completed"
                watched = (await m.summary())["disk"]["watched"][0]
                assert watched["total_inodes"] == 4000 and watched["min_free_inodes"] == 125, watched
                stop.set()


async def _full(path: Path) -> bool:
    return os.statvfs(path).f_bavail == 0


async def _gone(path: Path) -> bool:
    return not path.exists()


async def _journal_writable(m: RunManager) -> bool:
    return bool((await m.summary())["journal"]["writable"])


# --------------------------------------------------------------------------- the guard's check


class FakeManager:
    """What the guard calls: the run book's record, the manager's cancel, the sessions'
    profile eviction; each call kept."""

    def __init__(self, tmp_path: Path) -> None:
        self.live: dict[str, Run] = {}
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.cancels: list[tuple[str, str]] = []
        self.evicted: list[tuple[str, str]] = []
        self.profiles = tmp_path / "profiles"

    def add(self, run_id: str, size: int, tmp_path: Path, *, profile: int = 0) -> Run:
        run = Run(
            run_id=run_id,
            session_id="s-" + run_id if profile else None,
            spec={"browser": True} if profile else {},
            timeout_s=None,
            token=CancelToken(run_id),
            state=RunState.RUNNING,
            run_dir=tmp_path / "runs" / run_id,
        )
        assert run.run_dir is not None
        (run.run_dir / "tmp").mkdir(parents=True)
        (run.run_dir / "tmp" / "data").write_bytes(os.urandom(size))
        if profile:
            (self.profiles / run_id).mkdir(parents=True)
            (self.profiles / run_id / "Cookies").write_bytes(os.urandom(profile))
        self.live[run_id] = run
        return run

    def guard(self, config: Config) -> DiskGuard:
        return DiskGuard(
            config,
            self.live,
            record=self.record,
            cancel=self.cancel,
            profile_of=self.profile_of,
            evict_profile=self.evict,
        )

    def profile_of(self, run: Run) -> Path | None:
        return self.profiles / run.run_id if run.session_id is not None else None

    async def record(self, run: Run, kind: str, data: dict[str, Any]) -> None:
        self.events.append((run.run_id, kind, data))

    async def cancel(self, run_id: str, reason: str) -> None:
        self.live[run_id].token.cancel(reason)
        self.cancels.append((run_id, reason))

    async def evict(self, session_id: str, why: str) -> None:
        self.evicted.append((session_id, why))

    def end(self, run: Run) -> None:
        """The run ends as the lifecycle ends it: let go, then its directory removed."""
        del self.live[run.run_id]
        run.done.set()
        assert run.run_dir is not None
        shutil.rmtree(run.run_dir)


async def settled(guard: DiskGuard) -> None:
    """The guard's stop has dealt with its session's profile (removed it, or kept it)."""
    assert guard._stopping is not None
    with trio.fail_after(10):
        await guard._stopping[2].wait()


def full_disk(path: str | os.PathLike[str]) -> os.statvfs_result:  # noqa: ARG001
    """A 64 MiB filesystem with nothing free."""
    return os.statvfs_result((4096, 4096, 16384, 0, 0, 0, 0, 0, 0, 255))


async def test_the_guard_stops_the_worst_run_one_at_a_time_and_a_session_turn_loses_its_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state").mkdir()
    config = Config.load(state_dir=tmp_path / "state", disk_min_free_mib=1, disk_min_free_percent=0, environ={})
    fake = FakeManager(tmp_path)
    small = fake.add("small", 3 * MiB, tmp_path)
    fake.add("tiny", 512 * 1024, tmp_path)
    browser = fake.add("browser", 256 * 1024, tmp_path, profile=6 * MiB)  # its profile holds the most
    guard = fake.guard(config)
    await guard.check()
    assert fake.cancels == []  # the disk has room
    monkeypatch.setattr(os, "statvfs", full_disk)
    async with trio.open_nursery() as nursery:
        guard._nursery = nursery
        await guard.check()
        assert fake.cancels == [("browser", DISK_FULL_REASON)]
        [(run_id, kind, detail)] = fake.events
        assert (run_id, kind) == ("browser", DISK_FULL_REASON)
        assert detail["free_bytes"] == 0 and detail["min_free_bytes"] == MiB
        assert 6 * MiB <= detail["held_bytes"] < 7 * MiB and 3 * MiB <= detail["next_most_bytes"] < 4 * MiB
        assert browser.stop_detail == detail
        guard.journal_failed()
        await guard.check()  # still full, but its stop has not brought the space back yet
        assert len(fake.cancels) == 1 and fake.evicted == []
        fake.end(browser)
        await settled(guard)
        assert [(sid, why.split(" (")[0]) for sid, why in fake.evicted] == [
            ("s-browser", "its turn browser filled the disk")
        ]
        await guard.check()  # still full: the next worst, right away
        assert fake.cancels[1:] == [("small", DISK_FULL_REASON)]
        fake.end(small)
        guard.journal_failed()
        await guard.check()  # what is left holds too little to blame (the host filled it)
        assert len(fake.cancels) == 2
    assert guard.stopped == 2 and guard.describe()["last_stop"]["run_id"] == "small"


async def test_a_session_turn_that_filled_its_run_dir_keeps_its_small_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "state").mkdir()
    config = Config.load(state_dir=tmp_path / "state", disk_min_free_mib=1, disk_min_free_percent=0, environ={})
    fake = FakeManager(tmp_path)
    turn = fake.add("turn", 6 * MiB, tmp_path, profile=4096)  # the space is in its run dir
    guard = fake.guard(config)
    monkeypatch.setattr(os, "statvfs", full_disk)
    async with trio.open_nursery() as nursery:
        guard._nursery = nursery
        await guard.check()
        assert fake.cancels == [("turn", DISK_FULL_REASON)]
        fake.end(turn)
        await settled(guard)
    # Its run dir goes with the run; the session's profile (cookies, a login) stays.
    assert fake.evicted == [] and (fake.profiles / "turn" / "Cookies").exists()


def test_the_cli_says_why_the_daemon_stopped_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    message = "the filesystem of /s had 0 bytes free, below its low-water mark of 2097152; this run held ..."
    line = format_event({"seq": 7, "ts": 0.0, "kind": DISK_FULL_REASON, "data": {"message": message}})
    assert "stopped by the daemon, the disk is full: the filesystem of /s had 0 bytes free" in line
    receipt = {"cancel_reason": DISK_FULL_REASON, "stop_detail": {"reason": DISK_FULL_REASON, "message": message}}
    _print_run({"id": "r-1", "state": "cancelled", "reason": DISK_FULL_REASON, "receipt": receipt})
    out = capsys.readouterr().out
    assert "cancelled (disk_full)" in out and f"by the daemon: {message}" in out


def test_the_low_water_mark_is_the_larger_of_its_two_settings(tmp_path: Path) -> None:
    default = Config.load(state_dir=tmp_path, environ={})
    assert (default.disk_min_free_mib, default.disk_min_free_percent) == (256, 1.0)
    assert default.min_free_bytes(10 * 1024 * MiB) == 256 * MiB  # 1 % of 10 GiB is less
    assert default.min_free_bytes(1024 * 1024 * MiB) == 1024 * 1024 * MiB // 100  # 1 % of 1 TiB
    env = {"AGENTD_DISK_MIN_FREE_MIB": "0", "AGENTD_DISK_MIN_FREE_PERCENT": "0"}
    off = Config.load(state_dir=tmp_path, environ=env)
    assert off.min_free_bytes(MiB * 1024) == 0
    for bad in ("-1", "100", "nan"):
        with pytest.raises(ConfigError, match="disk_min_free_percent"):
            Config.load(state_dir=tmp_path, environ={"AGENTD_DISK_MIN_FREE_PERCENT": bad})
    with pytest.raises(ConfigError, match="disk_min_free_mib"):
        Config.load(state_dir=tmp_path, environ={"AGENTD_DISK_MIN_FREE_MIB": "-5"})


async def test_a_session_whose_turn_filled_the_disk_loses_its_profile_and_stays_open(tmp_path: Path) -> None:
    async with await Journal.open(tmp_path / "j.sqlite3") as journal:
        live = {"s1"}
        sessions = SessionDesk(
            Config.load(state_dir=tmp_path / "state", environ={}), journal, live_sessions=lambda: set(live)
        )
        await sessions.open("s1")
        profile = sessions.profile_path("s1")
        profile.mkdir(parents=True)
        (profile / "junk").write_bytes(b"\0" * 4096)
        await journal.set_profile("s1", str(profile), used_at=0.0)
        assert await sessions.evict_profile("s1", "its turn r-1 filled the disk") is False  # a turn is live
        assert (profile / "junk").exists()
        live.clear()
        assert await sessions.evict_profile("s1", "its turn r-1 filled the disk") is True
        assert not profile.exists() and await journal.profiles() == []
        await sessions.open("s1")  # still open: its next turn makes a new profile


async def test_a_run_being_stopped_for_another_reason_that_holds_the_most_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run that filled the disk is being stopped by its user (its command may write on
    # through the grace): the guard left it out and stopped an innocent run holding far
    # less, "the most of the live runs". It waits for the stopping run's end instead.
    (tmp_path / "state").mkdir()
    config = Config.load(state_dir=tmp_path / "state", disk_min_free_mib=1, disk_min_free_percent=0, environ={})
    fake = FakeManager(tmp_path)
    filler = fake.add("filler", 8 * MiB, tmp_path)
    fake.add("innocent", 2 * MiB, tmp_path)
    filler.token.cancel("user")  # its stop is under way (its grace)
    guard = fake.guard(config)
    monkeypatch.setattr(os, "statvfs", full_disk)
    guard.journal_failed()
    await guard.check()
    assert fake.cancels == [] and fake.events == [] and filler.stop_detail is None
    guard.journal_failed()
    await guard.check()  # still full: its stop has not brought the space back yet
    assert fake.cancels == []
    fake.end(filler)
    await guard.check()  # its space is back; were the disk still full, the next worst goes
    assert fake.cancels == [("innocent", DISK_FULL_REASON)]
    assert guard.stopped == 1


# --------------------------------------------------------------------------- across a restart


async def _until_state(c: Client, run_id: str, state: str) -> None:
    await c.call("subscribe", run_id=run_id, after_seq=0)
    while True:
        msg = json.loads(await c.ws.get_message())
        if msg.get("op") == "event" and msg["run_id"] == run_id and msg["kind"] == "state":
            if msg["data"]["state"] == state:
                await c.call("unsubscribe", sub=msg["sub"])
                return
        assert not (msg.get("op") == "end" and msg["run_id"] == run_id), msg


async def test_a_disk_full_stop_keeps_its_measurement_across_a_daemon_kill(disk: Path) -> None:
    """The daemon is SIGKILLed while it stops a run for a full disk: the daemon that
    finishes the stop writes the same ``stop_detail`` in the receipt (it lived in the
    first daemon's memory only)."""
    # The filler writes 14 MiB and waits: below the 12 MiB mark of a 24 MiB disk, with room
    # left for the journal; its command may finish (policy), so the stop lasts the grace.
    spec = scripted(
        {
            "turns": [
                {
                    "text": "Filling.",
                    "tool_calls": [
                        {
                            "name": "run_command",
                            "arguments": {"command": 'dd if=/dev/zero of="$TMPDIR/fill" bs=1M count=14; sleep 600'},
                        }
                    ],
                }
            ],
            "final": "never",
        }
    )
    spec["stop_policy"] = {"run_command": "finish"}
    state = disk / "state"
    settings = {"disk_min_free_mib": "12", "disk_min_free_percent": "0"}
    with trio.fail_after(60):
        async with daemon(state, grace_s=4.0, **settings) as (d1, c):
            rid = (await c.call("spawn", spec=spec))["run_id"]
            await _until_state(c, rid, "cancelling")  # its intent is journaled: then the reply
            first = await c.call("status", run_id=rid)
            runner = first["pid"]
            events = (await c.call("events", run_id=rid))["events"]
            (measured,) = [e["data"] for e in events if e["kind"] == DISK_FULL_REASON]
            await c.ws.aclose()
            d1.kill()  # SIGKILL, mid-stop: the daemon this test started
            await d1.wait()
        assert first["cancel_reason"] == DISK_FULL_REASON and psutil.pid_exists(runner)
        async with daemon(state, grace_s=4.0, **settings) as (d2, c):
            assert await c.wait_for(rid) == "cancelled"
            final = await c.call("status", run_id=rid)
    assert (final["reason"], final["cancel_reason"]) == (DISK_FULL_REASON, DISK_FULL_REASON), final
    assert measured["held_bytes"] >= 14 * MiB and measured["min_free_bytes"] == 12 * MiB
    assert final["receipt"]["stop_detail"] == measured, final["receipt"]


async def test_a_users_stop_during_the_guards_event_write_does_not_take_its_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard wrote its disk_full event, then stopped the run: a user's cancel that
    # landed during that write won the run's reason ('user'), while the event, the
    # receipt's detail and the guard's count said 'disk_full'. Its stop comes first now.
    (tmp_path / "state").mkdir()
    config = Config.load(state_dir=tmp_path / "state", disk_min_free_mib=1, disk_min_free_percent=0, environ={})
    fake = FakeManager(tmp_path)
    filler = fake.add("filler", 8 * MiB, tmp_path)
    fake.add("other", 1 * MiB, tmp_path)
    written = fake.record

    async def record(run: Run, kind: str, data: dict[str, Any]) -> None:
        run.token.cancel("user")  # a user's stop, while the event is being written
        await trio.lowlevel.checkpoint()
        await written(run, kind, data)

    monkeypatch.setattr(fake, "record", record)
    guard = fake.guard(config)
    monkeypatch.setattr(os, "statvfs", full_disk)
    guard.journal_failed()
    await guard.check()
    assert filler.token.reason == DISK_FULL_REASON
    assert fake.cancels == [("filler", DISK_FULL_REASON)]
    assert [(rid, kind) for rid, kind, _ in fake.events] == [("filler", DISK_FULL_REASON)]
    assert filler.stop_detail is not None and guard.stopped == 1


async def test_a_stopped_run_whose_directory_cannot_be_removed_does_not_hold_the_guard_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    # The guard waited for the stopped run's directory to disappear before it would stop
    # anyone else: a removal that failed for another reason (a file it may not remove)
    # kept the run that fills the disk now from ever being stopped.
    from supervisor.core.diskguard import REMOVAL_WAIT_S

    (tmp_path / "state").mkdir()
    config = Config.load(state_dir=tmp_path / "state", disk_min_free_mib=1, disk_min_free_percent=0, environ={})
    for how in ("failed", "never tried"):
        fake = FakeManager(tmp_path / how)
        filler = fake.add("filler", 8 * MiB, tmp_path / how)
        fake.add("next", 2 * MiB, tmp_path / how)
        guard = fake.guard(config)
        monkeypatch.setattr(os, "statvfs", full_disk)
        guard.journal_failed()
        await guard.check()
        assert fake.cancels == [("filler", DISK_FULL_REASON)]
        await settled(guard)
        del fake.live["filler"]
        filler.done.set()  # it ended; its directory stays
        guard.journal_failed()
        await guard.check()
        assert fake.cancels == [("filler", DISK_FULL_REASON)], how  # its removal may still come
        if how == "failed":
            filler.removal_tried.set()
        else:
            await trio.sleep(REMOVAL_WAIT_S)
        guard.journal_failed()
        await guard.check()
        assert fake.cancels == [("filler", DISK_FULL_REASON), ("next", DISK_FULL_REASON)], how
        assert guard.stopped == 2
