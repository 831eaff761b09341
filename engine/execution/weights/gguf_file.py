"""A GGUF file's tensors as they are stored: quantized blocks stay blocks.

Each tensor comes with its type and its shape in torch's order ([out, in] for a matrix), checked
against the file's own metadata (hidden size, heads, feed-forward width, vocabulary). Tensors of
the types with kernels (ggml_blocks.KERNEL_TYPES: all a Q4_K_M or Q5_K_M download holds, the
Q5_0 / Q5_1 / Q8_0 of rows no multiple of 256 included) come as their raw blocks, one row of blocks
per output channel; float types as their values (bfloat16, which numpy lacks, widened to float32:
exact); every other quantized type is dequantized once, to float32, with a warning naming the type. Llama-architecture files store the query and key
projections' rows in llama.cpp's rotary order: they come back in Hugging Face's (a permutation of
whole rows, so of whole blocks), as transformers' own GGUF loader restores them. llama.cpp's
converter permutes no other architecture's rows (qwen2, qwen3, qwen3moe and gemma3 rotate halves, as Hugging
Face does; bert has no rotary positions). A head's width is the file's attention.key_length where
it has one (Qwen3's and Gemma 3's heads are wider than hidden size / heads).

A truncated file or an architecture whose tensor layout this reader does not know fails with a
ValueError that says so.
"""
from __future__ import annotations

import logging
import mmap
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from engine.execution.weights.ggml_blocks import KERNEL_TYPES, row_bytes

logger = logging.getLogger(__name__)

_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
# The architectures whose llama.cpp tensor names and row orders this reader and gguf_loader map to
# Hugging Face's. A format fact, kept here rather than read from the model registry so that
# weights/ never imports models/; a new family adds its name here once its layout is mapped
# (tests/engine/execution/weights/test_gguf_file.py checks each has a model family).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "gpt-oss", "bert")
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")  # llama.cpp's per-layer tensor names


class _Truncated(Exception):
    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class _CheckedReader(GGUFReader):
    """GGUFReader, but a read past the file's end says so (the package reports it as a failed
    reshape or view)."""

    mapping: mmap.mmap | None = None  # the file's read-only mapping, which every tensor's data views

    def _get(self, offset: int, dtype: Any, count: int = 1, *args: Any, **kwargs: Any) -> np.ndarray:
        if type(self.data) is np.memmap:
            # the same mapped bytes as a plain array: np.memmap's bookkeeping on each of the million
            # small slices a 150,000-token vocabulary takes doubled its reading (21 s against 10 s)
            self.mapping = self.data._mmap
            self.data = self.data.view(np.ndarray)
        end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
        if end > len(self.data):
            raise _Truncated(end)
        return super()._get(offset, dtype, count, *args, **kwargs)


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    quant_type: GGMLQuantizationType  # the type `data` holds: the file's, or F32 once dequantized
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # KERNEL_TYPES: [N, row bytes] uint8 blocks; otherwise the values, [*shape]

    @property
    def is_blocks(self) -> bool:
        return self.quant_type in KERNEL_TYPES


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        try:
            self._reader = _CheckedReader(str(self.path))
        except _Truncated as exc:
            raise ValueError(f"model: GGUF file {str(self.path)!r} is truncated: it has {size} bytes, its header and "
                             f"tensors need at least {exc.needed} (an interrupted download?)") from None
        except (ValueError, KeyError) as exc:
            raise ValueError(f"model: {str(self.path)!r} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self.field("general.architecture", ""))
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(f"model: GGUF architecture {self.architecture!r} of {self.path.name} is not supported; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        self._expected = self.expected_shapes()

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (a string, number or list), or default when the file has none."""
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def arch_field(self, key: str, default: Any = None) -> Any:
        return self.field(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        """Every tensor's name in file order, nothing read."""
        return [t.name for t in self._reader.tensors]

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        """A tensor's shape in torch's order from the header, nothing read; None for no such tensor."""
        shape = next((t.shape for t in self._reader.tensors if t.name == name), None)
        return None if shape is None else tuple(int(d) for d in reversed(shape.tolist()))

    def release(self, tensors: Iterable[GGUFTensor]) -> None:
        """Drop the pages of these tensors' bytes from this process's resident memory, once what
        they were repacked into holds them: the mapping is read-only, so MADV_DONTNEED only unmaps
        them (the page cache keeps them, a later read faults them back in). Without it the whole
        file stayed resident beside its repacked copy until loading ended: twice the file. Data not
        in the mapping (a copy: dequantized, or rows reordered) is left alone."""
        mapping = self._reader.mapping
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        base = self._reader.data.ctypes.data
        for t in tensors:
            begin = t.data.ctypes.data - base
            end = begin + t.data.nbytes
            if begin < 0 or end > len(mapping) or not t.data.nbytes:
                continue
            start = begin - begin % mmap.PAGESIZE
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def resident_bytes(self, float_itemsize: int, keep_blocks: bool) -> int:
        """The bytes the weights take once loaded, from the header alone: with keep_blocks (the
        block kernels) tensors of KERNEL_TYPES as stored and every other as floats of
        float_itemsize; else every tensor as such floats (the dequantized path)."""
        return sum(int(t.n_bytes) if keep_blocks and GGMLQuantizationType(t.tensor_type) in KERNEL_TYPES
                   else int(t.n_elements) * float_itemsize for t in self._reader.tensors)

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor in file order, checked (see the module's docstring)."""
        warned: set[GGMLQuantizationType] = set()
        for t in self._reader.tensors:
            quant_type = GGMLQuantizationType(t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
            self._check_shape(t.name, shape)
            if quant_type in KERNEL_TYPES:
                data = np.asarray(t.data).reshape(int(np.prod(shape[:-1])), row_bytes(quant_type, shape[-1]))
            elif quant_type in _FLOAT_TYPES:
                data = np.asarray(t.data).reshape(shape)
            elif quant_type == GGMLQuantizationType.BF16:  # each value's float32 top half: exact
                data = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
                quant_type = GGMLQuantizationType.F32
            else:
                if quant_type not in warned:
                    logger.warning("GGUF %s: tensors of type %s (the first: %s) have no kernel here; dequantized to "
                                   "float32 once, at load", self.path.name, quant_type.name, t.name)
                    warned.add(quant_type)
                data = dequantize(np.asarray(t.data), quant_type).astype(np.float32).reshape(shape)
                quant_type = GGMLQuantizationType.F32
            yield GGUFTensor(t.name, quant_type, shape, self._hf_rows(t.name, data))

    def _hf_rows(self, name: str, data: np.ndarray) -> np.ndarray:
        """llama.cpp's rotary row order of a llama query / key projection back to Hugging Face's."""
        if self.architecture != "llama" or not (".attn_q." in name or ".attn_k." in name):
            return data
        num_heads = int(self.arch_field("attention.head_count"))
        if ".attn_k." in name:
            num_heads = int(self.arch_field("attention.head_count_kv", num_heads))
        rows = data.shape[0]
        half = rows // num_heads // 2
        return np.ascontiguousarray(data.reshape(num_heads, half, 2, *data.shape[1:]).swapaxes(1, 2)).reshape(data.shape)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """A layer's tensors' shapes by their short name, and the model's, from the metadata."""
        hidden = int(self.arch_field("embedding_length", 0))
        heads = int(self.arch_field("attention.head_count", 0))
        if hidden <= 0 or heads <= 0:
            raise ValueError(f"model: GGUF file {self.path.name} lacks {self.architecture}.embedding_length or "
                             f"{self.architecture}.attention.head_count")
        kv_heads = int(self.arch_field("attention.head_count_kv", heads))
        head_dim = int(self.arch_field("attention.key_length", hidden // heads))
        ff = int(self.arch_field("feed_forward_length", 0))
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens", []))
        q, kv = heads * head_dim, kv_heads * head_dim
        # attn_q_norm / attn_k_norm: Qwen3's and Gemma 3's per-head RMSNorms of the queries and keys;
        # post_attention_norm / post_ffw_norm: Gemma 3's norms of each sublayer's output
        shapes = {"attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, q),
                  "attn_norm": (hidden,), "ffn_norm": (hidden,), "output_norm.weight": (hidden,),
                  "attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,), "post_attention_norm": (hidden,),
                  "post_ffw_norm": (hidden,), "attn_sinks": (heads,)}
        if ff > 0:
            shapes.update(ffn_gate=(ff, hidden), ffn_up=(ff, hidden), ffn_down=(hidden, ff))
        # mixture of experts: the router (ffn_gate_inp) and every expert's projections stacked, [E, ...]
        num_experts = int(self.arch_field("expert_count", 0))
        expert_ff = int(self.arch_field("expert_feed_forward_length", 0))
        if num_experts > 0:
            shapes["ffn_gate_inp"] = (num_experts, hidden)
            if expert_ff > 0:
                shapes.update(ffn_gate_exps=(num_experts, expert_ff, hidden), ffn_up_exps=(num_experts, expert_ff, hidden),
                              ffn_down_exps=(num_experts, hidden, expert_ff))
        if int(vocab) > 0:
            shapes.update({"token_embd.weight": (int(vocab), hidden), "output.weight": (int(vocab), hidden)})
        # BERT's: the LayerNorms after the embeddings and after each sublayer, the learned absolute
        # positions (one row a position of the context) and the token types (segments)
        shapes.update({"token_embd_norm.weight": (hidden,), "token_embd_norm.bias": (hidden,),
                       "attn_output_norm": (hidden,), "layer_output_norm": (hidden,)})
        context = int(self.arch_field("context_length", 0))
        if context > 0:
            shapes["position_embd.weight"] = (context, hidden)
        num_token_types = int(self.field("tokenizer.ggml.token_type_count", 0))
        if num_token_types > 0:
            shapes["token_types.weight"] = (num_token_types, hidden)
        return shapes

    def _check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        expected = self._expected
        layer = LAYER_TENSOR.match(name)
        want: tuple[int, ...] | None = expected.get(name)
        if layer is not None:
            index, part, kind = int(layer.group(1)), layer.group(2), layer.group(3)
            num_layers = int(self.arch_field("block_count", 0))
            if index >= num_layers:
                raise ValueError(f"model: GGUF tensor {name} is past the file's {num_layers} layers")
            want = expected.get(part)
            if want is not None and kind == "bias" and len(want) > 1:
                # a projection's: one per output row, [N] of [N, K] ([E, N] of experts' [E, N, K]);
                # a LayerNorm's (BERT's) is its weight's shape
                want = want[:-1]
        if want is not None and shape != want:
            raise ValueError(f"model: GGUF tensor {name} has shape {list(shape)}, expected {list(want)} from the "
                             f"file's metadata")
