"""Protected files with other hard links: what a run's grants may reach anyway.

A Landlock rule follows the inodes reached by path beneath it, so a protected file that
has another hard link somewhere beneath a granted tree is readable through that link
(``plan_rules`` keeps the protected path out, not the file). A run cannot make such a
link itself: linking or renaming a file it has no rule for (``REFER`` on its directory)
is refused. Finding the other links would mean walking every granted tree (``/usr``);
this says instead, for each protected file with more than one link, which granted trees
lie on its filesystem (a link cannot cross one), where such a link would be in the run's
reach: cheap (a ``stat`` per protected path and per grant, ``mountinfo`` once, only when
a protected file has links), honest, not a search. Stdlib only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

__all__ = ["linked_protected", "protected_file_linked_as"]

_MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts() -> list[tuple[int, str]]:
    """(device, mount point) of each mount in this mount namespace."""
    try:
        with open(_MOUNTINFO, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or ":" not in fields[2]:
            continue
        major, _, minor = fields[2].partition(":")
        try:
            out.append((os.makedev(int(major), int(minor)), _unescape(fields[4])))
        except ValueError:
            continue
    return out


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def linked_protected(protect: Iterable[str], granted: Iterable[str]) -> list[str]:
    """A problem per protected file with another hard link that a granted tree may hold:
    one on the file's filesystem (its root, or a mount beneath it). Empty when none."""
    linked: dict[str, os.stat_result] = {}
    for p in dict.fromkeys(protect):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
            linked[p] = st
    if not linked:
        return []
    roots: dict[str, int] = {}
    for g in dict.fromkeys(granted):
        try:
            roots[os.path.realpath(g)] = os.stat(g).st_dev
        except OSError:
            continue
    mounts = _mounts()
    problems = []
    for p, st in linked.items():
        trees = [
            g for g, dev in roots.items() if dev == st.st_dev or any(d == st.st_dev and _under(m, g) for d, m in mounts)
        ]
        if trees:
            problems.append(
                f"protected file {p!r} has {st.st_nlink} hard links: one beneath a granted tree on its "
                f"filesystem ({', '.join(trees)}) is readable by the run (a rule follows the file, not "
                "its path; agentd does not search for it)"
            )
    return problems


def protected_file_linked_as(path: str, protect: Iterable[str]) -> str | None:
    """The protected file that ``path`` is another hard link to, or None: a grant naming
    such a link is refused as one naming the protected path is (one stat, and the
    protected paths' only when ``path`` is a file with other links)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) or st.st_nlink < 2:
        return None
    for p in protect:
        try:
            pst = os.stat(p)
        except OSError:
            continue
        if (pst.st_dev, pst.st_ino) == (st.st_dev, st.st_ino):
            return p
    return None
