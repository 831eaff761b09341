"""Which layers share block accounting (KV-cache groups, vLLM's name) and where their K/V live.

A sliding-window layer never reads a block that lies wholly before its window, so it need not
keep one; a full-attention layer keeps every block. Layers are grouped by kind (full, or one
window size): each group has its own block table per sequence, and a window group gives its
out-of-window blocks back to the pool while the full groups keep theirs.

All groups share one pool of block ids, so every block must be the same size: each group holds
`group_size` layers (vLLM's rule: the fewest layers of any kind; a kind with more layers splits
into several groups of that size, the last one padded). The pool is `group_size` tensors, and
tensor p holds layer p of every group: block b of a group is the same rows of every tensor, read
by that group's layers only, so a block id means one piece of memory whatever group holds it.
A model with one kind of layer has one group of all its layers: the pool, the tables and the
block ids are what they were before groups existed.

A window group's table keeps its length (an entry per block of the context), the released
entries pointing at the null block: a reserved, zeroed block past the usable ones that no one
writes. Kernels that walk the table then read finite values they mask, as they would anywhere
before the window.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    window: int | None  # None: full attention, every block kept
    layers: tuple[int, ...]  # the model's layer indices, at most group_size of them


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]  # full-attention groups first
    group_size: int  # tensors in the pool: layers that one block id holds
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: the pool tensor it reads and writes

    @classmethod
    def of(cls, windows: tuple[int | None, ...], is_hybrid: bool = True,
           max_model_len: int | None = None) -> KVCacheLayout:
        """The layout of layers with these sliding windows (None: full). is_hybrid off, or a
        model with one kind of layer: one group of every layer. A window that covers
        max_model_len never releases a block: such a layer counts as full."""
        if not windows:
            raise ValueError("windows: a model has at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            if not is_hybrid or (window is not None and max_model_len is not None and window >= max_model_len):
                window = None
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            (window, layers), = kinds.items()
            return cls((KVCacheGroup(window, tuple(layers)),), len(layers), (0,) * len(layers),
                       tuple(range(len(layers))))
        group_size = min(len(layers) for layers in kinds.values())
        groups: list[KVCacheGroup] = []
        # Full attention first: its table anchors the prefix-cache checks of the window groups.
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[window]
            groups += [KVCacheGroup(window, tuple(layers[i : i + group_size]))
                       for i in range(0, len(layers), group_size)]
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for g, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                layer_group[layer], layer_slot[layer] = g, slot
        return cls(tuple(groups), group_size, tuple(layer_group), tuple(layer_slot))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full)."""
        return tuple(g.window for g in self.groups)

    @property
    def has_null_block(self) -> bool:
        """Whether a window group releases blocks (their table entries then point at the null
        block, which the pool holds past the usable ones)."""
        return any(g.window is not None for g in self.groups)

    @property
    def is_single_group(self) -> bool:
        return len(self.groups) == 1
