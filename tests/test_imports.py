"""The project's modules import downward only (STYLE.md 1) and in no cycle, read from source with ``ast``.

Modules are named as installed: pyproject.toml's ``package-dir`` maps ``modelfleet`` (modelfleet/),
``modelfleet.engine`` (engine/), ``modelfleet.agent`` (agent/) and ``modelfleet.operator`` (operator/).

Every import statement is an edge, wherever it sits: at module level, inside a function (a late
import that dodges a cycle at run time still leaves two modules that need each other), and under
``if TYPE_CHECKING:`` (a type-only import is still a dependency that readers, mypy and the next
refactor must respect). A failure names each edge's file, line and kind. Relative imports are
resolved against the importing package. An edge points at the most specific project module it
names (``from ..engine import frame`` and ``from ..engine.frame import Frame`` both point at
``modelfleet.engine.frame``). Importing a submodule also runs its packages' ``__init__``; those
implicit edges are left out, or every package that re-exports its submodules would be a cycle,
one that Python resolves safely.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# importer layer -> the layers above it, none of which it may import (a name matches itself and
# its submodules: "modelfleet.plan" is not "modelfleet.planner")
ENGINE_MAY_NOT_IMPORT = ("agent", "operator", "cli", "commands", "plan", "planner")
AGENT_MAY_NOT_IMPORT = ("operator", "cli", "commands")
PLAN_MAY_NOT_IMPORT = ("agent", "operator", "cli", "commands")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "modelfleet.engine": tuple(f"modelfleet.{n}" for n in ENGINE_MAY_NOT_IMPORT),
    "modelfleet.agent": tuple(f"modelfleet.{n}" for n in AGENT_MAY_NOT_IMPORT),
    "modelfleet.plan": tuple(f"modelfleet.{n}" for n in PLAN_MAY_NOT_IMPORT),
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    path: str  # relative to the root the modules were read from
    line: int
    kind: str  # "module level", "in a function" or "under TYPE_CHECKING"

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path}:{self.line}, {self.kind})"


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def package_dirs(root: Path) -> dict[str, str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def project_modules(root: Path, dirs: dict[str, str]) -> dict[str, Path]:
    """Dotted name -> source file of every module under each package dir (packages as their __init__)."""
    modules: dict[str, Path] = {}
    for package, folder in dirs.items():
        for file in sorted((root / folder).rglob("*.py")):
            parts = file.relative_to(root / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((package, *parts))] = file
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_with_kinds(node: ast.AST, kind: str = "module level"):  # type: ignore[no-untyped-def]
    """Yield (import statement, kind) for ``node`` and every statement nested in it."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node, kind
        return
    if isinstance(node, ast.If) and is_type_checking(node.test):
        for statement in node.body:
            yield from imports_with_kinds(statement, "under TYPE_CHECKING")
        for statement in node.orelse:
            yield from imports_with_kinds(statement, kind)
        return
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and kind == "module level":
        kind = "in a function"
    for child in ast.iter_child_nodes(node):
        yield from imports_with_kinds(child, kind)


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def most_specific(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def named_targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Dotted names an import statement may mean: ``from a import b`` means a.b, or a if b is no module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = resolve_from(module, is_package, node)
    return [source if alias.name == "*" else f"{source}.{alias.name}" for alias in node.names]


def import_statements(modules: dict[str, Path]):  # type: ignore[no-untyped-def]
    """Yield (module, its file, import statement, kind) for every import of every module."""
    for module, file in modules.items():
        for node, kind in imports_with_kinds(ast.parse(file.read_text(), str(file))):
            yield module, file, node, kind


def import_edges(root: Path, modules: dict[str, Path]) -> list[Edge]:
    edges = []
    for module, file, node, kind in import_statements(modules):
        for name in named_targets(module, file.name == "__init__.py", node):
            target = most_specific(name, modules)
            if target is not None and target != module:
                edges.append(Edge(module, target, str(file.relative_to(root)), node.lineno, kind))
    return edges


def missing_modules(root: Path, modules: dict[str, Path]) -> list[str]:
    """Project modules that an import names but no file holds: the ``a.b`` of ``from a.b import c``, ``import a.b``."""
    missing = []
    for module, file, node, _ in import_statements(modules):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [resolve_from(module, file.name == "__init__.py", node)]
        )
        missing += [
            f"{name} ({file.relative_to(root)}:{node.lineno})"
            for name in names
            if within(name, "modelfleet") and name not in modules
        ]
    return missing


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """Modules of a shortest path start -> ... -> start (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        reached = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in previous:
                    previous[nxt] = node
                    reached.append(nxt)
        frontier = reached
    return []


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One shortest cycle through each module of each cycle, as the edges (first by line) that make it."""
    by_pair: dict[tuple[str, str], Edge] = {}
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in sorted(edges, key=lambda e: (e.path, e.line)):
        by_pair.setdefault((edge.importer, edge.imported), edge)
        graph[edge.importer].add(edge.imported)
        graph.setdefault(edge.imported, set())  # every module a node, importing or not
    found: dict[frozenset[tuple[str, str]], list[Edge]] = {}
    for component in strongly_connected(graph):
        inside = {m: graph[m] & set(component) for m in component}
        for start in component:
            loop = shortest_cycle(inside, start)
            pairs = list(zip(loop, loop[1:], strict=False))
            found.setdefault(frozenset(pairs), [by_pair[pair] for pair in pairs])
    return list(found.values())


def upward_imports(edges: list[Edge], forbidden: dict[str, tuple[str, ...]]) -> list[Edge]:
    return [
        edge
        for edge in edges
        for layer, above in forbidden.items()
        if within(edge.importer, layer) and any(within(edge.imported, name) for name in above)
    ]


def describe_cycles(found: list[list[Edge]]) -> str:
    return "\n".join("cycle:\n  " + "\n  ".join(map(str, loop)) for loop in found)


@pytest.fixture(scope="module")
def project_edges() -> list[Edge]:
    return import_edges(ROOT, project_modules(ROOT, package_dirs(ROOT)))


# ---- the project --------------------------------------------------------------------------------


def test_every_layer_of_the_project_is_read_under_its_installed_name():
    modules = project_modules(ROOT, package_dirs(ROOT))
    for name in ["modelfleet.cli", "modelfleet.commands.quantize", "modelfleet.plan", "modelfleet.planner"]:
        assert name in modules
    for name in ["modelfleet.engine.shard", "modelfleet.engine.formats.mxfp4", "modelfleet.agent.stage"]:
        assert name in modules
    assert "modelfleet.operator.handlers" in modules and "modelfleet.engine" in modules
    assert len(modules) == sum(1 for folder in package_dirs(ROOT).values() for _ in (ROOT / folder).rglob("*.py"))


def test_the_projects_modules_import_each_other_in_no_cycle(project_edges):
    found = cycles(project_edges)
    assert not found, f"{len(found)} import cycle(s); break each at one edge:\n{describe_cycles(found)}"


def test_every_import_of_a_project_module_names_a_file_that_exists():
    modules = project_modules(ROOT, package_dirs(ROOT))
    missing = missing_modules(ROOT, modules)
    assert not missing, "imports name modules that no file holds:\n" + "\n".join(missing)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_of_the_layers_above_it(project_edges, layer):
    upward = upward_imports(project_edges, {layer: FORBIDDEN[layer]})
    assert not upward, f"{layer} may not import {', '.join(FORBIDDEN[layer])}:\n" + "\n".join(map(str, upward))


# ---- the checker itself, on synthetic packages --------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return project_modules(root, {"modelfleet": "mf", "modelfleet.engine": "eng"})


def test_a_cycle_closed_by_a_late_import_and_a_type_checking_import_is_found(tmp_path):
    modules = write_tree(
        tmp_path,
        {
            "mf/__init__.py": "",
            "eng/__init__.py": "from .a import run\n",  # re-exports are no cycle
            "eng/a.py": "def run():\n    from modelfleet.engine.b import B\n    return B\n",
            "eng/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\nB = 1\n",
            "eng/c.py": "import modelfleet.engine.b\n",
        },
    )
    found = cycles(import_edges(tmp_path, modules))
    assert [[str(edge) for edge in loop] for loop in found] == [
        [
            "modelfleet.engine.a -> modelfleet.engine.b (eng/a.py:2, in a function)",
            "modelfleet.engine.b -> modelfleet.engine.a (eng/b.py:3, under TYPE_CHECKING)",
        ]
    ]


def test_a_three_module_cycle_is_reported_once_with_every_edge(tmp_path):
    files = {"mf/__init__.py": "", "eng/__init__.py": ""}
    files |= {f"eng/{m}.py": f"from .{n} import x\nx = 1\n" for m, n in [("a", "b"), ("b", "c"), ("c", "a")]}
    found = cycles(import_edges(tmp_path, write_tree(tmp_path, files)))
    assert len(found) == 1 and {(e.importer[-1], e.imported[-1]) for e in found[0]} == {
        ("a", "b"),
        ("b", "c"),
        ("c", "a"),
    }


def test_relative_imports_resolve_against_the_importing_package(tmp_path):
    modules = write_tree(
        tmp_path,
        {
            "mf/__init__.py": "",
            "mf/cli.py": "",
            "mf/sub/__init__.py": "from .. import cli\n",
            "eng/__init__.py": "",
            "eng/deep/__init__.py": "",
            "eng/deep/x.py": "from ...engine import y\nfrom ..y import Y\nfrom modelfleet.engine.deep import x\n",
            "eng/y.py": "import os\nimport modelfleet.mf_missing\nY = 1\n",
        },
    )
    assert missing_modules(tmp_path, modules) == ["modelfleet.mf_missing (eng/y.py:2)"]
    pairs = {(e.importer, e.imported) for e in import_edges(tmp_path, modules)}
    assert pairs == {
        ("modelfleet.sub", "modelfleet.cli"),
        ("modelfleet.engine.deep.x", "modelfleet.engine.y"),
        ("modelfleet.engine.y", "modelfleet"),  # a name with no module of its own: its nearest package
    }


def test_an_upward_import_is_named_with_its_file_line_and_kind(tmp_path):
    modules = write_tree(
        tmp_path,
        {
            "mf/__init__.py": "",
            "mf/cli.py": "",
            "mf/planner.py": "",
            "eng/__init__.py": "",
            "eng/z.py": "from modelfleet import planner\n",
        },
    )
    upward = upward_imports(import_edges(tmp_path, modules), FORBIDDEN)
    assert [str(e) for e in upward] == ["modelfleet.engine.z -> modelfleet.planner (eng/z.py:1, module level)"]
    assert not upward_imports([Edge("modelfleet.plan", "modelfleet.engine.spec", "p", 1, "module level")], FORBIDDEN)
