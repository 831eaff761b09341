"""Runs the model for the two workloads, in one forward per step: packed prefill chunks and one
token per decoding sequence.

Owns the backend (engine/execution/backends: the device, the weights in the form it runs, the
attention), the KV cache pool, its persistent batch of rows (updated from each SchedulerOutput's
diffs; it never sees the scheduler's sequences) and the sampler: a step goes in as a
SchedulerOutput value and comes out as a RunnerOutput value. Nothing here depends on which
backend runs the step.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import numpy as np
import torch

from engine.config import Quantization
from engine.core.runner_output import RunnerOutput
from engine.core.scheduler_output import SchedulerOutput
from engine.execution.attention import AttentionMetadata, PrefillSeqMeta
from engine.execution.backends import select_backend
from engine.execution.host_memory import HostMemory
from engine.execution.input_batch import CachedRequestState, Chunk, InputBatch, prepare_decode, prepare_prefill
from engine.execution.kv_cache_layout import KVCacheLayout
from engine.execution.models import model_class
from engine.execution.models.moe import track_expert_usage
from engine.execution.pooler import pool_prefill
from engine.execution.prompt_logprobs import prompt_logprobs
from engine.execution.resolved_config import ResolvedConfig
from engine.execution.sampler import Sampler
from engine.execution.speculative import make_proposer
from engine.execution.speculative.speculator import Speculator
from engine.execution.startup_phases import KV_CACHE_ALLOCATION, PACKING, WARM_UP, WEIGHT_LOADING, StartupPhases
from engine.execution.weights.checkpoint import gguf_path, iter_weights
from engine.execution.weights.gguf_file import GGUFFile
from engine.processing.pooling_params import PoolingType

logger = logging.getLogger(__name__)



class ModelRunner:
    def __init__(self, model_dir: Path, hf_config: object, resolved: ResolvedConfig,
                 phases: StartupPhases | None = None, score_token_ids: tuple[int, ...] = ()) -> None:
        """Loads the weights, packs them and allocates the KV pool: phases times each (the
        engine's start-up log; a runner built alone logs them too). score_token_ids: a causal LM
        served for scores, the tokens whose logits its score head reads."""
        phases = phases or StartupPhases()
        config = resolved.config
        cls = model_class(hf_config.model_type, getattr(hf_config, "architectures", None))
        self.model_config = cls.config_from_hf(hf_config)
        if score_token_ids:
            self.model_config = dataclasses.replace(self.model_config, score_token_ids=score_token_ids)
        self.backend = select_backend(resolved, self.model_config)
        self.device, self.dtype, self.cache_dtype = self.backend.device, self.backend.dtype, self.backend.cache_dtype
        self.block_size = config.block_size
        self.batch = InputBatch()
        mc = self.model_config
        # Which layers share block tables (full attention, each window size) and pool tensors.
        self.kv_layout = KVCacheLayout.of(mc.sliding_windows, config.enable_hybrid_kv_cache,
                                          config.max_model_len or mc.max_position_embeddings)
        with phases.phase(WEIGHT_LOADING):
            if resolved.quantization is Quantization.GGUF:
                self.model = self._load_gguf(cls, gguf_path(config.model))
            else:
                self.model = self.backend.load_model(cls, iter_weights(model_dir))
        with phases.phase(PACKING):
            self.backend.prepare(self.model)
        self.expert_usage = track_expert_usage(self.model)  # after prepare: the experts it runs
        with phases.phase(KV_CACHE_ALLOCATION):
            if mc.is_causal:
                # sized after packing: on a GPU the pool takes what the weights leave
                self.num_kv_blocks = config.num_kv_blocks or max(1, self.backend.kv_cache_bytes() // self._block_bytes)
                # One pool for all layers: [group_size, k/v, slots, kv_heads, head_dim], tensor p holding
                # layer p of every KV-cache group (all layers with one group), and the null block past
                # the usable ones where a window group releases blocks.
                num_slots = (self.num_kv_blocks + self.kv_layout.has_null_block) * self.block_size
                self.kv_cache = self.backend.allocate_kv_cache(
                    (self.kv_layout.group_size, 2, num_slots, mc.num_kv_heads, mc.head_dim))
            else:
                # An encoder keeps no K/V after its step: its blocks only count a step's tokens for
                # admission, so they take no memory (an empty pool: a write to it would fail loudly).
                # Enough for two full steps of whole prompts, each wasting at most a block's tail.
                self.num_kv_blocks = config.num_kv_blocks or 2 * (
                    -(-config.max_num_batched_tokens // self.block_size) + config.max_num_seqs)
                self.kv_cache = torch.empty((self.kv_layout.group_size, 2, 0, mc.num_kv_heads, mc.head_dim),
                                            dtype=self.cache_dtype, device=self.device)
            self.kv_caches = [(self.kv_cache[p, 0], self.kv_cache[p, 1]) for p in self.kv_layout.layer_slot]
            self.backend.bind_kv_cache(self.model, self.kv_caches, self.block_size, self.kv_layout.layer_group)
        if self.backend.has_warm_up:
            with phases.phase(WARM_UP):
                self.backend.warm_up()
        self.sampler = Sampler(self.device, config.seed, self.backend.kernels)
        proposer = make_proposer(config)
        self.speculator = Speculator(proposer, self.sampler, config.speculative_max_batch,
                                     config.num_speculative_tokens) if proposer else None
        self._num_steps = 0
        # A model that reads token types (a BERT cross-encoder) gets them with every forward;
        # others never see the keyword, nor pay for building it.
        self.uses_token_types = bool(getattr(self.model, "uses_token_types", False))
        self.takes_output_rows = bool(getattr(self.model, "takes_output_rows", False))
        groups = "" if self.kv_layout.is_single_group else (
            f", {self.kv_layout.num_groups} KV-cache groups of {self.kv_layout.group_size} layers (windows "
            f"{', '.join(str(w or 'full') for w in self.kv_layout.windows)})")
        logger.info("%s; KV cache %d blocks x %d tokens (%.2f GiB)%s", self.backend.describe(), self.num_kv_blocks,
                    self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, groups)

    def _load_gguf(self, cls: type[torch.nn.Module], path: Path) -> torch.nn.Module:
        """The model from a GGUF file, its blocks kept as the backend runs them (refused first
        where it cannot fit). The file's reader (its header's Python objects: 170 MB for a
        150,000-token vocabulary) is dropped on return, before packing returns freed memory to
        the OS."""
        gguf = GGUFFile(path)
        self._refuse_what_cannot_fit(gguf)
        return self.backend.load_gguf_model(cls, gguf)

    def _refuse_what_cannot_fit(self, gguf: GGUFFile) -> None:
        """On the CPU, a file whose weights and KV pool exceed the memory available is refused
        before a byte of it is read (engine/execution/host_memory.py says why)."""
        if self.device.type != "cpu" or (memory := HostMemory.read()) is None:
            return
        itemsize = torch.finfo(self.dtype).bits // 8
        weights = gguf.resident_bytes(itemsize, keep_blocks=self.backend.gguf)
        num_blocks = self.backend.config.num_kv_blocks or max(1, self.backend.kv_cache_bytes() // self._block_bytes)
        kv_cache = (num_blocks + self.kv_layout.has_null_block) * self._block_bytes
        memory.check_fits(f"GGUF file {gguf.path.name}", weights, kv_cache)

    @property
    def num_moe_layers(self) -> int:
        """The model's mixture-of-experts layers (0: dense)."""
        return 0 if self.expert_usage is None else self.expert_usage.num_moe_layers

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked samples: the K/V of block src into block dst, every layer at once."""
        self.backend.copy_blocks(self.kv_cache, pairs, self.block_size)

    @property
    def _block_bytes(self) -> int:
        """A block id's memory: K and V of block_size tokens in each of group_size layers."""
        mc = self.model_config
        return (2 * self.kv_layout.group_size * self.block_size * mc.num_kv_heads * mc.head_dim
                * torch.finfo(self.cache_dtype).bits // 8)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def execute(self, sched: SchedulerOutput, gate: threading.Event | None = None) -> RunnerOutput:
        """One step: update the persistent batch from the step's diffs, copy forked blocks, run one
        forward over every scheduled token (the prefill chunks and verifications, packed without
        padding, then one token per decoding sequence), sample every request in
        `sched.sampling_req_ids` (a verification: its accepted drafts and one more), and propose
        the next step's drafts. The projections and MLPs see all rows at once (the weights are
        read once per step, which on a CPU is most of a small step); only attention splits by path.
        gate (async scheduling): sampling waits until it is set, which the engine does once it has
        processed the step before this one. That processing advances a grammar's matcher over the
        step's token, and this step's mask is that matcher's next; until then the matchers are the
        engine thread's. A request that step ended is still sampled here (a complete grammar allows
        only EOS) and its token dropped."""
        t0 = time.perf_counter()
        self._num_steps += 1
        if self.speculator is not None:
            preempted = set(sched.preempted_req_ids)
            for req_id in sched.removed_req_ids:
                if req_id in self.batch.rows:
                    self.speculator.remove(self.batch.rows[req_id], req_id in preempted)
        self.batch.update(sched)
        if sched.blocks_to_copy:
            self.copy_blocks(sched.blocks_to_copy)
        req_ids = sched.sampling_req_ids
        rows = [self.batch.rows[r] for r in req_ids]
        out = RunnerOutput(req_ids)
        if not sched.prefill_req_ids and sched.num_verify_tokens + len(sched.decode_req_ids) \
                <= self.backend.max_decode_rows:
            # The backend's own decode path (the CPU's one C++ call, CUDA's graphs), outside
            # inference mode: it builds no autograd graph either way, and the mode's switch costs
            # host time in a small step. A verification runs there as decode rows, one per
            # position of the sequence (each row attends up to its own position).
            logits, greedy_ids = self._execute_backend_decode(sched, rows, t0, out)
        else:
            logits, greedy_ids = self._execute_modules(sched, t0, out), None
        t1 = time.perf_counter()
        out.forward_time = t1 - t0 - out.prepare_time
        if self.expert_usage is not None:
            out.num_experts_touched = self.expert_usage.take()
        if not req_ids:  # only pooling chunks ran: nothing samples
            out.sample_time = time.perf_counter() - t1
            return out
        if gate is not None:
            t_wait = time.perf_counter()
            gate.wait()
            t1 += time.perf_counter() - t_wait  # sample_time leaves the wait out
        if sched.verify_req_ids:
            out.sampled_token_ids, out.logprobs = self._sample_with_verification(sched, logits, rows, greedy_ids)
        else:
            sampled = self.sampler(logits, rows, greedy_ids)
            out.sampled_token_ids = [[t] for t in sampled.token_ids]
            out.logprobs = [None if lp is None else [lp] for lp in sampled.logprobs]
        self.batch.append_sampled(req_ids, out.sampled_token_ids)
        if self.speculator is not None:
            out.draft_token_ids = self.speculator.propose(rows, self._num_steps)
        out.sample_time = time.perf_counter() - t1
        return out

    def _sample_with_verification(self, sched: SchedulerOutput, logits: torch.Tensor,
                                  rows: list[CachedRequestState], greedy_ids: list[int] | None
                                  ) -> tuple[list[list[int]], list]:
        """logits: [prefill samples | every verified row | decodes | forks, vocab]: the plain rows
        sample as always, the verifications accept or reject their drafts. greedy_ids: every
        row's argmax when every request is plain greedy (the forward made them): then that is
        all either needs."""
        num_first = len(sched.prefill_sample_rows)
        num_verified = sched.num_verify_tokens
        if greedy_ids is not None:
            verified = greedy_ids[num_first : num_first + num_verified]
            tokens = self.speculator.accept_greedy(verified, rows[num_first : num_first + len(sched.verify_req_ids)],
                                                   sched.verify_draft_ids, self._num_steps)
            plain = [[t] for t in greedy_ids[:num_first] + greedy_ids[num_first + num_verified:]]
            return plain[:num_first] + tokens + plain[num_first:], [None] * len(rows)
        plain = list(range(num_first)) + list(range(num_first + num_verified, logits.shape[0]))
        verifying = len(sched.verify_req_ids)
        plain_rows = rows[:num_first] + rows[num_first + verifying:]
        sampled = self.sampler(logits[plain], plain_rows) if plain else None
        tokens, logprobs = self.speculator.verify(logits[num_first : num_first + num_verified],
                                                  rows[num_first : num_first + verifying], sched.verify_draft_ids,
                                                  self._num_steps)
        plain_tokens = [[t] for t in sampled.token_ids] if sampled else []
        plain_logprobs = [None if lp is None else [lp] for lp in sampled.logprobs] if sampled else []
        return (plain_tokens[:num_first] + tokens + plain_tokens[num_first:],
                plain_logprobs[:num_first] + logprobs + plain_logprobs[num_first:])

    @torch.inference_mode()
    def _execute_modules(self, sched: SchedulerOutput, t0: float, out: RunnerOutput) -> torch.Tensor:
        """The step through the model's modules (prefill, or more decode rows than the fused call
        takes) -> logits of the sampling rows [num_sampling, vocab]."""
        rows = self.batch.rows
        prefill_rows = [rows[r] for r in sched.prefill_req_ids]
        chunks = [Chunk(row.token_ids_slice(start, start + n), start, row.block_tables) for row, start, n in zip(
            prefill_rows, sched.prefill_num_computed, sched.prefill_num_tokens, strict=True)]
        for req_id, drafts in zip(sched.verify_req_ids, sched.verify_draft_ids, strict=True):
            row = rows[req_id]  # its last token (not yet computed) and the drafts after it
            chunks.append(Chunk([row.last_token_id, *drafts], row.num_tokens - 1, row.block_tables))
        decode_rows = [rows[r] for r in sched.decode_req_ids]
        # Each KV-cache group's slots and tables (the tokens and positions are every group's).
        group_attn = []
        for group in range(self.kv_layout.num_groups):
            prefill = prepare_prefill(chunks, self.block_size, self._to_device,
                                      self.backend.attention.reads_prefill_block_tables, group)
            decode = prepare_decode(decode_rows, self.block_size, group)
            num_prefill_tokens = prefill.num_tokens if prefill else 0
            parts = [p for p in (prefill, decode) if p is not None]
            attn = AttentionMetadata(slot_mapping=self._to_device(np.concatenate([p.slot_mapping for p in parts])),
                                     num_prefill_tokens=num_prefill_tokens, prefill=prefill.metas if prefill else None,
                                     block_size=self.block_size, backend=self.backend.attention,
                                     is_fused=sum(len(p.token_ids) for p in parts) <= self.backend.max_fused_tokens)
            if prefill is not None:
                self.backend.attention.prepare_prefill(attn, [c.block_tables[group] for c in chunks],
                                                       [c.start for c in chunks], [len(c.token_ids) for c in chunks])
            if decode is not None:
                self.backend.attention.prepare_decode(attn, self._to_device(decode.block_tables),
                                                      self._to_device(decode.context_lens))
            group_attn.append(attn)
        input_ids = torch.from_numpy(np.concatenate([p.token_ids for p in parts])).to(self.device)
        positions = self._to_device(np.concatenate([p.positions for p in parts]))
        if len(group_attn) > 1:  # the step's: no slots of its own, each layer reads its group's
            attn = AttentionMetadata(slot_mapping=None, num_prefill_tokens=num_prefill_tokens,
                                     block_size=self.block_size, backend=self.backend.attention,
                                     is_fused=attn.is_fused, groups=group_attn, layer_group=self.kv_layout.layer_group)
        rows_t = None  # a decode-only step samples every row, in order: no gather
        sample_rows: list[int] = []
        if prefill is not None:
            last_row = dict(zip(sched.prefill_req_ids, prefill.last_indices[: len(prefill_rows)], strict=True))
            sample_rows = [prefill.last_indices[i] for i in sched.prefill_sample_rows]
            for meta in prefill.metas[len(prefill_rows):]:  # a verification samples at every row
                sample_rows += range(meta.query_start, meta.query_start + meta.query_len)
            sample_rows += range(num_prefill_tokens, num_prefill_tokens + len(sched.decode_req_ids))
            sample_rows += [last_row[parent] for parent in sched.fork_parent_ids]  # forks: their parent's row
            rows_t = self._to_device(np.asarray(sample_rows, dtype=np.int64))
        model_inputs = {}
        if self.uses_token_types:
            model_inputs["token_type_ids"] = self._token_type_ids(prefill_rows, sched, len(input_ids))
        if self.takes_output_rows and prefill is not None:
            model_inputs["output_rows"] = self._read_rows(sched, prefill_rows, prefill.metas, sample_rows,
                                                          len(input_ids))
        out.prepare_time = time.perf_counter() - t0
        hidden = self.backend.forward(self.model, input_ids, positions, attn, self.kv_caches,
                                      **model_inputs)  # [T, hidden]
        if prefill is not None:
            out.prompt_logprobs = prompt_logprobs(self.model, sched, prefill_rows, prefill.metas, hidden)
            if any(sched.prefill_is_pooling):
                out.pooled_req_ids, out.pooled = pool_prefill(sched, prefill_rows, prefill.metas, hidden,
                                                              getattr(self.model, "score_head", None))
        if rows_t is not None and rows_t.numel() == 0:  # pooling chunks alone: no logits to make
            return hidden.new_empty((0, self.model_config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden if rows_t is None else hidden[rows_t])

    def _read_rows(self, sched: SchedulerOutput, prefill_rows: list[CachedRequestState],
                   metas: list[PrefillSeqMeta], sample_rows: list[int], num_tokens: int) -> torch.Tensor | None:
        """The rows of the step's final hidden states that anything reads ([R] int64, ascending):
        the sampled ones, a [CLS]-pooled prompt's first row, a last-token-pooled prompt's last.
        None (every row) when a chunk asks for prompt logprobs or pools by mean, or when every
        row is read anyway (a step of verifications: no gather and scatter of the whole step)."""
        rows = set(sample_rows)
        for i, row in enumerate(prefill_rows):
            meta, params = metas[i], row.pooling_params
            if row.params.prompt_logprobs is not None:
                return None
            if params is None:
                continue
            if params.pooling_type is PoolingType.MEAN:
                return None
            if params.pooling_type is PoolingType.CLS and sched.prefill_num_computed[i] == 0:
                rows.add(meta.query_start)
            elif params.pooling_type is PoolingType.LAST and sched.prefill_is_last_chunk[i]:
                rows.add(meta.query_start + meta.query_len - 1)
        if len(rows) == num_tokens:
            return None
        return self._to_device(np.asarray(sorted(rows), dtype=np.int64))

    def _token_type_ids(self, prefill_rows: list[CachedRequestState], sched: SchedulerOutput,
                        num_tokens: int) -> torch.Tensor | None:
        """The step's token types aligned with its packed input ids, [num_tokens] int64: each
        prefill chunk's slice of its prompt's types (0 where a request has none, and for the
        verified and decoded rows after the chunks); None when no chunk has any."""
        if not any(row.token_type_ids is not None for row in prefill_rows):
            return None
        types = np.zeros(num_tokens, dtype=np.int64)
        offset = 0
        for row, start, n in zip(prefill_rows, sched.prefill_num_computed, sched.prefill_num_tokens, strict=True):
            if row.token_type_ids is not None:
                types[offset : offset + n] = row.token_type_ids[start : start + n]
            offset += n
        return self._to_device(types)

    def _execute_backend_decode(self, sched: SchedulerOutput, rows: list[CachedRequestState], t0: float,
                                out: RunnerOutput) -> tuple[torch.Tensor, list[int] | None]:
        """A decode-only step by the backend's own path, from the rows' own lists to logits
        [rows, vocab] float32 (and, when every row is plain greedy, their argmax): the verified
        positions first (a request's consecutive), then the decodes."""
        num_groups = self.kv_layout.num_groups
        token_ids, context_lens = [], []
        block_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]  # [groups][rows]: a table each
        for row, drafts in zip(rows, sched.verify_draft_ids, strict=False):  # the verifications lead `rows`
            token_ids += [row.last_token_id, *drafts]
            for group in range(num_groups):
                block_tables[group] += [row.block_tables[group]] * (1 + len(drafts))
            context_lens += range(row.num_tokens, row.num_tokens + 1 + len(drafts))
        decodes = rows[len(sched.verify_req_ids):]
        token_ids += [r.last_token_id for r in decodes]
        for group in range(num_groups):
            block_tables[group] += [r.block_tables[group] for r in decodes]
        context_lens += [r.num_tokens for r in decodes]
        # Plain greedy rows need only the argmax, verified positions too (a request's rows all
        # count as past min_tokens when its first does: the later ones have more output).
        with_argmax = self.sampler.is_plain_greedy(rows)
        out.prepare_time = time.perf_counter() - t0
        return self.backend.decode_logits(token_ids, block_tables, context_lens, with_argmax)
