"""Engine configuration: one validated dataclass, every knob with a CPU-friendly default."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Defaults suit the CPU default model.

    `model` is None (the default SmolLM2-135M-Instruct), a local HF directory, a `.gguf`
    file, or a hub id (only where a network allows it).
    """

    model: str | None = None
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    seed: int = 0
    num_threads: int | None = None  # None: one per core, so both cores compute

    # Paged KV cache.
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_gib
    kv_cache_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's context length

    # Scheduler: the token budget of one step and the policy knobs that balance
    # prefill (time to first token) against decode (streaming pace).
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_num_waiting: int = 1024  # admission limit: beyond it add_request raises QueueFullError
    enable_chunked_prefill: bool = True
    min_prefill_share: float = 0.25  # budget share kept for prefill while requests wait
    aging_s: float = 5.0  # each aging_s seconds of waiting raises priority by one level
    # Time-aware budget: while sequences decode, prefill chunks are sized so the step's
    # predicted time (from costs learned online) stays under max_step_ms; None: auto,
    # step_time_ratio x the recent decode-only step, so the streams' pace slows by at most
    # that factor while prompts prefill. The token budget stays a cap.
    enable_time_budget: bool = True
    max_step_ms: float | None = None
    step_time_ratio: float = 2.2
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # KV blocks kept free when admitting new prompts

    # Request limits, checked before any costly work: beyond them a request is refused
    # (LimitExceededError -> RESOURCE_EXHAUSTED; out-of-range values -> INVALID_ARGUMENT).
    max_prompt_chars: int = 1_000_000  # text prompt or all chat message contents together
    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_request_id_chars: int = 256
    max_priority: int = 1000  # priority must lie in [-max_priority, max_priority]

    def __post_init__(self) -> None:
        positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_num_waiting", "max_prompt_chars",
                    "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", "max_request_id_chars")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
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
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
