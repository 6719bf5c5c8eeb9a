"""Look-alike characters in a call a person decides on: a note naming them, for the CLI.

``curl https://pаypal.com`` (a Cyrillic ``а``) and ``ｒｍ`` (fullwidth) read as what they
are not. A token (letters, marks, digits, as a host label is) is named when it mixes scripts
with Latin look-alikes (the IDN mixed-script rule), holds compatibility forms of ASCII
letters or digits (NFKC reads them as ASCII), or is all Cyrillic or all Greek letters that
each look Latin (``аррӏе``: the whole-script rule) amid Latin text; Russian, Greek or Chinese
prose is not. Display only: the text is never changed. ``lookalike.js`` does the same.
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
# Cyrillic and Greek letters drawn like one Latin letter, each with the letter it reads as
# (pairs: the letter as an escape, then its twin). Each is in Unicode's confusables.txt
# (UTS #39, v14) mapped to that ASCII letter; ӏ (U+04CF) is mapped to "i" through a dotless
# i, and read here as the "l" it draws (``аррӏе``). Left out on purpose: letters the data
# maps to a small capital or another non-ASCII letter (Cyrillic в к м н т ь, Greek κ τ)
# and г (U+0433, "r" in the data, a hook in most fonts), so that more real words keep a
# letter with no twin (``дом``, ``гора``). A token whose letters are all here is a
# whole-script look-alike. lookalike.js has the same string; a test compares them.
TWIN_PAIRS: Final = (
    # Cyrillic small: а с е һ і ј о р ѕ у х ӏ ԁ ԛ ԝ ү ѵ
    "\u0430a \u0441c \u0435e \u04bbh \u0456i \u0458j \u043eo \u0440p \u0455s \u0443y \u0445x "
    "\u04cfl \u0501d \u051bq \u051dw \u04afy \u0475v "
    # Cyrillic capital: А В Е К М Н О Р С Т У Х Ѕ І Ј Ӏ Ү
    "\u0410A \u0412B \u0415E \u041aK \u041cM \u041dH \u041eO \u0420P \u0421C \u0422T \u0423Y "
    "\u0425X \u0405S \u0406I \u0408J \u04c0I \u04aeY "
    # Greek small: α γ ι ν ο ρ υ
    "\u03b1a \u03b3y \u03b9i \u03bdv \u03bfo \u03c1p \u03c5u "
    # Greek capital: Α Β Ε Ζ Η Ι Κ Μ Ν Ο Ρ Τ Υ Χ
    "\u0391A \u0392B \u0395E \u0396Z \u0397H \u0399I \u039aK \u039cM \u039dN \u039fO \u03a1P "
    "\u03a4T \u03a5Y \u03a7X"
)
TWINS: Final = {pair[0]: pair[1] for pair in TWIN_PAIRS.split()}
# What ends the word a token is in, for the whole-script rule: white space, quotes and the
# punctuation between arguments (JSON, shell). A host, a path, an address stay one word.
WORD_END: Final = frozenset("\"'`,;:=(){}[]<>|&")
# How many tokens a note names; more are counted.
NOTE_MAX_TOKENS: Final = 5


@dataclass
class Finding:
    """A token to mark: ``kind`` "mixed scripts", "compatibility forms" or "look-alike
    script"; ``chars`` the characters that make it so (the letters not of its main script,
    the forms, the look-alike letters), each once, with its ``U+XXXX NAME``."""

    token: str
    kind: str
    chars: list[str] = field(default_factory=list)
    ascii: str = ""  # compatibility forms: the token as NFKC reads it; look-alike script: as it reads


def _script(name: str) -> str | None:
    first = name.split(" ", 1)[0]
    return first if first in LATINLIKE else None


def _tokens(text: str) -> Iterator[tuple[int, int]]:
    """Where the runs of letters, marks, digits, format characters (a zero-width joiner
    does not split a token) and compatibility forms of ASCII letters and digits are."""
    import unicodedata

    start = None
    for i, c in enumerate(text):
        inside = c.isascii() and c.isalnum()
        if not inside and not c.isascii():
            inside = unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Cf" or _compat(c) is not None
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            yield start, i
            start = None
    if start is not None:
        yield start, len(text)


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


def _word_has_ascii(text: str, start: int, end: int) -> bool:
    """Whether the word around ``text[start:end]`` holds ASCII letters or digits beside it:
    ``аррӏе.com``, ``/srv/ѕсоре/x``, ``"host":"аррӏе"`` (a word ends at WORD_END)."""
    i = start
    while i > 0 and not text[i - 1].isspace() and text[i - 1] not in WORD_END:
        i -= 1
    j = end
    while j < len(text) and not text[j].isspace() and text[j] not in WORD_END:
        j += 1
    return any(c.isascii() and c.isalnum() for c in text[i:start] + text[end:j])


def _whole_script(token: str, scripts: dict[str, list[str]]) -> str | None:
    """The Latin a token reads as when it is all Cyrillic or all Greek letters with Latin
    twins (ASCII digits and format characters may stand among them), else None."""
    if len(scripts) != 1 or next(iter(scripts)) not in ("CYRILLIC", "GREEK"):
        return None
    import unicodedata

    if not all(c in TWINS or (c.isascii() and c.isdigit()) or unicodedata.category(c) == "Cf" for c in token):
        return None
    return "".join(TWINS.get(c, c) for c in token if c in TWINS or c.isascii())


def find_lookalikes(text: str) -> list[Finding]:
    """The tokens of ``text`` a person should be told about, in order, each once.

    A whole-script look-alike (``аррӏе``) is told only amid Latin text: when its word holds
    ASCII letters or digits beside it (a host, a path segment), or no other token of the
    text has a letter of its script (``ssh ѕсоре``). In Russian or Greek prose it is a word.
    """
    if text.isascii():
        return []
    import unicodedata

    spans = list(_tokens(text))
    per_token: list[dict[str, list[str]]] = []
    for start, end in spans:
        scripts: dict[str, list[str]] = {}
        for c in text[start:end]:
            if _compat(c) is None and unicodedata.category(c).startswith("L"):
                script = _script(unicodedata.name(c, ""))
                if script is not None:
                    scripts.setdefault(script, []).append(c)
        per_token.append(scripts)
    found: list[Finding] = []
    seen: set[tuple[str, str]] = set()
    for n, (start, end) in enumerate(spans):
        token, scripts = text[start:end], per_token[n]
        if token.isascii():
            continue
        forms = [c for c in dict.fromkeys(token) if _compat(c) is not None]
        if forms and (token, "forms") not in seen:
            seen.add((token, "forms"))
            ascii_ = "".join(_compat(c) or c for c in token)
            found.append(Finding(token, "compatibility forms", [_label(c) for c in forms], ascii_))
        if len(scripts) > 1 and (token, "mixed") not in seen:
            seen.add((token, "mixed"))
            main = "LATIN" if "LATIN" in scripts else max(scripts, key=lambda s: len(scripts[s]))
            odd = [c for s, cs in scripts.items() if s != main for c in cs]
            found.append(Finding(token, "mixed scripts", [_label(c) for c in dict.fromkeys(odd)]))
        reads = None if forms else _whole_script(token, scripts)
        if reads is not None and (token, "whole") not in seen:
            (script,) = scripts
            alone = not any(script in other for m, other in enumerate(per_token) if m != n)
            if alone or _word_has_ascii(text, start, end):
                seen.add((token, "whole"))
                letters = [_label(c) for c in dict.fromkeys(token) if c in TWINS]
                found.append(Finding(token, "look-alike script", letters, reads))
    return found


def lookalike_note(text: str) -> str:
    """`` [look-alike characters: ...]`` naming what ``find_lookalikes`` found, or "".

    E.g. `` [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]``,
    `` [look-alike characters: 'ѕсоре' reads 'scope' in Cyrillic letters: U+0455 ...]``.
    """
    found = find_lookalikes(text)
    if not found:
        return ""
    parts = []
    for f in found[:NOTE_MAX_TOKENS]:
        if f.kind == "mixed scripts":
            parts.append(f"{f.token!r} mixes scripts: {', '.join(f.chars)}")
        elif f.kind == "look-alike script":
            script = f.chars[0].split(" ")[1].title()  # "U+0430 CYRILLIC SMALL LETTER A"
            parts.append(f"{f.token!r} reads {f.ascii!r} in {script} letters: {', '.join(f.chars)}")
        else:
            parts.append(f"{f.token!r} reads {f.ascii!r} in compatibility forms: {', '.join(f.chars)}")
    if len(found) > NOTE_MAX_TOKENS:
        parts.append(f"and {len(found) - NOTE_MAX_TOKENS} more")
    return f" [look-alike characters: {'; '.join(parts)}]"
