"""Runs the model for the two workloads: packed prefill and one-token-per-sequence decode.

Owns the device, the weights and the KV cache pool. Reads sequences, never mutates them:
the engine folds results back after sampling.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from engine.attention import AttentionMetadata, PrefillSeqMeta
from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.model_loader import iter_weights
from engine.models import model_class
from engine.models.layers import can_pack_linear
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but no GPU is available")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 GEMMs are ~10x slower than fp32 on AVX2 CPUs without bf16 units.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class ModelRunner:
    def __init__(self, model_dir: Path, hf_config: object, config: EngineConfig) -> None:
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        cls = model_class(hf_config.model_type)
        self.model_config = cls.config_from_hf(hf_config)
        self.block_size = config.block_size
        self.last_prepare_time = 0.0  # host-side input building of the last run_* call (seconds)
        model = cls(self.model_config)
        model.load_weights(iter_weights(model_dir))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        is_cpu = self.device.type == "cpu"
        if is_cpu and os.environ.get("MINIVLLM_DISABLE_PACKED_LINEAR") != "1" and can_pack_linear(self.dtype):
            self.model.pack_linear_weights()
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for(config.kv_cache_gib)
        mc = self.model_config
        # One pool for all layers: [layers, k/v, slots, kv_heads, head_dim].
        self.kv_cache = torch.zeros(mc.num_layers, 2, self.num_kv_blocks * self.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=self.dtype, device=self.device)
        use_kernels = (is_cpu and self.dtype in (torch.float32, torch.bfloat16)
                       and os.environ.get("MINIVLLM_DISABLE_CPP_KERNELS") != "1")
        self.cpu_kernels = load_cpu_kernels() if use_kernels else None
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        logger.info("model on %s (%s), KV cache %d blocks x %d tokens (%.2f GiB)", self.device, self.dtype,
                    self.num_kv_blocks, self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    def _blocks_for(self, gib: float) -> int:
        mc = self.model_config
        bytes_per_block = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                           * torch.finfo(self.dtype).bits // 8)
        return max(1, int(gib * 2**30) // bytes_per_block)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]) -> torch.Tensor:
        """Compute the scheduled chunk of each sequence, packed without padding.

        Returns logits at each sequence's last scheduled position: [len(seqs), vocab].
        """
        t0 = time.perf_counter()
        bs = self.block_size
        token_ids: list[int] = []
        positions, slots, metas, last_indices = [], [], [], []
        num_tokens = 0
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            token_ids.extend(seq.token_ids_slice(start, start + n))
            table = np.asarray(seq.block_table, dtype=np.int64)
            ctx_pos = np.arange(start + n, dtype=np.int64)
            ctx_slots = table[ctx_pos // bs] * bs + ctx_pos % bs
            positions.append(ctx_pos[start:])
            slots.append(ctx_slots[start:])
            metas.append(PrefillSeqMeta(num_tokens, n, start + n, None if start == 0 else self._to_device(ctx_slots)))
            num_tokens += n
            last_indices.append(num_tokens - 1)
        attn = AttentionMetadata(slot_mapping=self._to_device(np.concatenate(slots)), prefill=metas)
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        positions_t = self._to_device(np.concatenate(positions))
        last = self._to_device(np.asarray(last_indices, dtype=np.int64))
        self.last_prepare_time = time.perf_counter() - t0
        return self.model.compute_logits(self.model(input_ids, positions_t, attn, self.kv_caches)[last])

    @torch.inference_mode()
    def run_decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token per sequence against the paged cache. Returns logits [B, vocab]."""
        t0 = time.perf_counter()
        bs = self.block_size
        batch = len(seqs)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((batch, max_blocks), dtype=np.int64)  # padding reads block 0, masked
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        context_lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=batch)
        positions = context_lens - 1
        slot_mapping = tables[np.arange(batch), positions // bs] * bs + positions % bs
        attn = AttentionMetadata(slot_mapping=self._to_device(slot_mapping), block_size=bs,
                                 block_tables=self._to_device(tables), context_lens=self._to_device(context_lens),
                                 decode_kernels=self.cpu_kernels)
        if self.cpu_kernels is None:
            ctx_slots = (tables[:, :, None] * bs + np.arange(bs, dtype=np.int64)).reshape(batch, max_blocks * bs)
            mask = np.where(np.arange(max_blocks * bs) < context_lens[:, None], 0.0, -np.inf).astype(np.float32)
            attn.decode_slots = self._to_device(ctx_slots)
            attn.decode_mask = self._to_device(mask).to(self.dtype).view(batch, 1, 1, -1)
        input_ids = torch.tensor([s.last_token_id for s in seqs], dtype=torch.long).to(self.device, non_blocking=True)
        positions_t = self._to_device(positions)
        self.last_prepare_time = time.perf_counter() - t0
        return self.model.compute_logits(self.model(input_ids, positions_t, attn, self.kv_caches))
