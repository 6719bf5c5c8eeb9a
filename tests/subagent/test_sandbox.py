"""The sandbox's parts: grant planning, the tool environment, settings, the spec's grants,
and Landlock itself on a real child process (the runs themselves: tests/e2e/test_sandbox.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from subagent import _isolate, _landlock, _quotas
from subagent._landlock import FS_READ, FS_WRITE, Grant, plan_rules
from subagent.sandbox import SANDBOX_ENV, TMPFS_MAX_MIB, Settings, check_grants, tool_env
from subagent.spec import RunSpec, SpecError
from tests import conftest

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> None:
    for rel in ("state/runs/mine/f", "state/runs/other/f", "state/token", "lib/x", "top"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
    (root / "link-to-state").symlink_to(root / "state")


def test_a_grant_around_a_protected_path_grants_its_siblings_instead(tmp_path: Path) -> None:
    _tree(tmp_path)
    state = tmp_path / "state"
    rules = plan_rules([Grant(str(tmp_path), FS_READ), Grant(str(state / "runs" / "mine"), FS_WRITE)], [str(state)])
    got = {(Path(g.path).relative_to(tmp_path).as_posix(), g.access) for g in rules}
    assert ("lib", FS_READ) in got
    assert ("top", FS_READ & _landlock.FS_FILE_ONLY) in got  # a file gets file rights only
    assert ("state/runs/mine", FS_WRITE) in got  # explicit, inside: kept
    paths = {p for p, _ in got}
    # Nothing that reaches the state dir: not it, not an ancestor (a rule on a directory
    # covers all below it), not a symlink into it.
    assert not paths & {".", "state", "state/runs", "state/token", "state/runs/other", "link-to-state"}


def test_a_protected_file_in_a_granted_directory_is_not_granted(tmp_path: Path) -> None:
    """A protected path that is a file (``/etc/shadow``, a ``sandbox_protect`` file) is
    skipped as a protected directory is: its directory's other entries are granted, it not."""
    _tree(tmp_path)
    rules = plan_rules([Grant(str(tmp_path), FS_READ)], [str(tmp_path / "lib" / "x"), str(tmp_path / "top")])
    paths = {Path(g.path).relative_to(tmp_path).as_posix() for g in rules}
    assert "state" in paths  # a directory without a protected path in it: whole
    assert not paths & {".", "lib", "lib/x", "top"}


def test_plan_rules_drops_missing_paths_and_keeps_unrelated_grants(tmp_path: Path) -> None:
    rules = plan_rules([Grant(str(tmp_path / "nope"), FS_READ), Grant(str(tmp_path), FS_READ)], ["/elsewhere"])
    assert rules == [Grant(str(tmp_path), FS_READ)]


def test_tool_env_is_an_allowlist_and_never_carries_a_secret() -> None:
    environ = {
        "PATH": "/usr/bin",
        "HOME": "/run/home",
        "LC_ALL": "C",
        "OPENAI_API_KEY": "sk-model",
        "OPENAI_BASE_URL": "http://model",
        "GITHUB_TOKEN": "ghp-x",
        "AGENTD_RUN_ID": "r-1",
        "AGENTD_TREE": "t-1",
        "AGENTD_STATE_DIR": "/var/lib/agentd",
        SANDBOX_ENV: Settings(protect=("/var/lib/agentd",)).to_env(),
        "RANDOM_THING": "x",
        "BASH_FUNC_f%%": "() { :; }",
    }
    env = tool_env({"SERVER_URL": "http://s", "API": "sk-model", "AGENTD_TREE": "spoofed"}, environ=environ)
    assert env == {
        "PATH": "/usr/bin",
        "HOME": "/run/home",
        "LC_ALL": "C",
        "SERVER_URL": "http://s",  # a server's own env is passed ...
        "AGENTD_RUN_ID": "r-1",
        "AGENTD_TREE": "t-1",  # ... but never over the run's markers
    }  # and never the model key, whatever name it is given


def test_names_the_daemon_adds_pass_but_the_model_key_never_does() -> None:
    environ = {
        "GITHUB_TOKEN": "ghp-x",
        "OPENAI_API_KEY": "sk-model",
        "PROXY_URL": "http://p",
        SANDBOX_ENV: Settings(tool_env=("GITHUB_TOKEN", "OPENAI_API_KEY", "PROXY_URL")).to_env(),
    }
    assert tool_env(environ=environ) == {"GITHUB_TOKEN": "ghp-x", "PROXY_URL": "http://p"}


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        (None, "auto"),
        ("off", "off"),
        ("required", "required"),
        ("{not json", "required"),
        ('{"mode": "bogus"}', "required"),
    ],
)
def test_settings_from_the_environment_err_on_the_safe_side(raw: str | None, mode: str) -> None:
    environ = {} if raw is None else {SANDBOX_ENV: raw}
    assert Settings.from_env(environ).mode == mode


def test_settings_round_trip() -> None:
    s = Settings(
        mode="required", protect=("/a", "/b"), tool_env=("X",), tmpfs_max_mib=64, inotify_instances=3,
        inotify_watches=5,
    )  # fmt: skip
    assert Settings.from_env({SANDBOX_ENV: s.to_env()}) == s


def test_a_runs_inotify_caps_are_the_daemons_settings_and_the_same_by_default(tmp_path: Path) -> None:
    from supervisor.config import Config
    from supervisor.trees.pool import sandbox_settings

    assert Config().run_inotify_instances == Settings().inotify_instances == _quotas.INOTIFY_INSTANCES > 0
    assert Config().run_inotify_watches == Settings().inotify_watches == _quotas.INOTIFY_WATCHES > 0
    environ = {"AGENTD_RUN_INOTIFY_INSTANCES": "4", "AGENTD_RUN_INOTIFY_WATCHES": "0"}
    settings = sandbox_settings(Config.load(state_dir=tmp_path, environ=environ))
    assert (settings.inotify_instances, settings.inotify_watches) == (4, 0)
    assert "max_inotify_watches" not in _quotas.user_limits(4, 0)  # 0: no cap of the run's own
    # A runner told nothing of them (an older daemon's settings) keeps the caps.
    assert Settings.from_env({SANDBOX_ENV: '{"mode": "auto"}'}).inotify_instances == _quotas.INOTIFY_INSTANCES


def test_the_private_tmpfs_bound_is_the_daemons_setting_and_the_same_by_default(tmp_path: Path) -> None:
    from supervisor.config import Config
    from supervisor.trees.pool import sandbox_settings

    assert Config().run_tmpfs_max_mib == Settings().tmpfs_max_mib == TMPFS_MAX_MIB > 0
    config = Config.load(state_dir=tmp_path, environ={"AGENTD_RUN_TMPFS_MAX_MIB": "0"})
    assert sandbox_settings(config).tmpfs_max_mib == 0  # the kernel's default
    # A runner told nothing of it (an older daemon's settings) keeps the bound.
    assert Settings.from_env({SANDBOX_ENV: '{"mode": "auto"}'}).tmpfs_max_mib == TMPFS_MAX_MIB


def test_grants_inside_a_protected_path_are_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert check_grants([str(tmp_path / "data")], [str(tmp_path / "out")], [str(state)]) is None
    assert check_grants([str(tmp_path)], [], [str(state)]) is None  # around it: planned out
    why = check_grants([], [str(state / "runs")], [str(state)])
    assert why is not None and "which no run may reach" in why


def test_the_spec_takes_explicit_absolute_grants() -> None:
    spec = RunSpec.from_dict(
        {"task": "t", "sandbox": {"read": ["/data/in/"], "write": ["/data/out"], "workdir": "/srv/p"}}, env={}
    )
    assert spec.sandbox.read == ("/data/in",) and spec.sandbox.write == ("/data/out",)
    assert spec.sandbox.workdir == "/srv/p"
    assert RunSpec.from_dict(spec.to_dict(), env={}) == spec
    for bad, field in [
        ({"read": ["relative"]}, "sandbox.read[0]"),
        ({"write": "/x"}, "sandbox.write"),
        ({"workdir": 3}, "sandbox.workdir"),
        ({"network": True}, "sandbox.network"),
    ]:
        with pytest.raises(SpecError) as info:
            RunSpec.from_dict({"task": "t", "sandbox": bad}, env={})
        assert info.value.field == field


CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from subagent import _landlock as L
root, protect = sys.argv[2], sys.argv[3]
target = sys.argv[5] if len(sys.argv) > 5 else os.path.join(protect, "token")
grants = [L.Grant(p, L.FS_READ) for p in json.loads(sys.argv[4])] + [L.Grant(root, L.FS_READ)]
L.restrict_self(L.plan_rules(grants, [protect]), abi=L.abi_version(), scoped=L.SCOPE_SIGNAL)
out = {}
for name, fn in [
    ("sibling", lambda: open(os.path.join(root, "lib", "x")).read()),
    ("protected", lambda: open(target).read()),
    ("write", lambda: open(os.path.join(root, "lib", "new"), "w")),
    ("signal_parent", lambda: os.kill(os.getppid(), 0)),
]:
    try:
        fn()
        out[name] = "ok"
    except OSError as exc:
        out[name] = exc.strerror
print(json.dumps(out))
"""


def test_landlock_on_a_real_process_denies_what_was_not_granted(tmp_path: Path) -> None:
    conftest.require(_landlock.abi_version() >= 6, "Landlock ABI 6 (signal scoping: kernel 6.12+)")
    _tree(tmp_path)
    runtime = [sys.prefix, sys.base_prefix, str(REPO), "/usr", "/lib", "/lib64", "/etc"]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), str(tmp_path), str(tmp_path / "state"), json.dumps(runtime)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(out) == {
        "sibling": "ok",
        "protected": "Permission denied",
        "write": "Permission denied",
        "signal_parent": "Operation not permitted",
    }
    assert os.path.exists(tmp_path / "state" / "token")


def test_landlock_denies_a_protected_file_in_a_granted_directory(tmp_path: Path) -> None:
    """A protected file (``/etc/shadow`` in the granted ``/etc``) cannot be opened, its
    siblings can: a run of a root daemon read the host's /etc/shadow."""
    conftest.require(_landlock.abi_version() >= 6, "Landlock ABI 6 (signal scoping: kernel 6.12+)")
    _tree(tmp_path)
    secret = str(tmp_path / "state" / "token")
    runtime = [sys.prefix, sys.base_prefix, str(REPO), "/usr", "/lib", "/lib64", "/etc"]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO), str(tmp_path), secret, json.dumps(runtime), secret],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(out)["protected"] == "Permission denied", out
    assert json.loads(out)["sibling"] == "ok", out


def _as_nobody(fn: Callable[[], bool]) -> int:
    """``fn()`` in a forked child that is uid/gid 65534 (no groups): 0 if true, 1 if false."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 2
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = 0 if fn() else 1
        except BaseException:
            code = 3
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_normal_users_runner_sees_that_chromium_can_make_its_namespace() -> None:
    # The runner is not dumpable (its /proc files then belong to root); Chromium, exec'd,
    # is. The probe must answer for Chromium, not for the runner.
    from subagent import _isolate
    from tests.conftest import require

    require(os.geteuid() == 0, "root, to become a normal user")

    def dumpable() -> bool:
        _isolate.set_dumpable(True)  # (a uid change makes a process not dumpable)
        return _isolate.can_nest_user_namespace()

    def not_dumpable() -> bool:
        _isolate.set_dumpable(False)
        return _isolate.can_nest_user_namespace()

    require(_as_nobody(dumpable) == 0, "unprivileged user namespaces")
    assert _as_nobody(not_dumpable) == 0


@pytest.mark.parametrize(
    ("read", "write", "plan"),
    [
        # A write grant inside a read grant: the read grant read-only, the write grant
        # bound again over it, writable (it was the read grant bound writable whole).
        (["/tmp/p"], ["/tmp/p/out"], [("/tmp/p", True), ("/tmp/p/out", False)]),
        # A read grant inside a write grant: the write grant covers it.
        (["/tmp/p/in"], ["/tmp/p"], [("/tmp/p", False)]),
        # Nested reads, and a write below a write that is itself below a read.
        (["/tmp/p", "/tmp/p/q"], ["/tmp/p/w", "/tmp/p/w/x"], [("/tmp/p", True), ("/tmp/p/w", False)]),
        # Beside each other; a path outside the private dirs is not bound back.
        (["/tmp/a", "/usr/lib"], ["/tmp/ab"], [("/tmp/a", True), ("/tmp/ab", False)]),
        # A path both read and written is written.
        (["/dev/shm/x"], ["/dev/shm/x"], [("/dev/shm/x", False)]),
    ],
)
def test_the_bind_plan_keeps_read_grants_read_only_and_write_grants_writable(
    read: list[str], write: list[str], plan: list[tuple[str, bool]]
) -> None:
    assert _isolate.bind_plan(read, write, within=["/tmp", "/dev/shm"]) == plan


def test_the_spawn_check_refuses_what_the_runners_check_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One list (``protected``): the daemon's spawn check had its own, without the host's
    # ssh keys, so such a grant was refused only as the run started (a failed run).
    from subagent import sandbox
    from supervisor.config import Config
    from supervisor.core._spec_check import validate_spec
    from supervisor.errors import SpawnError

    key = tmp_path / "ssh_host_ed25519_key"
    key.write_text("secret")
    real_glob = sandbox.glob.glob
    monkeypatch.setattr(
        sandbox.glob, "glob", lambda pattern: [str(key)] if "ssh_host" in pattern else real_glob(pattern)
    )
    config = Config.load(state_dir=tmp_path / "state", environ={})
    spec = {"task": "t", "model": {"provider": "scripted"}, "sandbox": {"read": [str(key)]}}
    with pytest.raises(SpawnError, match="which no run may reach"):
        validate_spec(spec, config=config)


def test_a_runner_is_given_its_tools_paths_and_its_browser_as_the_binary_not_a_link(tmp_path: Path) -> None:
    # A runner forked ahead sees /tmp through its own tmpfs: the daemon tells it what its
    # tools need (``tool_paths``), and names the browser's binary, not a link kept there
    # (Chromium finds its files beside what it was started as).
    from supervisor.core._spec_check import spec_for_runner

    link = tmp_path / "chr"
    link.symlink_to("/usr/lib/chromium/chromium")
    spec = {"task": "t", "model": {"provider": "scripted"}, "browser": {"executable_path": str(link)}}
    out = spec_for_runner(spec)
    assert out["browser"]["executable_path"] == os.path.realpath(link)
    assert "/usr/lib/chromium" in out["tool_paths"]
    assert spec["browser"]["executable_path"] == str(link)  # the run's own spec is as it was
    plain = {"task": "t", "model": {"provider": "scripted"}}
    assert spec_for_runner(plain) is plain  # nothing to find: given as it is


def test_a_write_grant_holding_or_inside_the_runners_own_code_is_refused(tmp_path: Path) -> None:
    # A run that could write the checkout or the virtualenv ran its own code, unsandboxed,
    # in the next run's runner (it copied the daemon's token): a probe did it with a write
    # grant of the directory holding the clone.
    from subagent import sandbox

    code = sandbox.runner_code()
    parent = str(Path(sandbox.CHECKOUT).parent)
    for g in (sandbox.CHECKOUT, f"{sandbox.CHECKOUT}/subagent", parent, sys.prefix):
        why = sandbox.check_grants([], [g], [])
        assert why is not None and "agentd's own code" in why, (g, why)
        assert sandbox.check_grants([g], [], []) is None  # reading it is fine
    assert sandbox.check_grants([], [str(tmp_path)], []) is None or any(c.startswith(str(tmp_path)) for c in code)


def test_a_grant_that_cannot_be_resolved_is_refused_not_an_internal_error() -> None:
    from subagent import sandbox

    assert sandbox.check_grants(["/tmp/a\x00b"], [], []) == "'/tmp/a\\x00b' cannot be resolved"


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("layout", ["node_modules", "bare"])
def test_a_browser_run_is_granted_nodes_binary_and_the_packages_not_the_dirs_around_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    # node unpacked into a home's ~/.local (its prefix, once granted whole: ~/.local/share
    # and the rest of it); @playwright/mcp kept in node_modules, or bare in a directory of
    # its own (three levels above cli.js, once granted, is then the home's parent).
    home = tmp_path / "home" / "u"
    node = _exe(home / ".local" / "bin" / "node")
    (home / ".local" / "lib").mkdir()
    (home / ".local" / "lib" / "libnode.so.115").write_text("")
    chromium = _exe(home / "chromium" / "chrome")
    package = home / "node_modules" / "@playwright" / "mcp" if layout == "node_modules" else home / "pw-mcp"
    package.mkdir(parents=True)
    (package / "cli.js").write_text("// fake\n")
    monkeypatch.setenv("AGENTD_NODE", str(node))
    monkeypatch.setenv("AGENTD_CHROMIUM", str(chromium))
    monkeypatch.setenv("AGENTD_PLAYWRIGHT_MCP", str(package))
    from subagent.sandbox import tool_paths

    got = tool_paths(RunSpec.from_dict({"task": "t", "browser": True}))
    modules = home / "node_modules" if layout == "node_modules" else package
    assert got == [str(node), str(home / ".local" / "lib" / "libnode.so.115"), str(modules), str(chromium.parent)]
