"""Runs the model for the two workloads, in one forward per step: packed prefill chunks and one
token per decoding sequence.

Owns the backend (engine/execution/backends: the device, the weights in the form it runs, the
attention), the KV cache pool, its persistent batch of rows (updated from each SchedulerOutput's
diffs; it never sees the scheduler's sequences) and the sampler: a step goes in as a
SchedulerOutput value and comes out as a RunnerOutput value. Nothing here depends on which
backend runs the step.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler_output import SchedulerOutput
from engine.execution.attention import AttentionMetadata
from engine.execution.backends import select_backend
from engine.execution.input_batch import CachedRequestState, InputBatch, prepare_decode, prepare_prefill
from engine.execution.model_loader import iter_weights
from engine.execution.models import model_class
from engine.execution.prompt_logprobs import prompt_logprobs
from engine.execution.sampler import Sampler

logger = logging.getLogger(__name__)



class ModelRunner:
    def __init__(self, model_dir: Path, hf_config: object, config: EngineConfig) -> None:
        cls = model_class(hf_config.model_type)
        self.model_config = cls.config_from_hf(hf_config)
        self.backend = select_backend(config, self.model_config)
        self.device, self.dtype, self.cache_dtype = self.backend.device, self.backend.dtype, self.backend.cache_dtype
        self.block_size = config.block_size
        self.batch = InputBatch()
        self.model = self.backend.load_model(cls(self.model_config), iter_weights(model_dir))
        mc = self.model_config
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for(config.kv_cache_gib)
        # One pool for all layers: [layers, k/v, slots, kv_heads, head_dim].
        self.kv_cache = self.backend.allocate_kv_cache(
            (mc.num_layers, 2, self.num_kv_blocks * self.block_size, mc.num_kv_heads, mc.head_dim))
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        self.backend.bind_kv_cache(self.model, self.kv_caches, self.block_size)
        self.sampler = Sampler(self.device, config.seed, self.backend.kernels)
        logger.info("%s; KV cache %d blocks x %d tokens (%.2f GiB)", self.backend.describe(), self.num_kv_blocks,
                    self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked samples: the K/V of block src into block dst, every layer at once."""
        self.backend.copy_blocks(self.kv_cache, pairs, self.block_size)

    def _blocks_for(self, gib: float) -> int:
        mc = self.model_config
        bytes_per_block = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                           * torch.finfo(self.cache_dtype).bits // 8)
        return max(1, int(gib * 2**30) // bytes_per_block)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step: update the persistent batch from the step's diffs, copy forked blocks, run one
        forward over every scheduled token (the prefill chunks, packed without padding, then one
        token per decoding sequence), and sample every request in `sched.sampling_req_ids`. The
        projections and MLPs see all rows at once (the weights are read once per step, which on a
        CPU is most of a small step); only attention splits by path."""
        t0 = time.perf_counter()
        self.batch.update(sched)
        if sched.blocks_to_copy:
            self.copy_blocks(sched.blocks_to_copy)
        req_ids = sched.sampling_req_ids
        rows = [self.batch.rows[r] for r in req_ids]
        out = RunnerOutput(req_ids)
        if not sched.prefill_req_ids and len(sched.decode_req_ids) <= self.backend.max_decode_rows:
            # One C++ call, outside inference mode: it builds no autograd graph either way, and
            # without the mode's switch (cold after a batch-1 step) it costs less host time.
            logits, greedy_ids = self._execute_fused_decode(rows, self.sampler.is_plain_greedy(rows), t0, out)
        else:
            logits, greedy_ids = self._execute_modules(sched, t0, out), None
        t1 = time.perf_counter()
        out.forward_time = t1 - t0 - out.prepare_time
        sampled = self.sampler(logits, rows, greedy_ids)
        out.sampled_token_ids, out.logprobs = sampled.token_ids, sampled.logprobs
        self.batch.append_sampled(req_ids, sampled.token_ids)
        out.sample_time = time.perf_counter() - t1
        return out

    @torch.inference_mode()
    def _execute_modules(self, sched: SchedulerOutput, t0: float, out: RunnerOutput) -> torch.Tensor:
        """The step through the model's modules (prefill, or more decode rows than the fused call
        takes) -> logits of the sampling rows [num_sampling, vocab]."""
        rows = self.batch.rows
        prefill_rows = [rows[r] for r in sched.prefill_req_ids]
        prefill = prepare_prefill(prefill_rows, sched.prefill_num_computed, sched.prefill_num_tokens,
                                  self.block_size, self._to_device, self.backend.attention.reads_prefill_block_tables)
        decode = prepare_decode([rows[r] for r in sched.decode_req_ids], self.block_size)
        num_prefill_tokens = prefill.num_tokens if prefill else 0
        parts = [p for p in (prefill, decode) if p is not None]
        input_ids = torch.from_numpy(np.concatenate([p.token_ids for p in parts])).to(self.device)
        positions = self._to_device(np.concatenate([p.positions for p in parts]))
        attn = AttentionMetadata(slot_mapping=self._to_device(np.concatenate([p.slot_mapping for p in parts])),
                                 num_prefill_tokens=num_prefill_tokens, prefill=prefill.metas if prefill else None,
                                 block_size=self.block_size, backend=self.backend.attention,
                                 is_fused=len(input_ids) <= self.backend.max_fused_tokens)
        if decode is not None:
            self.backend.attention.prepare_decode(attn, self._to_device(decode.block_tables),
                                                  self._to_device(decode.context_lens))
        rows_t = None  # a decode-only step samples every row, in order: no gather
        if prefill is not None:
            last_row = dict(zip(sched.prefill_req_ids, prefill.last_indices, strict=True))
            sample_rows = [prefill.last_indices[i] for i in sched.prefill_sample_rows]
            sample_rows += range(num_prefill_tokens, num_prefill_tokens + len(sched.decode_req_ids))
            sample_rows += [last_row[parent] for parent in sched.fork_parent_ids]  # forks: their parent's row
            rows_t = self._to_device(np.asarray(sample_rows, dtype=np.int64))
        out.prepare_time = time.perf_counter() - t0
        hidden = self.backend.forward(self.model, input_ids, positions, attn, self.kv_caches)  # [T, hidden]
        if prefill is not None:
            out.prompt_logprobs = prompt_logprobs(self.model, sched, prefill_rows, prefill, hidden)
        return self.model.compute_logits(hidden if rows_t is None else hidden[rows_t])

    def _execute_fused_decode(self, rows: list[CachedRequestState], with_argmax: bool, t0: float,
                              out: RunnerOutput) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step on the fused kernels (CPU only): one C++ call from the rows' own
        lists to logits [B, vocab] float32 (and, with_argmax, their argmax)."""
        token_ids = [r.last_token_id for r in rows]
        block_tables = [r.block_table for r in rows]
        context_lens = [r.num_tokens for r in rows]
        out.prepare_time = time.perf_counter() - t0
        return self.backend.decode_logits(token_ids, block_tables, context_lens, with_argmax)
