"""The import structure the layout promises (ARCHITECTURE.md).

- ``subagent`` never imports ``supervisor`` (the runner runs without the daemon's code);
- no import cycle among the product's modules: imports anywhere in a module count (a
  lazy import inside a function is a runtime import too), except those only for type
  checkers (``if TYPE_CHECKING:``) and a module's implicit import of its own packages;
- every module imports alone, in a fresh set of the product's modules (what a cycle that
  only bites in one import order would break).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("supervisor", "subagent")


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imported_names(path: Path, module: str) -> Iterator[str]:
    """Every module name ``path`` imports at run time (absolute, as written)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield name
            for alias in node.names:
                yield f"{name}.{alias.name}"  # ``from pkg import module``
        todo.extend(ast.iter_child_nodes(node))


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges[name] = {
            dep for dep in imported_names(path, name) if dep in mods and dep != name and dep not in own_packages
        }
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_subagent_never_imports_supervisor() -> None:
    offenders = [
        f"{name} imports {dep}"
        for name, path in modules().items()
        if name.startswith("subagent")
        for dep in imported_names(path, name)
        if dep == "supervisor" or dep.startswith("supervisor.")
    ]
    assert offenders == []


def test_there_is_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


IMPORT_EACH = """
import importlib, json, sys
names = json.loads(sys.argv[1])
failed = {}
for name in names:
    for m in [m for m in sys.modules if m.split(".")[0] in ("supervisor", "subagent")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("supervisor", "subagent"):
            failed[name] = repr(exc)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps(failed))
"""


def test_every_module_imports_alone() -> None:
    names = [n for n in modules() if not n.endswith("__main__")]
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_the_daemon_knows_the_browser_preset_only_through_the_presets_interface() -> None:
    offenders = [
        f"{name} imports {dep}"
        for name, path in modules().items()
        if name.startswith("supervisor")
        for dep in imported_names(path, name)
        if dep == "subagent.tools.browser" or dep.startswith("subagent.tools.browser.")
    ]
    assert offenders == []
