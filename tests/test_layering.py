"""Layers point one way (shared/STYLE.md of the project, principle 11): spec <- cache <- native <- model <-
loader/CLI/server. LAYERS below declares the order, lowest first: a unit imports only from its own layer
and the layers below it.

Read from the source with `ast`; no kvref module is imported or executed. A unit is a subpackage
(kvref.spec, kvref.cache, ...), a top-level module (kvref.model, ...; kvref itself is its __init__), or a
module LAYERS names on its own (kvref.generation.config sits below the rest of kvref.generation). Every
import counts, including those inside functions: a lazy import still makes one layer depend on another.
Failures name the file:line of each import or access.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvref"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in SOURCES.items()}


def where(module: str, node) -> str:
    return f"{SOURCES[module].relative_to(PACKAGE.parent)}:{node.lineno}"


def unit(module: str) -> str:
    """The unit a module belongs to: the longest name in LAYERS it is or lies inside (kvref.tools.common
    sits low while the rest of kvref.tools sits on top), else its subpackage, else the module itself."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        if ".".join(parts[:n]) in LAYER:
            return ".".join(parts[:n])
    if len(parts) >= 2 and ".".join(parts[:2]) in PACKAGES:
        return ".".join(parts[:2])
    return module


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _known(target: str) -> str:
    """The kvref module a dotted name refers to: itself, or its longest known prefix (an attribute,
    or a compiled extension such as kvref.native._kvref, belongs to the module that holds it)."""
    while target not in SOURCES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def imports(module: str):
    """(node, imported module, imported name or None, dotted path as written) for every kvref import
    in `module`; relative imports are resolved."""
    package = module if module in PACKAGES else module.rsplit(".", 1)[0]
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "kvref" or alias.name.startswith("kvref."):
                    yield node, _known(alias.name), None, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == "kvref" or base.startswith("kvref.")):
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in SOURCES:  # `from . import ops`: the submodule itself
                    yield node, submodule, None, submodule
                else:
                    yield node, _known(base), alias.name, f"{base}.{alias.name}"


def _edges(key):
    """{(from, to): [file:line, ...]} over every import, with both ends mapped by `key` (None: skip)."""
    edges = defaultdict(list)
    for module in SOURCES:
        for node, target, _, _ in imports(module):
            a, b = key(module, target)
            if a is not None and a != b and where(module, node) not in edges[a, b]:
                edges[a, b].append(where(module, node))
    return edges


def _cycles(edges) -> list[str]:
    """One description per strongly connected component of more than one node: a cycle through it,
    each step with the file:line of the imports that make it."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(set(graph) | {b for _, b in edges}):
        if v not in index:
            visit(v)
    out = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a node repeats: that is a cycle
            nxt = min(w for w in graph[path[-1]] if w in component)
            if nxt in seen:
                path = path[path.index(nxt):] + [nxt]
                break
            path.append(nxt)
            seen.add(nxt)
        steps = [f"{a} -> {b} ({', '.join(edges[a, b])})" for a, b in zip(path, path[1:])]
        out.append(f"cycle among {sorted(component)}: " + "; ".join(steps))
    return out


# Lowest first. A new unit (module or subpackage) is placed here, at the lowest layer its imports allow.
LAYERS = [
    {"errors", "limits", "digest", "config", "moved"},  # the ground floor: numbers, failures, bounds
    {"weights", "text", "generation.sampling", "generation.speculative"},  # plain data and pure functions
    {"spec"},  # the readable specification
    {"cache", "formats", "tolerance", "scoring"},  # the explicit KV cache; file readers; rules on logits
    {"native"},  # the C kernels and the fused forward
    {"generation.config", "generation.stream", "text.frontend", "trace", "backends", "executor"},  # what a model holds
    {"model"},
    {"generation", "loader"},  # generation over a model (one sequence or a batch); loading one from files
    {"serving", "conformance", "tools"},  # programs above the API
    {"tools.cli"},
    {"", "__main__"},  # kvref itself: the public API, re-exported names only
]
LAYER = {("kvref." + name).rstrip("."): i for i, names in enumerate(LAYERS) for name in names}


def layer_problems(edges_with_names) -> list[str]:
    """Imports that point up the declared order: [(importer, imported, name, file:line), ...] -> messages.
    Only kvref.__version__ may be taken from the package itself (it holds nothing else of its own)."""
    problems = []
    for a, b, name, at in edges_with_names:
        if a == b or (b == "kvref" and name == "__version__"):
            continue
        if a not in LAYER or b not in LAYER:
            problems.append(f"{at}: {a} or {b} is in no layer of tests/test_layering.py's LAYERS")
        elif LAYER[b] > LAYER[a]:
            problems.append(f"{at}: {a} (layer {LAYER[a]}) imports {b} (layer {LAYER[b]}), a layer above it")
    return problems


def unit_imports():
    return [(unit(module), unit(target), name, where(module, node))
            for module in SOURCES for node, target, name, _ in imports(module)]


def test_every_import_points_down_the_declared_layers():
    problems = layer_problems(unit_imports())
    assert not problems, "\n".join(problems)


def test_the_layer_check_fails_on_an_import_up_the_layers():
    # the spec importing generation settings (what issue 26 found passing unnoticed), and a unit in no layer
    edges = unit_imports() + [("kvref.spec", "kvref.generation.config", "GenerationConfig", "kvref/spec/ops.py:1"),
                              ("kvref.newthing", "kvref.errors", "KVRefError", "kvref/newthing.py:1")]
    problems = layer_problems(edges)
    assert len(problems) == 2
    assert "kvref.spec (layer 2) imports kvref.generation.config (layer 5)" in problems[0]
    assert "in no layer" in problems[1]


def test_no_import_cycle_between_kvref_subpackages_and_top_level_modules():
    edges = _edges(lambda module, target: (unit(module), unit(target)))
    problems = _cycles(edges)
    assert not problems, "\n".join(problems)


def test_no_import_cycle_between_the_modules_of_one_subpackage():
    edges = _edges(lambda module, target: (module, target) if unit(module) == unit(target) != module else
                   (None, None))
    problems = _cycles(edges)
    assert not problems, "\n".join(problems)


def test_the_graph_reader_sees_the_layers_it_checks():
    # guards the test above against reading nothing: known edges of the lower layers are found
    edges = set(_edges(lambda module, target: (unit(module), unit(target))))
    assert {("kvref.native", "kvref.cache"), ("kvref.native", "kvref.spec"), ("kvref.formats", "kvref.spec"),
            ("kvref.tools.cli", "kvref.tools"), ("kvref.generation.stream", "kvref.text")} <= edges
    assert {"kvref.spec", "kvref.cache", "kvref.native", "kvref.formats"} <= PACKAGES


def _defined_private_names(module: str) -> set:
    """Private names `module` itself defines: functions, classes, assignments (module, class or
    attribute targets such as self._x or other._x), class-body annotations, parameters."""
    names = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute):
                        names.add(t.attr)
                    elif isinstance(t, ast.Name):
                        names.add(t.id)
    return {n for n in names if private(n)}


def _module_aliases(module: str) -> dict:
    """Local names bound to kvref modules by this module's imports: {name: module}."""
    aliases = {}
    for node, target, name, _ in imports(module):
        for alias in node.names:
            local = alias.asname or alias.name.split(".")[0]
            if isinstance(node, ast.Import):
                aliases[local] = _known(alias.name) if alias.asname else "kvref"
            elif name is None and target.endswith("." + alias.name):
                aliases[local] = target
    return aliases


def test_no_module_imports_or_reaches_into_a_private_name_of_another_kvref_module():
    problems = []
    for module in SOURCES:
        own = _defined_private_names(module)
        aliases = _module_aliases(module)
        for node, _, _, path in imports(module):
            # a private name (or module) belongs to the module or package whose name precedes it;
            # only that module, or a module inside that package, may import it
            parts = path.split(".")
            hidden = [i for i, part in enumerate(parts) if private(part)]
            owner = ".".join(parts[:hidden[0]]) if hidden else None
            if owner is not None and not (module == owner or module.startswith(owner + ".")):
                problems.append(f"{where(module, node)}: imports {path}, private to {owner}")
        for node in ast.walk(TREES[module]):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases and aliases[base.id] != module:
                problems.append(f"{where(module, node)}: {base.id}.{node.attr} is private to {aliases[base.id]}")
            elif isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            elif node.attr not in own:  # obj._x where nothing in this module defines _x: another module's
                problems.append(f"{where(module, node)}: {ast.unparse(node)} reaches into a private name "
                                f"this module does not define")
    assert not problems, "\n".join(problems)


def test_nothing_in_kvref_reaches_through_a_bound_method_to_its_object():
    problems = []
    for module in SOURCES:
        for node in ast.walk(TREES[module]):
            if isinstance(node, ast.Attribute) and node.attr == "__self__":
                problems.append(f"{where(module, node)}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr")
                  and any(isinstance(a, ast.Constant) and a.value == "__self__" for a in node.args)):
                problems.append(f"{where(module, node)}: {ast.unparse(node)}")
    assert not problems, "\n".join(problems)
