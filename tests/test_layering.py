"""engine/ must not know about the transport or observability layers."""
from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = ("service", "grpc", "grpc_health", "grpc_reflection", "prometheus_client", "opentelemetry", "bench")


def test_engine_imports_nothing_from_service_grpc_prometheus_or_otel() -> None:
    engine_dir = Path(__file__).resolve().parents[1] / "engine"
    offenders = []
    for path in engine_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
