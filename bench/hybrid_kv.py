"""KV blocks a long context holds with KV-cache groups (engine/execution/kv_cache_layout.py) against one
full cache, by the engine's own block accounting: a sequence prefilled in chunks, then decoding.

    python -m bench.hybrid_kv --context 16384

The default shape is Gemma-3-1B's: 26 layers, five sliding (window 512) to one global, 1 KV head
of 256 dims. A block id of the hybrid cache holds group_size layers, one of the full cache all of
them, so the comparison is in layer-blocks (and bytes), not in block ids.
"""
from __future__ import annotations

import argparse

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.execution.kv_cache_layout import KVCacheLayout
from engine.processing.sampling_params import SamplingParams


def held_blocks(windows: tuple[int | None, ...], context: int, block_size: int, chunk: int) -> tuple[list[int], int]:
    """(blocks each group's table holds, blocks in use) once `context` tokens are computed and
    the next token is being decoded."""
    bm = BlockManager(num_blocks=(context // block_size + 2) * len(windows), block_size=block_size, windows=windows)
    seq = Sequence("bench", list(range(context)), SamplingParams(), 0.0)
    while seq.num_computed_tokens < context:
        n = min(chunk, context - seq.num_computed_tokens)
        if not bm.allocate(seq, n):
            raise RuntimeError("the pool is too small")
        seq.num_computed_tokens += n
        bm.register_computed_blocks(seq)
    seq.output_token_ids.append(0)
    bm.allocate(seq, 1)
    return [sum(b != bm.null_block for b in table) for table in seq.block_tables], bm.num_used_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--global-every", type=int, default=6, help="every n-th layer is global (full attention)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--bytes", type=int, default=2, help="bytes per cached value (bfloat16: 2)")
    args = parser.parse_args()
    windows = tuple(None if (i + 1) % args.global_every == 0 else args.window for i in range(args.layers))
    layout = KVCacheLayout.of(windows)
    per_group, used = held_blocks(layout.windows, args.context, args.block_size, args.chunk)
    full_blocks = -(-(args.context + 1) // args.block_size)
    layer_block_bytes = 2 * args.block_size * args.kv_heads * args.head_dim * args.bytes
    hybrid = used * layout.group_size
    full = full_blocks * args.layers
    print(f"layers {args.layers} ({sum(w is None for w in windows)} global, window {args.window}), "
          f"context {args.context} + 1 decoding, blocks of {args.block_size} tokens")
    print(f"hybrid: {layout.num_groups} groups of {layout.group_size} layers; blocks held per group {per_group}; "
          f"{used} blocks = {hybrid} layer-blocks = {hybrid * layer_block_bytes / 2**20:.1f} MiB")
    print(f"full cache: {full_blocks} blocks of {args.layers} layers = {full} layer-blocks = "
          f"{full * layer_block_bytes / 2**20:.1f} MiB")
    print(f"hybrid / full: {hybrid / full:.3f}")


if __name__ == "__main__":
    main()
