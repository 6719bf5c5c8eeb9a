"""What a node offers Ray and what a run asks of it: the only placement logic agentd has.

Pure: no Ray, no I/O beyond looking for a Chromium binary. A node advertises run slots
(``agentd_slots``, its daemon's ``max_concurrent``) and, where Chromium is installed,
``browser`` (one per slot: a browser run takes one of each). A run asks for one slot,
one ``browser`` if its spec wants a browser, and optionally CPU and memory from the
spec's fleet-only ``resources`` key, which the fleet removes before the node sees it.
Ray's scheduler does the rest: it picks a node that has all of it, or queues.
"""

from __future__ import annotations

import math
from typing import Any, Final

from supervisor.errors import SpawnError

__all__ = ["SLOTS", "BROWSER", "node_resources", "has_browser", "split_demand"]

SLOTS: Final = "agentd_slots"
BROWSER: Final = "browser"
# The spec key the fleet reads (and removes) for a run's CPU and memory demand.
RESOURCES_KEY: Final = "resources"


def has_browser() -> bool:
    """Whether this machine can run the browser preset (a Chromium binary is found)."""
    try:
        from subagent.presets import available
    except ImportError:
        return False
    return available().get("browser", False)


def node_resources(max_concurrent: int, *, browser: bool | None = None) -> dict[str, float]:
    """The Ray custom resources a node advertises: ``ray start --resources`` takes them.

    Args:
        max_concurrent: the node daemon's run slots.
        browser: whether the node offers browser runs; None: where Chromium is found.
    """
    if max_concurrent < 1:
        raise ValueError(f"expected max_concurrent >= 1, got {max_concurrent!r}")
    offers_browser = has_browser() if browser is None else browser
    return {SLOTS: float(max_concurrent), BROWSER: float(max_concurrent if offers_browser else 0)}


def split_demand(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """The spec a node receives and the Ray bundle the run asks for.

    ``spec["resources"]`` may hold ``cpu`` (cores) and ``memory_mb``; it is removed.

    Raises:
        SpawnError: a bad ``resources`` value.
    """
    spec = dict(spec)
    raw = spec.pop(RESOURCES_KEY, None)
    bundle: dict[str, float] = {SLOTS: 1.0}
    if spec.get("browser"):
        bundle[BROWSER] = 1.0
    if raw is None:
        return spec, bundle
    if not isinstance(raw, dict):
        raise SpawnError(f"expected 'resources' to be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"cpu", "memory_mb"})
    if unknown:
        raise SpawnError(f"unknown key {unknown[0]!r} in 'resources' (expected 'cpu', 'memory_mb')")
    for key, ray_name, scale in (("cpu", "CPU", 1.0), ("memory_mb", "memory", 1024.0 * 1024.0)):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise SpawnError(f"expected 'resources.{key}' to be a number >= 0, got {value!r}")
        if value > 0:
            bundle[ray_name] = float(value) * scale
    return spec, bundle
