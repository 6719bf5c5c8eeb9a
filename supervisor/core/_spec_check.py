"""A spec is checked at spawn time, with the runner's own validator: bad input is refused
then, never discovered by a failed run later.

``validate_spec`` raises ``SpawnError`` naming what is wrong: a spec the runner would
reject, a model that cannot be used (no key anywhere: the error says where the key goes),
a sandbox grant that would reach the daemon's state, a preset the machine cannot run
(``subagent.presets``: the daemon knows presets only through that interface).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from supervisor.config import Config
from supervisor.errors import SpawnError
from supervisor.protocol import Secret

__all__ = ["validate_spec"]

logger = logging.getLogger(__name__)


def validate_spec(spec: dict[str, Any], model_key: Secret | None = None, config: Config | None = None) -> str | None:
    """Reject a bad spec at spawn time, with the runner's own validator (stdlib only).

    Returns the model provider the run will use (None if the runner package is absent).
    A model that cannot be used is refused here, never replaced: provider "openai" with
    no API key (neither this daemon's ``OPENAI_API_KEY`` nor the run's own ``model_key``)
    and no base URL of a local server is a SpawnError saying where the key goes. So is a
    sandbox grant that would reach the daemon's state (``config``'s protected paths).
    """
    try:
        from subagent.spec import RunSpec, SpecError
    except ImportError:  # the runner package is not there: the runner will say so
        return None
    env = dict(os.environ)
    if model_key is not None:
        env["OPENAI_API_KEY"] = model_key.reveal()
    try:
        parsed = RunSpec.from_dict(spec, env)
    except SpecError as exc:
        raise SpawnError(f"invalid run spec: {exc}") from exc
    except Exception as exc:  # the validator tripped on a value (unhashable, overflow...): still bad input
        logger.info("spec validation raised %r", exc)
        raise SpawnError(f"invalid run spec: {type(exc).__name__}: {exc}") from exc
    model = parsed.model
    if (
        model.provider == "openai"
        and not env.get("OPENAI_API_KEY")
        and not (model.base_url or env.get("OPENAI_BASE_URL"))
    ):
        asked = f"model {model.name!r}" if model.name else "provider 'openai'"
        raise SpawnError(
            f"invalid run spec: model: {asked} needs an API key and the daemon has none: set OPENAI_API_KEY "
            "in the daemon's environment (under systemd: /etc/agentd/agentd.env, see systemd/agentd.env.example, "
            "then restart agentd), or give this run its own with `agentd spawn --model-key-env VAR`; "
            "for a local OpenAI-compatible server set model.base_url or OPENAI_BASE_URL instead"
        )
    grants = parsed.sandbox
    if grants.granted or parsed.mcp_servers or parsed.model.script_path or parsed.browser is not False:
        from subagent.sandbox import Settings, check_grants, protected, spec_paths
        from supervisor.trees.pool import sandbox_settings

        # Every path the run would be granted: its sandbox's, and what its tools need (an
        # MCP server's cwd or command, a browser's files, a script): none in the state dir,
        # none the runner's own check refuses (the same list: ``protected``).
        protect = protected(sandbox_settings(config) if config is not None else Settings())
        why = check_grants(*spec_paths(parsed), protect)
        if why is not None:
            raise SpawnError(f"invalid run spec: sandbox: {why}")
        if grants.workdir is not None and not Path(grants.workdir).is_dir():
            raise SpawnError(
                f"invalid run spec: sandbox.workdir: expected an existing directory, got {grants.workdir!r}"
            )
    # A missing Chromium or node is a clear error now, not a failed run later.
    from subagent.presets import PresetError, check_presets

    try:
        check_presets(spec)
    except PresetError as exc:
        raise SpawnError(f"invalid run spec: {exc}") from exc
    return model.provider


def spec_for_runner(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec a runner is given: ``spec``, and the paths its tools need (an MCP server's
    command and cwd, the browser's files) as this daemon finds them on the host
    (``tool_paths``). A runner forked ahead (a zygote's spare) sees /tmp, /run and the like
    through its private tmpfs, where a Chromium or a server command kept there is not: it
    dropped the browser's every grant, then failed with "chromium not found"."""
    try:
        from subagent.sandbox import tool_paths
        from subagent.spec import RunSpec
    except ImportError:
        return spec
    try:
        parsed = RunSpec.from_dict(spec)
    except Exception:  # noqa: BLE001 - validated at the spawn; the runner reports it
        return spec
    if not parsed.mcp_servers and parsed.browser is False:
        return spec
    out = {**spec, "tool_paths": tool_paths(parsed)}
    browser = spec.get("browser")
    exe = browser.get("executable_path") if isinstance(browser, dict) else None
    if isinstance(browser, dict) and isinstance(exe, str) and os.path.isabs(exe) and os.path.realpath(exe) != exe:
        # The binary itself: Chromium finds its files beside what it was started as, and
        # a link kept under a private /tmp is not there for the runner to follow.
        out["browser"] = {**browser, "executable_path": os.path.realpath(exe)}
    return out
