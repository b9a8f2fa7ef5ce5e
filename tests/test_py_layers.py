"""The Python modules import each other without circles, as the C core's layers do
(tests/test_c_layers.py): for the packages kvcache and kvcache_bench, every import a module makes
(at its top or inside a function; not those under ``if TYPE_CHECKING``, which never run) points
to a module that does not reach back to it. A package's ``__init__`` may import its modules; a
module importing its package's ``__init__`` for a name (``from kvcache import X``) then counts
as an edge back, so modules take names from the module that defines them."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"kvcache": ROOT / "src" / "kvcache", "kvcache_bench": ROOT / "benchmarks" / "kvcache_bench"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the packages by its dotted name (extension modules too, by their .pyx)."""
    out = {}
    for pkg, d in PACKAGES.items():
        for path in d.rglob("*"):
            if path.suffix not in (".py", ".pyx"):
                continue
            parts = list(path.relative_to(d.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                skip.update(id(x) for stmt in node.body for x in ast.walk(stmt))
    return skip


def _owner(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The module of the packages that an imported dotted name lies in (None: outside them)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the packages it imports."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        graph[mod] = set()
        if path.suffix != ".py":
            continue          # an extension's Cython imports only kvcache's C parts
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        names: list[str] = []
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                names += subs
                if len(subs) < len(node.names):
                    names.append(node.module)     # a name defined in that module itself
        graph[mod] = {o for o in (_owner(n, modules) for n in names) if o is not None and o != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circles():
    graph = import_graph()
    assert "kvcache.store" in graph and "kvcache_bench.case_serving" in graph, "the packages were not found"
    assert circles(graph) == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
])
def test_circles_found(graph, expected):
    assert circles(graph) == expected
