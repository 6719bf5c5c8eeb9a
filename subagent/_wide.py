"""Grants too wide to give a run whole, and what the runner's imports need instead.

A grant derived from where something is kept (Chromium's directory, a ``sys.path`` entry,
the interpreter's prefix) can be a directory that holds people's files: a Chromium kept as
``~/chrome``, a ``PYTHONPATH`` naming ``~`` or ``/``. ``too_wide`` says why one is: ``/``,
a home (any passwd entry's, the process's ``$HOME``), a directory holding one, a temporary
directory every user shares; ``within_home``, why one lies inside a home (a Chromium
kept in ``~/Downloads`` is narrowed to its own files). What the system read set
(``SYSTEM_READ``) holds is readable anyway, so never too wide. ``narrow_runtime`` narrows the runner's own grants; Chromium's
is narrowed by ``browser_setup.read_paths``. Stdlib only (the daemon imports it).
"""

from __future__ import annotations

import importlib.machinery
import os
import pwd
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = [
    "SYSTEM_READ",
    "SHARED_DIRS",
    "Narrowed",
    "homes",
    "system_readable",
    "too_wide",
    "within_home",
    "importable",
    "narrow_runtime",
]

# Read (and execute) for every run. Missing ones are skipped.
SYSTEM_READ: Final = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/var/lib",
    "/var/cache", "/sys", "/nix/store",
)  # fmt: skip
# Temporary directories every user writes (a run's own are private: ``sandbox.PRIVATE_DIRS``).
SHARED_DIRS: Final = ("/tmp", "/var/tmp", "/dev/shm", "/run")
# At most this many names of what was granted in a sys.path entry's note.
_NAMES_SHOWN: Final = 8


def _beneath(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def homes(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every home directory (real path) and whose it is: each passwd entry's and this
    process's ``$HOME`` (the daemon user's, inherited by its runners)."""
    out: dict[str, str] = {}
    try:
        entries = pwd.getpwall()
    except OSError:  # no passwd database to read: ``$HOME`` alone
        entries = []
    for e in entries:
        if e.pw_dir and os.path.isabs(e.pw_dir):
            out.setdefault(os.path.realpath(e.pw_dir), f"user {e.pw_name!r}")
    home = (os.environ if environ is None else environ).get("HOME")
    if home and os.path.isabs(home):
        out[os.path.realpath(home)] = "the daemon's user ($HOME)"
    return out


def system_readable(path: str) -> bool:
    """Whether every run reads ``path`` anyway: it is in the system read set."""
    real = os.path.realpath(path)
    return any(_beneath(real, os.path.realpath(top)) for top in SYSTEM_READ if os.path.exists(top))


def too_wide(path: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the directory ``path`` must not be granted whole, or None: ``/``, a shared
    temporary directory, a home directory or one that holds a home. A path the system
    read set holds is never too wide (a run reads it anyway)."""
    real = os.path.realpath(path)
    if system_readable(real):
        return None
    if real == "/":
        return "'/', every file of the host"
    for d in SHARED_DIRS:
        if os.path.exists(d) and real == os.path.realpath(d):
            return f"{d!r}, which every user shares"
    found = homes(environ)
    if real in found:
        return f"the home directory of {found[real]}"
    for home, whose in sorted(found.items()):
        if _beneath(home, real):
            return f"a directory holding the home directory of {whose} ({home!r})"
    return None


def within_home(path: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the directory ``path`` holds what only a person keeps, or None: it lies beneath
    a home (``~/Downloads``, ``~/.cache``), the home itself being ``too_wide``. A home
    that is ``/`` (a system user's: ``systemd-network``'s) is not counted (it holds
    everything); nor what the system read set holds (a run reads it anyway)."""
    real = os.path.realpath(path)
    if system_readable(real):
        return None
    for home, whose in sorted(homes(environ).items()):
        if home != "/" and real != home and _beneath(real, home):
            return f"inside the home directory of {whose} ({home!r})"
    return None


def importable(entry: str, loaded: Iterable[str] = ()) -> list[str]:
    """What Python imports from the ``sys.path`` directory ``entry``: its modules (a
    file named ``<identifier><suffix>``, ``importlib.machinery.all_suffixes()``), its
    packages (a directory named an identifier holding an ``__init__`` module), its
    ``__pycache__``, and the directories named in ``loaded`` (namespace packages already
    imported from it). Links are skipped: a rule follows one to its target, anywhere."""
    suffixes = importlib.machinery.all_suffixes()
    wanted = {os.path.realpath(p) for p in loaded}
    out: list[str] = []
    try:
        entries = sorted(os.scandir(entry), key=lambda e: e.name)
    except OSError:
        return out
    for e in entries:
        name = e.name
        if e.is_symlink():
            continue
        if e.is_dir():
            init = any(os.path.isfile(os.path.join(e.path, "__init__" + s)) for s in suffixes)
            if name == "__pycache__" or (name.isidentifier() and (init or os.path.realpath(e.path) in wanted)):
                out.append(e.path)
        elif e.is_file() and any(name.endswith(s) and name[: -len(s)].isidentifier() for s in suffixes):
            out.append(e.path)
    return out


def _namespaces_in(entry: str) -> list[str]:
    """The namespace packages this process imported from ``entry`` (no ``__init__``: no
    scan finds them)."""
    real = os.path.realpath(entry)
    out = []
    for name, module in list(sys.modules.items()):
        if "." in name or getattr(module, "__file__", None) is not None:
            continue
        for p in list(getattr(module, "__path__", None) or []):
            if isinstance(p, str) and os.path.dirname(os.path.realpath(p)) == real:
                out.append(p)
    return out


@dataclass
class Narrowed:
    """The runner's own grants, narrowed: ``read`` whole; ``imports``, each ``sys.path``
    directory too wide to grant (its real path) and the names Python imports from it,
    which it may not list (``_importfinder``); a note for each narrowed path (the
    sandbox's ``problems``)."""

    read: list[str] = field(default_factory=list)
    imports: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def narrow_runtime(
    paths: Iterable[str], import_dirs: Iterable[str], keep: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> Narrowed:
    """``paths`` (what the runner reads to keep running) with those too wide narrowed:
    a ``sys.path`` directory (in ``import_dirs``) to reading what Python imports from it
    (``importable``), whose names are kept (``imports``) for the runner's imports after
    the sandbox (it imports lazily): Python's ``FileFinder`` would list the directory,
    which the run may not (``_importfinder``); any other (the
    interpreter's prefix: its ``sys.path`` entries are among ``paths``) to nothing.
    ``keep``: granted whole whatever they are (agentd's own checkout)."""
    imports = {os.path.realpath(p) for p in import_dirs}
    kept = {os.path.realpath(p) for p in keep}
    out = Narrowed()
    for p in paths:
        real = os.path.realpath(p)
        why = None if real in kept or not os.path.isdir(real) else too_wide(real, environ)
        if why is None:
            out.read.append(p)
        elif real in imports:
            inside = importable(real, _namespaces_in(real))
            out.read += inside
            names = [os.path.basename(i) for i in inside]
            out.imports[real] = names
            shown = ", ".join(names[:_NAMES_SHOWN]) + (f", ... ({len(names)})" if len(names) > _NAMES_SHOWN else "")
            out.problems.append(
                f"{p!r} (on the runner's sys.path) is {why}: not granted whole; the run may not list it and "
                f"reads only what Python imports from it ({shown or 'nothing'}), as it was when the run started"
            )
        else:
            out.problems.append(f"{p!r} (the interpreter's prefix) is {why}: not granted (its sys.path entries are)")
    out.read = list(dict.fromkeys(out.read))
    return out
