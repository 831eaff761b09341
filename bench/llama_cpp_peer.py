"""Runs the offline workload through llama.cpp (llama-cpp-python), in llama.cpp's own
environment: `bench.offline_throughput --compare` starts this file with that environment's
Python and reads one JSON line back. Imports nothing from minivllm, so the peer's venv needs
only `llama-cpp-python`.

stdin: one job a line, {"model_path": str, "prompts": [[token ids]], "output_len": int, "threads": int,
"batched": bool (optional)}
stdout: a line RESULT {"seconds": float, "decode_tok_s": float | None, "ttft_s": float, "output_tokens": int}
a job (decode_tok_s: the median over prompts with two tokens or more; ttft_s: the median time to a
prompt's first token). A batched job runs every prompt at once through llama.cpp's batch API
(one sequence id a prompt, as its server's parallel slots do): the prompts' prefills in batches of
up to 512 tokens, then one decode a step for all of them, greedy on the logits; its
decode_tok_s is the steps' tokens over their time, ttft_s the time to every prompt's first token.
The model stays loaded between jobs of the same file, so `--compare-rounds` alternates short runs
with minivllm's without reloading either. Note that llama-cpp-python reuses the KV of the prefix
a prompt shares with the one before it (as minivllm's prefix cache does): a round that repeats a
prompt skips most of its prefill, so `--prefill-len` gives each round a new one.
"""
from __future__ import annotations

import json
import statistics
import sys
import time


def run_job(llm: object, prompts: list[list[int]], output_len: int) -> dict[str, float | None]:
    decode_rates, first_token_times, total, produced = [], [], 0.0, 0
    for prompt in prompts:  # llama-cpp-python serves one sequence at a time
        start = time.perf_counter()
        first = start
        count = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):  # greedy; EOS is ignored by the count
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count >= output_len:
                break
        end = time.perf_counter()
        total += end - start
        produced += count
        first_token_times.append(first - start)
        if count > 1:
            decode_rates.append((count - 1) / (end - first))
    return {"seconds": total, "output_tokens": produced, "ttft_s": statistics.median(first_token_times),
            "decode_tok_s": statistics.median(decode_rates) if decode_rates else None}


class BatchedContext:
    """A llama.cpp context of its own over a loaded model, holding one sequence a prompt."""

    def __init__(self, llm: object, num_seqs: int, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = num_seqs, threads, threads
        params.kv_unified = True  # one buffer for all sequences, as llama-server's parallel slots keep by default
        self.ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp: could not create a batched context")
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.vocab_size = llm.n_vocab()

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits), at most 512 (the batch's arrays)."""
        if len(entries) > 512:
            raise ValueError(f"prompts: {len(entries)} sequences in one decode, the batch holds 512")
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama.cpp: llama_decode failed")

    def _argmax(self, index: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.vocab_size,))
        return int(logits.argmax())

    def run(self, prompts: list[list[int]], output_len: int) -> dict[str, float | None]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(token, pos, seq, pos == len(prompt) - 1)
                   for seq, prompt in enumerate(prompts) for pos, token in enumerate(prompt)]
        last = [0] * len(prompts)
        for begin in range(0, len(entries), 512):
            chunk = entries[begin : begin + 512]
            self._decode(chunk)
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    last[seq] = self._argmax(i)
        first = time.perf_counter()
        lengths = [len(p) for p in prompts]
        for step in range(output_len - 1):
            self._decode([(last[seq], lengths[seq] + step, seq, True) for seq in range(len(prompts))])
            last = [self._argmax(i) for i in range(len(prompts))]
        end = time.perf_counter()
        decoded = len(prompts) * (output_len - 1)
        return {"seconds": end - start, "output_tokens": len(prompts) * output_len, "ttft_s": first - start,
                "decode_tok_s": decoded / (end - first) if decoded else None}


def main() -> None:
    from llama_cpp import Llama

    llm, loaded, batched = None, None, None
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        prompts, output_len = job["prompts"], job["output_len"]
        if job.get("batched"):
            n_ctx = sum(len(p) + output_len for p in prompts) + 8
            if llm is None or loaded[0] != job["model_path"]:
                if batched is not None:
                    batched[1].close()
                    batched = None
                llm = Llama(model_path=job["model_path"], n_threads=job["threads"], n_ctx=64, verbose=False)
                loaded = (job["model_path"], None, None)
            if batched is None or batched[0] != (loaded[0], len(prompts), n_ctx, job["threads"]):
                if batched is not None:
                    batched[1].close()
                key = (loaded[0], len(prompts), n_ctx, job["threads"])
                batched = (key, BatchedContext(llm, len(prompts), n_ctx, job["threads"]))
                batched[1].run([p[:8] for p in prompts], 4)  # warm-up
            print("RESULT " + json.dumps(batched[1].run(prompts, output_len)), flush=True)
            continue
        n_ctx = max(len(p) for p in prompts) + output_len + 8
        key = (job["model_path"], job["threads"], n_ctx)
        if key != loaded:
            if batched is not None:
                batched[1].close()
                batched = None
            llm = Llama(model_path=job["model_path"], n_threads=job["threads"], n_threads_batch=job["threads"],
                        n_ctx=n_ctx, n_batch=512, verbose=False)
            for _ in zip(range(4), llm.generate(prompts[0][:8], temp=0.0, top_k=1), strict=False):  # warm-up
                pass
            loaded = key
        print("RESULT " + json.dumps(run_job(llm, prompts, output_len)), flush=True)


if __name__ == "__main__":
    main()
