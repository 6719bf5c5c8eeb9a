"""The presets interface the daemon uses (subagent/presets.py): check, release, available."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from subagent import presets
from subagent.tools import browser


def test_a_spec_without_presets_passes_and_one_whose_browser_cannot_start_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    presets.check_presets({"task": "x"})
    presets.check_presets({"task": "x", "browser": False})
    monkeypatch.setenv("AGENTD_CHROMIUM", str(tmp_path / "no-chromium-here"))
    with pytest.raises(presets.PresetError) as caught:
        presets.check_presets({"task": "x", "browser": True})
    assert caught.value.preset == "browser"
    assert str(caught.value).startswith("browser: ") and "no-chromium-here" in str(caught.value)


def test_release_removes_the_browsers_link_outside_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as links:  # short: Chromium's socket path
        monkeypatch.setattr(browser, "LINK_ROOT", Path(links))
        run_dir = tmp_path / ("deep-" * 20) / "run"
        (run_dir / "tmp").mkdir(parents=True)
        link = browser.browser_tmpdir(run_dir, create=True)
        assert link.is_symlink() and link.parent == Path(links)  # the run dir is too deep for Chromium
        presets.release_run_dir(run_dir)
        assert not link.is_symlink()
        presets.release_run_dir(run_dir)  # idempotent


def test_available_names_the_browser() -> None:
    assert set(presets.available()) == {"browser"}
