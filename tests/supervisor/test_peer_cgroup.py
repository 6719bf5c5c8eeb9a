"""Which cgroup made a connection's peer socket (``supervisor.control._peer_cgroup``).

The netlink messages are built here by hand, from the kernel's struct layouts, and
compared with what the module packs and parses; the real kernel is asked about a loopback
connection of the test's own (IPv4 and IPv6); the subtree cache is driven with a fake
netlink socket and directories of ``tmp_path``. The whole (a real run flooding the real
daemon's sockets) is ``test_run_connections``.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from subagent.osedge import LINUX
from supervisor.control import _peer_cgroup
from supervisor.control._peer_cgroup import RunPeers, Unsupported, pack_request, parse_reply
from supervisor.trees._cgroupfs import own_cgroup_dir
from tests import conftest


def test_a_request_is_inet_diag_req_v2_for_the_peers_socket() -> None:
    got = pack_request(socket.AF_INET, ("127.0.0.1", 40000), ("127.0.0.1", 8765), seq=7)
    # struct nlmsghdr: len 16 + 56, SOCK_DIAG_BY_FAMILY (20), NLM_F_REQUEST, seq 7, pid 0
    header = (72).to_bytes(4, "little") + (20).to_bytes(2, "little") + (1).to_bytes(2, "little")
    header += (7).to_bytes(4, "little") + bytes(4)
    # inet_diag_req_v2: family AF_INET, IPPROTO_TCP, no extensions, pad, every state
    req = bytes([2, 6, 0, 0]) + b"\xff\xff\xff\xff"
    # inet_diag_sockid: sport, dport big-endian; src, dst 16 bytes each; if; no cookie
    req += bytes([0x9C, 0x40, 0x22, 0x3D])
    req += bytes([127, 0, 0, 1]) + bytes(12) + bytes([127, 0, 0, 1]) + bytes(12)
    req += bytes(4) + b"\xff" * 8
    assert got == header + req

    six = pack_request(socket.AF_INET6, ("::1", 1), ("::ffff:127.0.0.1", 2), seq=1)
    assert six[16] == socket.AF_INET6 and len(six) == 72
    assert six[24:28] == bytes([0, 1, 0, 2])
    assert six[28:44] == bytes(15) + b"\x01"
    assert six[44:60] == bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1])


def _reply(seq: int, attrs: list[tuple[int, bytes]], kind: int = 20) -> bytes:
    msg = bytes([2, 1, 0, 0]) + bytes(48) + bytes(20)  # inet_diag_msg: 72 bytes
    for atype, payload in attrs:
        rta = struct.pack("=HH", 4 + len(payload), atype) + payload
        msg += rta + bytes(-len(rta) % 4)
    return struct.pack("=IHHII", 16 + len(msg), kind, 0, seq, 0) + msg


def test_the_cgroup_id_is_read_among_the_attributes() -> None:
    attrs = [(1, b"\x01\x02\x03"), (5, bytes(8)), (21, struct.pack("=Q", 123456789))]
    assert parse_reply(_reply(3, attrs), seq=3) == 123456789
    # A stale reply before it is skipped.
    stale = _reply(2, [(21, struct.pack("=Q", 1))])
    assert parse_reply(stale + _reply(3, attrs), seq=3) == 123456789
    with pytest.raises(LookupError):
        parse_reply(stale, seq=3)
    with pytest.raises(LookupError):
        parse_reply(_reply(3, attrs)[:40], seq=3)  # cut short


def test_no_attribute_is_an_old_kernel_and_errors_are_errors() -> None:
    with pytest.raises(Unsupported):
        parse_reply(_reply(4, [(1, bytes(4))]), seq=4)

    def error(code: int) -> bytes:
        return struct.pack("=IHHII", 16 + 20, 2, 0, 9, 0) + struct.pack("=i", code) + bytes(16)

    assert parse_reply(error(-errno.ENOENT), seq=9) is None  # no such socket
    with pytest.raises(OSError) as caught:
        parse_reply(error(-errno.EPERM), seq=9)
    assert caught.value.errno == errno.EPERM


def _own_cgroup_inode() -> int:
    own = own_cgroup_dir(LINUX)
    conftest.require(own is not None and own.is_dir(), "a cgroup2 mount")
    assert own is not None
    return os.stat(own).st_ino


@pytest.mark.parametrize(("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_the_kernel_names_the_cgroup_of_the_peers_socket(family: int, host: str) -> None:
    expected = _own_cgroup_inode()
    try:
        listener = socket.socket(family)
        listener.bind((host, 0))
    except OSError:
        conftest.require(False, f"a loopback address {host}")
    diag = _peer_cgroup.SockDiag()
    with listener, socket.socket(family) as client:
        listener.listen(1)
        client.connect(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        with accepted:
            try:
                got = diag.cgroup_of_peer(accepted)
            except Unsupported:
                conftest.require(False, "INET_DIAG_CGROUP_ID (kernel >= 5.7)")
            assert got == expected
            # A socket that is not there: none.
            port = accepted.getsockname()[1]
            assert diag.cgroup_of(family, (host, 1), (host, port)) is None
    assert _peer_cgroup.probe(diag) == expected
    diag.close()


class FakeDiag:
    def __init__(self) -> None:
        self.ids: list[int] = []

    def cgroup_of_peer(self, sock: object) -> int | None:
        return self.ids.pop(0)

    def close(self) -> None:
        pass


async def test_ids_of_the_subtree_are_refused_and_the_walks_are_bounded(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = tmp_path / "agentd-x"
    (root / "t1" / "calls" / "0").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    walks = 0
    real_walk = _peer_cgroup.subtree_inodes

    def counting(path: Path) -> dict[int, str]:
        nonlocal walks
        walks += 1
        return real_walk(path)

    diag = FakeDiag()
    runs = RunPeers(lambda: root, diag, refresh_s=0.2)  # type: ignore[arg-type]
    sock = object()

    async def ask(path: Path) -> bool:
        diag.ids.append(os.stat(path).st_ino)
        return await runs.made_by_a_run(sock, "control")  # type: ignore[arg-type]

    monkeypatch.setattr(_peer_cgroup, "subtree_inodes", counting)
    assert await ask(root / "t1" / "calls" / "0")
    assert await ask(root / "t1")
    assert await ask(root)
    assert walks == 1
    # A flood from a known cgroup: no walk.
    for _ in range(100):
        assert await ask(root / "t1" / "calls" / "0")
    assert walks == 1 and runs.refused == 103
    # Another cgroup: one walk, not before the bound, then known not to be a run's.
    start = trio.current_time()
    assert not await ask(outside)
    assert walks == 2 and trio.current_time() - start >= 0.2 - 1e-9
    for _ in range(10):
        assert not await ask(outside)
    assert walks == 2
    # A tree made after the last walk is found by the next one.
    (root / "t2" / "calls" / "1").mkdir(parents=True)
    assert await ask(root / "t2" / "calls" / "1")
    assert walks == 3
    refusals = [r for r in caplog.records if "refusing connections" in r.getMessage()]
    assert [r.getMessage().split("run tree ")[1].split()[0] for r in refusals] == ["t1", "(subtree", "t2"]


class Peer:
    """An accepted connection's addresses, as a socket gives them."""

    def __init__(self, peer: str, ours: str = "127.0.0.1") -> None:
        self.peer, self.ours = peer, ours

    def getpeername(self) -> tuple[str, int]:
        return self.peer, 40000

    def getsockname(self) -> tuple[str, int]:
        return self.ours, 8765


@pytest.mark.parametrize(
    ("peer", "refused"),
    [
        ("127.0.0.1", True),
        ("127.5.6.7", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.5", False),  # another host's: not a run's
    ],
)
async def test_a_local_peer_the_kernel_cannot_place_is_refused_and_a_remote_one_admitted(
    tmp_path: Path, peer: str, refused: bool
) -> None:
    # A run's socket bound to a device (SO_BINDTODEVICE) was not found, and one closed
    # right after its request (time-wait: no cgroup id) was found without an id: both
    # were admitted, and a run reached the handshake and filled the per-peer slots.
    class Broken(FakeDiag):
        def cgroup_of_peer(self, sock: object) -> int | None:
            raise _peer_cgroup.Unsupported("no INET_DIAG_CGROUP_ID")

    for diag in (Broken(), FakeDiag()):
        diag.ids.append(None)  # type: ignore[arg-type]  # FakeDiag: not found
        runs = RunPeers(lambda: tmp_path, diag)  # type: ignore[arg-type]
        assert await runs.made_by_a_run(Peer(peer), "dashboard") is refused  # type: ignore[arg-type]
        assert runs.refused == runs.refused_unplaced == int(refused)


def test_a_socket_bound_to_the_loopback_device_is_found_by_asking_with_it() -> None:
    # SO_BINDTODEVICE needs no privilege; the kernel's lookup of such a socket needs the
    # device's index in the request.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.socket()
        with client:
            try:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
            except OSError:
                conftest.require(False, "SO_BINDTODEVICE")
            client.connect(listener.getsockname())
            accepted, _ = listener.accept()
            with accepted:
                diag = _peer_cgroup.SockDiag()
                try:
                    remote, local = accepted.getpeername(), accepted.getsockname()
                    assert diag.cgroup_of(socket.AF_INET, remote, local) is None  # not found without it
                    try:
                        got = diag.cgroup_of_peer(accepted)
                    except _peer_cgroup.Unsupported:
                        conftest.require(False, "INET_DIAG_CGROUP_ID (kernel >= 5.7)")
                    assert got is not None and got == os.stat(own_cgroup_dir()).st_ino
                finally:
                    diag.close()


def test_without_a_subtree_nothing_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    assert RunPeers.open(lambda: None) is None
    assert "no cgroup containment" in caplog.text
