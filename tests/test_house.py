"""The shape of the house (STYLE.md; docs/architecture.md): small modules, short
functions, no import circle, layers that import only downward, and a web layer that
uses kvscope's public names only.

Everything is read from the source with `ast`, nothing is imported. Where today's code
still breaks a rule, the offender is listed below with its count and what should change;
each list only shrinks: a listed offender that grew fails, a new one fails, and so does a
listed one that no longer breaks the rule (delete its line).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvscope

PACKAGE = Path(kvscope.__file__).parent

#: A module's lines (`wc -l`).
MAX_MODULE_LINES = 350
#: A function's body lines: from its first statement after the docstring to its last
#: line, blank and comment lines within included; the signature, decorators and
#: docstring excluded, and so are its attribute declarations (statements of the body
#: itself that only assign `self.name = ...`, as an `__init__` declaring its fields).
#: A nested function counts in its enclosing one and on its own. Classes are not
#: measured: a block of field declarations is not a function.
MAX_FUNCTION_LINES = 60

#: The layers, top to bottom. A module may import from its own layer and any below it,
#: never from one above. An entry names a module or a package (all its modules);
#: `kvscope` itself names only `kvscope/__init__.py`. Every module must be placed.
LAYERS: tuple[tuple[str, ...], ...] = (
    # The `kvscope` command, which dispatches to the subcommands.
    ("kvscope.cli",),
    # Subcommands: `kvscope bench` (benchmarks that start servers and engines) and
    # `kvscope serve` (one server, or replicas on Ray Serve).
    ("kvscope.bench", "kvscope.serve"),
    # Scale-out: Ray Serve replicas, each serving the single server's app.
    ("kvscope.replicas",),
    # The HTTP server over one Engine.
    ("kvscope.web",),
    # The public API (`kvscope/__init__.py`) and the clients written against it.
    ("kvscope", "kvscope.beam_search"),
    # The actors: the engine, requests, admission, the step actor, the scheduler.
    ("kvscope.actors",),
    # Running the model: the runner in a thread or a worker process, its wire, warm-up.
    ("kvscope.execution",),
    # The model: architecture, weights, loaders, tokenizer, chat templates.
    ("kvscope.models",),
    # The kernels: attention, sampling, quantized matmuls, guided masks.
    ("kvscope.kernels",),
    # The paged KV cache: block pool, block tables, the cache tensors.
    ("kvscope.cache",),
    # The types that own each rule and default, imported by every layer.
    (
        "kvscope.config",
        "kvscope.errors",
        "kvscope.options",
        "kvscope.param_values",
        "kvscope.params",
        "kvscope.scheduling",
        "kvscope.text",
    ),
)

#: What `kvscope/web` may import from kvscope outside itself: the package's exports
#: (`kvscope/__init__.py`'s `__all__`), the modules that own each rule (the last of
#: `LAYERS`: the engine's settings, sampling, errors, the server threads' scheduling)
#: and the beam search client.
PUBLIC_MODULES = frozenset({"kvscope.beam_search", *LAYERS[-1]})

#: Modules over MAX_MODULE_LINES: path -> lines at most.
LONG_MODULES: dict[str, int] = {}

#: Functions over MAX_FUNCTION_LINES: "path::qualified name" -> body lines at most.
LONG_FUNCTIONS: dict[str, int] = {}

#: Import circles: each a set of modules that import one another.
CYCLES: list[frozenset[str]] = []

#: Imports that reach up a layer: (importer, imported).
UPWARD_IMPORTS: set[tuple[str, str]] = set()


#: Web modules that import internal names: path -> how many, at most.
WEB_INTERNAL_IMPORTS = {
    # RequestState, the argument of Engine.release_listeners: the actors' mutable state,
    # not a public name; goes once the hook hands out a public, frozen record of it.
    "web/ops/metrics.py": 1,
}


def modules() -> dict[str, Path]:
    """Every module of kvscope by its dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def short(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, str]]:
    """(module, name) for each name `name`'s module imports from kvscope, anywhere in
    it (module level, functions, TYPE_CHECKING blocks); `module` is the kvscope module
    the name resolves to, a submodule where the name is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvscope":
                    yield _owner(alias.name, known), ""
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] != "kvscope":
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in known:
                    yield submodule, ""
                else:
                    yield _owner(base, known), alias.name


def _owner(dotted: str, known: dict[str, Path]) -> str:
    while dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {module for module, _ in imports(name, path, known) if module != name}
        for name, path in known.items()
    }


def function_lengths(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(qualified name, body lines) of every function in `tree`."""

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                body = child.body
                if len(body) > 1 and ast.get_docstring(child) is not None:
                    body = body[1:]
                assert child.end_lineno is not None
                lines = child.end_lineno - body[0].lineno + 1
                yield prefix + child.name, lines - sum(map(_declaration_lines, body))
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            else:
                yield from visit(child, prefix)

    return visit(tree, "")


def _declaration_lines(statement: ast.stmt) -> int:
    """The lines of `statement` if it declares an attribute (`self.name = ...`)."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target: ast.expr = statement.targets[0]
    elif isinstance(statement, ast.AnnAssign):
        target = statement.target
    else:
        return 0
    if not (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    ):
        return 0
    assert statement.end_lineno is not None
    return statement.end_lineno - statement.lineno + 1


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import circles: Tarjan's components of more than one module (or one that
    imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def layer_of(module: str) -> int | None:
    for depth, layer in enumerate(LAYERS):
        for entry in layer:
            if module == entry or (entry != "kvscope" and module.startswith(entry + ".")):
                return depth
    return None


def check_listed(measured: dict[str, int], listed: dict[str, int], limit: int) -> list[str]:
    """What breaks a size rule: offenders not listed or grown past their listed
    count, and listed ones that no longer break it."""
    problems = []
    for where, count in sorted(measured.items()):
        if count > limit and where not in listed:
            problems.append(f"{where}: {count} > {limit}")
        elif where in listed and count > listed[where]:
            problems.append(f"{where}: grew to {count} (listed at {listed[where]})")
    for where in sorted(listed):
        if measured.get(where, 0) <= limit:
            problems.append(f"{where}: {measured.get(where)} now; delete it from the list")
    return problems


def test_no_module_is_long() -> None:
    measured = {
        short(path): len(path.read_text(encoding="utf-8").splitlines())
        for path in modules().values()
    }
    problems = check_listed(measured, LONG_MODULES, MAX_MODULE_LINES)
    assert not problems, "\n".join(problems)


def test_no_function_is_long() -> None:
    measured: dict[str, int] = {}
    for path in modules().values():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, lines in function_lengths(tree):
            key = f"{short(path)}::{name}"
            measured[key] = max(lines, measured.get(key, 0))
    problems = check_listed(measured, LONG_FUNCTIONS, MAX_FUNCTION_LINES)
    assert not problems, "\n".join(problems)


def test_no_import_circle() -> None:
    found = set(strongly_connected(import_graph()))
    new = [" <-> ".join(sorted(cycle)) for cycle in found - set(CYCLES)]
    gone = [" <-> ".join(sorted(cycle)) for cycle in set(CYCLES) - found]
    assert not new, "new import circles: " + "; ".join(new)
    assert not gone, "gone or changed, update CYCLES: " + "; ".join(gone)


def test_every_module_sits_in_a_layer() -> None:
    assert [name for name in modules() if layer_of(name) is None] == []


def test_layers_import_only_downward() -> None:
    upward = set()
    for importer, imported in import_graph().items():
        for module in imported:
            above, below = layer_of(importer), layer_of(module)
            if above is not None and below is not None and below < above:
                upward.add((importer, module))
    assert sorted(upward - UPWARD_IMPORTS) == [], "imports up a layer"
    assert sorted(UPWARD_IMPORTS - upward) == [], "no longer there: update UPWARD_IMPORTS"


def test_web_imports_only_public_names() -> None:
    known = modules()
    measured: dict[str, int] = {}
    for name, path in known.items():
        if not name.startswith("kvscope.web"):
            continue
        internal = [
            (module, imported)
            for module, imported in imports(name, path, known)
            if not module.startswith("kvscope.web")
            and module not in PUBLIC_MODULES
            and not (module == "kvscope" and imported in {"", "__version__", *kvscope.__all__})
        ]
        measured[short(path)] = len(internal)
    problems = check_listed(measured, WEB_INTERNAL_IMPORTS, 0)
    assert not problems, "\n".join(problems)


def test_the_rules_catch_what_they_are_for() -> None:
    """The measures themselves: a docstring is not counted, a nested function counts
    in its enclosing one, and a circle of three is found."""
    source = 'def f():\n    """Doc\n    string."""\n    def g():\n        pass\n    return g\n'
    assert dict(function_lengths(ast.parse(source))) == {"f": 3, "f.g": 1}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [frozenset("abc")]
    assert layer_of("kvscope") != layer_of("kvscope.actors.engine")
