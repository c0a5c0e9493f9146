"""No import circle among the project's modules, at module level or inside a function.

A function-level import hides a circle from Python (the module is complete by the time the function runs), not
from the reader: the two modules still depend on each other. So every import statement counts wherever it sits,
except under `if TYPE_CHECKING:` (never run). Relative imports are resolved; `from pkg import name` points at
pkg.name when that is a module, else at pkg. Imports of anything outside ds_ulysses_ext/, engine/ and configs/
(torch, and the optional GPU extras triton, liger, flash_attn, fla, deep_ep) are not project modules and are
skipped. A package's own __init__ is not counted as imported by its submodules: Python always runs it first, so
a submodule importing from it is no circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ds_ulysses_ext", "engine", "configs")


def project_modules(root: Path, packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    """dotted name -> (file, is a package's __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, outside `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _type_checking_only(node):
            children = node.orelse  # the else branch runs
        stack.extend(children)


def import_graph(root: Path, packages=PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first such import}."""
    modules = project_modules(root, packages)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        edges = graph.setdefault(name, {})
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            for target in targets:
                target = known(target) if target.split(".")[0] in packages else None
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per strongly connected component of two or more modules."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):  # Tarjan; the graph is a few hundred modules, well inside the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        start = min(component)
        paths, seen = [[start]], {start}
        while paths:  # breadth first: the shortest way back to start inside the component
            path = paths.pop(0)
            nxt = [w for w in sorted(graph[path[-1]]) if w in component]
            if start in nxt:
                found.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return found


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules) -> str:
    return "\n".join(f"  {a} ({modules[a][0].relative_to(ROOT) if ROOT in modules[a][0].parents else modules[a][0]}"
                     f":{graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_no_import_circle():
    graph = import_graph(ROOT)
    modules = project_modules(ROOT)
    assert len(graph) > 100 and "ds_ulysses_ext.loss" in graph["ds_ulysses_ext.lm"], "the parser found no edges"
    found = cycles(graph)
    assert not found, "import circles (put the shared piece in a module below both):\n" + "\n\n".join(
        describe(c, graph, modules) for c in found)


def test_the_check_sees_hidden_and_relative_imports(tmp_path):
    """The parser's own cases, on a made-up package: a circle through a function-level relative import is found,
    one through a TYPE_CHECKING import is not, and `from . import sub` points at the submodule."""
    pkg = tmp_path / "configs"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from .a import A\n    return A\nB = 2\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\nC = 3\n")
    (pkg / "d.py").write_text("from .c import C\nD = 4\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "e.py").write_text("from .. import d\nimport triton\n")
    graph = import_graph(tmp_path, ("configs",))
    assert graph["configs.sub.e"] == {"configs.d": 1}
    assert graph["configs.b"] == {"configs.a": 2}
    assert graph["configs.c"] == {}
    assert cycles(graph) == [["configs.a", "configs.b", "configs.a"]]
