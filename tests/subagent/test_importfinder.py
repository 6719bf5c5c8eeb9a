"""``_importfinder.NamedFinder``: imports from a ``sys.path`` directory by the names known
before the sandbox, never listing it (the run in tests/e2e/test_sandbox_homes.py)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from subagent import _importfinder, _wide

# The module the import system lists a directory through (``FileFinder._fill_cache``).
_BOOTSTRAP_OS: Any = sys.modules["importlib._bootstrap_external"]._os


@pytest.fixture
def entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "nf_probe_mod.py").write_text("VALUE = 'module'\n")
    (tmp_path / "nf_probe_pkg").mkdir()
    (tmp_path / "nf_probe_pkg" / "__init__.py").write_text("VALUE = 'package'\n")
    (tmp_path / "secret.txt").write_text("x")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("nf_probe_mod", "nf_probe_pkg", "nf_probe_late"):
        sys.modules.pop(name, None)
    sys.path_importer_cache.pop(str(tmp_path), None)


def test_a_named_finder_imports_what_it_was_told_and_never_lists(entry: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names = {str(entry): [os.path.basename(p) for p in _wide.importable(str(entry))]}
    assert _importfinder.install(names) == [str(entry)]
    listed: list[str] = []

    def listdir(path: str = ".") -> list[str]:
        listed.append(path)
        raise PermissionError(13, "Permission denied", path)

    # Every finder of the process lists through it: each one a failing listing left with an
    # empty cache is filled again after the patch is undone (else later imports in this
    # process, `pty` or `benchmarks`, were not found: seen in CI).
    try:
        with monkeypatch.context() as patched:
            patched.setattr(_BOOTSTRAP_OS, "listdir", listdir)
            importlib.invalidate_caches()  # dropped: filled again, from the names
            os.utime(entry, (1, 1))  # a new mtime: the same
            (entry / "nf_probe_late.py").write_text("VALUE = 'late'\n")  # not among the names
            os.utime(entry, (2, 2))
            assert importlib.import_module("nf_probe_mod").VALUE == "module"
            assert importlib.import_module("nf_probe_pkg").VALUE == "package"
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module("nf_probe_late")
    finally:
        importlib.invalidate_caches()
    assert str(entry) not in listed, listed
