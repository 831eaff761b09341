"""A client in another language: Node.js (@grpc/grpc-js + proto-loader) streams Generate (and a
chat with a required tool: its call parses)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from tests.server_harness import ServerThread

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "tls-and-token"])
def test_node_client_streams_generate(tiny_model_dir: Path, tiny_llm: LLM, secure: bool,
                                      request: pytest.FixtureRequest) -> None:
    in_ci = os.environ.get("CI") == "true"
    if shutil.which("node") is None or not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        if in_ci:
            pytest.fail("node and tests/node/node_modules are required in CI (make test installs them)")
        pytest.skip("node or tests/node/node_modules missing: run `make test`")
    prompt = "Hello world! Once upon a time"
    # 200 tokens: a stream's pending deltas go out as one message, and the tiny model makes 12
    # tokens faster than the event loop sends the first (one message, where several are expected).
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    options, extra_env = {}, {}
    if secure:
        pki = request.getfixturevalue("pki")
        options = {"tls_cert_file": str(pki / "server.pem"), "tls_key_file": str(pki / "server.key"),
                   "auth_tokens": ["node-secret"]}
        extra_env = {"MINIVLLM_TLS_CA": str(pki / "ca.pem"), "MINIVLLM_TOKEN": "node-secret"}
    srv = ServerThread(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256), **options)
    try:
        env = dict(os.environ, MINIVLLM_TARGET=srv.target, **extra_env,
                   MINIVLLM_EXPECTED=json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids}))
        proc = subprocess.run(["node", "--test", "generate.test.mjs"], cwd=NODE_DIR, env=env, capture_output=True,
                              text=True, timeout=120)
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"# pass {6 if secure else 5}" in proc.stdout and "# fail 0" in proc.stdout
