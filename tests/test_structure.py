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
            "app.evaluation.eval_run",
            "app.evaluation.corpus_links",
            "app.evaluation.head_importance",
            "app.report.head_report",
            "app.report.evaluation_files",
            "app.train.state",
            "app.train.trainer",
            "app.train.stop_rules",
            "app.decode.translate",
            "app.decode.interactive",
            "app.decode.likelihood",
            "app.decode.export",
            "app.run.checkpoint",
            "app.bench.suite",
            "app.report.compare",
            "app.serve.server",
            "app.bench.serving",
            "app.run.distributed",
            "app.train.init_from",
        )
    },
    # torch: a command line with a refused setting is told before torch is imported (two seconds on a CPU)
    ("app.run.folder_lock", "app.run.distributed"): "torch",
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


# The wings, lowest first: a module imports from its own wing or a lower one, never upward. The run's plumbing
# (errors, files, devices, checkpoints, locks, processes) and the configuration serve every wing; the command
# line dispatches to all of them.
WINGS = [
    *("app.run", "app.config", "app.data", "app.models", "app.decode", "app.evaluation", "app.report"),
    *("app.train", "app.serve", "app.bench", "app.cli"),
]


def wing(module: str) -> str:
    return "app.cli" if module in ("app", "app.cli", "app.__main__") else ".".join(module.split(".")[:2])


def upward(edges: list[tuple[str, str, bool]]) -> list[tuple[str, str]]:
    return sorted({(a, b) for a, b, _ in edges if WINGS.index(wing(b)) > WINGS.index(wing(a))})


def test_no_module_imports_from_a_wing_above_its_own():
    assert upward(imports(modules())) == []


def test_the_wing_check_finds_an_upward_import():
    edges = [("app.decode.search", "app.train.update", False), ("app.train.update", "app.decode.search", False)]
    assert upward(edges) == [("app.decode.search", "app.train.update")]
    assert upward([("app.config.schema", "app.data.corpus", True)]) == [("app.config.schema", "app.data.corpus")]


def test_the_top_of_app_holds_only_the_entry_points():
    top = sorted(m for m in modules() if m.count(".") <= 1 and not modules()[m].endswith("__init__.py"))
    assert top == ["app.__main__", "app.cli"]
    assert {wing(m) for m in modules()} <= set(WINGS)  # every other module sits in a wing


def test_the_report_writes_and_runs_no_model():
    """app/report/ holds writers (files, heatmaps, explorer, TensorBoard, tables): what it writes was computed by
    app/evaluation/, which alone runs the decoder's passes over a split."""
    assert (
        sorted(
            (a, b)
            for a, b, _ in imports(modules())
            if wing(a) == "app.report" and wing(b) in ("app.decode", "app.models", "app.train")
        )
        == []
    )


def test_no_two_modules_share_a_file_name():
    names: dict[str, list[str]] = {}
    for module, path in modules().items():
        if not path.endswith("__init__.py"):
            names.setdefault(os.path.basename(path), []).append(module)
    assert {name: found for name, found in names.items() if len(found) > 1} == {}


def test_no_two_classes_share_a_name():
    defined: dict[str, list[str]] = {}
    for module, path in modules().items():
        with open(path, encoding="utf-8") as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, ast.ClassDef):
                    defined.setdefault(node.name, []).append(module)
    assert {name: found for name, found in defined.items() if len(found) > 1} == {}


def test_the_readme_is_short_and_its_layout_names_every_package():
    with open(os.path.join(os.path.dirname(APP), "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert readme.count("\n") <= 200
    layout = readme.split("## Layout", 1)[1]
    packages = sorted(f"app/{d}/" for d in os.listdir(APP) if os.path.isfile(os.path.join(APP, d, "__init__.py")))
    assert [p for p in packages if p not in layout] == []
    assert "app/__main__.py, cli.py" in layout
