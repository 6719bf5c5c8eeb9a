"""Look-alike characters in a call a person decides on: a note naming them, for the CLI.

``curl https://pаypal.com`` (a Cyrillic ``а``) and ``ｒｍ`` (fullwidth) read as what they
are not. A token (letters, marks, digits, as a host label is) is named when it mixes scripts
with Latin look-alikes (the IDN mixed-script rule) or holds compatibility forms of ASCII
letters or digits (NFKC reads them as ASCII); one script alone (Russian, Chinese) is not.
Display only: the raw text is never changed. The dashboard's ``lookalike.js`` does the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["Finding", "find_lookalikes", "lookalike_note"]

# Scripts with letters drawn like Latin ones: a token mixing two of them is suspect. Mixing
# Latin with Han, kana, Hangul, Arabic... is not (UTS #39 allows the CJK ones; the others
# have no Latin look-alikes). Known from a character's Unicode name, which starts with it.
LATINLIKE: Final = ("LATIN", "GREEK", "CYRILLIC", "ARMENIAN", "CHEROKEE", "COPTIC", "LISU")
# How many tokens a note names; more are counted.
NOTE_MAX_TOKENS: Final = 5


@dataclass
class Finding:
    """A token to mark: ``kind`` "mixed scripts" or "compatibility forms"; ``chars`` the
    characters that make it so (the letters not of its main script, or the forms), each
    once, with its ``U+XXXX NAME``."""

    token: str
    kind: str
    chars: list[str] = field(default_factory=list)
    ascii: str = ""  # for compatibility forms: the token as NFKC reads it


def _script(name: str) -> str | None:
    first = name.split(" ", 1)[0]
    return first if first in LATINLIKE else None


def _tokens(text: str) -> Iterator[str]:
    """Runs of letters, marks, digits, format characters (a zero-width joiner does not
    split a token) and compatibility forms of ASCII letters and digits."""
    import unicodedata

    start = None
    for i, c in enumerate(text):
        inside = c.isascii() and c.isalnum()
        if not inside and not c.isascii():
            inside = unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Cf" or _compat(c) is not None
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            yield text[start:i]
            start = None
    if start is not None:
        yield text[start:]


def _compat(c: str) -> str | None:
    """What NFKC makes of a non-ASCII character when that is ASCII letters or digits,
    else None: not punctuation (an ellipsis, the fullwidth comma of Chinese text)."""
    import unicodedata

    if c.isascii():
        return None
    n = unicodedata.normalize("NFKC", c)
    return n if n != c and n.isascii() and n.isalnum() else None


def _label(c: str) -> str:
    import unicodedata

    return f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}"


def find_lookalikes(text: str) -> list[Finding]:
    """The tokens of ``text`` a person should be told about, in order, each once."""
    if text.isascii():
        return []
    import unicodedata

    found: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for token in _tokens(text):
        if token.isascii():
            continue
        forms = [c for c in dict.fromkeys(token) if _compat(c) is not None]
        if forms and (token, "forms") not in seen:
            seen.add((token, "forms"))
            ascii_ = "".join(_compat(c) or c for c in token)
            found.append(Finding(token, "compatibility forms", [_label(c) for c in forms], ascii_))
        scripts: dict[str, list[str]] = {}
        for c in token:
            if c in forms or not unicodedata.category(c).startswith("L"):
                continue
            script = _script(unicodedata.name(c, ""))
            if script is not None:
                scripts.setdefault(script, []).append(c)
        if len(scripts) > 1 and (token, "mixed") not in seen:
            seen.add((token, "mixed"))
            main = "LATIN" if "LATIN" in scripts else max(scripts, key=lambda s: len(scripts[s]))
            odd = [c for s, cs in scripts.items() if s != main for c in cs]
            found.append(Finding(token, "mixed scripts", [_label(c) for c in dict.fromkeys(odd)]))
    return found


def lookalike_note(text: str) -> str:
    """`` [look-alike characters: ...]`` naming what ``find_lookalikes`` found, or "".

    E.g. `` [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]``.
    """
    found = find_lookalikes(text)
    if not found:
        return ""
    parts = []
    for f in found[:NOTE_MAX_TOKENS]:
        if f.kind == "mixed scripts":
            parts.append(f"{f.token!r} mixes scripts: {', '.join(f.chars)}")
        else:
            parts.append(f"{f.token!r} reads {f.ascii!r} in compatibility forms: {', '.join(f.chars)}")
    if len(found) > NOTE_MAX_TOKENS:
        parts.append(f"and {len(found) - NOTE_MAX_TOKENS} more")
    return f" [look-alike characters: {'; '.join(parts)}]"
