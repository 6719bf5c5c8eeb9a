"""A run cannot lock the user out of its daemon by filling the connection slots.

Every local client connects from 127.0.0.1, a run's commands too, and a connection that
never handshakes holds one of the 128 per-peer slots for 5 s (the dashboard's one of its
64 for 30 s): a run that kept 200 connections open, reopening each one as soon as it was
closed, held all of them, and neither ``status`` nor ``cancel`` got through. The daemon
asks the kernel which cgroup made each connection and closes a run's at once, before it
takes a slot. Real daemon with cgroups, real runner and sandbox, scripted model: the run's
command floods the control port and the dashboard's, and tells the test (over a socket
of the test's own) once it has had hundreds of its connections closed; the test then,
from outside the run, gets ``status`` and the dashboard's page and cancels the run.
"""

from __future__ import annotations

import base64
import json
import socket
from pathlib import Path

import pytest
import trio

from tests import conftest
from tests.supervisor.real_daemon import real_daemon
from tests.supervisor.test_call_cgroups import ENV, _zygote, script
from tests.supervisor.test_sweep_mode import none_left

CONNECTIONS = 200
FLOOD_S = 60  # the flooder's own bound: it ends by then, cancelled or not

# Holds CONNECTIONS connections to each port, reopening a closed one at once, for at most
# FLOOD_S; says "ready" on the test's socket once CONNECTIONS have been closed on it.
FLOODER = """
import selectors, socket, sys, time
ports, tell, n, bound = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
device = sys.argv[5].encode() if len(sys.argv) > 5 else None
sel = selectors.DefaultSelector()
def open_one(port):
    s = socket.socket()
    if device:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device)
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    sel.register(s, selectors.EVENT_READ, port)
for port in ports:
    for _ in range(n):
        open_one(port)
closed = {port: 0 for port in ports}
told = False
end = time.monotonic() + bound
while time.monotonic() < end:
    for key, _ in sel.select(0.2):
        try:
            if key.fileobj.recv(1):
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        sel.unregister(key.fileobj)
        key.fileobj.close()
        closed[key.data] += 1
        open_one(key.data)
    if not told and min(closed.values()) >= n:
        told = True
        socket.create_connection(("127.0.0.1", tell)).sendall(b"ready")
print("closed", closed)
"""


def flood_command(ports: list[int], tell: int, device: str = "") -> str:
    code = base64.b64encode(FLOODER.encode()).decode()
    return (
        f"python3 -c \"import base64; exec(base64.b64decode('{code}'))\" "
        f"{','.join(map(str, ports))} {tell} {CONNECTIONS} {FLOOD_S} {device}"
    )


async def http_get(url: str) -> bytes:
    host, port = url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
    async with stream:
        await stream.send_all(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    return data


@pytest.mark.parametrize("device", ["", "lo"])
async def test_a_run_flooding_the_sockets_can_still_be_cancelled(tmp_path: Path, device: str) -> None:
    # device "lo": its sockets bound to the loopback device (SO_BINDTODEVICE, no
    # privilege needed), which the kernel's lookup did not find without the device: they
    # were admitted.
    told = socket.socket()
    told.bind(("127.0.0.1", 0))
    told.listen(1)
    tell = trio.socket.from_stdlib_socket(told)
    with tell, trio.fail_after(120):
        async with real_daemon(tmp_path / "state", env=ENV) as d, d.connect() as c:
            summary = await c.ok("status")
            conftest.require(summary["summary"]["containment"] == "cgroup", "cgroup containment")
            endpoint = json.loads((tmp_path / "state" / "daemon.json").read_text())
            dash = endpoint["dashboard_url"]
            ports = [int(d.url.rsplit(":", 1)[1].split("/")[0]), int(dash.rstrip("/").rsplit(":", 1)[1])]
            run_id = (await c.ok("spawn", spec=script(flood_command(ports, tell.getsockname()[1], device))))["run_id"]
            # The flood is on: the run has had CONNECTIONS of its connections closed on each
            # port (without the fix: refused above the limits, all slots held by the run).
            conn, _ = await tell.accept()
            with conn:
                assert await conn.recv(16) == b"ready"
            # From outside the run, on fresh connections, as `agentd status` and `agentd
            # cancel` make them.
            async with d.connect() as outside:
                st = await outside.ok("status", run_id=run_id)
                assert st["state"] == "running", st
                info = (await outside.ok("ping"))["connection_limits"]
                assert info["refused_runs"] >= CONNECTIONS and info["open"] <= 3, info
            assert b"200 OK" in (await http_get(dash)).split(b"\r\n", 1)[0]
            async with d.connect() as outside:
                await outside.ok("cancel", run_id=run_id)
                end = await outside.wait_end(run_id, 30)
            assert end["state"] == "cancelled", end
            log = d.log_text()
            assert log.count("refusing connections made by the processes of run tree") <= 2, log[-3000:]
            await none_left(d.pid, _zygote(await c.ok("status")))
