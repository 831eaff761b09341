"""DecodeModel.step with KV-cache groups: each layer reads and writes through its own group's
block tables (engine/execution/kv_cache_layout.py), not the first group's."""
from __future__ import annotations

import torch

from engine.execution.models.layers import RMSNorm
from engine.execution.weights.packed_weight import PackedWeight
from tests.engine.execution.kernels.test_packed_kernels import _layer_case


def test_each_layer_reads_its_groups_tables(kernels) -> None:
    """Layer 1 in a group of its own, its blocks renumbered (block b of group 0 is block
    perm[b] of group 1) and its cache moved to match: the same logits and the same new K/V rows
    as one group; handed group 0's tables instead, it reads other rows and the logits differ."""
    bs, num_blocks, vocab = 4, 40, 70
    lens = [1, 9, 14, 3, 7]
    isa = kernels.best_isa()
    layers = []
    for i, window in enumerate((None, 5, None)):
        torch.manual_seed(10 + i)
        layers.append(_layer_case(torch.float32, window, kernels, isa)[2])
    cfg = _layer_case(torch.float32, None, kernels, isa)[0]
    gen = torch.Generator().manual_seed(7)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * 4].view(len(lens), 4).tolist()
    tables = [t[: (n - 1) // bs + 1] for t, n in zip(tables, lens, strict=True)]
    caches = [(torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen),
               torch.randn(num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, generator=gen)) for _ in layers]
    perm = torch.randperm(num_blocks, generator=gen)
    # slot s of block b in group 0 is slot perm[b] * bs + s % bs in group 1
    slot_of = (perm[:, None] * bs + torch.arange(bs)).reshape(-1)
    moved = [(k.clone(), v.clone()) for k, v in caches]
    moved[1] = tuple(torch.empty_like(c).index_copy_(0, slot_of, c) for c in caches[1])
    group1 = [[int(perm[b]) for b in t] for t in tables]
    embedding = torch.randn(vocab, cfg.hidden_size, generator=gen)
    freqs = torch.arange(20).float().unsqueeze(1) * torch.linspace(1, 0.01, cfg.head_dim // 2)
    cos_table, sin_table = torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((freqs, freqs), dim=-1).sin()
    final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    head = PackedWeight.pack(torch.randn(vocab, cfg.hidden_size, generator=gen), None, torch.float32)
    token_ids = [5, 69, 0, 12, 33]

    def step(step_caches, layer_groups, block_tables):
        decoder = kernels.DecodeModel(embedding, cos_table, sin_table, [layer.weights(kernels) for layer in layers],
                                      step_caches, final_norm.weight, head.as_args(), cfg.num_heads, bs,
                                      cfg.rms_norm_eps, cfg.head_dim**-0.5, isa, layer_groups)
        num_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one thread each: the same floats in the same order
        try:
            return decoder.step(token_ids, block_tables, lens, False)[0]
        finally:
            torch.set_num_threads(num_threads)

    one = [(k.clone(), v.clone()) for k, v in caches]
    expected = step(one, [0, 0, 0], [tables])
    two = [(k.clone(), v.clone()) for k, v in moved]
    assert torch.equal(step(two, [0, 1, 0], [tables, group1]), expected)
    for i in (0, 2):  # the group-0 layers wrote where one group writes
        assert torch.equal(two[i][0], one[i][0]) and torch.equal(two[i][1], one[i][1])
    for got, want in zip(two[1], one[1], strict=True):  # layer 1 wrote its new rows at group 1's slots
        assert torch.equal(got, torch.empty_like(want).index_copy_(0, slot_of, want))
    wrong = [(k.clone(), v.clone()) for k, v in moved]
    assert not torch.allclose(step(wrong, [0, 1, 0], [tables, tables]), expected)
