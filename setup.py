"""Build hooks: the gRPC modules are generated from protos/inference.proto while the package is
built (wheel, sdist install or editable install), so an installed minivllm never writes into
its own directory; and a wheel (or a non-editable install) compiles the C++ CPU kernels into
engine/execution/kernels/_minivllm_cpu_kernels*.so, so its first start does not compile them.
Everything else about the package lives in pyproject.toml."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNEL_DIR = Path("engine") / "execution" / "kernels"
KERNEL_MODULE = "engine.execution.kernels._minivllm_cpu_kernels"


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


def kernel_sources_digest(kernel_dir: Path) -> str:
    """What the compiled module was built from; engine.execution.kernels.sources_digest computes the same
    (the loader takes the module only while its sources are these)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in kernel_dir.iterdir() if p.suffix in (".cpp", ".h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def portable_cflags() -> list[str]:
    """One binary for every CPU of its architecture, never -march=native: x86-64-v2 (SSE4.2 and POPCNT,
    every x86-64 CPU since about 2009) for the code outside the wide paths; those (AVX2, AVX-512,
    AVX512-BF16, AMX) carry their own __attribute__((target(...))) and run only where best_isa() finds
    the CPU has them. The JIT build of a source install keeps -march=native (built per CPU kind).
    -fno-wrapv -g0 undo what setuptools adds from Python's own build flags, so the code is the JIT's
    but for -march."""
    flags = ["-O3", "-fopenmp", "-fno-wrapv", "-g0"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-march=x86-64-v2")
    return flags


def kernel_build() -> dict:
    """setup() arguments that compile the kernels, from torch's C++ extension build (torch comes from
    [build-system] requires). MINIVLLM_SKIP_KERNEL_BUILD=1 leaves them out: the installed package then
    compiles them on first use, as an editable install does."""
    if os.environ.get("MINIVLLM_SKIP_KERNEL_BUILD") == "1":
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as exc:
        raise SystemExit(f"building minivllm's C++ kernels needs torch at build time ({exc}): build with build "
                         "isolation (torch comes from [build-system] requires), or install torch first, or set "
                         "MINIVLLM_SKIP_KERNEL_BUILD=1 to compile them on first use instead") from exc

    class BuildKernels(BuildExtension):
        def run(self) -> None:
            if self.editable_mode:
                # A checkout: its sources are the ones being edited, so they compile on first use
                # (engine.execution.kernels.load_cpu_kernels) and recompile when edited.
                self.extensions = []
            super().run()
            for ext in self.extensions:
                import torch

                # Beside the module: the torch it links against and the sources it was built from.
                info = {"torch": torch.__version__, "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
                        "sources": kernel_sources_digest(ROOT / KERNEL_DIR), "cflags": portable_cflags()}
                out = Path(self.get_ext_fullpath(ext.name))
                out.with_name(ext.name.rsplit(".", 1)[1] + ".json").write_text(json.dumps(info, indent=1) + "\n")

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / KERNEL_DIR).glob("*.cpp"))
    extension = CppExtension(KERNEL_MODULE, sources, extra_compile_args={"cxx": portable_cflags()},
                             extra_link_args=["-fopenmp"])
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildKernels}}


build = kernel_build()
setup(**{**build, "cmdclass": {"build_py": BuildPyWithGrpc, **build.get("cmdclass", {})}})
