"""The package's imports point down its layers, and no two packages import each other.

    foundations (kernels, config, the environment, errors, the step's messages, ...)
      -> the state plane and attention (kvcache, attention)
      -> the execution config (which paths run here)
      -> the model
      -> the platforms (each device's speed) and the loader (a model on its platform)
      -> what runs on it (request, speculative, output_processor, structured)
      -> scheduler, worker
      -> engine (and its options and plug-ins)
      -> llm, build_engine, distributed, disagg, server, router
      -> cli, course, viz, bench

A module may import from its own layer or any layer below it; between packages of one
layer the imports must not form a cycle. Imports only for type checking
(`if TYPE_CHECKING:`) are left out: they do not run. The package's `__init__` (its public
names) is the one place that may reach any layer.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import minserve

PACKAGE = Path(minserve.__file__).parent

LAYERS: list[set[str]] = [
    {"kernels", "config", "device", "environment", "openmp_env", "errors", "messages",
     "model_config", "outputs", "sampling_params", "step_timings", "stop_strings"},
    {"kvcache", "attention"},
    {"execution"},
    {"model"},
    {"platforms", "loader"},
    {"request", "speculative", "output_processor", "structured"},
    {"scheduler", "worker"},
    {"engine", "engine_args", "engine_client", "engine_metrics", "plugins", "reference"},
    {"llm", "engine_builder", "distributed", "disagg", "server", "router"},
    {"cli", "course", "viz", "bench"},
]  # fmt: skip
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """The layer unit of a dotted module name: its package, or a top-level module's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "minserve"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> list[str]:
    """minserve modules a file imports when it runs (anywhere in it, type-only blocks aside)."""
    found: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            names = []
        found += [name for name in names if name.split(".")[0] == "minserve"]
        stack.extend(ast.iter_child_nodes(node))
    return found


def package_imports() -> dict[str, set[str]]:
    """unit -> the units it imports, from every source file but the package's `__init__`."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts)
        if module == "minserve.__init__":
            continue
        source = unit_of(module)
        for imported in runtime_imports(ast.parse(path.read_text(), str(path))):
            target = unit_of(imported)
            if target != source and target != "minserve":
                edges[source].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of units, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_every_package_and_top_level_module_has_a_layer() -> None:
    units = {unit_of(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts))
             for p in PACKAGE.rglob("*.py")} - {"__init__"}  # fmt: skip
    assert not units - RANK.keys(), f"give these a layer in LAYERS: {sorted(units - RANK.keys())}"


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        f"{source} (layer {RANK[source]}) imports {target} (layer {RANK[target]})"
        for source, targets in package_imports().items()
        for target in targets
        if RANK[target] > RANK[source]
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other() -> None:
    cycle = find_cycle(package_imports())
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_upward_imports_and_cycles() -> None:
    """The rules themselves: a type-only import is ignored, a runtime one in a function counts."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from minserve.engine import LLMEngine\n"
        "def f():\n    from minserve.server.app import build_app\n"
    )
    assert runtime_imports(tree) == ["minserve.server.app"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


# the words of the CPU's speed machinery, which the model file never names
PLATFORM_WORDS = ("cpu_ops", "c_kernels", "fused_decode", "greedy_screen", "hasattr", "is_cuda")


def test_the_model_file_names_no_platform_machinery() -> None:
    """A layer calls its ops; which ops, and which kernels, the platform decided at load."""
    source = (PACKAGE / "model" / "llama.py").read_text()
    assert [word for word in PLATFORM_WORDS if word in source] == []
