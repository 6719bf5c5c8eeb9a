"""What the daemon may ask of the runner's built-in presets (today: the browser).

The daemon knows a preset only through these three calls, never its internals (its
discovery of Chromium and node, its /tmp link scheme, its process sweep):

- ``check_presets(spec)`` at spawn time: a preset the spec asks for that cannot run on
  this machine is a ``PresetError`` naming what to install (the run is refused, not
  failed later);
- ``release_run_dir(run_dir)`` when a run's directory is removed: whatever a preset made
  outside it (the browser's short TMPDIR link in /tmp) goes too;
- ``available()`` which presets this machine offers (a fleet node advertises them).

Stdlib only, and cheap to import: the preset's module is imported only when a call needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PresetError", "check_presets", "release_run_dir", "available"]


class PresetError(Exception):
    """A preset the spec asks for cannot run here; the message says what to install."""

    def __init__(self, preset: str, message: str) -> None:
        super().__init__(f"{preset}: {message}")
        self.preset = preset


def check_presets(spec: Mapping[str, Any]) -> None:
    """Raise ``PresetError`` if a preset the spec turns on cannot start on this machine."""
    options = spec.get("browser")
    if options:
        from subagent.tools.browser import BrowserSetupError, check_browser

        try:
            check_browser(options)
        except BrowserSetupError as exc:
            raise PresetError("browser", str(exc)) from exc


def release_run_dir(run_dir: Path) -> None:
    """Remove what presets made for ``run_dir`` outside it. Blocking; idempotent."""
    from subagent.tools.browser import release_browser_dir

    release_browser_dir(run_dir)


def available() -> dict[str, bool]:
    """Which presets can run here (``{"browser": bool}``): a fleet node's resources."""
    from subagent.tools.browser import BrowserSetupError, find_chromium

    try:
        find_chromium()
    except BrowserSetupError:
        return {"browser": False}
    return {"browser": True}
