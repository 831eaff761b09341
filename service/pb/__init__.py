"""Generated gRPC modules. They are built from protos/inference.proto on first import when
missing (a fresh checkout), so `import service.pb.inference_pb2` always works."""
from __future__ import annotations

from pathlib import Path


def generate() -> None:
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    proto = root / "protos" / "inference.proto"
    if not proto.exists():
        raise RuntimeError(f"{proto} is missing: install minivllm from a source checkout (pip install -e .)")
    args = ["grpc_tools.protoc", f"-Iservice/pb={root / 'protos'}", f"--python_out={root}", f"--pyi_out={root}",
            f"--grpc_python_out={root}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")


def _is_stale() -> bool:
    here = Path(__file__).resolve().parent
    proto = here.parents[1] / "protos" / "inference.proto"
    generated = here / "inference_pb2.py"
    return not generated.exists() or (proto.exists() and proto.stat().st_mtime > generated.stat().st_mtime)


if _is_stale():
    generate()
