"""Packages import only downward, no two modules import each other, and module basenames
are unique (docs/architecture.md, "Packages and their import order" and "Naming rules").

Pure and fast: every module is parsed with ``ast``, nothing is imported. Every import
counts: at module level, inside a function (a lazy import) and for type hints only
(under ``if TYPE_CHECKING:``), since each says that one module depends on another.
"""

from __future__ import annotations

import ast
import functools
import os
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .support import ROOT

PROCESSES = ("retina_server", "trans_gate", "cdc_client", "spark_jobs")
# What each package may import of ours: the floors of docs/architecture.md.
MAY_IMPORT: dict[str, frozenset[str]] = {
    "retina_common": frozenset(),
    **{process: frozenset({"retina_common"}) for process in PROCESSES},
    "devtools": frozenset({"retina_common", *PROCESSES}),
    "chaos": frozenset({"retina_common", *PROCESSES, "devtools"}),
}
# Ours too, above every package: importing them from a package is an upward edge.
TOP = ("tests", "bench", "scripts")
# Cycles found and reported, not yet removed; the test fails when one is gone, so that
# this list only shrinks. chaos/stalls.py and chaos/split_reads.py import FaultContext
# and FaultResult from chaos/faults.py for their type hints, and faults.py imports both
# modules: the two types belong in a module below all three.
KNOWN_CYCLES = {frozenset({"chaos.faults", "chaos.stalls", "chaos.split_reads"})}
SKIPPED_DIRS = {".git", ".venv", ".venv-peers", "__pycache__", ".pytest_cache", ".ruff_cache",
                "build", "dist", "node_modules", ".retina-cluster", ".retina-demo"}


def generated(path: Path) -> bool:
    return path.stem.endswith(("_pb2", "_pb2_grpc"))


def python_files(root: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(directory, name)
            if name.endswith(".py") and not generated(path):
                yield path


def modules_of(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in python_files(root / package):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    how: str  # "module level", "lazy" or "type-only"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} (line {self.line}, {self.how})"


def _type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Dotted names an import statement reaches (``from a import b``: ``a.b``, which is a
    module or else a name inside ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def imports_of(module: str, path: Path, known: set[str], ours: set[str]) -> list[Edge]:
    """The imports of one module that reach another module of ours, resolved to the
    innermost known module (``from a import b``: module ``a.b`` if there is one, else
    ``a``); a name of ours that is no known module is kept as it is (``tests``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[Edge] = []

    def visit(node: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for inner in child.body:
                    visit_one(inner, "type-only")
                for inner in child.orelse:
                    visit_one(inner, how)
                continue
            visit_one(child, how)

    def visit_one(child: ast.AST, how: str) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            for name in _imported_names(child, package):
                if name.split(".")[0] not in ours:
                    continue
                target = name
                while target and target not in known:
                    target = target.rpartition(".")[0]
                target = target or name.split(".")[0]
                if target != module:
                    edges.append(Edge(module, target, child.lineno, how))
        inner_how = "lazy" if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
            and how == "module level" else how
        visit(child, inner_how)

    visit(ast.parse(path.read_text(), str(path)), "module level")
    return edges


def all_edges(root: Path, may_import: dict[str, frozenset[str]],
              top: tuple[str, ...] = TOP) -> list[Edge]:
    modules = modules_of(root, tuple(may_import))
    ours = set(may_import) | set(top)
    edges = (edge for module, path in modules.items()
             for edge in imports_of(module, path, set(modules), ours))
    return list(dict.fromkeys(edges))  # one per statement, not per imported name


def forbidden_edges(edges: list[Edge], may_import: dict[str, frozenset[str]]) -> list[Edge]:
    """Edges to another package that the floors do not allow (upward or sideways)."""
    out = []
    for edge in edges:
        source, target = edge.source.split(".")[0], edge.target.split(".")[0]
        if source != target and target not in may_import[source]:
            out.append(edge)
    return out


def cycles(edges: list[Edge]) -> dict[frozenset[str], list[Edge]]:
    """Every set of modules that import each other (a strongly connected component of
    more than one module), with the edges inside it."""
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges:
        graph[edge.source].add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        # Tarjan's algorithm, iteratively: (node, its successors not yet looked at).
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return {c: [e for e in edges if e.source in c and e.target in c] for c in found}


def duplicate_basenames(root: Path) -> dict[str, list[str]]:
    names: dict[str, list[str]] = defaultdict(list)
    for path in python_files(root):
        if path.name not in ("__init__.py", "__main__.py"):
            names[path.name].append(path.relative_to(root).as_posix())
    return {name: paths for name, paths in sorted(names.items()) if len(paths) > 1}


@functools.cache
def repository_edges() -> list[Edge]:
    return all_edges(ROOT, MAY_IMPORT)


def test_packages_import_only_downward() -> None:
    edges = repository_edges()
    assert edges, "no imports found: the scan is broken"
    assert [str(e) for e in forbidden_edges(edges, MAY_IMPORT)] == []


def test_no_two_modules_import_each_other() -> None:
    found = cycles(repository_edges())
    new = {", ".join(sorted(c)): [str(e) for e in edges]
           for c, edges in found.items() if c not in KNOWN_CYCLES}
    assert new == {}
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert gone == [], "fixed: take these out of KNOWN_CYCLES"


def test_module_basenames_are_unique() -> None:
    assert duplicate_basenames(ROOT) == {}


def test_the_checks_find_a_cycle_through_a_lazy_import_and_an_upward_edge(
        tmp_path: Path) -> None:
    # The checks above pass on the repository; this one shows they can fail.
    files = {
        "low/__init__.py": "",
        "low/a.py": "from low import b\n",
        "low/b.py": "def later():\n    from low.c import C\n    return C\n",
        "low/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from .a import A\nfrom high.top import T\n",
        "low/d.py": "import tests.support\n",
        "high/__init__.py": "",
        "high/top.py": "from low.a import A\n",
        "high/again/a.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    floors = {"low": frozenset(), "high": frozenset({"low"})}
    edges = all_edges(tmp_path, floors)
    assert sorted(map(str, forbidden_edges(edges, floors))) == [
        "low.c -> high.top (line 4, module level)", "low.d -> tests (line 1, module level)"]
    found = cycles(edges)
    assert list(found) == [frozenset({"low.a", "low.b", "low.c", "high.top"})]
    assert {e.how for e in found[frozenset({"low.a", "low.b", "low.c", "high.top"})]} == {
        "module level", "lazy", "type-only"}
    assert duplicate_basenames(tmp_path) == {"a.py": ["high/again/a.py", "low/a.py"]}
