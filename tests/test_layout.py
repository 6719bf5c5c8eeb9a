"""The layout's size rule (issue 14): no module over ~500 lines without a reason at its top.

The reason is a paragraph of the module's docstring that starts with ``Size:`` (as in
``supervisor/cli.py``), saying why the module is one piece. A module that grows past the
bound without one fails here, naming it: split it, or say why it stays whole.
"""

from __future__ import annotations

import ast

from tests.test_imports import modules

MAX_LINES = 500
# "Size:" and a reason of a few words at least.
MIN_REASON_CHARS = 40


def size_reason(docstring: str) -> str | None:
    paragraphs = [" ".join(p.split()) for p in docstring.split("\n\n")]
    return next((p[len("Size:") :].strip() for p in paragraphs if p.startswith("Size:")), None)


def test_every_module_over_500_lines_says_why_at_the_top_of_its_docstring() -> None:
    big = {}
    for name, path in modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_LINES:
            big[name] = (lines, ast.get_docstring(ast.parse(text)) or "")
    assert big, "no module over the bound: the check would check nothing"
    missing = [
        f"{name} ({lines} lines)"
        for name, (lines, doc) in sorted(big.items())
        if len(size_reason(doc) or "") < MIN_REASON_CHARS
    ]
    assert not missing, f"over {MAX_LINES} lines with no 'Size:' paragraph in the module docstring: {missing}"


def test_a_size_paragraph_is_found_only_where_it_is_one() -> None:
    assert size_reason("Title.\n\nSize: one concept, one owner; the rest lives apart.\n") == (
        "one concept, one owner; the rest lives apart."
    )
    assert size_reason("Title.\n\nIts Size: is not a paragraph of its own.\n") is None
    assert size_reason("Title only.") is None
