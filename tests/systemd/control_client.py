"""A minimal client for the systemd tests, run inside the container with the venv's Python.

    control_client.py call STATE_DIR OP [JSON_ARGS]   one request on the control socket;
                                                      prints the reply object as JSON
    control_client.py run STATE_DIR RUN_ID            the run's record, read from the store
                                                      (the daemon may be stopped)

It speaks ``supervisor.protocol`` directly (endpoint and token from the state dir), so the
tests depend on the wire protocol only, not on the CLI's flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import trio
from trio_websocket import open_websocket_url

from supervisor import protocol
from supervisor.config import ENDPOINT_FILE, JOURNAL_FILE, TOKEN_FILE
from supervisor.control._statefiles import read_endpoint, read_token


async def call(state_dir: Path, op: str, args: dict[str, object]) -> dict[str, object]:
    endpoint = read_endpoint(state_dir / ENDPOINT_FILE)
    token = read_token(state_dir / TOKEN_FILE)
    headers = [(b"Authorization", f"Bearer {token}".encode())]
    with trio.fail_after(30):
        async with open_websocket_url(endpoint["url"], extra_headers=headers) as ws:
            await ws.send_message(protocol.encode_request(1, op, **args))
            while True:
                msg = protocol.decode_server_message(await ws.get_message())
                if msg.get("id") == 1:
                    return msg


async def read_run(state_dir: Path, run_id: str) -> dict[str, object] | None:
    from supervisor.store.journal import Journal

    journal = await Journal.open(state_dir / JOURNAL_FILE)
    try:
        return await journal.get_run(run_id)  # type: ignore[return-value]
    finally:
        await journal.aclose()


def main() -> None:
    what, state_dir = sys.argv[1], Path(sys.argv[2])
    if what == "call":
        args = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
        out: object = trio.run(call, state_dir, sys.argv[3], args)
    elif what == "run":
        out = trio.run(read_run, state_dir, sys.argv[3])
    else:
        raise SystemExit(f"unknown command {what!r}")
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
