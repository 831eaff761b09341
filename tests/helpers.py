"""Small helpers shared by tests."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import LLMEngine, RequestOutput, SamplingParams
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.execution.kernels import ISAS

ISA_NAMES = {level: name for name, level in ISAS.items()}  # for assertion messages


def run_engine(engine: LLMEngine, max_steps: int = 10_000) -> tuple[dict[str, list[RequestOutput]], int]:
    """Step until idle; return every output by request id and the number of steps."""
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps > max_steps:
            raise AssertionError("engine did not finish")
        for out in engine.step()[0]:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs, steps


def fake_seq(request_id: str, num_prompt: int, num_output: int = 0, arrival: float = 0.0,
             priority: int = 0, params: SamplingParams | None = None) -> Sequence:
    """A sequence with made-up tokens, for scheduler and block-manager tests."""
    seq = Sequence(request_id=request_id, prompt_token_ids=list(range(1, num_prompt + 1)),
                   params=params or SamplingParams(), arrival_time=arrival, priority=priority)
    seq.output_token_ids = [7] * num_output
    return seq


def sampled(sched: SchedulerOutput, token_id: int = 9) -> RunnerOutput:
    """What a forward would return for a scheduler-only test: token_id for every sampling request."""
    req_ids = sched.sampling_req_ids
    return RunnerOutput(req_ids, [[token_id] for _ in req_ids], [None] * len(req_ids))


# Greedy tokens of GGUF blocks may part from their float32 twin's only where the twin itself all
# but ties: per-32 int8 activations move each product by about half a percent (a product's
# relative error on Gaussian inputs), and random models' top two tokens lie within 0.01-0.3 nats
# at some steps.
TIE_NATS = 0.5


def assert_parts_only_at_ties(twin: Any, prompts: list[list[int]], outs: list[list[int]],
                              refs: list[list[int]], num_new: int) -> None:
    """Each of outs follows its twin's ref until a step where the twin's two likeliest tokens
    lie within TIE_NATS, and together they follow it for at least a third of the tokens (a
    broken product parts at once)."""
    same = 0
    for prompt, mine, ref in zip(prompts, outs, refs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(mine, ref, strict=True)) if x != y), len(ref))
        same += n
        if n < len(ref):
            out = twin.generate([prompt + ref[:n]], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0]
            first, second = sorted(out.logprobs[0].values(), reverse=True)[:2]
            assert first - second < TIE_NATS, (prompt, n)
    assert same >= len(prompts) * num_new // 3, same



def transformers_greedy(model_dir: Path, prompts: list[list[int]], num_new: int, **load: Any) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, num_new tokens whatever eos says: the
    reference the exactness tests compare with. load: from_pretrained's options (dtype, attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), **load).eval()
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False)
            refs.append(ids[0, len(prompt):].tolist())
    return refs


def rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], Any]) -> Path:
    """A copy of checkpoint src at dst whose tensors `edit` changed in place (a missing or altered weight)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def token_logprobs(llm: Any, sequences: list[list[int]]) -> np.ndarray:
    """Each token's log-probability given the tokens before it, teacher-forced through `llm`
    (prompt log-probabilities; the first token of each sequence left out), concatenated."""
    outs = llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, ignore_eos=True))
    return np.array([entry[token] for out, seq in zip(outs, sequences, strict=True)
                     for entry, token in zip(out.prompt_logprobs[1:], seq[1:], strict=True)])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [N, D] arrays of vectors -> [N]."""
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
