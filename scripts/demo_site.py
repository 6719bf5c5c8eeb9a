#!/usr/bin/env python3
"""The demo's web site: a few pages on 127.0.0.1, stdlib only.

Usage: demo_site.py STATE_DIR [--slow-s SECONDS]

Writes its URL to STATE_DIR/site.url once it listens, and touches STATE_DIR/slow.requested
when a browser asks for /slow (a page that takes SECONDS to answer: the demo cancels the
sub-agent that waits for it). Stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import sys
import threading
from pathlib import Path

PAGES = {
    "/": """<!doctype html><html><head><title>agentd demo: Harbor Gazette</title></head><body>
<h1>Harbor Gazette</h1>
<p>Welcome to the local demo site of agentd. Nothing here comes from the internet.</p>
<ul>
  <li><a href="/news">Latest news</a></li>
  <li><a href="/archive">The archive (slow)</a></li>
</ul>
</body></html>""",
    "/news": """<!doctype html><html><head><title>Harbor Gazette: news</title></head><body>
<h1>Latest news</h1>
<article><h2>Headline: Lighthouse keeper spots 42 dolphins</h2>
<p>The count was confirmed by the harbor office on Tuesday.</p></article>
<article><h2>Ferry timetable changes next week</h2><p>Morning boats leave ten minutes earlier.</p></article>
<p><a href="/">Home</a></p>
</body></html>""",
}


class Handler(http.server.BaseHTTPRequestHandler):
    server: Site

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path in ("/slow", "/archive"):
            (self.server.state_dir / "slow.requested").touch()
            if self.server.stopping.wait(self.server.slow_s):
                return
            body = "<!doctype html><html><body><h1>The archive</h1><p>Finally.</p></body></html>"
        elif path in PAGES:
            body = PAGES[path]
        else:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except OSError:
            pass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


class Site(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state_dir: Path, slow_s: float) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.state_dir = state_dir
        self.slow_s = slow_s
        self.stopping = threading.Event()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--slow-s", type=float, default=120.0)
    args = parser.parse_args()
    site = Site(args.state_dir, args.slow_s)

    def stop(signum: int, frame: object) -> None:
        site.stopping.set()
        threading.Thread(target=site.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://127.0.0.1:{site.server_address[1]}"
    tmp = args.state_dir / "site.url.tmp"
    tmp.write_text(url + "\n")
    os.replace(tmp, args.state_dir / "site.url")
    site.serve_forever()
    site.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
