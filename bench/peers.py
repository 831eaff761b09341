"""The peers `bench.offline_throughput --compare` runs beside minivllm on the same prompts:
llama.cpp (llama-cpp-python) and vLLM's CPU build, each in a venv of its own."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.batch1 import bandwidth_buffer, decode_tok_s, read_bandwidths, weight_bytes_per_token
from bench.runs import WEIGHT_MODES, make_prompts, resolve_dir, run_minivllm
from engine import LLM


class LlamaCppPeer:
    """llama.cpp kept loaded in its own process (bench/llama_cpp_peer.py's line protocol), so that
    rounds can alternate with minivllm's within seconds: a shared VM's read bandwidth swings
    more than the two engines differ, and only runs that close together compare them."""

    def __init__(self, python: str) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([python, str(Path(__file__).with_name("llama_cpp_peer.py"))],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    def run(self, gguf: Path, prompts: list[list[int]], output_len: int, batched: bool = False) -> dict[str, float]:
        """The prompts one at a time, or with `batched` all at once through llama.cpp's batch API."""
        job = {"model_path": str(gguf), "prompts": prompts, "output_len": output_len,
               "threads": torch.get_num_threads(), "batched": batched}
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line.removeprefix("RESULT "))
        self._stderr.seek(0)
        raise RuntimeError(f"llama.cpp run failed: {self._stderr.read().strip()[-2000:]}")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._stderr.close()


def run_vllm(python: str, model_dir: str, prompts: list[list[int]], output_len: int, dtype: str,
             max_num_seqs: int, prefill_prompts: list[list[int]] | None = None) -> dict[str, float]:
    """The workload through vLLM's CPU build in its own environment (bench/vllm_peer.py). With
    prefill_prompts, instead each of them alone to its first token, prefix caching off, after
    `prompts` as the untimed warm-up: ttft_s is their median."""
    job = {"model_dir": model_dir, "prompts": prompts, "output_len": output_len, "dtype": dtype,
           "max_num_seqs": max_num_seqs, "prefill_prompts": prefill_prompts}
    script = Path(__file__).with_name("vllm_peer.py")
    done = subprocess.run([python, str(script)], input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM run failed: {done.stderr.strip()[-2000:]}")
    return _peer_result(done.stdout)


def _peer_result(stdout: str) -> dict[str, float]:
    """A peer's figures: its one `RESULT {json}` line among whatever else it logs to stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the peer printed no RESULT line: {stdout[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def gguf_vocab_size(path: Path) -> int:
    """The vocabulary of a GGUF file: its embedding's rows."""
    from gguf import GGUFReader

    embedding = next(t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    return int(embedding.shape[-1])  # GGUF lists the dimensions fastest first: [hidden, vocab]


def gguf_weight_bytes_per_token(path: Path) -> int:
    """Bytes of a GGUF file's weights one batch-1 decode step of llama.cpp reads: every tensor in
    its stored blocks (projections, norms, the LM head `output.weight`), but the embedding, whose
    lookup reads one row; when the file has no `output.weight` the LM head is the embedding
    (tied), read whole. Stacked experts (`*_exps`) count k/E of their bytes: a token runs k
    (`<arch>.expert_used_count`) of the E. The same count as bench.batch1.weight_bytes_per_token
    for minivllm."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = reader.tensors
    is_tied = all(t.name != "output.weight" for t in tensors)
    arch = _gguf_scalar(reader, "general.architecture")
    num_experts = _gguf_scalar(reader, f"{arch}.expert_count") or 0
    num_used = _gguf_scalar(reader, f"{arch}.expert_used_count") or 0
    total = 0
    for t in tensors:
        if t.name == "token_embd.weight" and not is_tied:
            continue
        is_experts = "_exps." in t.name and num_experts
        total += int(t.n_bytes) * num_used // num_experts if is_experts else int(t.n_bytes)
    return total


def _gguf_scalar(reader: object, key: str) -> int | str | None:
    """A GGUF metadata value (a number or a string), None when the file lacks the key."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def compare(args: argparse.Namespace) -> None:
    """Each minivllm weight mode, then llama.cpp, on the same prompts, in one run; with
    --compare-rounds N, every system stays loaded and the rounds alternate them N times, after
    one untimed round. `--compare none` runs llama.cpp (and vLLM) alone, on --model's .gguf.
    With --prefill-len (args.num_prompts 1, output_len 1) each round, the untimed one too, has a
    prompt of its own, which neither system's prefix cache holds, and its time to first token is
    compared."""
    from engine.execution.weights.checkpoint import fetch_default_gguf

    modes = [] if args.compare == "none" else args.compare.split(",")
    for mode in modes:
        if mode not in WEIGHT_MODES:
            raise SystemExit(f"--compare: unknown mode {mode!r}; choose from {', '.join(WEIGHT_MODES)} or none")
    num_rounds = args.compare_rounds
    is_prefill = args.prefill_len is not None
    rows, result = [], {"workload": vars(args), "threads": torch.get_num_threads(), "systems": {}}
    prompts, vocab_size = None, None
    python = args.llama_cpp_python or os.environ.get("MINIVLLM_LLAMA_CPP_PYTHON")
    # the same file minivllm's gguf mode serves: the default model's Q4_1, or the .gguf given as --model
    gguf = Path(args.model) if args.model and args.model.endswith(".gguf") else fetch_default_gguf() if python else None
    if not modes and gguf is None:
        raise SystemExit("--compare none: needs --llama-cpp-python (and --model FILE.gguf)")
    llms: dict[int, LLM] = {}
    peer = LlamaCppPeer(python) if python else None  # one process, loaded once, for every round
    rounds: dict[str, list[dict[str, float]]] = {}
    # batch 1 over rounds: each round's read bandwidth, two sums before it, says which of the VM's
    # regimes the round saw
    buffer = bandwidth_buffer() if num_rounds > 1 and args.num_prompts == 1 and not is_prefill else None
    bandwidths: list[float] = []
    peer_name = f"llama.cpp {gguf.name}" + (" batched" if args.llama_cpp_batched else "") if gguf else ""

    def workload(round_index: int) -> list[list[int]]:
        seed = args.seed + 1 + round_index if is_prefill else args.seed  # the untimed round is -1
        return make_prompts(args.num_prompts, args.min_input, args.max_input, vocab_size, seed)

    try:
        # with rounds, a first one untimed: its first steps fault in pages and settle the threads
        for round_index in range(-1 if num_rounds > 1 else 0, num_rounds):
            if buffer is not None and round_index >= 0:
                bandwidths.append(statistics.median(read_bandwidths(buffer, 2)))
            if is_prefill:
                prompts = None
            for i, mode in enumerate(modes):
                llm = llms.get(i) or LLM(args.model, max_num_seqs=args.max_num_seqs,
                                         max_num_batched_tokens=args.max_num_batched_tokens, **WEIGHT_MODES[mode])
                vocab_size = vocab_size or llm.engine.vocab_size
                prompts = prompts or workload(round_index)
                seconds, steps = run_minivllm(llm, prompts, args.output_len)
                name = f"minivllm {mode}" + (f" #{modes[:i].count(mode) + 1}" if modes.count(mode) > 1 else "")
                if num_rounds > 1:
                    llms[i] = llm
                if round_index < 0:
                    continue
                figures = {"output_tok_s": args.num_prompts * args.output_len / seconds,
                           "decode_tok_s": decode_tok_s(steps) if args.num_prompts == 1 else None,
                           "weight_bytes_per_token": weight_bytes_per_token(llm)}
                if is_prefill:
                    figures["ttft_s"] = seconds  # one prompt, one output token: done at its first token
                rounds.setdefault(name, []).append(figures)
                del llm
            if python:
                vocab_size = vocab_size or gguf_vocab_size(gguf)
                prompts = prompts or workload(round_index)
                done = peer.run(gguf, prompts, args.output_len, batched=args.llama_cpp_batched)
                if round_index < 0:
                    continue
                figures = {"output_tok_s": done["output_tokens"] / done["seconds"],
                           "decode_tok_s": done["decode_tok_s"] if args.num_prompts == 1 else None,
                           "weight_bytes_per_token": gguf_weight_bytes_per_token(gguf)}
                if is_prefill:
                    figures["ttft_s"] = done["ttft_s"]
                rounds.setdefault(peer_name, []).append(figures)
    finally:
        if peer:
            peer.close()
    for name, runs in rounds.items():
        figures = {key: statistics.median(run[key] for run in runs) if runs[0][key] is not None else None
                   for key in runs[0]}
        if num_rounds > 1:
            figures["rounds"] = runs
        result["systems"][name] = figures
        rows.append((name, figures))
    vllm = args.vllm_python or os.environ.get("MINIVLLM_VLLM_PYTHON")
    if vllm:
        for mode in modes:
            if set(WEIGHT_MODES[mode]) - {"dtype", "quantization"} or WEIGHT_MODES[mode].get("quantization") != "none":
                continue  # the peer runs plain dtypes: vLLM's CPU build has no weight-only int8 for this model,
                # and a mode's own KV cache dtype would not be the same comparison
            # With --prefill-len each of the rounds' prompts to its first token (a warm-up prompt of
            # its own first), prefix caching off: the prefill the other systems timed.
            prefill_prompts = [workload(r)[0] for r in range(num_rounds)] if is_prefill else None
            done = run_vllm(vllm, resolve_dir(args.model), workload(-1) if is_prefill else prompts, args.output_len,
                            WEIGHT_MODES[mode]["dtype"], args.max_num_seqs, prefill_prompts)
            figures = {"output_tok_s": done["output_tokens"] / done["seconds"]}
            if is_prefill:
                figures["ttft_s"] = done["ttft_s"]
                print(f"vLLM CPU {mode} rounds: " + ", ".join(f"{1e3 * t:.1f} ms" for t in done["ttft_rounds_s"]))
            result["systems"][f"vLLM CPU {mode}"] = figures
            rows.append((f"vLLM CPU {mode}", figures))
    print(f"{args.num_prompts} prompt(s) of {args.min_input}..{args.max_input} tokens, {args.output_len} out, greedy, "
          f"{torch.get_num_threads()} threads")
    for name, figures in rows:
        if is_prefill:
            print(f"{name:30s}: time to first token {1e3 * figures['ttft_s']:8.1f} ms "
                  f"({args.max_input / figures['ttft_s']:6.1f} prompt tok/s)")
            continue
        decode = f", decode steps {figures['decode_tok_s']:6.1f} tok/s" if figures.get("decode_tok_s") else ""
        weights = figures.get("weight_bytes_per_token")
        weights = f", {weights / 1e6:4.0f} MB weights/token" if weights else ""
        print(f"{name:30s}: {figures['output_tok_s']:7.1f} output tok/s{decode}{weights}")
    if num_rounds > 1:
        print(f"medians of {num_rounds} alternating rounds" + (", a new prompt each round" if is_prefill else ""))
        _print_round_ratios(rounds, peer_name, bandwidths,
                            "ttft_s" if is_prefill else "decode_tok_s")
        result["round_read_bandwidth_gb_s"] = [b / 1e9 for b in bandwidths]
        if bandwidths:
            result["read_bound_fractions"] = _print_read_bounds(rounds, bandwidths)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _print_round_ratios(rounds: dict[str, list[dict[str, float]]], peer_name: str, bandwidths: list[float],
                        key: str = "decode_tok_s") -> None:
    """Each minivllm mode's figure (key: decode_tok_s, or ttft_s) over llama.cpp's in the same
    round: the ratio of two runs seconds apart, where the medians above may pair a fast second of
    one with a slow of the other."""
    if bandwidths:
        print(f"{'sums before each round':30s}: {', '.join(f'{b / 1e9:.1f}' for b in bandwidths)} GB/s")
    peer = rounds.get(peer_name)
    if not peer or peer[0].get(key) is None:
        return
    label = "decode steps" if key == "decode_tok_s" else "time to first token"
    for name, runs in rounds.items():
        if name == peer_name:
            continue
        ratios = [run[key] / other[key] for run, other in zip(runs, peer, strict=True)]
        print(f"{name:30s}: {label} {statistics.median(ratios):.2f}x llama.cpp (rounds "
              f"{', '.join(f'{r:.2f}' for r in ratios)})")


def _print_read_bounds(rounds: dict[str, list[dict[str, float]]], bandwidths: list[float]) -> dict[str, float]:
    """Per system, the median over rounds of its decode's weight-read rate (decode tok/s x weight
    bytes a token) over the round's read bandwidth: the fraction of the memory bound it reaches."""
    fractions = {}
    for name, runs in rounds.items():
        if runs[0].get("decode_tok_s") is None or not runs[0].get("weight_bytes_per_token"):
            continue
        per_round = [run["decode_tok_s"] * run["weight_bytes_per_token"] / bandwidth
                     for run, bandwidth in zip(runs, bandwidths, strict=True)]
        fractions[name] = statistics.median(per_round)
        bound = statistics.median(bandwidth / run["weight_bytes_per_token"] for run, bandwidth
                                  in zip(runs, bandwidths, strict=True))
        print(f"{name:30s}: {100 * fractions[name]:.0f}% of the read bound (at most {bound:.1f} tok/s; rounds "
              f"{', '.join(f'{100 * f:.0f}%' for f in per_round)})")
    return fractions
