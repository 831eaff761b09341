"""Token sampling, vectorized over the batch.

Each transform runs only when some row needs it, and on all rows at once: rows that did not
ask for it carry neutral values (temperature 1, top_k = vocab, top_p 1, min_p 0, penalty 1).
Sampling inverts each row's CDF at one uniform draw, which draws from p exactly and lets a
seeded request take its draw from its own generator, so its tokens do not depend on the rest
of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.processing.sampling_params import SamplingParams
from engine.processing.structured_output import GrammarMask


class SamplingRow(Protocol):
    """What the sampler reads of a request: the runner's rows (input_batch.CachedRequestState)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    matcher: Any  # its grammar's state; advanced over the sampled token by the scheduler, not here
    min_tokens_stop_ids: frozenset[int]

    @property
    def num_output_tokens(self) -> int: ...


Logprobs = dict[int, float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-N, when asked


# Columns of SamplingParams.row.
_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE, _IS_GREEDY = range(7)
_NUCLEUS_CANDIDATES = 256  # top_p looks among this many likeliest tokens before sorting a row whole


def accepted_run(drafts: list[int], targets: list[int], first: int) -> list[int]:
    """A verification's output: its drafts while each equals the token its position gives
    (targets[first + j]), then the token of the first position that differs (or of the last)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[first + accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[first + accepted]]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] -> [N] int64, the first maximum of each row (a NaN counts as one).
    On the CPU through numpy, whose argmax is vectorised (torch's is not); the same ties and NaN rule."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, kernels: object = None) -> None:
        """kernels: the C++ CPU kernels (the grammar mask uses them), or None."""
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernels = kernels
        self.grammar_mask: GrammarMask | None = None  # made on the first constrained step

    @staticmethod
    def is_plain_greedy(seqs: list[SamplingRow]) -> bool:
        """Whether every row's token is its logits' argmax, untouched: then the forward's own
        argmax (greedy_ids) is the step's tokens."""
        # A grammar's matcher exists only where params.structured_output does: the params say it.
        return all(s.params.is_plain_greedy and s.num_output_tokens >= s.params.min_tokens for s in seqs)

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow], greedy_ids: list[int] | None = None
                 ) -> SamplerOutput:
        """logits: [N, vocab] fp32, consumed (edited in place). greedy_ids: N ints, each row's
        first argmax, when the forward made them and `is_plain_greedy(seqs)`: the answer, with
        no op on the logits and no inference-mode switch (after a batch-1 step's weight stream
        each op here finds the caches cold, the switch and a tensor's tolist included)."""
        if greedy_ids is not None:
            return SamplerOutput(greedy_ids, [None] * len(seqs))
        return self._process(logits, seqs)

    # Inference mode: the model's logits are an inference tensor, and here they may be edited in
    # place (stop masks, biases, grammar masks) instead of copied once per edit.
    @torch.inference_mode()
    def _process(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> SamplerOutput:
        params = [s.params for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        self._mask_stops_before_min_tokens(logits, seqs)
        if any(p.logit_bias for p in params):
            self._apply_logit_bias(logits, seqs)
        constrained = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:  # only those rows; unconstrained steps pay nothing
            if self.grammar_mask is None:
                self.grammar_mask = GrammarMask(logits.shape[1], len(seqs), self.kernels)
            self.grammar_mask.apply(logits, constrained)
        has_penalties = any(p.has_penalties for p in params)
        is_all_greedy = all(p.is_greedy for p in params)
        # One [N, 7] tensor of the rows' parameters, each row built once per request.
        rows = None if is_all_greedy and not has_penalties else \
            torch.tensor([p.row for p in params], device=logits.device)
        if has_penalties:
            logits = self._apply_penalties(logits, seqs, rows)
        greedy = _argmax(logits)
        tokens = greedy if is_all_greedy else self._sample(logits, seqs, greedy, rows)
        token_list = tokens.tolist()  # the step's one host sync
        if raw_logprobs is None:
            return SamplerOutput(token_list, [None] * len(seqs))
        return SamplerOutput(token_list, self._gather_logprobs(raw_logprobs, tokens, params))

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, views: list[SamplingRow], chunks: list[tuple[int, list[int]]],
               raw_logprobs: torch.Tensor | None = None) -> tuple[list[list[int]], list[list[Logprobs] | None]]:
        """Accept or reject proposed tokens, exactly: the output's distribution is the target's.

        logits: [R, vocab] fp32, a request's rows consecutive (its last token's row, then each
        draft's), consumed; views: each row's request as of that position (drafts before it
        counted as output); chunks: per request (its first row, its drafts); raw_logprobs: [R,
        vocab], the logprobs to report when the caller masked logits before (a grammar), as the
        plain path reports them before its mask.

        Each row's token is what that position samples on its own: the argmax, or the inverse CDF
        of the row's distribution at one uniform from the request's stream. A draft is accepted
        while it equals its row's token; the first row that differs gives its own token, and all
        accepted, the last row gives one more. For a point-mass proposal this is rejection
        sampling: the draft survives with probability p(draft), and otherwise the token is p's
        sample given it is not the draft, which is the residual p without the draft, renormalised
        (whatever top-k, top-p or min-p left of p: the inverse CDF scales by the kept mass). A
        seeded request consumes one uniform per token it emits, in order, as when it decodes one
        token a step, so its output does not depend on the batch or on speculation. Returns per
        request the accepted drafts and the token after them, and their logprobs when asked."""
        params = [v.params for v in views]
        if raw_logprobs is None and any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._mask_stops_before_min_tokens(logits, views)
        if any(p.logit_bias for p in params):
            self._apply_logit_bias(logits, views)
        rows = torch.tensor([p.row for p in params], device=logits.device)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, views, rows)
        greedy = _argmax(logits)
        streams = []  # per seeded request: its generator, its state before this step's draws, its chunk
        if all(p.is_greedy for p in params):
            targets = greedy.tolist()
        else:
            for first, _ in chunks:
                generator = views[first].generator
                if generator is not None and not params[first].is_greedy:
                    streams.append((generator, generator.get_state(), first))
            draws = self._uniforms(views)
            targets = self._invert(self._probs(logits, views, rows), draws, greedy, rows).tolist()
        tokens, logprobs = [], []
        for first, drafts in chunks:
            tokens.append(accepted_run(drafts, targets, first))
            accepted = len(tokens[-1]) - 1
            if raw_logprobs is None or params[first].logprobs is None:
                logprobs.append(None)
                continue
            positions = list(range(first, first + accepted + 1))
            ids = torch.tensor(tokens[-1], device=logits.device)
            logprobs.append(self._gather_logprobs(raw_logprobs[positions], ids, [params[i] for i in positions]))
        emitted = {first: len(t) for (first, _), t in zip(chunks, tokens, strict=True)}
        for generator, state, first in streams:  # rewind: only the emitted tokens' uniforms are used
            generator.set_state(state)
            # One draw a call, as _uniforms and one token a step draw: CUDA's generator advances
            # by call, not by value, so one call of emitted values would land elsewhere.
            for _ in range(emitted[first]):
                torch.rand(1, dtype=torch.float64, device=generator.device, generator=generator)
        return tokens, logprobs

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, seqs: list[SamplingRow]) -> None:
        rows, cols, values = [], [], []
        for i, seq in enumerate(seqs):
            bias = seq.params.logit_bias or {}
            rows.extend([i] * len(bias))
            cols.extend(bias)
            values.extend(bias.values())
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=True)

    @staticmethod
    def _mask_stops_before_min_tokens(logits: torch.Tensor, seqs: list[SamplingRow]) -> None:
        rows, cols = [], []
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                rows.extend([i] * len(seq.min_tokens_stop_ids))
                cols.extend(seq.min_tokens_stop_ids)
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = -float("inf")

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[SamplingRow], rows: torch.Tensor) -> torch.Tensor:
        num_rows, vocab = logits.shape
        dev = logits.device

        def counts_of(lists: list[list[int]]) -> torch.Tensor:
            width = max((len(x) for x in lists), default=0)
            ids = torch.full((num_rows, max(width, 1)), vocab, dtype=torch.long)
            for i, x in enumerate(lists):
                ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            counts = torch.zeros(num_rows, vocab + 1, device=dev)  # column `vocab` absorbs padding
            counts.scatter_add_(1, ids.to(dev), torch.ones(ids.shape, device=dev))
            return counts[:, :vocab]

        output_counts = counts_of([s.output_token_ids for s in seqs])
        prompt_seen = counts_of([s.prompt_token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs]) > 0
        rep, freq, pres = (rows[:, c : c + 1] for c in (_REPETITION, _FREQUENCY, _PRESENCE))  # [N, 1] each
        seen = prompt_seen | (output_counts > 0)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - freq * output_counts - pres * (output_counts > 0).float()

    def _sample(self, logits: torch.Tensor, seqs: list[SamplingRow], greedy: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        return self._draw(self._probs(logits, seqs, rows), seqs, greedy, rows)

    def _probs(self, logits: torch.Tensor, seqs: list[SamplingRow], rows: torch.Tensor) -> torch.Tensor:
        """The distribution each row samples from (temperature, top-k, top-p, min-p): [N, vocab];
        a greedy row's is not used (its token is the argmax)."""
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        dev = logits.device
        logits = logits / rows[:, _TEMPERATURE : _TEMPERATURE + 1]
        top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
        if min(top_ks) < vocab:
            k_max = max(k for k in top_ks if k < vocab)
            top_values = logits.topk(k_max, dim=-1).values  # [N, k_max]
            ks = torch.tensor([min(k, k_max) - 1 for k in top_ks], device=dev).unsqueeze(1)
            kth = top_values.gather(1, ks)
            limited = torch.tensor([k < vocab for k in top_ks], device=dev).unsqueeze(1)
            logits = logits.masked_fill(limited & (logits < kth), -float("inf"))
        probs = torch.softmax(logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            probs = self._top_p(probs, rows[:, _TOP_P : _TOP_P + 1])
        if any(p.min_p > 0.0 for p in params):
            min_ps = rows[:, _MIN_P : _MIN_P + 1]
            probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, seqs: list[SamplingRow], greedy: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
        return self._invert(probs, self._uniforms(seqs), greedy, rows)

    def _uniforms(self, seqs: list[SamplingRow]) -> torch.Tensor:
        """One uniform per row, [N, 1] float64: a seeded request's from its own generator, in row
        order, so its tokens do not depend on the rest of the batch."""
        draws = torch.empty(len(seqs), 1, dtype=torch.float64, device=self.device)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            draws[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=self.device,
                                         generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                draws[i] = torch.rand(1, dtype=torch.float64, device=self.device, generator=seq.generator)
        return draws

    @staticmethod
    def _invert(probs: torch.Tensor, draws: torch.Tensor, greedy: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each row's token at its uniform: probs [N, vocab] (unnormalised: the CDF is scaled by
        its total), draws [N, 1] -> [N] int64; greedy rows take greedy's."""
        vocab = probs.shape[1]
        # Inverse CDF: one uniform draw per row. (An exponential race, argmax of p / E, needs a
        # draw per vocabulary entry, which costs a large share of a decode step.) The CDF is
        # summed in float64 so a 49k-entry sum does not blur the small probabilities.
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [N, vocab]
        # The first token whose CDF passes the draw (right=True: never a zero-probability one).
        sampled = torch.searchsorted(cdf, draws * cdf[:, -1:], right=True).squeeze(1)  # [N]
        # A draw that rounds up to the total mass falls off the end: take the likeliest token.
        sampled = torch.where(sampled < vocab, sampled, greedy)
        return torch.where(rows[:, _IS_GREEDY] > 0, greedy, sampled)

    @staticmethod
    def _top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        """Zero what lies outside each row's nucleus: a token is dropped when the mass of the
        tokens above it already reaches top_p (the top one always stays). probs: [N, vocab];
        top_ps: [N, 1], 1 for rows that did not ask.

        The nucleus is looked for among the top 256 first (far cheaper than sorting every row
        whole); a row whose nucleus reaches past them is sorted whole. Tokens tied with the
        smallest kept probability are all kept."""
        vocab = probs.shape[1]
        k = min(_NUCLEUS_CANDIDATES, vocab)
        values = probs.topk(k, dim=-1).values  # [N, k], descending
        kept = (values.cumsum(dim=-1) - values) < top_ps  # [N, k]: a prefix of each row
        asked = top_ps < 1.0  # [N, 1]
        smallest_kept = values.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)  # [N, 1]
        threshold = torch.where(asked, smallest_kept, torch.zeros_like(smallest_kept))
        result = probs.masked_fill(probs < threshold, 0.0)
        if k == vocab:  # the candidates were the whole row
            return result
        wide = kept[:, -1] & asked[:, 0]  # [N]: the nucleus may reach past the candidates
        if wide.any():
            rows = wide.nonzero().squeeze(1)
            sub = probs[rows]
            sorted_probs, order = sub.sort(dim=-1, descending=True)
            drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps[rows]
            result[rows] = sub.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
        return result

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, params: list) -> list[dict[int, float] | None]:
        k_max = max(p.logprobs or 0 for p in params)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        top = logprobs.topk(k_max, dim=-1) if k_max else None
        top_ids = top.indices.tolist() if top is not None else None
        top_vals = top.values.tolist() if top is not None else None
        token_list = tokens.tolist()
        result: list[dict[int, float] | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                result.append(None)
                continue
            entry = {token_list[i]: chosen[i]}
            if top_ids is not None:
                for tid, val in zip(top_ids[i][: p.logprobs], top_vals[i][: p.logprobs], strict=True):
                    entry.setdefault(tid, val)
            result.append(entry)
        return result
