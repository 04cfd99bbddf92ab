"""The library's import layering, read from the source with `ast` (nothing is imported or compiled).

The library is the packages users import: zaya_jax/ and pallas_kernels/. This checks that
  (a) no library module imports the tooling around it: benchmarks, tools, launch or tests;
  (b) the library's modules import one another without a cycle.

Every import statement counts, wherever it stands: at module level, inside a function or under `if TYPE_CHECKING`
(a function-level import that closes a cycle still ties the two modules together). Relative imports are resolved
against the importing module's package. An edge goes to the module named: `import a.b` and `from a.b import f` point
at a.b, `from a import b` at the submodule a.b when there is one. The parent packages Python imports on the way
(a for a.b) are not counted as edges.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = ("zaya_jax", "pallas_kernels")
TOOLING = ("benchmarks", "tools", "launch", "tests")


def _library_files() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the library packages."""
    out = {}
    for top in LIBRARY:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for each import in the file, relative ones made absolute."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            out.append((module, [a.name for a in node.names], node.lineno))
    return out


def _edges(modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """Library module -> {library module it imports: line of the first such import}."""
    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = {}
    for name, path in modules.items():
        targets = {}
        for module, names, line in _imports(name, path):
            hits = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            if len(hits) < len(names) or not names:  # something other than a submodule is taken from `module`
                hits.append(known(module))
            for t in hits:
                if t is not None and t != name:
                    targets.setdefault(t, line)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative), each as a sorted list."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, str]) -> str:
    inside = set(component)
    lines = [f"  {m} ({os.path.relpath(modules[m], ROOT)}:{graph[m][t]}) -> {t}"
             for m in component for t in sorted(graph[m]) if t in inside]
    return "cycle among " + ", ".join(component) + ":\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def modules():
    found = _library_files()
    assert "zaya_jax.train.loop" in found and "pallas_kernels.platform" in found  # the walk saw the packages
    return found


def test_library_does_not_import_tooling(modules):
    bad = [f"{os.path.relpath(path, ROOT)}:{line}: imports {module}"
           for name, path in sorted(modules.items())
           for module, _, line in _imports(name, path)
           if module.split(".")[0] in TOOLING]
    assert not bad, "library modules import tooling (" + ", ".join(TOOLING) + "):\n" + "\n".join(bad)


def test_no_import_cycles_in_the_library(modules):
    graph = _edges(modules)
    assert graph["zaya_jax.train.loop"], "no edges found: the import parsing is broken"
    cycles = _cycles(graph)
    assert not cycles, "\n".join(_describe(c, graph, modules) for c in cycles)


def test_cycle_finder_sees_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {}}
    assert _cycles(graph) == [["a", "b", "c"]]
