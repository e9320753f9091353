"""The import graph of `mars2`: no cycles between modules, and imports only run downwards.

Read from the source with `ast` (every import statement, including ones inside functions;
``if TYPE_CHECKING:`` blocks are left out because they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Lower layers never import higher ones; packages on the same layer never import each other.
LAYERS: dict[str, int] = {
    "utils": 0,
    "data": 0,
    "sandbox": 1,
    "models": 1,
    "generation": 2,
    "search": 3,
    "rewards": 4,
    "builders": 5,
    "training": 6,
    "eval": 7,
    "cli": 8,
    "train": 9,  # the checkout script `python src/mars2/train.py`
    "study": 9,  # mars2-study: the top; it runs training and eval, nothing imports it
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    # src/mars2/configs is a link to the repository's configs/ (YAML), not code.
    return {
        _module_name(p): p
        for p in sorted((SRC / "mars2").rglob("*.py"))
        if "configs" not in p.relative_to(SRC).parts
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, known: set[str]) -> set[str]:
    """The mars2 modules a file imports (``from a import b`` counts a.b when that is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mars2")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "mars2"
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in known else str(node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imported(ast.parse(path.read_text(encoding="utf-8")), known) & known
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "mars2.training.run" in graph and "mars2.builders" in graph["mars2.training.run"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_every_package_has_a_layer() -> None:
    packages = {_package(m) for m in _graph()} - {None, "configs"}
    assert packages <= set(LAYERS), f"give these packages a layer: {packages - set(LAYERS)}"


def test_imports_only_run_downwards() -> None:
    upward = []
    for module, targets in _graph().items():
        source = _package(module)
        if source is None:
            continue
        for target in targets:
            dest = _package(target)
            if dest is None or dest == source:
                continue
            if LAYERS[dest] >= LAYERS[source]:
                upward.append(f"{module} -> {target}")
    assert upward == []


def _third_party(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", ["search", "rewards"])
def test_pure_cores_import_no_lightning_or_vllm(package: str) -> None:
    heavy = {
        name: _third_party(path) & {"lightning", "vllm"}
        for name, path in _modules().items()
        if _package(name) == package
    }
    assert heavy and not any(heavy.values()), heavy


def test_sandbox_worker_starts_without_the_training_stack() -> None:
    """Every job's process is forked from an executor: whatever it has imported is copied into
    each fork, so it must hold neither the training stack nor the judge (`ast`, the comparisons);
    the worker beside it starts in a clean interpreter too."""
    import subprocess
    import sys

    heavy = ("hydra", "omegaconf", "torch", "lightning", "transformers", "numpy")
    judging = ("ast", "mars2.sandbox.verdict.judge", "mars2.sandbox.pool.worker")
    probe = (
        "import sys, mars2.sandbox.runner.executor; "
        f"print(','.join(sorted(m for m in {heavy + judging!r} if m in sys.modules)))"
    )
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"sandbox executor imports {out.stdout.strip()}"
    probe = (
        "import sys, mars2.sandbox.pool.worker, mars2.sandbox.verdict.judge; "
        f"print(','.join(sorted(m for m in {heavy!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"sandbox worker imports {out.stdout.strip()}"
