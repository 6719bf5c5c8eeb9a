"""Whose process made a local TCP connection: a run's connections are never admitted.

Every local client connects from 127.0.0.1 (or ::1), a run's shell commands included, so
the per-peer connection limit (``_conn_limits``) is shared by the user and by every run:
a run that kept reconnecting could hold all the slots, and nobody could even cancel it.
The kernel knows which cgroup made a socket: ``NETLINK_SOCK_DIAG`` (inet_diag), asked for
the exact 4-tuple of the peer's socket, answers ``INET_DIAG_CGROUP_ID`` (kernel >= 5.7),
the cgroup v2 id, which is the inode number of the cgroup's directory. A connection whose
socket was made in this daemon's run subtree (``agentd-<instance>`` and below it: trees,
their ``calls/<n>``) is closed at once, before it takes a slot or any handshake work.

Cheap under a flood: one netlink round trip per connection (the kernel answers within
the send), and a cache of the subtree's inode numbers. An id seen for the first time
makes the subtree be walked again (at most every ``REFRESH_S``; a connection waits for the
next allowed walk rather than being admitted unchecked); an id not found by a walk that
began after its socket existed is not a run's, for good: cgroups do not move between
parents and their ids are not reused, so both answers are cached.

A local peer the kernel cannot place is refused too: a socket bound to a device is asked
for again with the loopback device (its lookup needs it), and one gone before the accept
(time-wait, no cgroup id) is nobody's to admit. A remote peer is on another host: admitted.

Where the question cannot be asked (no cgroup containment, netlink refused, a kernel
without the attribute: found by asking about a connection of our own at start), every
connection is admitted as before, and the log says so once.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Final, final

import trio

__all__ = [
    "RunPeers",
    "RefusingListener",
    "SockDiag",
    "Unsupported",
    "pack_request",
    "parse_reply",
]

logger = logging.getLogger(__name__)

# <linux/netlink.h>, <linux/sock_diag.h>, <linux/inet_diag.h>
NETLINK_SOCK_DIAG: Final = 4
SOCK_DIAG_BY_FAMILY: Final = 20
NLM_F_REQUEST: Final = 0x1
NLMSG_ERROR: Final = 2
INET_DIAG_NOCOOKIE: Final = 0xFFFFFFFF
INET_DIAG_CGROUP_ID: Final = 21
ALL_STATES: Final = 0xFFFFFFFF

# struct nlmsghdr { u32 len; u16 type; u16 flags; u32 seq; u32 pid; }
NLMSGHDR: Final = struct.Struct("=IHHII")
# struct inet_diag_req_v2 { u8 family, protocol, ext, pad; u32 states; struct inet_diag_sockid id; }
REQ_HEAD: Final = struct.Struct("=BBBBI")
# struct inet_diag_sockid { be16 sport, dport; be32 src[4], dst[4]; u32 if; u32 cookie[2]; }
SOCKID: Final = struct.Struct("!HH16s16s")
SOCKID_TAIL: Final = struct.Struct("=III")
# struct inet_diag_msg: family, state, timer, retrans (u8 each), the sockid (48 bytes),
# expires, rqueue, wqueue, uid, inode (u32 each).
DIAG_MSG_LEN: Final = 4 + SOCKID.size + SOCKID_TAIL.size + 20
# struct rtattr { u16 len; u16 type; }, then the payload, padded to 4 bytes.
RTATTR: Final = struct.Struct("=HH")

# The subtree is walked again for an unknown id at most this often (seconds).
REFRESH_S: Final = 0.2
# Ids known not to be a run's, kept at most this many (then forgotten and asked again).
MAX_OTHERS: Final = 4096


def is_local(peer: str, ours: str) -> bool:
    """Is a peer at ``peer`` on this host (a loopback address, or the address it reached)?"""
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or peer == ours


def _peer_is_local(sock: socket.socket | trio.socket.SocketType) -> bool:
    try:
        return is_local(str(sock.getpeername()[0]), str(sock.getsockname()[0]))
    except OSError:  # already gone: whoever it was, it is not let in
        return True


def _loopback_index() -> int:
    try:
        return socket.if_nametoindex("lo")
    except OSError:
        return 1  # the loopback device is the first one made


class Unsupported(Exception):
    """The kernel cannot say which cgroup made a socket."""


def _address(family: int, host: str) -> bytes:
    packed = socket.inet_pton(family, host.split("%", 1)[0])
    return packed.ljust(16, b"\0")


def pack_request(family: int, src: tuple[str, int], dst: tuple[str, int], *, seq: int, ifindex: int = 0) -> bytes:
    """A SOCK_DIAG_BY_FAMILY request for the TCP socket bound at ``src``, connected to
    ``dst`` (and bound to the device ``ifindex``, if not 0: the kernel's lookup of such a
    socket needs it)."""
    sockid = SOCKID.pack(src[1], dst[1], _address(family, src[0]), _address(family, dst[0]))
    sockid += SOCKID_TAIL.pack(ifindex, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    body = REQ_HEAD.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_STATES) + sockid
    return NLMSGHDR.pack(NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def parse_reply(data: bytes, *, seq: int) -> int | None:
    """The cgroup id in the reply numbered ``seq`` in ``data``; None if no such socket.

    Raises:
        Unsupported: the socket was found and its reply carries no cgroup id.
        OSError: the kernel refused the request (its errno).
        LookupError: ``data`` holds no whole reply numbered ``seq``.
    """
    off = 0
    while off + NLMSGHDR.size <= len(data):
        length, kind, _flags, got_seq, _pid = NLMSGHDR.unpack_from(data, off)
        if length < NLMSGHDR.size or off + length > len(data):
            break
        if got_seq == seq:
            body = data[off + NLMSGHDR.size : off + length]
            if kind == NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", body) if len(body) >= 4 else (-errno.EPROTO,)
                if err == -errno.ENOENT:
                    return None
                raise OSError(-err, os.strerror(-err))
            if kind != SOCK_DIAG_BY_FAMILY or len(body) < DIAG_MSG_LEN:
                raise LookupError(f"unexpected netlink message type {kind}")
            at = DIAG_MSG_LEN
            while at + RTATTR.size <= len(body):
                alen, atype = RTATTR.unpack_from(body, at)
                if alen < RTATTR.size:
                    break
                if atype == INET_DIAG_CGROUP_ID and alen >= RTATTR.size + 8:
                    return int(struct.unpack_from("=Q", body, at + RTATTR.size)[0])
                at += (alen + 3) & ~3
            raise Unsupported("no INET_DIAG_CGROUP_ID (kernel < 5.7?)")
        off += (length + 3) & ~3
    raise LookupError(f"no netlink reply numbered {seq}")


@final
class SockDiag:
    """A NETLINK_SOCK_DIAG socket that asks which cgroup made a TCP socket."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)
        self._sock.setblocking(False)
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def cgroup_of(self, family: int, src: tuple[str, int], dst: tuple[str, int], *, ifindex: int = 0) -> int | None:
        """The cgroup id of the TCP socket bound at ``src`` and connected to ``dst``; None
        if there is none (gone, or on another host).

        Raises:
            Unsupported: see ``parse_reply``.
            OSError, LookupError: the request failed.
        """
        self._seq = self._seq % 0x7FFFFFFF + 1
        seq = self._seq
        self._sock.send(pack_request(family, src, dst, seq=seq, ifindex=ifindex))
        # The kernel answers a request for one socket within the send: the reply is queued.
        for _ in range(8):  # skip a stale reply, if any
            try:
                data = self._sock.recv(8192)
            except BlockingIOError:
                break
            try:
                return parse_reply(data, seq=seq)
            except LookupError:
                continue
        raise LookupError("no netlink reply")

    def cgroup_of_peer(self, sock: socket.socket | trio.socket.SocketType) -> int | None:
        """The cgroup id of the socket at the other end of the accepted connection ``sock``.

        A local peer (this host's) is asked for again as bound to the loopback device: a
        socket bound to a device (``SO_BINDTODEVICE``, which needs no privilege) is not
        found without it. None: no such socket (or one on another host).

        Raises:
            Unsupported, OSError, LookupError: see ``cgroup_of``.
        """
        remote = sock.getpeername()
        local = sock.getsockname()
        src, dst = (remote[0], remote[1]), (local[0], local[1])
        found = self.cgroup_of(sock.family, src, dst)
        if found is None and is_local(remote[0], local[0]):
            found = self.cgroup_of(sock.family, src, dst, ifindex=_loopback_index())
        return found


def probe(diag: SockDiag) -> int:
    """Ask about a loopback connection of our own: its cgroup id.

    Raises:
        Unsupported, OSError, LookupError: the question cannot be asked here.
    """
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        except OSError:
            continue
        with listener:
            try:
                listener.bind((host, 0))
                listener.listen(1)
                client = socket.create_connection(listener.getsockname()[:2], timeout=2)
            except OSError:
                continue
            with client:
                accepted, _ = listener.accept()
                with accepted:
                    got = diag.cgroup_of_peer(accepted)
                    if got is None:
                        raise LookupError("our own connection was not found")
                    return got
    raise OSError(errno.EADDRNOTAVAIL, "no loopback address to test with")


def subtree_inodes(root: Path) -> dict[int, str]:
    """The inode number of ``root`` and of every directory below it, with the name of the
    child of ``root`` it lies in ("" for ``root`` itself)."""
    found: dict[int, str] = {}
    try:
        found[os.stat(root).st_ino] = ""
    except OSError:
        return found
    stack: list[tuple[str, str]] = [(str(root), "")]
    while stack:
        path, tree = stack.pop()
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            name = tree or entry.name
                            found[entry.inode()] = name
                            stack.append((entry.path, name))
                    except OSError:
                        continue
        except OSError:
            continue
    return found


@final
class RunPeers:
    """Tells the connections a run's processes made (``made_by_a_run``) and counts them."""

    def __init__(self, subtree: Callable[[], Path | None], diag: SockDiag, *, refresh_s: float = REFRESH_S) -> None:
        self._subtree = subtree
        self._diag: SockDiag | None = diag
        self._refresh_s = refresh_s
        self._ours: dict[int, str] = {}  # cgroup id -> its tree's directory name
        self._others: set[int] = set()
        self._walked_at = -float("inf")  # trio time a walk began
        self._logged: set[tuple[str, str]] = set()
        self.refused = 0
        self.refused_unplaced = 0  # of them: local peers the kernel could not place

    @classmethod
    def open(cls, subtree: Callable[[], Path | None]) -> RunPeers | None:
        """None (logged once) when connections from runs cannot be told from others."""
        if subtree() is None:
            logger.warning(
                "control: no cgroup containment: connections from runs cannot be told from others "
                "(a run may take the control socket's and dashboard's connection slots)"
            )
            return None
        try:
            diag = SockDiag()
        except OSError as exc:
            logger.warning("control: netlink sock_diag refused (%s): connections from runs are admitted", exc)
            return None
        try:
            probe(diag)
        except (Unsupported, OSError, LookupError) as exc:
            diag.close()
            logger.warning(
                "control: the kernel does not say which cgroup made a socket (%s): connections from runs are admitted",
                exc,
            )
            return None
        return cls(subtree, diag)

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    async def made_by_a_run(self, sock: trio.socket.SocketType, what: str) -> bool:
        """Was the peer socket of the accepted connection ``sock`` made in the run subtree?
        If so it is counted, and logged once per tree; ``what`` names the listener."""
        if self._diag is None:
            return False
        since = trio.current_time()  # the peer's socket exists by now
        try:
            cgroup = self._diag.cgroup_of_peer(sock)
        except (Unsupported, OSError, LookupError) as exc:
            cgroup = None
            logger.debug("%s: cgroup of a peer not known: %s", what, exc)
        if cgroup is None:
            # The kernel said at the start it can tell (``probe``). A local peer it cannot
            # place now is refused, not admitted: a socket closed before the accept (a
            # time-wait one carries no cgroup), one it could not find. A remote one is
            # on another host: not a run's.
            if not _peer_is_local(sock):
                return False
            self.refused += 1
            self.refused_unplaced += 1
            if self.refused_unplaced == 1:
                logger.warning(
                    "%s: refusing a local connection whose socket the kernel cannot place "
                    "(closed before it was accepted, or not found): only the first is logged",
                    what,
                )
            return True
        if cgroup not in self._ours and cgroup not in self._others:
            # Only a walk that began after ``since`` surely saw its cgroup (one at the same
            # instant may have begun before: walked again). Another connection's may begin
            # while this one waits for the next walk allowed.
            await trio.sleep_until(self._walked_at + self._refresh_s)
            if self._walked_at <= since:
                self._walk()
            if cgroup not in self._ours:
                if len(self._others) >= MAX_OTHERS:
                    self._others.clear()
                self._others.add(cgroup)
        tree = self._ours.get(cgroup)
        if tree is None:
            return False
        self.refused += 1
        if (what, tree) not in self._logged and len(self._logged) < 10_000:
            self._logged.add((what, tree))
            logger.warning(
                "%s: refusing connections made by the processes of run tree %s (cgroup id %d): "
                "a run may not connect to the daemon; %d refused so far",
                what,
                tree or "(subtree root)",
                cgroup,
                self.refused,
            )
        return True

    def _walk(self) -> None:
        self._walked_at = trio.current_time()
        root = self._subtree()
        if root is not None:
            # Kept across walks: an id once a run's stays one (ids are not reused), so a
            # socket that outlived its cgroup is still refused.
            self._ours.update(subtree_inodes(root))


@final
class RefusingListener(trio.abc.Listener[trio.SocketStream]):
    """A listener that closes, at once, the connections ``runs`` says a run made."""

    def __init__(self, inner: trio.SocketListener, runs: RunPeers, what: str) -> None:
        self.inner = inner
        self.runs = runs
        self.what = what

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    async def accept(self) -> trio.SocketStream:
        while True:
            stream = await self.inner.accept()
            if await refuse_a_runs(stream, self.runs, self.what):
                continue
            return stream

    async def aclose(self) -> None:
        await self.inner.aclose()


async def refuse_a_runs(stream: trio.SocketStream, runs: RunPeers | None, what: str) -> bool:
    """Close ``stream`` at once if a run made it; True if so."""
    if runs is None or not await runs.made_by_a_run(stream.socket, what):
        return False
    await trio.aclose_forcefully(stream)
    return True
