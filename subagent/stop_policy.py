"""Which ``StopPolicy`` a tool call gets: from the tool's nature, unless the spec says otherwise.

Seed 004 and DESIGN "Cancellation": a stop abandons read-only work, tells cancellable work
to stop, and lets only a non-interruptible write finish (then records it honestly).
- ``run_command``: ``interrupt`` by default (``stop_policy.run_command`` may say ``finish``).
- MCP tools, by MCP's own annotations (whose defaults are ``readOnlyHint: false``,
  ``destructiveHint: true``, ``idempotentHint: false``): read-only -> ``abandon``; not
  destructive, or idempotent -> ``cancel``; otherwise (a tool that says nothing, too)
  -> ``finish``.
- Overrides, most specific first: ``stop_policy.mcp["server/tool"]``, then
  ``stop_policy.mcp["server"]``, then the browser preset's own table, then the annotations.
Pure: no I/O, stdlib only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from subagent.events import StopPolicy
from subagent.spec import StopPolicySpec

__all__ = ["command_policy", "mcp_policy", "annotation_policy", "BROWSER_PRESET_POLICY"]

# @playwright/mcp marks every tool that is not read-only destructive (and none
# idempotent). A navigation in the run's own isolated browser only reads a page (HTTP
# GET), and the browser is closed when the run ends: a stop tells it to stop rather than
# waiting up to the grace for a slow page. Clicks, typing, forms, uploads, evaluate and
# run_code may submit something: they keep "finish".
BROWSER_PRESET_POLICY: Final[Mapping[str, StopPolicy]] = {
    "browser_navigate": StopPolicy.CANCEL,
    "browser_navigate_back": StopPolicy.CANCEL,
}


def command_policy(spec: StopPolicySpec) -> StopPolicy:
    return StopPolicy(spec.run_command)


def annotation_policy(annotations: Any) -> StopPolicy:
    """The policy MCP's tool annotations imply (``annotations`` may be None)."""
    read_only = bool(getattr(annotations, "read_only_hint", None) or False)
    if read_only:
        return StopPolicy.ABANDON
    destructive = getattr(annotations, "destructive_hint", None)
    idempotent = bool(getattr(annotations, "idempotent_hint", None) or False)
    if destructive is False or idempotent:
        return StopPolicy.CANCEL
    return StopPolicy.FINISH


def mcp_policy(spec: StopPolicySpec, server: str, tool: str, annotations: Any, *, preset: bool = False) -> StopPolicy:
    """The stop policy of ``server``'s tool ``tool``.

    Args:
        spec: the run's ``stop_policy``.
        server: the server's name in the spec (``browser`` for the preset).
        tool: the tool's name as the server lists it.
        annotations: the tool's ``annotations`` as the SDK parsed them, or None.
        preset: the server is the browser preset (its table applies under the spec's).
    """
    for key in (f"{server}/{tool}", server):
        if key in spec.mcp:
            return StopPolicy(spec.mcp[key])
    if preset and tool in BROWSER_PRESET_POLICY:
        return BROWSER_PRESET_POLICY[tool]
    return annotation_policy(annotations)
