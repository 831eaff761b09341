"""Engine configuration: one validated dataclass, every knob with a CPU-friendly default.

This is the only module under engine/ that reads MINIVLLM_* environment variables: the CLI maps
MINIVLLM_<FIELD> onto every field, and a few older names stay here as aliases of fields
(MINIVLLM_DISABLE_CPP_KERNELS, MINIVLLM_KERNEL_ISA, MINIVLLM_DISABLE_PACKED_LINEAR,
MINIVLLM_CACHE), so code below the config never looks at the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # served from its own GGUF file (weights/checkpoint.py)


class Quantization(StrEnum):
    """How the weights are held. EngineConfig keeps the user's word ("auto" included);
    engine/execution/resolved_config.py settles auto once, where the backend and kernels are known."""

    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    GGUF = "gguf"


def _opt(default: Any, help: str) -> Any:
    """A config field whose help text the CLI shows (one source for flags, env vars and docs)."""
    return field(default=default, metadata={"help": help})


def _env_flag_off(name: str) -> bool:
    """False when the legacy switch MINIVLLM_<name>=1 turns a default-on feature off."""
    return os.environ.get(f"MINIVLLM_{name}") != "1"


def default_cache_dir() -> Path:
    """Where the converted default model and the kernel builds live (MINIVLLM_CACHE)."""
    return Path(os.environ.get("MINIVLLM_CACHE") or Path.home() / ".cache" / "minivllm")


def usable_cpus(cgroup_dir: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may really use: its affinity mask, capped by a cgroup v2 CPU quota
    (a container limited to 2 CPUs on a 64-core host must not start 64 threads)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup_dir / "cpu.max").read_text().split()[:2]
        if quota != "max":
            count = min(count, max(1, int(int(quota) / int(period) + 0.5)))
    except (OSError, ValueError):
        pass
    return max(1, count)


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Defaults suit the CPU default model.

    A plain value: validated here without I/O (beyond the environment's legacy aliases), its
    "auto" choices left as they are. What needs the machine (the device, the dtype, the C++
    kernels and their SIMD path, quantization auto, the kernel_isa name) is settled and refused
    once, by engine/execution/resolved_config.py's resolve_config.

    `model` is None (the default SmolLM2-135M-Instruct), a local HF directory, a `.gguf`
    file, or a hub id (only where a network allows it).
    """

    model: str | None = _opt(None, "a local HF directory, a .gguf file or a hub id; unset: SmolLM2-135M-Instruct")
    tokenizer: str | None = _opt(None, "tokenizer directory or id; unset: the model's")
    task: str = _opt("auto", "generate | embed (serve /v1/embeddings: the model's pooled hidden states) | score "
                             "(serve /rerank and /score: a cross-encoder's or reranker's score of each query and "
                             "document pair) | auto (score when config.json's architectures name a "
                             "*ForSequenceClassification, embed when the model directory has sentence-transformers' "
                             "modules.json with a Pooling module or a .gguf file a pooling_type of mean, cls or "
                             "last, else generate); vLLM's --task / --runner pooling")
    score_label_tokens: str | None = _opt(None, "task score on a causal LM (Qwen3-Reranker): the label tokens "
                                                "whose logits score a pair, comma-separated; two: the second's "
                                                "logit minus the first's, one: its logit; unset: no,yes "
                                                "(vLLM's hf_overrides classifier_from_token)")
    device: str = _opt("auto", "auto | cpu | cuda")
    backend: str = _opt("auto", "auto (cuda with a GPU, else cpu) | cpu (C++ kernels, oneDNN) | cuda (Triton "
                                "attention, CUDA graphs) | torch (the pure-torch reference, on `device`)")
    dtype: str = _opt("auto", "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16")
    seed: int = _opt(0, "seed of the engine's random generator (per-request seeds override it)")
    num_threads: int | None = _opt(None, "torch threads; unset: the CPUs this process may use "
                                         "(affinity and cgroup quota)")
    kv_cache_dtype: str = _opt("auto", "auto (the model's dtype) | float32 | bfloat16: a bfloat16 cache beside "
                                       "float32 weights holds twice the tokens and, on AVX512-BF16 CPUs, runs "
                                       "prefill attention on vdpbf16ps (greedy output may then differ from "
                                       "transformers' float32)")
    quantization: str = _opt("auto", "weight quantization: auto (gguf for a .gguf model on the CPU where its kernels build, else none) | "
                                     "none (a .gguf file dequantized to float) | int8 (weight-only, one scale per "
                                     "output channel; CPU; activations keep dtype, the KV cache kv_cache_dtype) | "
                                     "gguf (a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/MXFP4 blocks as they are, by integer-dot "
                                     "kernels; CPU; unset model: the default model's own Q4_1 file)")
    max_fused_tokens: int | None = _opt(None, "steps of at most this many tokens (decode sequences + prefill "
                                              "tokens) run each layer in C++ over weights packed in 16-channel "
                                              "panels (CPU); 0: off; unset: every step with int8 or gguf weights, in "
                                              "float32 on AVX-512 and in bfloat16 on AMX CPUs (then no oneDNN "
                                              "copy of the weights is kept), else 64 in float32 and 8 in bfloat16")
    enable_cpp_kernels: bool = field(default_factory=lambda: _env_flag_off("DISABLE_CPP_KERNELS"), metadata={
        "help": "the C++ CPU kernels (built on first use); off: the pure-torch reference path "
                "(alias MINIVLLM_DISABLE_CPP_KERNELS=1)"})
    kernel_isa: str = field(default_factory=lambda: os.environ.get("MINIVLLM_KERNEL_ISA", "auto"), metadata={
        "help": "the C++ kernels' SIMD path: auto (the best this CPU runs) | scalar | avx2 | avx512 | "
                "avx512_bf16 | amx (a lower one to test or compare it)"})
    enable_onednn: bool = field(default_factory=lambda: _env_flag_off("DISABLE_PACKED_LINEAR"), metadata={
        "help": "keep a oneDNN-packed copy of the weights for steps the panels do not run "
                "(alias MINIVLLM_DISABLE_PACKED_LINEAR=1 turns it off)"})
    gpu_memory_utilization: float = _opt(0.9, "fraction of the GPU's memory the engine may take: weights, "
                                              "activations and the KV cache, which gets the rest (CUDA; on the "
                                              "CPU kv_cache_gib sizes it)")
    enforce_eager: bool = _opt(False, "run decode steps eagerly instead of replaying CUDA graphs (CUDA)")
    enable_huge_pages: bool = _opt(True, "put the weight panels and the KV cache on 2 MiB pages (CPU, Linux "
                                         "transparent huge pages in madvise or always mode)")

    # Paged KV cache.
    block_size: int = _opt(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _opt(None, "KV cache blocks; unset: sized from kv_cache_gib")
    kv_cache_gib: float = _opt(1.0, "KV cache size in GiB when num_kv_blocks is unset")
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens; unset: the model's context length")
    enable_hybrid_kv_cache: bool = _opt(True, "give sliding-window layers their own block tables, so they release "
                                              "blocks before their window (off: every layer keeps every block)")

    # Scheduler: the token budget of one step and the policy knobs that balance
    # prefill (time to first token) against decode (streaming pace).
    # 2048, vLLM's API-server default: a lone long prompt prefills in chunks of 2048 (its products
    # on 2048 rows, its cached context's K and V laid out for attention a quarter as often: a
    # 4,000-token prefill 877 -> 725 ms against 512). While sequences decode, the time budget
    # (enable_time_budget: on in the server, off in LLM) sizes the chunks, not this cap.
    max_num_batched_tokens: int = _opt(2048, "token budget of one engine step (prefill + decode)")
    max_num_seqs: int = _opt(64, "sequences in the running batch at most")
    max_num_waiting: int = _opt(1024, "waiting requests at most; more are refused (RESOURCE_EXHAUSTED / HTTP 429)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps")
    min_prefill_share: float = _opt(0.25, "budget share kept for prefill while requests wait (0..1)")
    aging_s: float = _opt(5.0, "each aging_s seconds of waiting raises a request's priority by one level")
    # Time-aware budget: while sequences decode, prefill chunks are sized so the step's
    # predicted time (from costs learned online) stays under max_step_ms; None: auto,
    # step_time_ratio x the running batch's decode-only step (predicted), so their pace slows by at most
    # that factor while prompts prefill. The token budget stays a cap.
    enable_time_budget: bool = _opt(True, "size prefill chunks by predicted step time while sequences decode")
    max_step_ms: float | None = _opt(None, "step-time target in ms while sequences decode; unset: "
                                           "step_time_ratio x the running batch's decode-only step")
    step_time_ratio: float = _opt(2.0, "auto step-time target as a multiple of the decode-only step (> 1)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of shared prompt prefixes")
    async_scheduling: bool = _opt(False, "overlap the host's work with the forward: schedule and stage step n+1 "
                                         "while step n runs (its outputs are processed a step later; outputs "
                                         "unchanged); pays where the device, not the host, runs the forward")
    watermark: float = _opt(0.01, "fraction of KV blocks kept free when admitting new prompts")

    # Speculative decoding without a draft model: proposals from the request's own tokens (and,
    # for suffix, recent outputs), verified k + 1 at a time in the step's forward.
    speculative_method: str = _opt("none", "none | ngram (prompt lookup: the tokens that followed the last n-gram's "
                                           "latest earlier match) | suffix (the longest suffix match over the request "
                                           "and recent requests' outputs, its length adapted to the match)")
    num_speculative_tokens: int = _opt(4, "most proposed tokens verified per step and request (k)")
    prompt_lookup_min: int = _opt(2, "ngram: the shortest n-gram matched")
    prompt_lookup_max: int = _opt(5, "ngram: the longest n-gram matched (tried first)")
    speculative_max_batch: int = _opt(4, "speculate only while at most this many sequences decode: a larger "
                                         "batch's step is no longer bound by reading the weights, so "
                                         "verifying proposals there costs what it saves")

    # Request limits, checked before any costly work: beyond them a request is refused
    # (LimitExceededError -> RESOURCE_EXHAUSTED; out-of-range values -> INVALID_ARGUMENT).
    max_prompt_chars: int = _opt(1_000_000, "characters of a text prompt or of all chat messages together")
    max_stop_strings: int = _opt(32, "stop strings per request")
    max_stop_string_chars: int = _opt(256, "characters of one stop string")
    max_stop_token_ids: int = _opt(256, "stop token ids per request")
    max_request_id_chars: int = _opt(256, "characters of a client's request id")
    max_priority: int = _opt(1000, "priority must lie in [-max_priority, max_priority]")
    max_logit_bias: int = _opt(300, "logit_bias entries per request")

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_num_waiting", "max_prompt_chars",
                    "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", "max_request_id_chars",
                    "max_logit_bias")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if not 0.0 <= self.min_prefill_share <= 1.0:
            raise ValueError(f"min_prefill_share must be in [0, 1], got {self.min_prefill_share}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.max_priority < 0:
            raise ValueError(f"max_priority must be >= 0, got {self.max_priority}")
        if self.max_step_ms is not None and self.max_step_ms <= 0:
            raise ValueError(f"max_step_ms must be positive, got {self.max_step_ms}")
        if self.step_time_ratio <= 1.0:
            raise ValueError(f"step_time_ratio must be > 1, got {self.step_time_ratio}")
        if self.aging_s <= 0:
            raise ValueError(f"aging_s must be positive, got {self.aging_s}")
        if self.backend not in ("auto", "cpu", "cuda", "torch"):
            raise ValueError(f"backend must be auto, cpu, cuda or torch, got {self.backend!r}")
        if self.task not in ("auto", "generate", "embed", "score"):
            raise ValueError(f"task must be auto, generate, embed or score, got {self.task!r}")
        if self.score_label_tokens is not None:
            tokens = self.label_tokens
            if not 1 <= len(tokens) <= 2 or not all(tokens):
                raise ValueError(f"score_label_tokens must name one or two tokens, comma-separated, got "
                                 f"{self.score_label_tokens!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.quantization not in {q.value for q in Quantization}:
            raise ValueError(f"quantization must be auto, none, int8 or gguf, got {self.quantization!r}")
        if self.quantization == Quantization.GGUF and not self._names_a_gguf_file():
            raise ValueError(f"quantization gguf serves a .gguf file (or the default model's), not {self.model!r}")
        if self.max_fused_tokens is not None and self.max_fused_tokens < 0:
            raise ValueError(f"max_fused_tokens must be >= 0, got {self.max_fused_tokens}")
        if self.speculative_method not in ("none", "ngram", "suffix"):
            raise ValueError(f"speculative_method must be none, ngram or suffix, got {self.speculative_method!r}")
        if self.async_scheduling and self.speculative_method != "none":
            raise ValueError("async_scheduling cannot run with speculative_method "
                             f"{self.speculative_method!r}: a proposal needs its request's last token on the host "
                             "before the next step is scheduled")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min must be in [1, prompt_lookup_max], got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def label_tokens(self) -> tuple[str, ...] | None:
        """score_label_tokens as a tuple (None when unset)."""
        if self.score_label_tokens is None:
            return None
        return tuple(token.strip() for token in self.score_label_tokens.split(","))

    def _names_a_gguf_file(self) -> bool:
        """The model is a .gguf path or the default model (its own GGUF file, named or not)."""
        return self.model is None or self.model == DEFAULT_MODEL_NAME or self.model.endswith(".gguf")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
