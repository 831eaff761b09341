"""The llama.cpp peer of `bench.offline_throughput --compare`: its line protocol keeps the model
loaded between jobs, a failing peer's error reaches the caller, and `--compare-rounds` alternates
minivllm's runs with the peer's, printing each round's ratio. llama-cpp-python itself lives in
its own venv (never the project's), so a stand-in package plays its `Llama` here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.peers import LlamaCppPeer, _print_round_ratios

_FAKE_LLAMA_CPP = '''
import os, time

class Llama:
    def __init__(self, model_path, **options):
        with open(os.environ["FAKE_LLAMA_LOADS"], "a") as f:
            f.write(f"{model_path} {options['n_threads']} {options['n_ctx']}\\n")
        if "broken" in model_path:
            raise ValueError(f"cannot load {model_path}")

    def generate(self, tokens, **sampling):
        i = 0
        while True:
            time.sleep(0.002)
            yield i
            i += 1
'''


@pytest.fixture()
def fake_llama_cpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_FAKE_LLAMA_CPP)
    loads = tmp_path / "loads.txt"
    loads.touch()
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setenv("FAKE_LLAMA_LOADS", str(loads))
    return loads


def test_the_peer_loads_a_file_once_and_answers_each_job(fake_llama_cpp: Path) -> None:
    peer = LlamaCppPeer(sys.executable)
    try:
        first = peer.run(Path("/models/a.gguf"), [[1, 2, 3], [4, 5]], 6)
        second = peer.run(Path("/models/a.gguf"), [[1, 2, 3], [4, 5]], 6)
        other = peer.run(Path("/models/b.gguf"), [[7]], 3)
    finally:
        peer.close()
    assert first["output_tokens"] == second["output_tokens"] == 12 and other["output_tokens"] == 3
    # the fake takes at least 2 ms a token: the peer times the tokens, not the lines between them
    assert first["seconds"] >= 12 * 0.002 and 0 < first["decode_tok_s"] <= 1 / 0.002
    loads = fake_llama_cpp.read_text().splitlines()
    assert [line.split()[0] for line in loads] == ["/models/a.gguf", "/models/b.gguf"]  # a kept, b loaded
    assert loads[0].split()[2] == str(3 + 6 + 8)  # the context the longest prompt and its output need


def test_a_peer_that_fails_raises_with_its_error(fake_llama_cpp: Path) -> None:
    peer = LlamaCppPeer(sys.executable)
    try:
        with pytest.raises(RuntimeError, match="cannot load /models/broken.gguf"):
            peer.run(Path("/models/broken.gguf"), [[1]], 2)
    finally:
        peer.close()


def test_round_ratios_pair_each_round_with_the_peers_same_round(capsys: pytest.CaptureFixture) -> None:
    rounds = {"minivllm gguf": [{"decode_tok_s": 60.0}, {"decode_tok_s": 40.0}, {"decode_tok_s": 90.0}],
              "llama.cpp x.gguf": [{"decode_tok_s": 30.0}, {"decode_tok_s": 40.0}, {"decode_tok_s": 45.0}]}
    _print_round_ratios(rounds, "llama.cpp x.gguf", [50e9, 36e9, 61e9])
    out = capsys.readouterr().out
    assert "50.0, 36.0, 61.0 GB/s" in out
    # per round 2.00, 1.00, 2.00: the median of the ratios, not the ratio of the medians (60 / 40 = 1.5)
    assert "decode steps 2.00x llama.cpp (rounds 2.00, 1.00, 2.00)" in out


def test_compare_rounds_alternate_minivllm_and_the_peer(fake_llama_cpp: Path, tiny_model_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    from bench import offline_throughput
    from engine.execution.weights import checkpoint as model_loader

    monkeypatch.setattr(model_loader, "fetch_default_gguf", lambda: tmp_path / "default.gguf")
    out_json = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["offline_throughput", "--model", str(tiny_model_dir), "--single-stream",
                                      "--max-input", "8", "--output-len", "6", "--compare", "float32",
                                      "--compare-rounds", "3", "--llama-cpp-python", sys.executable,
                                      "--json", str(out_json)])
    offline_throughput.main()
    result = json.loads(out_json.read_text())
    mine, peer = result["systems"]["minivllm float32"], result["systems"]["llama.cpp default.gguf"]
    assert len(mine["rounds"]) == len(peer["rounds"]) == 3 and len(result["round_read_bandwidth_gb_s"]) == 3
    assert mine["decode_tok_s"] == sorted(r["decode_tok_s"] for r in mine["rounds"])[1]  # the median
    assert len(fake_llama_cpp.read_text().splitlines()) == 1  # the peer stayed loaded across rounds
    assert "medians of 3 alternating rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        monkeypatch.setattr(sys, "argv", ["offline_throughput", "--compare", "float32", "--compare-rounds", "0"])
        offline_throughput.main()
