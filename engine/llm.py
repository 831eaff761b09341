"""Offline API for scripts and benchmarks: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processing.pooling_params import PoolingParams
from engine.processing.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_config: Any) -> None:
        unknown = set(engine_config) - set(EngineConfig.field_names())
        if unknown:
            raise ValueError(f"unknown engine option(s): {sorted(unknown)}")
        # Offline nobody watches a stream's pace: prefill by the token budget (throughput) unless asked.
        engine_config.setdefault("enable_time_budget", False)
        self.engine = LLMEngine(EngineConfig(model=model, **engine_config))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order. For
        params.n > 1 each output is sample 0 and its `samples` holds all n, by index."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params)

    def embed(self, prompts: Prompt | Seq[Prompt],
              params: PoolingParams | Seq[PoolingParams] | None = None) -> list[RequestOutput]:
        """Embed prompts (strings or token-id lists): prefill only, each output's `embedding` its
        pooled vector (the model's pooling and normalisation unless params say otherwise)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params or PoolingParams())

    def score(self, prompts: Prompt | Seq[Prompt]) -> list[RequestOutput]:
        """Score prompts (each a pair already put together: a cross-encoder's pair encoding, a
        reranker's template): prefill only, each output's `scores` the model's score-head logits
        [num_labels] (a sigmoid of a one-label logit is CrossEncoder.predict's score)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), PoolingParams(task="score"))

    def chat(self, conversations: list[dict[str, str]] | Seq[list[dict[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations, each formatted by the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._run([self.engine.apply_chat_template(list(c)) for c in conversations], params)

    def _run(self, prompts: list[Prompt], params: SamplingParams | PoolingParams | Seq[SamplingParams | PoolingParams]
             | None) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams | PoolingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"params: {len(params_list)} given for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, prompt_ids in zip(prompts, params_list, self.engine.encode_prompts(prompts), strict=True):
                ids.append(self.engine.add_request(prompt, p, encoded=prompt_ids))
        except ValueError:
            for request_id in ids:  # all or nothing: do not leave the accepted ones running
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        num_samples = {request_id: p.n if isinstance(p, SamplingParams) else 1
                       for request_id, p in zip(ids, params_list, strict=True)}
        finals: dict[str, dict[int, RequestOutput]] = {request_id: {} for request_id in ids}
        prompt_logprobs: dict[str, list] = {}  # they come with a request's first output only
        num_left = sum(num_samples.values())  # samples not yet finished (a count: not a walk of all ids a step)
        while num_left:
            outputs, _ = self.engine.step()
            for out in outputs:
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.is_finished:
                    if out.index == 0:
                        out.prompt_logprobs = prompt_logprobs.get(out.request_id, out.prompt_logprobs)
                    num_left -= out.index not in finals[out.request_id]
                    finals[out.request_id][out.index] = out
        while self.engine.num_steps_in_flight:  # (async scheduling) a step that ran past the ends
            self.engine.step()
        results = []
        for request_id in ids:
            first = finals[request_id][0]
            if num_samples[request_id] > 1:
                first.samples = [finals[request_id][i] for i in range(num_samples[request_id])]
            results.append(first)
        return results
