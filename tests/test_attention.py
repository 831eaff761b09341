"""The C++ paged decode kernel and the pure-torch path agree with dense attention."""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, decode_attention, gathered_decode_attention
from engine.kernels import load_cpu_kernels


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, dim, bs, blocks = 5, 9, 3, 16, 4, 40
    k = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    v = torch.randn(blocks * bs, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[: batch * 6].view(batch, 6)
    lens = torch.tensor([1, 4, 5, 17, 24])
    return q, k, v, tables, lens, bs


def _dense(q, k, v, tables, lens, bs):
    outs = []
    for b in range(q.shape[0]):
        slots = (tables[b, :, None] * bs + torch.arange(bs)).flatten()[: lens[b]]
        kb = k[slots].repeat_interleave(3, dim=1).transpose(0, 1)  # [H, L, D]
        vb = v[slots].repeat_interleave(3, dim=1).transpose(0, 1)
        probs = torch.softmax(q[b].unsqueeze(1) @ kb.transpose(1, 2) * q.shape[-1] ** -0.5, dim=-1)
        outs.append((probs @ vb).squeeze(1))
    return torch.stack(outs)


def test_torch_decode_path_matches_dense() -> None:
    q, k, v, tables, lens, bs = _case()
    slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(q.shape[0], -1)
    mask = torch.where(torch.arange(slots.shape[1]) < lens[:, None], 0.0, -float("inf")).view(q.shape[0], 1, 1, -1)
    out = gathered_decode_attention(q, k, v, slots, mask, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _dense(q, k, v, tables, lens, bs))


def test_cpp_kernel_matches_dense() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None, "the C++ kernel must build here (gcc and torch headers are installed)"
    q, k, v, tables, lens, bs = _case(1)
    attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs, block_tables=tables,
                             context_lens=lens, decode_kernels=kernels)
    out = decode_attention(q, k, v, attn, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, _dense(q, k, v, tables, lens, bs))


def test_cpp_kernel_bfloat16_cache() -> None:
    kernels = load_cpu_kernels()
    assert kernels is not None
    q, k, v, tables, lens, bs = _case(2)
    attn = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_size=bs, block_tables=tables,
                             context_lens=lens, decode_kernels=kernels)
    out = decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn, q.shape[-1] ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = _dense(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), tables, lens, bs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
