"""``agentd fleet ...``: start and stop the node agents, serve the front, print a node's resources.

Light at import (click and the stdlib): ``agentd --help`` and every single-machine
command stay free of Ray, which only the fleet commands import, when they run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from supervisor.config import default_state_dir

__all__ = ["fleet", "fleet_state_dir", "FLEET_DIR"]

# The front's state dir (its token, endpoint and index) under agentd's state dir.
FLEET_DIR = "fleet"


def fleet_state_dir(state_dir: Path | None) -> Path:
    return (state_dir if state_dir is not None else default_state_dir()) / FLEET_DIR


def _root_state_dir(ctx: click.Context) -> Path | None:
    value = ctx.find_root().params.get("state_dir")
    return Path(value) if value is not None else None


def _as_json(ctx: click.Context) -> bool:
    return bool(ctx.find_root().params.get("as_json"))


class _NoCluster(click.ClickException):
    exit_code = 3

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


# How long a cluster's address may take to answer a TCP connect before `fleet` gives up
# (seconds): ray.init retries an unreachable one for ever.
REACH_TIMEOUT_S = 5.0


def _reachable(address: str) -> str | None:
    """Why ``host:port`` cannot be reached, or None (also for the forms Ray resolves)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return None  # "auto", "ray://...", a bare host: Ray's to resolve
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        return f"nothing answers there ({exc.strerror or exc})"
    return None


def _connect(address: str | None) -> None:
    from supervisor.fleet._agent import connect

    why = _reachable(address) if address else None
    if why is not None:
        raise _NoCluster(f"cannot join the Ray cluster at {address!r}: {why}")
    try:
        connect(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise _NoCluster(f"cannot join the Ray cluster at {address or 'auto'!r}: {exc}") from None


_ADDRESS = click.option(
    "--address",
    envvar="RAY_ADDRESS",
    help="The Ray cluster: host:port of its GCS, 'auto', or any form `ray.init` takes. Env: RAY_ADDRESS.",
)
_NODE_DIR = click.option(
    "--node-dir",
    type=click.Path(file_okay=False),
    help="Base of each node's daemon state dir, on that node (default: its agentd state dir + /fleet-nodes).",
)


@click.group()
def fleet() -> None:
    """Run agentd on every node of a Ray cluster, with one control surface (the front)."""


@fleet.command()
@_ADDRESS
@_NODE_DIR
@click.pass_context
def up(ctx: click.Context, address: str | None, node_dir: str | None) -> None:
    """Start one agentd daemon on every node, each supervised by a Ray actor pinned there."""
    _connect(address)
    from supervisor.fleet._agent import ensure_agents

    infos = ensure_agents(node_dir)
    if _as_json(ctx):
        click.echo(json.dumps({"nodes": [{k: v for k, v in i.items() if k != "token"} for i in infos]}))
        return
    for info in infos:
        browser = "browser" if info["browser"] else "no browser"
        click.echo(
            f"node {info['node_id'][:12]}  {info['ip']:<15} slots {info['slots']:<4} {browser:<10}  "
            f"agentd {info['url']} (pid {info['pid']}, state dir {info['state_dir']})"
        )
    click.echo(f"{len(infos)} node(s) up; serve the front with `agentd fleet serve`")


@fleet.command()
@_ADDRESS
@click.option(
    "--timeout", "timeout_s", type=float, default=60.0, show_default=True, help="Per node, for its daemon to stop."
)
@click.pass_context
def down(ctx: click.Context, address: str | None, timeout_s: float) -> None:
    """Stop every node's daemon as `systemctl stop` does (every run cancelled), then its agent."""
    _connect(address)
    from supervisor.fleet._agent import fleet_down

    stopped = fleet_down(timeout_s)
    if _as_json(ctx):
        click.echo(json.dumps({"nodes": stopped}))
        return
    for s in stopped:
        click.echo(f"node {s['node_id'][:12]}: agentd stopped (exit code {s.get('exit_code')})")
    click.echo(f"{len(stopped)} node(s) down")


@fleet.command()
@_ADDRESS
@_NODE_DIR
@click.option("--host", help="Address the front binds (default 127.0.0.1).")
@click.option("--port", type=int, help="Port (default 0: any free port, published in the front's state dir).")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.pass_context
def serve(
    ctx: click.Context, address: str | None, node_dir: str | None, host: str | None, port: int | None, log_level: str
) -> None:
    """Serve the fleet front in the foreground (its state dir: <state dir>/fleet)."""
    import logging

    from supervisor.config import Config

    config = Config.load(state_dir=fleet_state_dir(_root_state_dir(ctx)), host=host, port=port)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from subagent.osedge import run_trio
    from supervisor.fleet._serve import serve_front

    try:
        run_trio(lambda: serve_front(config, address, node_root=node_dir))
    except KeyboardInterrupt:
        ctx.exit(130)
    except (ConnectionError, RuntimeError) as exc:
        raise _NoCluster(f"cannot join the Ray cluster at {address or 'auto'!r}: {exc}") from None


@fleet.command()
@click.option("--max-concurrent", type=click.IntRange(min=1), help="Run slots (default: this machine's agentd config).")
@click.option("--browser/--no-browser", default=None, help="Offer browser runs (default: where Chromium is found).")
@click.pass_context
def resources(ctx: click.Context, max_concurrent: int | None, browser: bool | None) -> None:
    """Print this node's Ray resources, for `ray start --resources "$(agentd fleet resources)"`."""
    from supervisor.config import Config
    from supervisor.fleet._resources import node_resources

    slots = max_concurrent if max_concurrent is not None else Config.load(state_dir=_root_state_dir(ctx)).max_concurrent
    click.echo(json.dumps(node_resources(slots, browser=browser)))
