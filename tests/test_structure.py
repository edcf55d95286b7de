"""The package's shape, read from its source: no import cycles between its modules (counting imports inside
functions, which would otherwise hide an upward dependency), app modules imported inside functions only
where that defers a heavy dependency on purpose, and no module over 400 lines."""

import ast
import os

import pytest

APP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "app")
MAX_LINES = 400
# (importer, imported): why the import waits for the function that needs it
DEFERRED = {
    # the command table loads only the modules of the command that runs (training, evaluation, bench ...)
    **{
        ("app.cli", m): "command"
        for m in (
            "app.data.corpus",
            "app.report.evaluate",
            "app.train.state",
            "app.train.trainer",
            "app.train.stop_rules",
            "app.decode.translate",
            "app.decode.score",
            "app.decode.export",
            "app.checkpoint",
            "app.bench.run",
            "app.report.compare",
            "app.serve.server",
            "app.serve.bench",
            "app.distributed",
            "app.train.init_from",
        )
    },
    # torch: a command line with a refused setting is told before torch is imported (two seconds on a CPU)
    ("app.folder_lock", "app.distributed"): "torch",
}


def modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(APP):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(APP)).replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def imports(known: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(importer, imported, inside a function) for every import of one app module by another."""
    edges = []
    for module, path in known.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
                targets = names or ([node.module] if node.module in known else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in known]
            else:
                continue
            edges += [(module, target, id(node) not in top) for target in targets if target != module]
    return edges


def cycles(edges: list[tuple[str, str, bool]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles_even_through_imports_inside_functions():
    assert cycles(imports(modules())) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles([("a", "b", False), ("b", "c", True), ("c", "a", False), ("c", "d", False)]) == [["a", "b", "c"]]


def test_app_modules_are_imported_inside_functions_only_to_defer_on_purpose():
    inside = sorted({(a, b) for a, b, deferred in imports(modules()) if deferred} - set(DEFERRED))
    assert inside == []


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_over_400_lines(module):
    with open(modules()[module], encoding="utf-8") as f:
        assert sum(1 for _ in f) <= MAX_LINES


# The wings, lowest first: a module imports from its own wing or a lower one, never upward. The shared modules
# at the top of app/ (settings, errors, files, checkpoints, processes) serve every wing; the command line
# dispatches to all of them.
WINGS = [
    "shared",
    *("app.data", "app.models", "app.decode", "app.report", "app.train", "app.bench", "app.serve"),
    "app.cli",
]
MAX_TOP_LEVEL = 12


def wing(module: str) -> str:
    if module in ("app.cli", "app.__main__"):
        return "app.cli"
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module in WINGS else "shared"


def upward(edges: list[tuple[str, str, bool]]) -> list[tuple[str, str]]:
    return sorted({(a, b) for a, b, _ in edges if WINGS.index(wing(b)) > WINGS.index(wing(a))})


def test_no_module_imports_from_a_wing_above_its_own():
    assert upward(imports(modules())) == []


def test_the_wing_check_finds_an_upward_import():
    edges = [("app.decode.search", "app.train.update", False), ("app.train.update", "app.decode.search", False)]
    assert upward(edges) == [("app.decode.search", "app.train.update")]
    assert upward([("app.config", "app.data.corpus", True)]) == [("app.config", "app.data.corpus")]


def test_the_top_of_app_keeps_only_what_every_wing_uses():
    top = [m for m in modules() if m.count(".") == 1 and wing(m) in ("shared", "app.cli")]
    assert len(top) <= MAX_TOP_LEVEL, top
    assert {wing(m) for m in modules()} <= set(WINGS)  # every other module sits in a wing
