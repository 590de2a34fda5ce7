"""Who may import whom (docs/design/architecture.md, Who imports whom), read from the source: each package's
imports against its rules, and no cycle among the modules (an import inside a function counts; one
under `if TYPE_CHECKING`, for annotations only, does not)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tandem", "tandem_kernels", "target_service", "draft_service", "training", "bench")

# A module (or package) and the modules it may not import, however deep.
FORBIDDEN = {
    "tandem_kernels": ("tandem", "target_service", "draft_service", "training", "bench", "tests"),
    "tandem": ("tandem_kernels", "target_service", "draft_service", "training", "bench", "tests"),
    "target_service": ("draft_service", "training", "bench", "tests"),
    "draft_service": ("target_service", "training", "bench", "tests"),
    "training": ("target_service", "draft_service", "bench", "tests"),
    "bench": ("target_service", "draft_service", "tests"),
    # Inside the target: the engine knows no front door; speculation and the model runner meet
    # only in step_items; speculation never drives the engine.
    "target_service.engine": ("target_service.front_doors",),
    "target_service.scheduler": ("target_service.front_doors", "target_service.speculation"),
    "target_service.sequence": ("target_service.front_doors", "target_service.speculation"),
    "target_service.step_items": ("target_service.front_doors", "target_service.speculation",
                                  "target_service.model_runner"),
    "target_service.model_runner": ("target_service.front_doors", "target_service.speculation"),
    "target_service.speculation": ("target_service.front_doors", "target_service.engine",
                                   "target_service.model_runner", "target_service.scheduler",
                                   "target_service.server"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if "__pycache__" not in path.parts}


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports, at its top or inside a function; not those under
    `if TYPE_CHECKING`, which only annotations read."""
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {name for name in found if name.split(".")[0] in (*PACKAGES, "tests")}


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        return [found for child in node.orelse for found in _import_nodes(child)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [node]
    return [found for child in ast.iter_child_nodes(node) for found in _import_nodes(child)]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_module_imports_what_its_layer_may_not():
    broken = [f"{module} imports {name}"
              for module, path in _modules().items()
              for rule, forbidden in FORBIDDEN.items() if _within(module, rule)
              for name in sorted(_imports(path)) if any(_within(name, f) for f in forbidden)]
    assert not broken, "\n".join(broken)


def test_no_cycle_among_the_modules_imports():
    modules = _modules()
    graph = {module: {_owner(name, modules) for name in _imports(path)} - {None, module}
             for module, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(", ".join(cycle) + " import one another" for cycle in cycles)


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported name lives in: `a.b.c` is module a.b.c, or name c of module a.b."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles_and_only_those(graph, expected):
    assert _cycles(graph) == expected
