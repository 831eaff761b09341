"""Shared fixtures: a tiny random model for unit tests, the real default model for a focused set."""
from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import LLM
from engine.execution.kernels import load_cpu_kernels
from tests.tiny_model import build_tiny_model

logging.getLogger("engine").setLevel(logging.WARNING)


@pytest.fixture(scope="session", autouse=True)
def built_kernels() -> None:
    """Build the C++ kernels once, up front: a test whose first engine loads in a server thread
    would otherwise wait out that build (up to a few minutes) against its startup timeout."""
    load_cpu_kernels()


@pytest.fixture(scope="session")
def kernels(built_kernels: None):
    """The C++ kernels module: a test of them fails, not skips, where they do not build."""
    k = load_cpu_kernels()
    if k is None:
        pytest.fail("the C++ kernels must build here (make test installs a compiler)")
    return k


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def real_llm() -> LLM:
    return LLM(None, num_kv_blocks=512)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate, all signed by the CA."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is required (make test installs it)")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=minivllm test CA", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "localhost"), ("client", "test client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={cn}", cwd=d)
        extra = ["-extfile", "san.cnf"] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)
    return d


@pytest.fixture(scope="session")
def tiny_tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with <tool_call>, </tool_call>, <think>, </think> as tokens and a template
    that knows tools."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tools") / "model", with_tools=True)


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3ForSequenceClassification (one label): the score tests' cross-encoder."""
    from tests.tiny_model import build_tiny_sequence_classifier

    return build_tiny_sequence_classifier(tmp_path_factory.mktemp("reranker") / "qwen3-cls")


@pytest.fixture(scope="session")
def reranker_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 causal LM served in Qwen3-Reranker's yes/no format."""
    from tests.tiny_model import build_tiny_reranker_lm

    return build_tiny_reranker_lm(tmp_path_factory.mktemp("reranker") / "qwen3-lm")
