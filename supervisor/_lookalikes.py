"""Look-alike characters in a call a person decides on: a note naming them, for the CLI.

``curl https://pаypal.com`` (a Cyrillic ``а``) and ``ｒｍ`` (fullwidth) read as what they
are not. A token (letters, marks, digits, as a host label is) is named when it mixes scripts
with Latin look-alikes, holds compatibility forms of ASCII letters or digits (NFKC reads
them as ASCII), or is all Cyrillic or all Greek letters that each look Latin (``аррӏе``)
amid Latin text; prose is not. Bounded: ASCII is skipped in C, a note is ~2 KB at most, a
check stops at SCAN_MAX_CHARS and says so. Display only. ``lookalike.js`` does the same.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = ["Finding", "Scan", "find_lookalikes", "lookalike_note", "scan_lookalikes"]

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
# How many characters of a token (and of what it reads as) a note quotes: a longer one is
# cut with "…" and its length given, so a 600,000-character token is not printed back.
NOTE_QUOTE_CHARS: Final = 40
# How many distinct characters a note names per token, each with its count; more are counted.
NOTE_MAX_CHARS: Final = 5
# A note's tokens stop (the rest counted) once it would pass this many characters: with the
# bounds above one token's part is ~1,000 at worst (escaped quotes, the longest names).
NOTE_BUDGET_CHARS: Final = 2000
# How many characters of a text are checked when non-ASCII ones lie beyond: the check costs
# per non-ASCII character (a call's arguments can be ~1 MiB, and the CLI's history checks
# each call's). ASCII beyond it holds no look-alike, so such a text is checked whole; else
# the note says what was checked ("[look-alike check: first 262,144 of ... characters only]").
SCAN_MAX_CHARS: Final = 256 * 1024

_NON_ASCII_RUN: Final = re.compile(r"[^\x00-\x7f]+")
_ALNUM_RUN: Final = re.compile(r"[A-Za-z0-9]*")
_ALNUM_RUNS: Final = re.compile(r"[A-Za-z0-9]+")
_ALNUM: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_PIECE: Final = re.compile(r"[A-Za-z0-9]+|[^\x00-\x7f]+")
# The rest of a word: up to white space (``\s`` is ``str.isspace``) or WORD_END.
_WORD_REST: Final = re.compile(r"[^\s\"'`,;:=(){}\[\]<>|&]*")


class _Char(NamedTuple):
    """What the check needs of a non-ASCII character, worked out once per text (a tuple:
    built for each distinct character, a frozen dataclass costs twice as much)."""

    inside: bool  # in a token: a letter, mark, digit, format character or compatibility form
    script: str | None  # a letter's script among LATINLIKE (not a compatibility form's)
    compat: str | None  # the ASCII letters or digits NFKC makes of it
    format: bool  # a format character (Cf: a zero-width joiner)


@dataclass
class Finding:
    """A token to mark: ``kind`` "mixed scripts", "compatibility forms" or "look-alike
    script"; ``chars`` the characters that make it so (the letters not of its main script,
    the forms, the look-alike letters), each once, in order."""

    token: str
    kind: str
    chars: list[str] = field(default_factory=list)
    ascii: str = ""  # compatibility forms: the token as NFKC reads it; look-alike script: as it reads


@dataclass
class Scan:
    """What ``scan_lookalikes`` found in the first ``checked`` of ``length`` characters."""

    found: list[Finding]
    checked: int
    length: int


def _script(name: str) -> str | None:
    first = name.split(" ", 1)[0]
    return first if first in LATINLIKE else None


def _compat(c: str) -> str | None:
    """What NFKC makes of a non-ASCII character when that is ASCII letters or digits,
    else None: not punctuation (an ellipsis, the fullwidth comma of Chinese text)."""
    import unicodedata

    if c.isascii():
        return None
    n = unicodedata.normalize("NFKC", c)
    return n if n != c and n.isascii() and n.isalnum() else None


def _classify(c: str) -> _Char:
    import unicodedata

    category, compat = unicodedata.category(c), _compat(c)
    script = _script(unicodedata.name(c, "")) if compat is None and category[0] == "L" else None
    return _Char(category[0] in "LMN" or category == "Cf" or compat is not None, script, compat, category == "Cf")


def _label(c: str) -> str:
    import unicodedata

    return f"U+{ord(c):04X} {unicodedata.name(c, 'unnamed')}"


def _tokens(text: str, limit: int, char: Callable[[str], _Char]) -> Iterator[tuple[int, int]]:
    """Where the tokens holding a non-ASCII character are in ``text[:limit]``: runs of ASCII
    letters and digits and of non-ASCII characters that are ``inside`` (a zero-width joiner
    does not split a token). Only non-ASCII characters are looked at one by one."""
    start, pos = -1, 0
    for run in _NON_ASCII_RUN.finditer(text, 0, limit):
        a, b = run.span()
        if start >= 0:  # a token open at the previous run goes on through ASCII letters, digits
            k = _ALNUM_RUN.match(text, pos, a).end()  # type: ignore[union-attr]  # `*` always matches
            if k < a:
                yield start, k
                start = -1
        for i, c in enumerate(text[a:b], a):
            if char(c).inside:
                if start < 0:
                    start = i if i > a else pos + len(text[pos:a].rstrip(_ALNUM))
            elif start >= 0:
                yield start, i
                start = -1
        pos = b
    if start >= 0:
        yield start, _ALNUM_RUN.match(text, pos, limit).end()  # type: ignore[union-attr]


def _scripts(token: str, char: Callable[[str], _Char]) -> dict[str, list[str]]:
    """A token's letters by script (those with Latin look-alikes), compatibility forms aside;
    its ASCII letters only make "LATIN" a key, in their place."""
    scripts: dict[str, list[str]] = {}
    for piece in _PIECE.findall(token):
        if piece.isascii():
            if not piece.isdigit():
                scripts.setdefault("LATIN", [])
            continue
        for c in piece:
            script = char(c).script
            if script is not None:
                scripts.setdefault(script, []).append(c)
    return scripts


class _Words:
    """Whether the word around a token holds ASCII letters or digits beside it: ``аррӏе.com``,
    ``/srv/ѕсоре/x``, ``"host":"аррӏе"`` (a word ends at WORD_END). Tokens are asked in
    order and each word is read once (a word of 100,000 tokens is not read 100,000 times)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.reversed = ""
        self.end = -1
        self.alnum = 0

    def ascii_beside(self, start: int, end: int) -> bool:
        text = self.text
        if start >= self.end:
            if not self.reversed:
                self.reversed = text[::-1]
            # The word's start: its rest read backwards from the token, in the reversed text.
            begin = len(text) - _WORD_REST.match(self.reversed, len(text) - start).end()  # type: ignore[union-attr]
            self.end = _WORD_REST.match(text, end).end()  # type: ignore[union-attr]
            self.alnum = sum(map(len, _ALNUM_RUNS.findall(text, begin, self.end)))
        return self.alnum > sum(map(len, _ALNUM_RUNS.findall(text, start, end)))


def _whole_script(token: str, scripts: dict[str, list[str]], char: Callable[[str], _Char]) -> str | None:
    """The Latin a token reads as when it is all Cyrillic or all Greek letters with Latin
    twins (ASCII digits and format characters may stand among them), else None."""
    if len(scripts) != 1 or next(iter(scripts)) not in ("CYRILLIC", "GREEK"):
        return None
    table: dict[int, str | None] = {}
    for c in set(token):
        if c in TWINS:
            table[ord(c)] = TWINS[c]
        elif not c.isascii() and char(c).format:
            table[ord(c)] = None
        elif not (c.isascii() and c.isdigit()):
            return None
    return token.translate(table)


def scan_lookalikes(text: str) -> Scan:
    """The tokens of ``text`` a person should be told about, in order, each once, and how
    much of it was checked: all of it, or SCAN_MAX_CHARS when non-ASCII characters lie beyond.

    A whole-script look-alike (``аррӏе``) is told only amid Latin text: when its word holds
    ASCII letters or digits beside it (a host, a path segment), or no other token of the
    text has a letter of its script (``ssh ѕсоре``). In Russian or Greek prose it is a word.
    """
    if text.isascii():
        return Scan([], len(text), len(text))
    limit = len(text) if len(text) <= SCAN_MAX_CHARS or text[SCAN_MAX_CHARS:].isascii() else SCAN_MAX_CHARS
    known: dict[str, _Char] = {}

    def char(c: str) -> _Char:
        got = known.get(c)
        if got is None:
            got = known[c] = _classify(c)
        return got

    spans = list(_tokens(text, limit, char))
    tokens = [text[start:end] for start, end in spans]
    count = Counter(tokens)
    scripts_of = {token: _scripts(token, char) for token in count}
    holders: Counter[str] = Counter()  # how many tokens have a letter of each script
    for token, scripts in scripts_of.items():
        for script in scripts:
            holders[script] += count[token]
    found: list[Finding] = []
    words = _Words(text)
    reads_as: dict[str, str | None] = {}
    settled: set[str] = set()  # each token is told once; its copies are skipped
    for (start, end), token in zip(spans, tokens, strict=True):
        if token in settled:
            continue
        scripts = scripts_of[token]
        if token not in reads_as:
            forms = [c for c in dict.fromkeys(token) if not c.isascii() and char(c).compat is not None]
            if forms:
                ascii_ = token.translate({ord(c): char(c).compat for c in forms})
                found.append(Finding(token, "compatibility forms", forms, ascii_))
            if len(scripts) > 1:
                main = "LATIN" if "LATIN" in scripts else max(scripts, key=lambda s: len(scripts[s]))
                odd = [c for s, cs in scripts.items() if s != main for c in cs]
                found.append(Finding(token, "mixed scripts", list(dict.fromkeys(odd))))
            reads_as[token] = None if forms else _whole_script(token, scripts, char)
        reads = reads_as[token]
        if reads is None:
            settled.add(token)
            continue
        (script,) = scripts
        if holders[script] == 1 or words.ascii_beside(start, end):
            settled.add(token)
            found.append(Finding(token, "look-alike script", [c for c in dict.fromkeys(token) if c in TWINS], reads))
    return Scan(found, limit, len(text))


def find_lookalikes(text: str) -> list[Finding]:
    """The tokens of ``text`` a person should be told about (``scan_lookalikes``)."""
    return scan_lookalikes(text).found


def _quote(s: str) -> str:
    if len(s) <= NOTE_QUOTE_CHARS:
        return repr(s)
    return f"{s[:NOTE_QUOTE_CHARS] + '…'!r} ({len(s):,} characters)"


def _named(f: Finding) -> str:
    """Its characters as ``U+0430 CYRILLIC SMALL LETTER A ×3,000``, NOTE_MAX_CHARS at most."""
    names = []
    for c in f.chars[:NOTE_MAX_CHARS]:
        n = f.token.count(c)
        names.append(_label(c) + (f" ×{n:,}" if n > 1 else ""))
    if len(f.chars) > NOTE_MAX_CHARS:
        names.append(f"and {len(f.chars) - NOTE_MAX_CHARS:,} more")
    return ", ".join(names)


def lookalike_note(text: str) -> str:
    """`` [look-alike characters: ...]`` naming what ``scan_lookalikes`` found, or "", then
    `` [look-alike check: first N of M characters only]`` when it did not check all.

    E.g. `` [look-alike characters: 'pаypal' mixes scripts: U+0430 CYRILLIC SMALL LETTER A]``,
    `` [look-alike characters: 'ѕсоре' reads 'scope' in Cyrillic letters: U+0455 ...]``.
    """
    scan = scan_lookalikes(text)
    parts: list[str] = []
    size = 0
    for f in scan.found[:NOTE_MAX_TOKENS]:
        if f.kind == "mixed scripts":
            part = f"{_quote(f.token)} mixes scripts: {_named(f)}"
        elif f.kind == "look-alike script":
            script = _label(f.chars[0]).split(" ")[1].title()  # "U+0430 CYRILLIC SMALL LETTER A"
            part = f"{_quote(f.token)} reads {_quote(f.ascii)} in {script} letters: {_named(f)}"
        else:
            part = f"{_quote(f.token)} reads {_quote(f.ascii)} in compatibility forms: {_named(f)}"
        if parts and size + len(part) > NOTE_BUDGET_CHARS:
            break
        parts.append(part)
        size += len(part) + 2
    if len(scan.found) > len(parts):
        parts.append(f"and {len(scan.found) - len(parts):,} more")
    note = f" [look-alike characters: {'; '.join(parts)}]" if parts else ""
    if scan.checked < scan.length:
        note += f" [look-alike check: first {scan.checked:,} of {scan.length:,} characters only]"
    return note
