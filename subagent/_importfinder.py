"""Imports from a ``sys.path`` directory the run may not list (``_wide``: a home on it).

Python's ``FileFinder`` lists a ``sys.path`` directory to know what it may import from it
(``_fill_cache``, again whenever the directory's mtime changes or ``invalidate_caches``
is called); a run granted that listing reads every name in a home (``~/.ssh``'s keys'
names among them). ``install`` puts, for each such entry, a ``NamedFinder`` into
``sys.path_importer_cache``: a ``FileFinder`` whose cache is the names found before the
sandbox (``_wide.importable``) and that never lists. The rest of its work is a ``stat``
(the directory's mtime, a file's kind), which Landlock does not restrict. Stdlib only.
"""

from __future__ import annotations

import importlib.machinery as machinery
import os
import sys
from collections.abc import Iterable, Mapping

__all__ = ["NamedFinder", "install"]


class NamedFinder(machinery.FileFinder):
    """A ``FileFinder`` for ``path`` that knows its names (``names``) instead of listing it."""

    def __init__(self, path: str, names: Iterable[str]) -> None:
        super().__init__(
            path,
            (machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
            (machinery.SourceFileLoader, machinery.SOURCE_SUFFIXES),
            (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES),
        )
        self.names = frozenset(names)

    def _fill_cache(self) -> None:
        # (``FileFinder.find_spec`` calls it when the directory's mtime is not the one it
        # saw, ``invalidate_caches`` making it -1: the names again, never a listing.)
        self._path_cache = set(self.names)
        self._relaxed_path_cache = {n.lower() for n in self.names}


def install(names: Mapping[str, Iterable[str]]) -> list[str]:
    """For each ``sys.path`` entry whose real path is a key of ``names`` (a directory's
    real path and the names Python imports from it), a ``NamedFinder`` in
    ``sys.path_importer_cache``, where the import system looks first; the entries."""
    out = []
    for entry in sys.path:
        if not (isinstance(entry, str) and os.path.isabs(entry)):
            continue
        real = os.path.realpath(entry)
        if real in names:
            sys.path_importer_cache[entry] = NamedFinder(entry, names[real])
            out.append(entry)
    return out
