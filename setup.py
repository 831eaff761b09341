"""Build hook: the gRPC modules are generated from protos/inference.proto while the package is
built (wheel, sdist install or editable install), so an installed minivllm never writes into
its own directory. Everything else about the package lives in pyproject.toml."""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_grpc_code(out_dir: Path) -> None:
    """protos/inference.proto -> out_dir/service/pb/inference_pb2{,_grpc}.py(i)."""
    from grpc_tools import protoc

    proto = ROOT / "protos" / "inference.proto"
    (out_dir / "service" / "pb").mkdir(parents=True, exist_ok=True)
    args = ["grpc_tools.protoc", f"-Iservice/pb={proto.parent}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(proto)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithGrpc(build_py):
    def run(self) -> None:
        super().run()
        # An editable install imports from the source tree, so the code goes there (git-ignored).
        generate_grpc_code(ROOT if self.editable_mode else Path(self.build_lib))


setup(cmdclass={"build_py": BuildPyWithGrpc})
