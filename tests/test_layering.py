"""The layers stay apart: engine/ knows nothing above it; the service and the CLI reach the
engine only through its public names; one module moves a sequence's progress; no import cycle
anywhere in engine/, service/ or minivllm/ (function-level imports included); the weight
formats know no model family."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[1]
ABOVE_ENGINE = ("service", "grpc", "grpc_health", "grpc_reflection", "prometheus_client", "opentelemetry", "bench",
                "tests", "minivllm")


def _imports(package: str) -> Iterator[tuple[str, ast.AST]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "pb" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield str(path.relative_to(ROOT)), node


def test_engine_imports_nothing_from_the_layers_above() -> None:
    offenders = []
    for where, node in _imports("engine"):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        offenders += [f"{where}: {n}" for n in names if n.split(".")[0] in ABOVE_ENGINE]
    assert not offenders, offenders


def test_service_and_cli_use_only_the_engines_public_names() -> None:
    """(bench/ may profile engine internals, e.g. time the attention of one chunk.)"""
    public = set(engine.__all__)
    offenders = []
    for package in ("service", "minivllm"):
        for where, node in _imports(package):
            if isinstance(node, ast.Import):
                offenders += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("engine.")]
            elif node.module and node.module.startswith("engine"):
                if node.module != "engine":
                    offenders.append(f"{where}: from {node.module}")
                offenders += [f"{where}: {a.name}" for a in node.names if a.name not in public]
    assert not offenders, offenders


def test_service_and_bench_do_not_import_the_cli() -> None:
    offenders = []
    for package in ("service", "bench"):
        for where, node in _imports(package):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            offenders += [f"{where}: {n}" for n in names if n.split(".")[0] == "minivllm"]
    assert not offenders, offenders


def test_only_the_scheduler_moves_sequence_progress() -> None:
    """status and num_computed_tokens are written in engine/core/scheduler.py and nowhere else."""
    writers = set()
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in ("num_computed_tokens", "status"):
                    writers.add(path.name)
    assert writers == {"scheduler.py"}, writers


# The engine's insides: the service talks to AsyncEngine's methods and the engine's facade only.
_ENGINE_INSIDES = {"runner", "model_runner", "scheduler", "block_manager", "input_processor", "output_processor",
                   "sampler", "backend"}


def _attribute_chains(package: str) -> Iterator[tuple[str, ast.Attribute]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        if "pb" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                yield str(path.relative_to(ROOT)), node


def test_service_does_not_reach_through_the_engine() -> None:
    """No service module touches the engine's parts (engine.engine.*, runner, scheduler, ...);
    only service/async_engine.py holds the LLMEngine, as a private attribute."""
    offenders = []
    for where, node in _attribute_chains("service"):
        if node.attr in _ENGINE_INSIDES:
            offenders.append(f"{where}:{node.lineno}: .{node.attr}")
        if node.attr == "_engine" and where != "service/async_engine.py":
            offenders.append(f"{where}:{node.lineno}: ._engine")
        if node.attr == "engine" and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
            offenders.append(f"{where}:{node.lineno}: .engine.engine")
    assert not offenders, offenders


def _environment_keys(path: Path) -> Iterator[tuple[int, str | None]]:
    """(line, key) of each os.environ.get / os.getenv / os.environ[...] read; None: not a literal."""
    for node in ast.walk(ast.parse(path.read_text())):
        key_node = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                node.func.attr == "getenv" or (node.func.attr == "get" and isinstance(node.func.value, ast.Attribute)
                                               and node.func.value.attr == "environ")):
            key_node = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            key_node = node.slice
        else:
            continue
        is_literal = isinstance(key_node, ast.Constant) and isinstance(key_node.value, str)
        yield node.lineno, key_node.value if is_literal else None


def test_only_the_config_reads_minivllm_variables_in_the_engine() -> None:
    """MINIVLLM_* switches are aliases of EngineConfig fields: read in engine/config.py, nowhere
    else under engine/ (the runner, kernels and loader take what they need from the config)."""
    offenders = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where == "engine/config.py":
            continue
        for line, key in _environment_keys(path):
            if key is None or key.startswith("MINIVLLM"):
                offenders.append(f"{where}:{line}: {key or 'a computed key'}")
    assert not offenders, offenders


# engine/'s layers, bottom up: plain values any layer may use; request processing; scheduling;
# execution, which sees the scheduler only through the step's two values.
_BASE = ("engine.config", "engine.errors", "engine.outputs")
_LAYER_IMPORTS = {
    "processing": _BASE + ("engine.processing",),
    "core": _BASE + ("engine.processing", "engine.core"),
    "execution": _BASE + ("engine.processing", "engine.execution", "engine.core.scheduler_output",
                          "engine.core.runner_output"),
}


def test_engine_layers_import_one_way_down() -> None:
    offenders = []
    for layer, allowed in _LAYER_IMPORTS.items():
        for where, node in _imports(f"engine/{layer}"):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name == "engine" or (name.startswith("engine.") and not name.startswith(allowed)):
                    offenders.append(f"{where}: {name}")
    assert not offenders, offenders


# ---- import cycles over the whole tree ----------------------------------------------------------
# Every import counts, those inside functions too: a lazy import hides a cycle from Python, not
# from whoever has to move one of its modules.
_CYCLE_PACKAGES = ("engine", "service", "minivllm")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of engine/, service/ and minivllm/ it imports (anywhere in its body)."""
    paths = {_module_name(path): path for package in _CYCLE_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             if "pb" not in path.relative_to(ROOT).parts}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package up level - 1
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports pkg.mod where that is a module, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            graph[name].update(t for t in targets if t in paths and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle
    through its first module: the modules to untangle, in import order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, set(component)) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest import path from the component's first module back to it (breadth first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    return sorted(component)


@pytest.mark.parametrize("package", _CYCLE_PACKAGES)
def test_no_import_cycles(package: str) -> None:
    cycles = [cycle for cycle in _cycles(_import_graph()) if cycle[0].split(".")[0] == package]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_weight_formats_know_no_model_family() -> None:
    """engine/execution/weights/ reads checkpoints and GGUF files for any family: it imports
    nothing from engine/execution/models/ (which the families' loading code may import)."""
    offenders = [f"{module} -> {target}" for module, targets in _import_graph().items()
                 if module.startswith("engine.execution.weights") for target in sorted(targets)
                 if target.startswith("engine.execution.models")]
    assert not offenders, offenders


def test_the_cycle_finder_reports_each_cycle_as_its_modules_in_import_order() -> None:
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
