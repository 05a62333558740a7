"""The layout's rules, for ``simulator/`` and ``calibration/``: no module over
:data:`MAX_LINES` lines, no function over :data:`MAX_FUNCTION` lines, no import cycle
between modules, and a docstring on every package saying what it owns.

An import counts wherever it stands (a function's lazy import is as much a cycle as a
module-level one), except under ``if TYPE_CHECKING:``, which never runs. ``from a.b
import c`` imports ``a.b.c`` when that is a module, else ``a.b``; importing a module
also runs its packages' ``__init__``, which hold docstrings only (checked below).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("simulator", "calibration")
MAX_LINES = 400
MAX_FUNCTION = 60


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that can run: the body of ``if TYPE_CHECKING:`` left out."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that ``path`` imports at run time."""
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing
    itself (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1 or node in graph[node]:
                    out.append(sorted(members))
    return out


def long_functions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f"{where}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > MAX_FUNCTION]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_over_the_limit(package: str) -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules(package).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package: str) -> None:
    assert [f for p in modules(package).values() for f in long_functions(p)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    known = set(modules("simulator")) | set(modules("calibration"))
    graph = {name: imports(path, known) for name, path in modules(package).items()}
    graph = {name: {m for m in deps if m in graph} for name, deps in graph.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_what_it_owns(package: str) -> None:
    """Each package's ``__init__`` is a docstring (what the folder owns) and nothing
    that runs beyond ``__version__``: importing a module never pulls in a hub."""
    bad = []
    for name, path in modules(package).items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        body = tree.body
        if not body or not isinstance(body[0], ast.Expr) or not isinstance(
                getattr(body[0], "value", None), ast.Constant):
            bad.append(f"{name}: no docstring")
        extra = [n for n in body[1:] if not (isinstance(n, ast.Assign) and any(
            getattr(t, "id", "") == "__version__" for t in n.targets))]
        if extra:
            bad.append(f"{name}: runs code beyond its docstring")
    assert bad == []


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    """The checks above can fail: a cycle through a lazy import, a long function."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\n"
                    "def f():\n    import x.z\n    from x import w\n")
    assert imports(path, {"x.y", "x.z", "x.w", "x"}) == {"x.z", "x.w"}
    body = "\n".join(f"    a = {i}" for i in range(MAX_FUNCTION))
    path.write_text(f"def f():\n{body}\n")
    assert long_functions(path) and "f (61 lines)" in long_functions(path)[0]
