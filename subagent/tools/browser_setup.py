"""Where the browser preset's pieces are on this machine: Chromium, node, ``@playwright/mcp``.

``find_chromium``, ``find_node``, ``find_playwright_mcp``: each returns a path or raises
``BrowserSetupError`` naming what is missing and what to install; ``read_paths`` is what a
sandboxed run must read to start them, and no more. Stdlib only, no files
written, no process started (the daemon checks a spec's browser at spawn time through
``subagent.presets``). Module-level paths (``DEBIAN_CHROMIUM``, ``CHECKOUT_ROOT``) are the
seams tests point elsewhere.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
from typing import Final

from subagent import _wide

__all__ = [
    "BrowserSetupError",
    "DEBIAN_CHROMIUM",
    "PLAYWRIGHT_BROWSERS_DEFAULT",
    "CHECKOUT_ROOT",
    "PLAYWRIGHT_MCP_CLI",
    "find_chromium",
    "find_node",
    "find_playwright_mcp",
    "read_paths",
    "CHROMIUM_FILES",
    "chromium_narrowed",
]

# Debian's package puts the real binary here; /usr/bin/chromium is a shell wrapper.
DEBIAN_CHROMIUM: Final = pathlib.Path("/usr/lib/chromium/chromium")

# Where ``python -m playwright install chromium`` puts its browsers unless told otherwise.
PLAYWRIGHT_BROWSERS_DEFAULT: Final = pathlib.Path("~/.cache/ms-playwright")

# The checkout this module lives in: ``scripts/setup`` runs ``npm ci`` here.
CHECKOUT_ROOT: Final = pathlib.Path(__file__).resolve().parents[2]
PLAYWRIGHT_MCP_CLI: Final = pathlib.Path("node_modules/@playwright/mcp/cli.js")


# What Chromium keeps beside its binary (Debian's /usr/lib/chromium, Chrome for Testing's
# chrome-linux64 as Playwright installs it, its chrome-headless-shell): granted one by one,
# with the binary, where its directory holds more than Chromium (``chromium_narrowed``).
CHROMIUM_FILES: Final = (
    "chrome_100_percent.pak", "chrome_200_percent.pak", "resources.pak", "headless_lib_data.pak",
    "headless_lib_strings.pak", "headless_command_resources.pak", "icudtl.dat", "snapshot_blob.bin",
    "v8_context_snapshot.bin", "chrome_crashpad_handler", "chrome_sandbox", "chrome-sandbox",
    "vk_swiftshader_icd.json", "libEGL.so", "libGLESv2.so", "libvk_swiftshader.so", "libvulkan.so.1",
    "libVkICD_mock_icd.so", "libVkLayer_khronos_validation.so", "libqt5_shim.so", "libqt6_shim.so",
    "locales", "resources", "extensions", "MEIPreload", "PrivacySandboxAttestationsPreloaded",
    "WidevineCdm", "swiftshader", "hyphen-data",
)  # fmt: skip


class BrowserSetupError(Exception):
    """The browser preset cannot be set up: ``what`` is missing or wrong, ``hint`` fixes it.

    The runner maps it to ``ExitCode.TOOL_SETUP``; the daemon rejects the spawn with it.
    """

    def __init__(self, what: str, hint: str) -> None:
        super().__init__(f"{what}: {hint}")
        self.what = what
        self.hint = hint


def _is_executable_file(path: pathlib.Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _playwright_chromiums() -> list[pathlib.Path]:
    """Playwright-managed Chromium binaries, newest revision first, full browser before shell."""
    base = os.environ.get("PLAYWRIGHT_BROWSERS_PATH")
    root = pathlib.Path(base) if base and base != "0" else PLAYWRIGHT_BROWSERS_DEFAULT.expanduser()

    def revision(p: str) -> int:
        m = re.search(r"-(\d+)/", p.removeprefix(str(root)))
        return int(m.group(1)) if m else 0

    found: list[pathlib.Path] = []
    # Layouts of Playwright 1.4x-1.6x: chrome-linux64/chrome (chrome-linux/chrome before), and
    # chrome-headless-shell-linux64/chrome-headless-shell (chrome-linux/headless_shell before).
    patterns = (
        "chromium-*/chrome-linux*/chrome",
        "chromium_headless_shell-*/chrome-headless-shell-linux*/chrome-headless-shell",
        "chromium_headless_shell-*/chrome-linux/headless_shell",
    )
    for pattern in patterns:
        hits = sorted(glob.glob(str(root / pattern)), key=revision, reverse=True)
        found += [pathlib.Path(h) for h in hits if _is_executable_file(pathlib.Path(h))]
    return found


def find_chromium(config_path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Find the Chromium binary a browser run will use.

    Order: ``config_path`` (a spec option or daemon config), env ``AGENTD_CHROMIUM``, Debian's
    ``/usr/lib/chromium/chromium``, a Playwright-managed Chromium under ``~/.cache/ms-playwright``
    (or ``PLAYWRIGHT_BROWSERS_PATH``). An explicit path that is not an executable file is an
    error, never a silent fallback.

    Raises:
        BrowserSetupError: no Chromium found, or the explicit one is not executable.
    """
    for source, value in (
        ("browser option executable_path", config_path),
        ("AGENTD_CHROMIUM", os.environ.get("AGENTD_CHROMIUM")),
    ):
        if value is None or str(value) == "":
            continue
        path = pathlib.Path(value).expanduser()
        if not _is_executable_file(path):
            raise BrowserSetupError(
                f"chromium not found at {str(path)!r} (from {source})",
                "point it at a Chromium binary, or unset it to use /usr/lib/chromium/chromium "
                "(apt-get install chromium)",
            )
        return path
    if _is_executable_file(DEBIAN_CHROMIUM):
        return DEBIAN_CHROMIUM
    managed = _playwright_chromiums()
    if managed:
        return managed[0]
    raise BrowserSetupError(
        f"chromium not found (looked for {str(DEBIAN_CHROMIUM)!r} and a Playwright-managed "
        f"browser under {str(PLAYWRIGHT_BROWSERS_DEFAULT)!r})",
        "install it: apt-get install chromium (as root), or set AGENTD_CHROMIUM to a Chromium binary",
    )


def find_node() -> pathlib.Path:
    """Find ``node``: env ``AGENTD_NODE``, else ``node`` on PATH.

    Raises:
        BrowserSetupError: no node found.
    """
    explicit = os.environ.get("AGENTD_NODE")
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if not _is_executable_file(path):
            raise BrowserSetupError(
                f"node not found at {explicit!r} (from AGENTD_NODE)",
                "point AGENTD_NODE at a node binary (Node.js 18 or newer), or unset it",
            )
        return path
    which = shutil.which("node")
    if which is None:
        raise BrowserSetupError(
            "node not found on PATH",
            "install Node.js 18 or newer (apt-get install nodejs npm), then run scripts/setup",
        )
    return pathlib.Path(which)


def find_playwright_mcp() -> pathlib.Path:
    """Find ``@playwright/mcp``'s ``cli.js``: env ``AGENTD_PLAYWRIGHT_MCP`` (the file or its
    package directory), else the checkout's ``node_modules`` (installed by ``scripts/setup``).

    Raises:
        BrowserSetupError: not installed.
    """
    explicit = os.environ.get("AGENTD_PLAYWRIGHT_MCP")
    if explicit:
        path = pathlib.Path(explicit).expanduser()
        if path.is_dir():
            path = path / "cli.js"
        if not path.is_file():
            raise BrowserSetupError(
                f"@playwright/mcp not found at {explicit!r} (from AGENTD_PLAYWRIGHT_MCP)",
                "point it at node_modules/@playwright/mcp (or its cli.js), or unset it",
            )
        return path
    path = CHECKOUT_ROOT / PLAYWRIGHT_MCP_CLI
    if not path.is_file():
        raise BrowserSetupError(
            f"@playwright/mcp is not installed (no {str(path)!r})",
            f"run scripts/setup (or: cd {str(CHECKOUT_ROOT)!r} && npm ci)",
        )
    return path


def chromium_narrowed(chromium: pathlib.Path) -> str | None:
    """Why Chromium's directory (its binary's, real) is not granted whole, or None: it is
    ``/``, a home, a directory holding one, a shared temporary directory
    (``_wide.too_wide``), a directory inside a home (``_wide.within_home``: a Chromium
    unpacked in ``~/Downloads``, where anything else may lie beside it, or Playwright's
    in ``~/.cache/ms-playwright``), or a ``bin`` directory outside the system read set."""
    where = os.path.dirname(os.path.realpath(chromium))
    why = _wide.too_wide(where) or _wide.within_home(where)
    if why is None and os.path.basename(where) == "bin" and not _wide.system_readable(where):
        why = "a directory of programs ('bin')"
    return why


def read_paths(node: pathlib.Path, playwright_mcp: pathlib.Path, chromium: pathlib.Path) -> list[str]:
    """What a sandboxed run must read to start these (their real paths): node's binary
    (with a ``libnode`` beside it in its prefix's ``lib``, for a shared build), the
    ``node_modules`` that holds ``@playwright/mcp`` (its dependencies are its siblings;
    the package's own directory when it is in none), and Chromium's directory (its
    resources are beside it), or, where that directory holds more than Chromium
    (``chromium_narrowed``), Chromium's binary and its own files there (``CHROMIUM_FILES``).

    Not node's prefix: a node kept at ``~/.local/bin/node`` (a tarball unpacked there,
    ``mise``) or ``~/bin/node`` made the run able to read all of ``~/.local`` or the daemon
    user's home, through its browser too (``file://``); nor three levels above ``cli.js``,
    which is ``/`` for a package kept at ``/opt/pw``; nor a Chromium's directory that is a
    home (``executable_path`` or ``AGENTD_CHROMIUM`` naming ``~/chrome``: the whole home)
    or lies in one (``~/Downloads/chrome-linux``: whatever else was downloaded there).
    """
    node = pathlib.Path(os.path.realpath(node))
    out = [str(node)]
    if node.parent.name == "bin":
        out += sorted(glob.glob(glob.escape(str(node.parent.parent / "lib")) + "/libnode.so*"))
    package = pathlib.Path(os.path.realpath(playwright_mcp)).parent
    modules = next((p for p in package.parents if p.name == "node_modules"), package)
    out.append(str(modules))
    binary = pathlib.Path(os.path.realpath(chromium))
    if chromium_narrowed(binary) is None:
        out.append(str(binary.parent))
    else:
        out.append(str(binary))
        # (Not a link: a rule follows it to its target, anywhere.)
        beside = [binary.parent / n for n in CHROMIUM_FILES]
        out += [str(p) for p in beside if p.exists() and not p.is_symlink()]
    return out
