"""Sampler transforms on hand-made logits."""
from __future__ import annotations

import torch

from engine import SamplingParams
from engine.execution.sampler import Sampler
from engine.processing.structured_output import StructuredOutput
from tests.helpers import fake_seq


def _seqs(*params: SamplingParams):
    return [fake_seq(str(i), 3, params=p) for i, p in enumerate(params)]


def test_greedy_rows_take_argmax_in_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [3.0, 0.0, 0.0, 2.9]])
    out = Sampler(torch.device("cpu"))(logits, _seqs(SamplingParams(temperature=0), SamplingParams(temperature=0)))
    assert out.token_ids == [1, 0]


def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_torch_does() -> None:
    """The CPU argmax runs through numpy: its ties and NaN rule are torch's."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=gen)
    logits[1, [10, 700]] = 50.0  # a tie: the first
    logits[2, [30, 600]] = float("nan")  # a NaN wins, the first one
    logits[3] = -float("inf")  # every token masked
    logits[4, 999] = 60.0  # the last column
    expected = logits.argmax(dim=-1).tolist()
    assert expected[1:] == [10, 30, 0, 999]
    greedy = [SamplingParams(temperature=0)] * 5
    assert Sampler(torch.device("cpu"))(logits.clone(), _seqs(*greedy)).token_ids == expected
    assert Sampler(torch.device("cpu"))(logits[:, ::2].clone(), _seqs(*greedy)).token_ids == \
        logits[:, ::2].argmax(dim=-1).tolist()


def test_the_forwards_argmax_is_taken_only_where_nothing_edits_or_reads_the_logits() -> None:
    plain = SamplingParams(temperature=0)
    assert Sampler.is_plain_greedy(_seqs(plain, plain))
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=0, logprobs=0),
                   SamplingParams(temperature=0, logit_bias={3: 5.0}), SamplingParams(temperature=0, presence_penalty=1),
                   SamplingParams(temperature=0, repetition_penalty=1.2)):
        assert not Sampler.is_plain_greedy(_seqs(plain, params)), params
    waiting = SamplingParams(temperature=0, min_tokens=2)  # its stop tokens are masked for two tokens
    assert not Sampler.is_plain_greedy([fake_seq("a", 3, num_output=1, params=waiting)])
    assert Sampler.is_plain_greedy([fake_seq("a", 3, num_output=2, params=waiting)])
    constrained = SamplingParams(temperature=0, structured_output=StructuredOutput("regex", "[ab]+"))
    assert not Sampler.is_plain_greedy(_seqs(plain, constrained))
    # Given the forward's argmax, the sampler answers with it (ids these logits would not give)
    # and does not touch the logits.
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    out = Sampler(torch.device("cpu"))(logits, _seqs(plain, plain), [2, 1])
    assert out.token_ids == [2, 1] and out.logprobs == [None, None]
    assert torch.equal(logits, torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]]))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen)
    expected = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=1.0, top_k=1) if i % 2 else SamplingParams(temperature=1.0, top_p=1e-6)
              for i in range(16)]
    assert Sampler(torch.device("cpu"))(logits, _seqs(*params)).token_ids == expected


def test_min_p_removes_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 200
    tokens = Sampler(torch.device("cpu"))(logits, _seqs(*params)).token_ids
    assert set(tokens) <= {0, 1} and {0, 1} <= set(tokens)


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).repeat(4000, 1)
    tokens = torch.tensor(Sampler(torch.device("cpu"), seed=5)(logits, _seqs(*[SamplingParams()] * 4000)).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_penalties_push_seen_tokens_down() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    seq = fake_seq("a", 3, params=SamplingParams(temperature=0, frequency_penalty=0.5))
    seq.output_token_ids = [0]
    assert Sampler(torch.device("cpu"))(logits, [seq]).token_ids == [1]
    seq_rep = fake_seq("b", 0, params=SamplingParams(temperature=0, repetition_penalty=2.0))
    seq_rep.prompt_token_ids = [0]
    assert Sampler(torch.device("cpu"))(logits.clone(), [seq_rep]).token_ids == [1]
    plain = fake_seq("c", 3, params=SamplingParams(temperature=0))
    plain.output_token_ids = [0]
    assert Sampler(torch.device("cpu"))(logits.clone(), [plain]).token_ids == [0]


def test_presence_penalty_counts_a_token_once_frequency_per_occurrence() -> None:
    logits = torch.tensor([[2.0, 1.8, 0.0, 0.0]])

    def pick(**penalty: float) -> int:
        seq = fake_seq("a", 3, params=SamplingParams(temperature=0, **penalty))
        seq.output_token_ids = [0, 0, 0]
        return Sampler(torch.device("cpu"))(logits.clone(), [seq]).token_ids[0]

    assert pick() == 0
    assert pick(presence_penalty=0.1) == 0  # 2.0 - 0.1 once: still ahead
    assert pick(frequency_penalty=0.1) == 1  # 2.0 - 3 * 0.1 falls behind 1.8
    assert pick(presence_penalty=0.3) == 1  # 1.7 < 1.8
    assert pick(presence_penalty=-0.5) == 0  # negative: encourages repeats


def _nucleus_by_full_sort(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_ps
    return probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)


def test_top_p_keeps_exactly_the_nucleus_narrow_wide_and_untouched_rows() -> None:
    """The top-256 search and its whole-row fallback agree with a full sort: peaked rows (the
    nucleus within the top 256), flat rows (it reaches past them) and rows that did not ask."""
    gen = torch.Generator().manual_seed(3)
    peaked = torch.softmax(torch.randn(4, 5000, generator=gen) * 4, dim=-1)
    flat = torch.softmax(torch.randn(4, 5000, generator=gen) * 0.1, dim=-1)
    probs = torch.cat([peaked, flat])
    top_ps = torch.tensor([[0.5], [0.9], [1.0], [0.99], [0.5], [0.9], [1.0], [0.2]])
    got = Sampler._top_p(probs, top_ps)
    asked = [0, 1, 3, 4, 5, 7]
    assert torch.equal(got[asked], _nucleus_by_full_sort(probs[asked], top_ps[asked]))
    # Rows at top_p 1 stay whole (a float32 cumulative sum can reach 1 before the tail does,
    # so the full-sort rule would clip their rarest tokens).
    assert torch.equal(got[[2, 6]], probs[[2, 6]])
    assert (got[4] > 0).sum() > 256  # a nucleus wider than the candidates: the sorted fallback


def test_sampling_with_top_p_follows_the_renormalized_nucleus() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    tokens = Sampler(torch.device("cpu"), seed=7)(logits, _seqs(*[SamplingParams(top_p=0.7)] * 4000)).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.0, 0.0]) / 0.75, atol=0.03)
