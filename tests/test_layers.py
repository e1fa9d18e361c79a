"""The package's layers (docs: DESIGN §2): no import cycle, and every import points down the floors.

Read from the source with ``ast``: every import of a ``dllm`` module counts, at module level or inside a function
(a deferred import is still a dependency). The package facade ``dllm`` imports its public names on first use
(``_LAZY``): it stands on what it re-exports.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "dllm"

# Bottom up: a module imports its own package and the floors below it (DESIGN §2); tasks and training share
# DESIGN's floor 6, training above the tasks.
FLOORS = [
    {"core"},  # errors, random numbers, geometry, registry, settings, the loop's protocol types
    {"kernels", "models", "constraints"},  # (constraints: the automata and their check of a canvas)
    {"caches"},
    {"engine"},
    {"samplers"},
    {"tasks"},
    {"train"},
    {"serve"},  # DESIGN's floor 7 with bench and eval: below the bench, whose serving benchmark drives it
    {"bench", "eval"},
    {"cli"},
    {"__main__"},
]
# Imports that still point up or close a cycle, each with what removes it. They are left out of the checks below;
# a new one fails them, and a listed one that is gone fails the last (delete it here).
KNOWN = {
    ("dllm.train", "dllm.bench.runner"): "the held-out evaluation decodes with the bench's settings "
    "(resolve_generation): the generation geometry replaces it",
}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _graph(known: bool = False) -> dict[str, set[str]]:
    """module -> the dllm modules it imports, the ``KNOWN`` imports left out unless ``known``."""
    graph = {name: set(targets) for name, targets in _imports().items()}
    if not known:
        for source, target in KNOWN:
            graph.get(source, set()).discard(target)
    return graph


@functools.cache
def _imports() -> dict[str, frozenset[str]]:
    """module -> the dllm modules it imports (``from pkg import name`` imports the module ``pkg.name`` when there
    is one, else ``pkg``)."""
    modules = _modules()

    def module_of(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name.split(".")[0] == "dllm"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dllm":
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {module_of(t) for t in targets} - {name}
    lazy = re.findall(r'\(\s*"(dllm[\w.]*)"', (PACKAGE / "__init__.py").read_text())
    assert lazy, "the facade's _LAZY table was not found"
    graph["dllm"] |= {module_of(t) for t in lazy}
    return {name: frozenset(targets) for name, targets in graph.items()}


def _floor(module: str) -> tuple[int, str]:
    if module.endswith(".__main__") and module != "dllm.__main__":  # ``python -m dllm.X``: an entry point, as the CLI
        return _floor("dllm.cli")
    parts = module.split(".")[1:]
    part = parts[0]
    for floor, members in enumerate(FLOORS):
        if part in members:
            return floor, part
    raise AssertionError(f"{module}: no floor for {part!r}; give it one in FLOORS")


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
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
            component = set()
            while v not in component:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
            if len(component) > 1:
                found.append(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert [sorted(cycle) for cycle in _cycles(_graph())] == []


def test_imports_point_down_the_floors():
    """Including: dllm/core imports nothing of the package above it."""
    graph = _graph()
    facade = max(_floor(m)[0] for m in graph["dllm"])  # the facade stands on what it re-exports
    upward = []
    for source, targets in graph.items():
        if source == "dllm":
            continue
        floor, part = _floor(source)
        for target in targets:
            below, other = (facade, "dllm") if target == "dllm" else _floor(target)
            if other != part and below >= floor:
                upward.append((source, target))
    assert sorted(upward) == []


def test_the_known_exceptions_are_still_there():
    graph = _graph(known=True)
    assert [edge for edge in KNOWN if edge[1] not in graph.get(edge[0], ())] == [], "gone: delete it from KNOWN"
