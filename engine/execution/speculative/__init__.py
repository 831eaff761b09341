"""Speculative decoding without a draft model: proposers that guess a request's next tokens from
tokens already seen, for the step to verify k + 1 at a time (engine/execution/model_runner.py and
Sampler.verify). Both search with numpy over whole arrays: no per-token Python loop over the
history on the engine thread."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.execution.speculative.ngram_proposer import NgramProposer
from engine.execution.speculative.proposer import Proposer
from engine.execution.speculative.suffix_proposer import SuffixProposer

__all__ = ["NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]


def make_proposer(config: EngineConfig) -> Proposer | None:
    if config.speculative_method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative_method == "suffix":
        return SuffixProposer(config.num_speculative_tokens)
    return None
