"""The llama.cpp peer of `bench.offline_throughput --compare`: its line protocol keeps the model
loaded between jobs, a failing peer's error reaches the caller, and `--compare-rounds` alternates
minivllm's runs with the peer's, printing each round's ratio. llama-cpp-python itself lives in
its own venv (never the project's), so a stand-in package plays its `Llama` here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.peers import LlamaCppPeer, _print_round_ratios, gguf_vocab_size, gguf_weight_bytes_per_token
from tests.gguf_samples import T, write_gguf

_FAKE_LLAMA_CPP = '''
import os, time

class Llama:
    def __init__(self, model_path, **options):
        with open(os.environ["FAKE_LLAMA_LOADS"], "a") as f:
            f.write(f"{model_path} {options['n_threads']} {options['n_ctx']}\\n")
        if "broken" in model_path:
            raise ValueError(f"cannot load {model_path}")

    def generate(self, tokens, **sampling):
        with open(os.environ["FAKE_LLAMA_PROMPTS"], "a") as f:
            f.write(" ".join(map(str, tokens)) + "\\n")
        time.sleep(0.01)  # a prefill before the first token
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
    (tmp_path / "prompts.txt").touch()
    monkeypatch.setenv("FAKE_LLAMA_PROMPTS", str(tmp_path / "prompts.txt"))
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

    gguf = _tiny_gguf(tmp_path / "default.gguf", True)  # the peer's figures count its file's bytes
    monkeypatch.setattr(model_loader, "fetch_default_gguf", lambda: gguf)
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


def test_the_peer_times_the_first_token_and_gives_no_decode_rate_for_one_token(fake_llama_cpp: Path) -> None:
    peer = LlamaCppPeer(sys.executable)
    try:
        one = peer.run(Path("/models/a.gguf"), [[1, 2, 3]], 1)
        many = peer.run(Path("/models/a.gguf"), [[1, 2, 3]], 20)
    finally:
        peer.close()
    assert one["decode_tok_s"] is None and one["output_tokens"] == 1
    # the fake waits 10 ms (its prefill) and 2 ms before each token: the first token takes both
    assert 0.012 <= one["ttft_s"] <= one["seconds"] and 0.012 <= many["ttft_s"] < many["seconds"] - 19 * 0.002


def _tiny_gguf(path: Path, tied: bool) -> Path:
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (rng.standard_normal((300, 64), dtype=np.float32), T.F32),
               "output_norm.weight": (np.ones(64, np.float32), T.F32),
               "blk.0.attn_q.weight": (rng.integers(0, 255, (64, 2 * 34), dtype=np.uint8), T.Q8_0)}
    if not tied:
        tensors["output.weight"] = (rng.integers(0, 255, (300, 2 * 34), dtype=np.uint8), T.Q8_0)
    return write_gguf(path, "llama", {"block_count": 1}, tensors)


def test_gguf_read_bytes_count_the_lm_head_once_and_not_a_separate_embedding(tmp_path: Path) -> None:
    tied, untied = _tiny_gguf(tmp_path / "tied.gguf", True), _tiny_gguf(tmp_path / "untied.gguf", False)
    norm, attn_q = 64 * 4, 64 * 2 * 34  # float32 values; Q8_0 rows of 2 blocks of 34 bytes
    assert gguf_weight_bytes_per_token(tied) == norm + attn_q + 300 * 64 * 4  # the embedding is the LM head
    assert gguf_weight_bytes_per_token(untied) == norm + attn_q + 300 * 2 * 34  # output.weight; one embedding row
    assert gguf_vocab_size(tied) == 300


def _prompts_sent(fake_llama_cpp: Path) -> list[list[int]]:
    """The prompts the fake peer was given after its warm-up (the first, on loading the file)."""
    lines = fake_llama_cpp.with_name("prompts.txt").read_text().splitlines()
    return [[int(t) for t in line.split()] for line in lines[1:]]


def test_prefill_len_times_a_new_prompt_each_round_in_both_systems(fake_llama_cpp: Path, tiny_model_dir: Path,
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from bench import offline_throughput
    from engine.execution.weights import checkpoint as model_loader

    gguf = _tiny_gguf(tmp_path / "peer.gguf", True)
    monkeypatch.setattr(model_loader, "fetch_default_gguf", lambda: gguf)
    out_json = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["offline_throughput", "--model", str(tiny_model_dir), "--compare", "float32",
                                      "--prefill-len", "40", "--compare-rounds", "3", "--llama-cpp-python",
                                      sys.executable, "--json", str(out_json)])
    offline_throughput.main()
    result = json.loads(out_json.read_text())
    mine, peer = result["systems"]["minivllm float32"], result["systems"]["llama.cpp peer.gguf"]
    assert len(mine["rounds"]) == len(peer["rounds"]) == 3
    assert all(r["ttft_s"] > 0 for r in mine["rounds"]) and all(r["ttft_s"] >= 0.012 for r in peer["rounds"])
    assert peer["ttft_s"] == sorted(r["ttft_s"] for r in peer["rounds"])[1]
    timed = _prompts_sent(fake_llama_cpp)
    assert [len(p) for p in timed] == [40] * 4  # the untimed round and 3 timed ones, each one prompt of 40
    assert len({tuple(p) for p in timed}) == 4  # a new prompt every round: no prefix cache holds it
    out = capsys.readouterr().out
    assert "time to first token" in out and "a new prompt each round" in out
    monkeypatch.setattr(sys, "argv", ["offline_throughput", "--compare", "float32", "--prefill-len", "0"])
    with pytest.raises(SystemExit):
        offline_throughput.main()


def test_compare_none_runs_llama_cpp_alone_on_the_files_vocabulary(fake_llama_cpp: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import offline_throughput

    gguf = _tiny_gguf(tmp_path / "alone.gguf", False)
    out_json = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["offline_throughput", "--model", str(gguf), "--compare", "none",
                                      "--num-prompts", "3", "--min-input", "5", "--max-input", "9", "--output-len", "4",
                                      "--llama-cpp-python", sys.executable, "--json", str(out_json)])
    offline_throughput.main()
    result = json.loads(out_json.read_text())
    assert list(result["systems"]) == ["llama.cpp alone.gguf"]
    assert result["systems"]["llama.cpp alone.gguf"]["weight_bytes_per_token"] == gguf_weight_bytes_per_token(gguf)
    prompts = _prompts_sent(fake_llama_cpp)
    assert len(prompts) == 3 and all(5 <= len(p) <= 9 and max(p) < 300 for p in prompts)
