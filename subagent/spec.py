"""The run spec: what the daemon asks one runner to do, validated from JSON.

Invariants: stdlib only and cheap (the daemon calls ``RunSpec.from_dict`` at spawn time to
reject bad specs before any process starts); every value is checked, unknown keys are
errors; a valid spec is a frozen value and ``RunSpec.from_dict(spec.to_dict()) == spec``.
The provider default ("openai" when a model ``name`` is given or ``OPENAI_API_KEY`` is
set, else "scripted") is resolved at validation time, from the environment passed in
(``os.environ`` by default): a model asked for by name is never silently replaced by the
scripted one.

Size: the run spec is one contract, validated field by field (one small parser each):
the daemon and the runner must agree on it exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "SpecError",
    "ModelSpec",
    "McpServerSpec",
    "Limits",
    "SandboxSpec",
    "StopPolicySpec",
    "ApprovalSpec",
    "SessionSpec",
    "RunSpec",
    "BUILTIN_TOOLS",
    "PROVIDERS",
    "parse_spec_text",
]

BUILTIN_TOOLS: Final = frozenset({"run_command"})
PROVIDERS: Final = frozenset({"scripted", "openai"})

DEFAULT_MAX_STEPS: Final = 20
# Bounds ``limits.max_steps`` (model turns of one run): with ``max_tool_calls_per_step``
# it bounds the calls, events and journal rows one run can cost the daemon (by default
# 20 x 256 calls; at most 1,000 x 1,024). A spec could ask for 2**63 - 1: no bound at all.
MAX_MAX_STEPS: Final = 1000
# Bounds ``limits.deadline_s`` and ``limits.command_timeout_s`` (seconds): 30 days, far
# beyond any turn, yet a wall-clock time every reader (status, the CLI, the dashboard's
# dates) can show and add to. A run with no deadline leaves ``deadline_s`` out.
MAX_LIMIT_S: Final = 30 * 24 * 3600.0
# Bounds the tool calls one model turn may have run (``limits.max_tool_calls_per_step``):
# calls beyond it are refused, never run. Each call that runs costs its events, its
# record and the daemon's journal writes: one turn of thousands of calls flooded the
# daemon for a minute. The ceiling keeps a spec from lifting the bound out of reach, and
# a step's snapshot (its calls' records) within one event line (1 MiB).
DEFAULT_MAX_TOOL_CALLS_PER_STEP: Final = 256
MAX_MAX_TOOL_CALLS_PER_STEP: Final = 1024
# Bounds one run_command call: the command's group is stopped when it runs out (seconds).
DEFAULT_COMMAND_TIMEOUT_S: Final = 120.0
DEFAULT_MAX_OUTPUT_BYTES: Final = 65536
# A tool's output travels in one stderr event line, which the daemon caps at 1 MiB.
MAX_MAX_OUTPUT_BYTES: Final = 512 * 1024
# A stop interrupts a running command: SIGTERM to its group at once, SIGKILL after this
# (seconds). Short on purpose: not the run's grace (the daemon's, 10 s by default).
DEFAULT_COMMAND_STOP_GRACE_S: Final = 1.0
# A stop tells a cancellable MCP call to stop (notifications/cancelled), then waits this
# long for its answer before abandoning it (seconds).
DEFAULT_CANCEL_WAIT_S: Final = 1.0
# Stop policies a spec may ask for (values of ``subagent.events.StopPolicy``).
COMMAND_STOP_POLICIES: Final = ("interrupt", "finish")
# How long a call that needs approval waits for a person's answer; then the daemon stops
# the run with reason "approval_timeout" (seconds).
DEFAULT_APPROVAL_TIMEOUT_S: Final = 300.0
# The roles a session's history may carry (OpenAI's chat messages).
HISTORY_ROLES: Final = ("system", "user", "assistant", "tool")
MCP_STOP_POLICIES: Final = ("abandon", "cancel", "finish")


class SpecError(ValueError):
    """A run spec is invalid. ``field`` is a dotted path to the offending value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def _check_keys(d: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise SpecError(
            f"{where}.{unknown[0]}" if where else unknown[0],
            f"unknown key {unknown[0]!r} (expected one of {sorted(allowed)!r})",
        )


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise SpecError(where, f"expected an object, got {type(v).__name__}")
    for k in v:
        if not isinstance(k, str):  # pragma: no cover - json keys are always str
            raise SpecError(where, f"expected string keys, got {k!r}")
    return v


def _str(v: Any, where: str, *, empty: bool = False) -> str:
    if not isinstance(v, str):
        raise SpecError(where, f"expected a string, got {type(v).__name__}")
    if not empty and not v.strip():
        raise SpecError(where, "expected a non-empty string")
    if "\x00" in v:
        raise SpecError(where, "string contains a NUL byte")
    return v


def _env_name(k: str, where: str) -> str:
    # What an environment can hold: execve takes "NAME=value" C strings (Popen refuses the
    # rest with ValueError, which ended the run as a runner bug).
    if not k or "=" in k or "\x00" in k:
        raise SpecError(where, f"expected variable names that are non-empty, without '=' or NUL, got {k!r}")
    return k


def _opt_str(d: Mapping[str, Any], key: str, where: str) -> str | None:
    v = d.get(key)
    return None if v is None else _str(v, f"{where}{key}")


def _num(v: Any, where: str, *, positive: bool = True, maximum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SpecError(where, f"expected a number, got {type(v).__name__}")
    f = float(v)
    if f != f or f in (float("inf"), float("-inf")):
        raise SpecError(where, f"expected a finite number, got {v!r}")
    if positive and f <= 0:
        raise SpecError(where, f"expected a positive number, got {v!r}")
    if maximum is not None and f > maximum:
        raise SpecError(where, f"expected a number <= {maximum:.15g}, got {v!r}")
    return f


def _int(v: Any, where: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(where, f"expected an integer, got {type(v).__name__}")
    if v < minimum:
        raise SpecError(where, f"expected an integer >= {minimum}, got {v!r}")
    if maximum is not None and v > maximum:
        raise SpecError(where, f"expected an integer <= {maximum}, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class ModelSpec:
    provider: str
    name: str | None = None
    base_url: str | None = None
    script: Mapping[str, Any] | None = None
    script_path: str | None = None
    request_timeout_s: float | None = None

    @classmethod
    def from_dict(cls, d: Any, env: Mapping[str, str]) -> ModelSpec:
        d = _obj(d, "model")
        _check_keys(d, "model", {"provider", "name", "base_url", "script", "script_path", "request_timeout_s"})
        provider = d.get("provider")
        if provider is None:
            # A named model is a real one: without a key the run fails, it is not played.
            provider = "openai" if d.get("name") is not None or env.get("OPENAI_API_KEY") else "scripted"
        provider = _str(provider, "model.provider")
        if provider not in PROVIDERS:
            raise SpecError("model.provider", f"expected one of {sorted(PROVIDERS)!r}, got {provider!r}")
        script = d.get("script")
        if script is not None:
            script = _obj(script, "model.script")
            # Validated fully by subagent.model.script (also stdlib): a bad script is a bad spec.
            from subagent.model.script import Script, ScriptError

            try:
                Script.from_dict(script)
            except ScriptError as exc:
                raise SpecError(f"model.script.{exc.field}".rstrip("."), exc.message) from None
        script_path = _opt_str(d, "script_path", "model.")
        if script is not None and script_path is not None:
            raise SpecError("model.script_path", "give either model.script or model.script_path, not both")
        if provider != "scripted" and (script is not None or script_path is not None):
            raise SpecError("model.script", f"a script needs provider 'scripted', got {provider!r}")
        timeout = d.get("request_timeout_s")
        return cls(
            provider=provider,
            name=_opt_str(d, "name", "model."),
            base_url=_opt_str(d, "base_url", "model."),
            script=script,
            script_path=script_path,
            request_timeout_s=None if timeout is None else _num(timeout, "model.request_timeout_s"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"provider": self.provider}
        for k in ("name", "base_url", "script", "script_path", "request_timeout_s"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    """One entry of the Claude Desktop ``mcpServers`` shape (stdio servers)."""

    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str) -> McpServerSpec:
        d = _obj(d, where)
        # "type": "stdio" appears in some clients' files; accept it for the "works unchanged" promise.
        _check_keys(d, where, {"command", "args", "env", "cwd", "type"})
        if d.get("type", "stdio") != "stdio":
            raise SpecError(f"{where}.type", f"only stdio servers are supported, got {d.get('type')!r}")
        if "command" not in d:
            raise SpecError(f"{where}.command", "missing required key 'command'")
        args = d.get("args", [])
        if not isinstance(args, list):
            raise SpecError(f"{where}.args", f"expected a list of strings, got {type(args).__name__}")
        env = _obj(d.get("env", {}), f"{where}.env")
        return cls(
            command=_str(d["command"], f"{where}.command"),
            args=tuple(_str(a, f"{where}.args[{i}]", empty=True) for i, a in enumerate(args)),
            env={_env_name(k, f"{where}.env"): _str(v, f"{where}.env.{k}", empty=True) for k, v in env.items()},
            cwd=_opt_str(d, "cwd", f"{where}."),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"command": self.command, "args": list(self.args), "env": dict(self.env)}
        if self.cwd is not None:
            out["cwd"] = self.cwd
        return out


@dataclass(frozen=True, slots=True)
class Limits:
    max_steps: int = DEFAULT_MAX_STEPS
    deadline_s: float | None = None
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    max_tool_calls_per_step: int = DEFAULT_MAX_TOOL_CALLS_PER_STEP

    @classmethod
    def from_dict(cls, d: Any) -> Limits:
        d = _obj(d, "limits")
        _check_keys(
            d,
            "limits",
            {"max_steps", "deadline_s", "command_timeout_s", "max_output_bytes", "max_tool_calls_per_step"},
        )
        deadline = d.get("deadline_s")
        return cls(
            max_steps=_int(d.get("max_steps", DEFAULT_MAX_STEPS), "limits.max_steps", maximum=MAX_MAX_STEPS),
            deadline_s=None if deadline is None else _num(deadline, "limits.deadline_s", maximum=MAX_LIMIT_S),
            command_timeout_s=_num(
                d.get("command_timeout_s", DEFAULT_COMMAND_TIMEOUT_S), "limits.command_timeout_s", maximum=MAX_LIMIT_S
            ),
            max_output_bytes=_int(
                d.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES),
                "limits.max_output_bytes",
                minimum=64,
                maximum=MAX_MAX_OUTPUT_BYTES,
            ),
            max_tool_calls_per_step=_int(
                d.get("max_tool_calls_per_step", DEFAULT_MAX_TOOL_CALLS_PER_STEP),
                "limits.max_tool_calls_per_step",
                maximum=MAX_MAX_TOOL_CALLS_PER_STEP,
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "max_steps": self.max_steps,
            "command_timeout_s": self.command_timeout_s,
            "max_output_bytes": self.max_output_bytes,
            "max_tool_calls_per_step": self.max_tool_calls_per_step,
        }
        if self.deadline_s is not None:
            out["deadline_s"] = self.deadline_s
        return out


def _abs_paths(v: Any, where: str) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise SpecError(where, f"expected a list of absolute paths, got {type(v).__name__}")
    return tuple(_abs_path(p, f"{where}[{i}]") for i, p in enumerate(v))


def _abs_path(v: Any, where: str) -> str:
    p = _str(v, where)
    if not p.startswith("/"):
        raise SpecError(where, f"expected an absolute path, got {p!r}")
    return os.path.normpath(p)


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What a run may touch beyond its own directory, granted explicitly (``subagent.sandbox``).

    ``read``: trees its processes may read and execute; ``write``: trees they may also
    write; ``workdir``: a directory they may write that ``run_command`` also runs in.
    """

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    workdir: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> SandboxSpec:
        d = _obj(d, "sandbox")
        _check_keys(d, "sandbox", {"read", "write", "workdir"})
        workdir = d.get("workdir")
        return cls(
            read=_abs_paths(d.get("read", []), "sandbox.read"),
            write=_abs_paths(d.get("write", []), "sandbox.write"),
            workdir=None if workdir is None else _abs_path(workdir, "sandbox.workdir"),
        )

    @property
    def granted(self) -> bool:
        return bool(self.read or self.write or self.workdir)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"read": list(self.read), "write": list(self.write)}
        if self.workdir is not None:
            out["workdir"] = self.workdir
        return out


@dataclass(frozen=True, slots=True)
class StopPolicySpec:
    """What a stop does to a running tool, where the spec overrides the tool's own nature.

    ``run_command``: ``interrupt`` (default) or ``finish``. ``mcp``: keys are a server name
    or ``server/tool``, values ``abandon``, ``cancel`` or ``finish``; the most specific key
    wins over the tool's MCP annotations.
    """

    run_command: str = "interrupt"
    mcp: Mapping[str, str] = field(default_factory=dict)
    command_grace_s: float = DEFAULT_COMMAND_STOP_GRACE_S
    cancel_wait_s: float = DEFAULT_CANCEL_WAIT_S

    @classmethod
    def from_dict(cls, d: Any, servers: set[str]) -> StopPolicySpec:
        d = _obj(d, "stop_policy")
        _check_keys(d, "stop_policy", {"run_command", "mcp", "command_grace_s", "cancel_wait_s"})
        command = d.get("run_command", "interrupt")
        if command not in COMMAND_STOP_POLICIES:
            raise SpecError(
                "stop_policy.run_command", f"expected one of {list(COMMAND_STOP_POLICIES)!r}, got {command!r}"
            )
        mcp: dict[str, str] = {}
        for key, value in _obj(d.get("mcp", {}), "stop_policy.mcp").items():
            where = f"stop_policy.mcp.{key}"
            server, _, tool = key.partition("/")
            if server not in servers:
                raise SpecError(where, f"no mcp server named {server!r} in this spec (servers: {sorted(servers)!r})")
            if "/" in key and not tool:
                raise SpecError(where, f"expected 'server' or 'server/tool', got {key!r}")
            if value not in MCP_STOP_POLICIES:
                raise SpecError(where, f"expected one of {list(MCP_STOP_POLICIES)!r}, got {value!r}")
            mcp[key] = value
        return cls(
            run_command=command,
            mcp=mcp,
            command_grace_s=_num(d.get("command_grace_s", DEFAULT_COMMAND_STOP_GRACE_S), "stop_policy.command_grace_s"),
            cancel_wait_s=_num(d.get("cancel_wait_s", DEFAULT_CANCEL_WAIT_S), "stop_policy.cancel_wait_s"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_command": self.run_command,
            "mcp": dict(self.mcp),
            "command_grace_s": self.command_grace_s,
            "cancel_wait_s": self.cancel_wait_s,
        }


@dataclass(frozen=True, slots=True)
class ApprovalSpec:
    """Which calls wait for a person's OK before they run, and for how long.

    ``tools``: tool names as the model sees them (``run_command``, ``write_file``,
    ``fs__write_file``) or ``server/tool``; ``servers``: every tool of these MCP servers;
    ``commands``: shell-style patterns (``fnmatch``) a ``run_command`` command is matched
    against, whole (``"rm *"``, ``"git push*"``). ``timeout_s``: then the run is stopped
    with reason ``approval_timeout``.
    """

    tools: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_APPROVAL_TIMEOUT_S

    @classmethod
    def from_dict(cls, d: Any, servers: set[str]) -> ApprovalSpec:
        d = _obj(d, "approval")
        _check_keys(d, "approval", {"tools", "servers", "commands", "timeout_s"})
        lists: dict[str, tuple[str, ...]] = {}
        for key in ("tools", "servers", "commands"):
            v = d.get(key, [])
            if not isinstance(v, list):
                raise SpecError(f"approval.{key}", f"expected a list of strings, got {type(v).__name__}")
            lists[key] = tuple(dict.fromkeys(_str(x, f"approval.{key}[{i}]") for i, x in enumerate(v)))
        for i, name in enumerate(lists["servers"]):
            if name not in servers:
                raise SpecError(
                    f"approval.servers[{i}]",
                    f"no mcp server named {name!r} in this spec (servers: {sorted(servers)!r})",
                )
        return cls(
            tools=lists["tools"],
            servers=lists["servers"],
            commands=lists["commands"],
            timeout_s=_num(d.get("timeout_s", DEFAULT_APPROVAL_TIMEOUT_S), "approval.timeout_s"),
        )

    @property
    def any(self) -> bool:
        return bool(self.tools or self.servers or self.commands)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tools": list(self.tools),
            "servers": list(self.servers),
            "commands": list(self.commands),
            "timeout_s": self.timeout_s,
        }


def _history(v: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(v, list):
        raise SpecError("session.history", f"expected a list of messages, got {type(v).__name__}")
    out = []
    for i, m in enumerate(v):
        where = f"session.history[{i}]"
        m = _obj(m, where)
        _check_keys(m, where, {"role", "content", "tool_calls", "tool_call_id"})
        if m.get("role") not in HISTORY_ROLES:
            raise SpecError(f"{where}.role", f"expected one of {list(HISTORY_ROLES)!r}, got {m.get('role')!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise SpecError(f"{where}.content", f"expected a string or null, got {type(content).__name__}")
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise SpecError(f"{where}.tool_calls", "expected a list, on an assistant message")
            for j, c in enumerate(calls):
                c = _obj(c, f"{where}.tool_calls[{j}]")
                fn = _obj(c.get("function"), f"{where}.tool_calls[{j}].function")
                _str(c.get("id"), f"{where}.tool_calls[{j}].id")
                _str(fn.get("name"), f"{where}.tool_calls[{j}].function.name")
                _str(fn.get("arguments"), f"{where}.tool_calls[{j}].function.arguments", empty=True)
        if m["role"] == "tool":
            _str(m.get("tool_call_id"), f"{where}.tool_call_id")
        out.append(dict(m))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """What the daemon adds for a turn of a session (never a user's spec: it refuses one).

    ``history``: the session's earlier turns as OpenAI-shaped messages, rebuilt from the
    journal (``subagent.history.turn_messages``); ``browser_profile``: the session's
    Chromium profile directory, which the browser preset uses instead of a throwaway one
    (the daemon also grants it in ``sandbox.write``).
    """

    history: tuple[Mapping[str, Any], ...] = ()
    browser_profile: str | None = None

    @classmethod
    def from_dict(cls, d: Any) -> SessionSpec:
        d = _obj(d, "session")
        _check_keys(d, "session", {"history", "browser_profile"})
        profile = d.get("browser_profile")
        return cls(
            history=_history(d.get("history", [])),
            browser_profile=None if profile is None else _abs_path(profile, "session.browser_profile"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"history": [dict(m) for m in self.history]}
        if self.browser_profile is not None:
            out["browser_profile"] = self.browser_profile
        return out


def _tool_paths(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_TOOL_PATHS:
        raise SpecError("tool_paths", f"expected a list of at most {MAX_TOOL_PATHS} absolute paths")
    return tuple(_abs_path(p, f"tool_paths[{i}]") for i, p in enumerate(v))


_TOP_KEYS: Final = {
    "run_id",
    "session_id",
    "task",
    "system_prompt",
    "model",
    "builtin_tools",
    "mcpServers",
    "browser",
    "limits",
    "sandbox",
    "stop_policy",
    "approval",
    "session",
    "tool_paths",
}
# At most this many paths in a spec's ``tool_paths`` (the daemon's: a browser's three, a
# command and a cwd per MCP server).
MAX_TOOL_PATHS: Final = 256


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A validated run spec. Build it with ``from_dict`` (or ``parse_spec_text``)."""

    task: str
    model: ModelSpec
    run_id: str | None = None
    session_id: str | None = None
    system_prompt: str | None = None
    builtin_tools: tuple[str, ...] = ("run_command",)
    mcp_servers: Mapping[str, McpServerSpec] = field(default_factory=dict)
    browser: bool | Mapping[str, Any] = False
    limits: Limits = field(default_factory=Limits)
    sandbox: SandboxSpec = field(default_factory=SandboxSpec)
    stop_policy: StopPolicySpec = field(default_factory=StopPolicySpec)
    approval: ApprovalSpec = field(default_factory=ApprovalSpec)
    session: SessionSpec = field(default_factory=SessionSpec)
    # What the run's tools need (its MCP servers' commands and cwds, its browser's files),
    # as the daemon found them on the host at the start (never a user's spec: it refuses
    # one). None: the runner finds them itself (``sandbox.tool_paths``). A runner forked
    # ahead sees /tmp and the like through its private tmpfs, where they are not.
    tool_paths: tuple[str, ...] | None = None

    @classmethod
    def from_dict(cls, d: Any, env: Mapping[str, str] | None = None) -> RunSpec:
        """Validate a decoded JSON spec.

        Args:
            d: the decoded JSON value.
            env: environment used for defaults (``OPENAI_API_KEY``); ``os.environ`` if None.

        Raises:
            SpecError: the spec is invalid; ``field`` names the offending value.
        """
        env = os.environ if env is None else env
        d = _obj(d, "")
        _check_keys(d, "", _TOP_KEYS)
        if "task" not in d:
            raise SpecError("task", "missing required key 'task'")
        tools = d.get("builtin_tools", ["run_command"])
        if not isinstance(tools, list):
            raise SpecError("builtin_tools", f"expected a list of strings, got {type(tools).__name__}")
        for i, t in enumerate(tools):
            if t not in BUILTIN_TOOLS:
                raise SpecError(
                    f"builtin_tools[{i}]", f"unknown built-in tool {t!r} (known: {sorted(BUILTIN_TOOLS)!r})"
                )
        servers_raw = _obj(d.get("mcpServers", {}), "mcpServers")
        servers: dict[str, McpServerSpec] = {}
        for name, entry in servers_raw.items():
            # Names from other clients' files are kept as they are; only what would break
            # tool naming (``<server>__<tool>``) or a file name is refused.
            if not name.strip() or "__" in name or len(name) > 64 or any(c in name for c in "/\x00\n"):
                raise SpecError(
                    f"mcpServers.{name}",
                    f"server names must be 1..64 characters without '__', '/' or newlines, got {name!r}",
                )
            servers[name] = McpServerSpec.from_dict(entry, f"mcpServers.{name}")
        browser = d.get("browser", False)
        if isinstance(browser, dict):
            browser = dict(_obj(browser, "browser"))
        elif not isinstance(browser, bool):
            raise SpecError("browser", f"expected true, false or an object, got {type(browser).__name__}")
        if browser is not False and "browser" in servers:
            raise SpecError("mcpServers.browser", "the name 'browser' is taken by the browser preset")
        return cls(
            task=_str(d["task"], "task"),
            model=ModelSpec.from_dict(d.get("model", {}), env),
            run_id=_opt_str(d, "run_id", ""),
            session_id=_opt_str(d, "session_id", ""),
            system_prompt=_opt_str(d, "system_prompt", ""),
            builtin_tools=tuple(dict.fromkeys(tools)),
            mcp_servers=servers,
            browser=browser,
            limits=Limits.from_dict(d.get("limits", {})),
            sandbox=SandboxSpec.from_dict(d.get("sandbox", {})),
            stop_policy=StopPolicySpec.from_dict(
                d.get("stop_policy", {}), set(servers) | ({"browser"} if browser is not False else set())
            ),
            approval=ApprovalSpec.from_dict(
                d.get("approval", {}), set(servers) | ({"browser"} if browser is not False else set())
            ),
            session=SessionSpec.from_dict(d.get("session", {})),
            tool_paths=_tool_paths(d.get("tool_paths")),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "task": self.task,
            "model": self.model.to_dict(),
            "builtin_tools": list(self.builtin_tools),
            "mcpServers": {k: v.to_dict() for k, v in self.mcp_servers.items()},
            "browser": self.browser if isinstance(self.browser, bool) else dict(self.browser),
            "limits": self.limits.to_dict(),
        }
        if self.sandbox.granted:
            out["sandbox"] = self.sandbox.to_dict()
        if self.stop_policy != StopPolicySpec():
            out["stop_policy"] = self.stop_policy.to_dict()
        if self.approval != ApprovalSpec():
            out["approval"] = self.approval.to_dict()
        if self.session != SessionSpec():
            out["session"] = self.session.to_dict()
        if self.tool_paths is not None:
            out["tool_paths"] = list(self.tool_paths)
        for k in ("run_id", "session_id", "system_prompt"):
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def parse_spec_text(text: str, env: Mapping[str, str] | None = None) -> RunSpec:
    """Parse the spec as the runner reads it (one JSON document).

    Raises:
        SpecError: not JSON, or not a valid spec.
    """
    if not text.strip():
        raise SpecError("", "expected a JSON run spec on stdin, got nothing")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise SpecError("", f"expected a JSON run spec on stdin, got invalid JSON ({exc})") from None
    return RunSpec.from_dict(obj, env)
