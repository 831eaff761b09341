"""Runs the model for the two workloads, in one forward per step: packed prefill chunks and one
token per decoding sequence.

Owns the device, the weights, the KV cache pool, its persistent batch of rows (updated from each
SchedulerOutput's diffs; it never sees the scheduler's sequences) and the sampler: a step goes
in as a SchedulerOutput value and comes out as a RunnerOutput value.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from engine.config import EngineConfig, usable_cpus
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler_output import SchedulerOutput
from engine.execution.attention import AttentionMetadata
from engine.execution.huge_pages import huge_page_tensor
from engine.execution.input_batch import CachedRequestState, DecodeInputs, InputBatch, prepare_decode, prepare_prefill
from engine.execution.kernels import ISAS, load_cpu_kernels
from engine.execution.model_loader import iter_weights
from engine.execution.models import model_class
from engine.execution.models.layers import can_pack_linear
from engine.execution.prompt_logprobs import prompt_logprobs
from engine.execution.sampler import Sampler

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



def pick_isa(kernels: ModuleType | None, wanted: str) -> int:
    """The SIMD path of the C++ kernels: the best this CPU runs, or a lower one named by
    MINIVLLM_KERNEL_ISA (scalar | avx2 | avx512 | avx512_bf16 | amx) to test or compare it.
    avx512_bf16 and amx are AVX-512 whose bfloat16 panels' products run on vdpbf16ps or on the
    AMX tiles (bf16 activations there)."""
    if kernels is None:
        return 0
    best = kernels.best_isa()
    if wanted == "auto":
        return best
    if wanted not in ISAS:
        raise ValueError(f"kernel_isa (MINIVLLM_KERNEL_ISA) must be auto, {', '.join(ISAS)}, got {wanted!r}")
    if ISAS[wanted] > best:
        raise ValueError(f"kernel_isa (MINIVLLM_KERNEL_ISA) {wanted}: this CPU does not run it")
    return ISAS[wanted]


class ModelRunner:
    def __init__(self, model_dir: Path, hf_config: object, config: EngineConfig) -> None:
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or usable_cpus())
        cls = model_class(hf_config.model_type)
        self.model_config = cls.config_from_hf(hf_config)
        self.block_size = config.block_size
        self.batch = InputBatch()
        model = cls(self.model_config)
        model.load_weights(iter_weights(model_dir))
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        is_cpu = self.device.type == "cpu"
        quantized = config.quantization == "int8"
        if quantized and not is_cpu:
            raise ValueError("quantization: int8 runs on the CPU only")
        use_kernels = is_cpu and self.dtype in (torch.float32, torch.bfloat16) and config.enable_cpp_kernels
        self.cpu_kernels = load_cpu_kernels() if use_kernels else None
        if quantized and self.cpu_kernels is None:
            raise ValueError("quantization: int8 needs the C++ CPU kernels (a compiler, dtype float32 or bfloat16, "
                             "enable_cpp_kernels)")
        self.isa = pick_isa(self.cpu_kernels, config.kernel_isa)
        max_fused = config.max_fused_tokens
        if max_fused is None:  # the crossovers measured on a 2-core AVX-512/AMX CPU (README)
            # Every step: in int8 (the panels are its only copy); in float32 with AVX-512 (the
            # panels' GEMM keeps up with oneDNN's at 512 rows, and a step past the old limit of 64
            # tokens, 22 decodes + a 72-token chunk under the time budget, cost 156 ms through
            # torch's ~150 ops a layer against 109-126 ms fused); in bf16 on AMX (the tiles beat
            # oneDNN's bf16 GEMM up to 128 rows and reach 0.7-0.86x of it at 512, where the fused
            # layer's fewer ops even it out) and with vdpbf16ps (on a 2-core Zen 4, 1.07x oneDNN's
            # bf16 GEMM at 32 rows, 0.94x at 512: `python -m bench.packed_gemm`). Unmeasured past
            # 64 on AVX2; bf16 on the FMA units loses to oneDNN past a few rows.
            every_step = (quantized or (self.dtype == torch.float32 and self.isa >= ISAS["avx512"])
                          or self.isa >= ISAS["avx512_bf16"])
            max_fused = sys.maxsize if every_step else 64 if self.dtype == torch.float32 else 8
        panel_dtype = torch.int8 if quantized else self.dtype if self.cpu_kernels is not None and max_fused > 0 else None
        # oneDNN's copy of the weights only where some step runs the torch path.
        every_step_fused = panel_dtype is not None and max_fused == sys.maxsize
        onednn = is_cpu and not every_step_fused and config.enable_onednn and can_pack_linear(self.dtype)
        if onednn or panel_dtype is not None:
            self.model.pack_weights(onednn, panel_dtype, self.cpu_kernels, self.isa, max_fused,
                                    huge_pages=config.enable_huge_pages)
        self.max_fused_tokens = max_fused if self.model.fused_kernels is not None else 0
        mc = self.model_config
        # The C++ prefill attention where it was measured ahead of torch's flash kernel: its
        # AVX-512 tiles (1.3x at a chunk over 1000 cached tokens, 2.6x at a first chunk, README);
        # its portable loop is slower than flash, so AVX2 machines keep flash.
        fits = mc.num_heads // mc.num_kv_heads <= 8 and mc.head_dim <= 256
        self.prefill_kernels = self.cpu_kernels if self.isa >= ISAS["avx512"] and fits else None
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for(config.kv_cache_gib)
        # One pool for all layers: [layers, k/v, slots, kv_heads, head_dim]. Decode attention
        # reads a sequence's blocks scattered over it: on 2 MiB pages, without a TLB miss each.
        shape = (mc.num_layers, 2, self.num_kv_blocks * self.block_size, mc.num_kv_heads, mc.head_dim)
        if is_cpu and config.enable_huge_pages:
            # Faulted in now, not by the steps that first write each block: a fault there (a 2 MiB
            # page zeroed, perhaps compacted for) made prefill steps look slow to the step cost
            # model, which then cut chunks small (515 steps for a served workload that takes 395).
            self.kv_cache = huge_page_tensor(shape, self.cache_dtype).zero_()
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        if self.max_fused_tokens:
            self.model.bind_decode(self.kv_caches, self.block_size)
        self.sampler = Sampler(self.device, config.seed, self.cpu_kernels)
        logger.info("model on %s (%s), KV cache %d blocks x %d tokens (%s, %.2f GiB)", self.device, self.dtype,
                    self.num_kv_blocks, self.block_size, self.cache_dtype,
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked samples: the K/V of block src into block dst, every layer at once."""
        bs = self.block_size
        offsets = torch.arange(bs)
        src = torch.cat([offsets + s * bs for s, _ in pairs]).to(self.device)  # [copies * bs] slots
        dst = torch.cat([offsets + d * bs for _, d in pairs]).to(self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [layers, k/v, slots, kv_heads, head_dim]

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
        if not sched.prefill_req_ids and len(sched.decode_req_ids) <= self.max_fused_tokens:
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
                                  self.block_size, self._to_device, self.prefill_kernels is not None)
        decode = prepare_decode([rows[r] for r in sched.decode_req_ids], self.block_size)
        num_prefill_tokens = prefill.num_tokens if prefill else 0
        parts = [p for p in (prefill, decode) if p is not None]
        input_ids = torch.from_numpy(np.concatenate([p.token_ids for p in parts])).to(self.device)
        positions = self._to_device(np.concatenate([p.positions for p in parts]))
        attn = AttentionMetadata(slot_mapping=self._to_device(np.concatenate([p.slot_mapping for p in parts])),
                                 num_prefill_tokens=num_prefill_tokens,
                                 prefill=prefill.metas if prefill else None, block_size=self.block_size,
                                 kernel_isa=self.isa)
        if prefill is not None:
            attn.prefill_kernels = self.prefill_kernels
        if decode is not None:
            self._fill_decode(attn, decode)
        attn.is_fused = len(input_ids) <= self.max_fused_tokens
        rows_t = None  # a decode-only step samples every row, in order: no gather
        if prefill is not None:
            last_row = dict(zip(sched.prefill_req_ids, prefill.last_indices, strict=True))
            sample_rows = [prefill.last_indices[i] for i in sched.prefill_sample_rows]
            sample_rows += range(num_prefill_tokens, num_prefill_tokens + len(sched.decode_req_ids))
            sample_rows += [last_row[parent] for parent in sched.fork_parent_ids]  # forks: their parent's row
            rows_t = self._to_device(np.asarray(sample_rows, dtype=np.int64))
        out.prepare_time = time.perf_counter() - t0
        hidden = self.model(input_ids, positions, attn, self.kv_caches)  # [T, hidden]
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
        return self.model.decode_logits(token_ids, block_tables, context_lens, with_argmax)

    def _fill_decode(self, attn: AttentionMetadata, decode: DecodeInputs) -> None:
        attn.block_tables = self._to_device(decode.block_tables)
        attn.context_lens = self._to_device(decode.context_lens)
        attn.decode_kernels = self.cpu_kernels
        if self.cpu_kernels is None:  # the torch path gathers contexts through one [B, L] slot index
            batch, max_blocks = decode.block_tables.shape
            bs = self.block_size
            ctx_slots = (decode.block_tables[:, :, None] * bs + np.arange(bs, dtype=np.int64)).reshape(batch, -1)
            mask = np.where(np.arange(max_blocks * bs) < decode.context_lens[:, None], 0.0, -np.inf)
            attn.decode_slots = self._to_device(ctx_slots)
            attn.decode_mask = self._to_device(mask.astype(np.float32)).to(self.dtype).view(batch, 1, 1, -1)
