"""The product's import graph (server/, engine/, scheduler/, drafters/, bench/ and specserve.py), read from the
source: no import circle, the package boundaries hold, and every function-local import of a product module says
why on its line."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "engine", "scheduler", "drafters", "bench")
PRODUCT = (*PACKAGES, "specserve")
FORBIDDEN = {  # importer package -> packages it must never import
    "scheduler": {"engine", "server", "bench"},
    "drafters": {"engine", "server", "scheduler", "bench"},
    "engine": {"server", "bench"},
    "server": {"bench"},
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every product module."""
    modules = {"specserve": REPO / "specserve.py"}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = module_files()


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The product modules an import statement loads: `from a.b import c` loads a.b.c when that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    base = node.module or ""
    if node.level:  # relative: resolve against the importer's package
        package = importer if MODULES[importer].name == "__init__.py" else importer.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}".strip(".")
    names = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
    return names or ([base] if base in MODULES else [])


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def walk_imports(tree: ast.AST, in_function: bool = False):
    """(import node, whether it runs inside a function) for every import that runs; TYPE_CHECKING blocks never do."""
    for child in ast.iter_child_nodes(tree):
        if is_type_checking_block(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        yield from walk_imports(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the product modules it imports at load time; and each uncommented function-local product import."""
    graph, uncommented = {}, []
    for name, path in MODULES.items():
        source = path.read_text()
        lines = source.splitlines()
        graph[name] = set()
        for node, in_function in walk_imports(ast.parse(source)):
            targets = imported_modules(node, name)
            if not in_function:
                graph[name].update(targets)
            elif targets and not any("#" in line for line in lines[node.lineno - 1:node.end_lineno]):
                uncommented.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return graph, uncommented


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, or a module importing itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_every_package_and_their_imports():
    graph, _ = import_graph()
    assert {name.partition(".")[0] for name in graph} == set(PRODUCT)
    assert "engine.model.packed_runner" in graph["engine.engine"] and "drafters.base" in graph["engine.engine"]


def test_the_product_imports_no_circle():
    graph, _ = import_graph()
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"a"}}) == [["a"]] and circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_packages_import_only_in_the_allowed_directions(importer):
    graph, _ = import_graph()
    crossing = sorted(
        f"{name} -> {target}" for name, targets in graph.items() if name.partition(".")[0] == importer
        for target in targets if target.partition(".")[0] in FORBIDDEN[importer]
    )
    assert crossing == []


OFFLINE_TOOLS = ("engine.calibration", "engine.training")  # `specserve calibrate` and `specserve train-draft`


def test_the_engine_never_imports_its_offline_tools():
    graph, _ = import_graph()
    crossing = sorted(
        f"{name} -> {target}" for name, targets in graph.items()
        if name.startswith("engine.") and not name.startswith(OFFLINE_TOOLS)
        for target in targets if target.startswith(OFFLINE_TOOLS)
    )
    assert crossing == []


def test_every_function_local_product_import_says_why():
    _, uncommented = import_graph()
    assert uncommented == []
