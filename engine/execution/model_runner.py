"""Runs the model for the two workloads, in one forward per step: packed prefill chunks and one
token per decoding sequence.

Owns the device, the weights and the KV cache pool. Reads sequences, never mutates them:
the engine folds results back after sampling.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from engine.config import EngineConfig, usable_cpus
from engine.core.scheduler_output import SchedulerOutput
from engine.core.sequence import Sequence
from engine.execution.attention import AttentionMetadata, PrefillSeqMeta
from engine.execution.huge_pages import huge_page_tensor
from engine.execution.kernels import ISAS, load_cpu_kernels
from engine.execution.model_loader import iter_weights
from engine.execution.models import model_class
from engine.execution.models.layers import can_pack_linear

logger = logging.getLogger(__name__)

_PROMPT_LOGPROB_ROWS = 256  # prompt positions scored per logits slice

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
        self.last_prepare_time = 0.0  # host-side input building of the last run_* call (seconds)
        # (seq, first prompt position, entries) of the last execute's prompt-logprob chunks
        self.last_prompt_logprobs: list[tuple[Sequence, int, list[dict[int, float]]]] = []
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

    def execute(self, sched: SchedulerOutput, with_argmax: bool = False) -> tuple[torch.Tensor, list[int] | None]:
        """One forward over every token the step scheduled: the prefill chunks, packed without
        padding, then one token per decoding sequence. The projections and MLPs see all rows
        at once (the weights are read once per step, which on a CPU is most of a small step);
        only attention splits by path. Returns logits of the sampling rows, in
        `sched.sampling_seqs` order: [num_sampling, vocab], and, when with_argmax and the step
        ran as one fused call, each row's first argmax (a list of num_sampling ints; else None)."""
        t0 = time.perf_counter()
        self.last_prompt_logprobs = []
        if not sched.prefill_seqs and len(sched.decode_seqs) <= self.max_fused_tokens:
            # One C++ call, outside inference mode: it builds no autograd graph either way, and
            # without the mode's switch (cold after a batch-1 step) this method's own time in a
            # bf16 step went from 43-51 to 15-24 us.
            return self._execute_fused_decode(sched.decode_seqs, with_argmax, t0)
        return self._execute_modules(sched, t0)

    @torch.inference_mode()
    def _execute_modules(self, sched: SchedulerOutput, t0: float) -> tuple[torch.Tensor, None]:
        """The step through the model's modules (prefill, or more decode rows than the fused call takes)."""
        prefill = self._prepare_prefill(sched.prefill_seqs, sched.prefill_num_tokens)
        decode = self._prepare_decode(sched.decode_seqs)
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
            decode.fill(attn, self)
        attn.is_fused = len(input_ids) <= self.max_fused_tokens
        rows_t = None  # a decode-only step samples every row, in order: no gather
        if prefill is not None:
            rows = [prefill.last_indices[i] for i in sched.prefill_sample_rows]
            rows += range(num_prefill_tokens, num_prefill_tokens + len(sched.decode_seqs))
            rows_t = self._to_device(np.asarray(rows, dtype=np.int64))
        self.last_prepare_time = time.perf_counter() - t0
        hidden = self.model(input_ids, positions, attn, self.kv_caches)  # [T, hidden]
        if prefill is not None:
            self.last_prompt_logprobs = self._prompt_logprobs(sched, prefill, hidden)
        return self.model.compute_logits(hidden if rows_t is None else hidden[rows_t]), None

    def _execute_fused_decode(self, seqs: list[Sequence], with_argmax: bool, t0: float
                              ) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step on the fused kernels (CPU only): one C++ call from the sequences'
        own lists to logits [B, vocab] float32 (and their argmax)."""
        token_ids = [s.last_token_id for s in seqs]
        block_tables = [s.block_table for s in seqs]
        context_lens = [s.num_tokens for s in seqs]
        self.last_prepare_time = time.perf_counter() - t0
        return self.model.decode_logits(token_ids, block_tables, context_lens, with_argmax)

    def _prompt_logprobs(self, sched: SchedulerOutput, prefill: _PrefillInputs, hidden: torch.Tensor
                         ) -> list[tuple[Sequence, int, list[dict[int, float]]]]:
        """(seq, first prompt position, entries) for prefill chunks that asked for prompt
        logprobs: entry k scores prompt token first + k (from position first + k - 1), with
        that token's logprob and the top-N. Logits are made a slice of rows at a time, never for
        a whole long prompt at once ([rows, vocab] fp32 is 200 KB per row here)."""
        results = []
        for seq, n, meta in zip(sched.prefill_seqs, sched.prefill_num_tokens, prefill.metas, strict=True):
            top_n = seq.params.prompt_logprobs
            if top_n is None:
                continue
            start = seq.num_computed_tokens  # this chunk covers positions [start, start + n)
            first_row, last_pos = meta.query_start, min(start + n, seq.num_prompt_tokens - 1)  # the last scores no prompt token
            entries: list[dict[int, float]] = []
            for lo in range(start, last_pos, _PROMPT_LOGPROB_ROWS):
                hi = min(lo + _PROMPT_LOGPROB_ROWS, last_pos)
                logprobs = torch.log_softmax(self.model.compute_logits(
                    hidden[first_row + lo - start : first_row + hi - start]).float(), dim=-1)  # [rows, vocab]
                targets = torch.tensor(seq.prompt_token_ids[lo + 1 : hi + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                top = logprobs.topk(top_n, dim=-1) if top_n else None
                top_ids = top.indices.tolist() if top is not None else [[]] * len(chosen)
                top_values = top.values.tolist() if top is not None else [[]] * len(chosen)
                for target, value, ids, values in zip(targets.tolist(), chosen, top_ids, top_values, strict=True):
                    entry = {target: value}
                    for token_id, v in zip(ids, values, strict=True):
                        entry.setdefault(token_id, v)
                    entries.append(entry)
            results.append((seq, start + 1, entries))
        return results

    def _prepare_prefill(self, seqs: list[Sequence], num_new_tokens: list[int]) -> _PrefillInputs | None:
        if not seqs:
            return None
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
            meta = PrefillSeqMeta(num_tokens, n, start + n, None)
            if self.prefill_kernels is not None:  # the C++ kernel reads the cache by block table
                meta.block_table = self._to_device(table)
            elif start:  # the torch path reads the cached context by slot
                meta.context_slots = self._to_device(ctx_slots)
                first = int(ctx_slots[0])
                if np.array_equal(ctx_slots[:start], np.arange(first, first + start)):  # read the pool in place
                    meta.cached_slot_start = first
            metas.append(meta)
            num_tokens += n
            last_indices.append(num_tokens - 1)
        return _PrefillInputs(np.asarray(token_ids, dtype=np.int64), np.concatenate(positions), np.concatenate(slots),
                              metas, last_indices)

    def _prepare_decode(self, seqs: list[Sequence]) -> _DecodeInputs | None:
        if not seqs:
            return None
        bs = self.block_size
        batch = len(seqs)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((batch, max_blocks), dtype=np.int64)  # padding reads block 0, masked
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        context_lens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=batch)
        positions = context_lens - 1
        slot_mapping = tables[np.arange(batch), positions // bs] * bs + positions % bs
        token_ids = np.fromiter((s.last_token_id for s in seqs), dtype=np.int64, count=batch)
        return _DecodeInputs(token_ids, positions, slot_mapping, tables, context_lens)


@dataclass(slots=True)
class _PrefillInputs:
    token_ids: np.ndarray  # [T_prefill]
    positions: np.ndarray  # [T_prefill]
    slot_mapping: np.ndarray  # [T_prefill]
    metas: list[PrefillSeqMeta]
    last_indices: list[int]  # each chunk's last row

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class _DecodeInputs:
    token_ids: np.ndarray  # [B]
    positions: np.ndarray  # [B]
    slot_mapping: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max_blocks]
    context_lens: np.ndarray  # [B]

    def fill(self, attn: AttentionMetadata, runner: ModelRunner) -> None:
        attn.block_tables = runner._to_device(self.block_tables)
        attn.context_lens = runner._to_device(self.context_lens)
        attn.decode_kernels = runner.cpu_kernels
        if runner.cpu_kernels is None:  # the torch path gathers contexts through one [B, L] slot index
            batch, max_blocks = self.block_tables.shape
            bs = runner.block_size
            ctx_slots = (self.block_tables[:, :, None] * bs + np.arange(bs, dtype=np.int64)).reshape(batch, -1)
            mask = np.where(np.arange(max_blocks * bs) < self.context_lens[:, None], 0.0, -np.inf).astype(np.float32)
            attn.decode_slots = runner._to_device(ctx_slots)
            attn.decode_mask = runner._to_device(mask).to(runner.dtype).view(batch, 1, 1, -1)
