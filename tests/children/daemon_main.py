"""Run the daemon in the foreground for tests: ``daemon_main.py STATE_DIR``.

Prints one JSON line ``{"url", "token", "pid"}`` on stdout once it serves; settings come
from ``AGENTD_*`` environment variables (``Config.load``). Ends on SIGTERM/SIGINT.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import trio

from supervisor.config import Config
from supervisor.daemon import serve


async def main(state_dir: str) -> None:
    config = Config.load(state_dir=state_dir)
    async with trio.open_nursery() as n:
        info = await n.start(serve, config)
        print(json.dumps({"url": info["url"], "token": info["token"], "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trio.run(main, sys.argv[1])
