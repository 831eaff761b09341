"""The layers stay apart: engine/ knows nothing above it; the service and the CLI reach the
engine only through its public names; one module moves a sequence's progress."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

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
