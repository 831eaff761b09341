"""Paged KV cache bookkeeping: which fixed-size blocks each sequence owns.

The cache itself is one preallocated tensor pool (see ModelRunner); this class only hands
out block ids. Blocks are ref-counted so several sequences can share a cached prefix. A
full block is published under a hash that chains over all tokens before it, so equal
prefixes map to equal hashes. A block whose ref count drops to zero keeps its hash and
goes to the back of an LRU free list: it can be revived by a later prefix hit until it is
reused for new tokens. Blocks that never got a hash go to the front so they are reused
first. Invariant: num_free_blocks + num_used_blocks == num_blocks.

Forked samples share every block of their prompt, the partly filled last one included; a
sequence about to write into a block it shares gets its own copy first (copy-on-write, in
`allocate`), and the (source, copy) pairs wait in `take_copies` for the runner to copy before
the step's forward. Every change to a block table marks `block_table_changed_from`, so the
scheduler sends the runner only what changed.

A hit is trusted only after comparing tokens: a cached block remembers its own tokens and its
parent block, and both must equal the new prompt's. The 64-bit hash only finds candidates,
so a collision (accidental or crafted, vLLM's CVE-2025-25183) can never serve one request
another's KV.

Prefix-cache events (BlockStored, BlockRemoved, AllBlocksCleared) are recorded only while
`is_recording_events` (the engine sets it while someone subscribes): with no subscriber a block
store builds no event and nothing accumulates.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import chain

from engine.core.sequence import Sequence
from engine.outputs import AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """Chained block hash (64-bit, like vLLM's builtin-hash option)."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.0, is_recording_events: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_watermark_blocks = int(watermark * num_blocks)
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # What a published block holds: (parent block or -1, the parent's generation, its tokens),
        # checked on every hit. A block's generation grows each time it is reused for new
        # tokens, so a child never vouches for a parent that has since changed.
        self._block_content: list[tuple[int, int, tuple[int, ...]] | None] = [None] * num_blocks
        self._generation = [0] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Prefix-cache changes since the last take_events(), for subscribers that route by what
        # this cache holds (a gateway's cache-aware policy); none while no one subscribes.
        self._is_recording_events = is_recording_events
        self._events: list[KvCacheEvent] = []
        self._copies: list[tuple[int, int]] = []  # copy-on-writes not yet taken by the scheduler

    @property
    def is_recording_events(self) -> bool:
        return self._is_recording_events

    def set_recording_events(self, is_recording: bool) -> None:
        """Record prefix-cache events from now on, or stop (and drop those not yet taken: no one
        is left to take them)."""
        self._is_recording_events = is_recording
        if not is_recording:
            self._events = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def count_referenced_blocks(self) -> int:
        """Slow recount from ref counts; tests check it against num_used_blocks."""
        return sum(1 for r in self._ref_counts if r > 0)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block of its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else 0
            seq.block_hashes.append(hash_block(parent, seq.token_ids_slice(i * bs, (i + 1) * bs)))

    def _content(self, seq: Sequence, i: int) -> tuple[int, int, tuple[int, ...]]:
        """What block i of seq must hold: its parent (block i - 1 of seq's table) and tokens."""
        parent = seq.block_table[i - 1] if i else -1
        bs = self.block_size
        return parent, self._generation[parent] if i else 0, tuple(seq.token_ids_slice(i * bs, (i + 1) * bs))

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """On first admission, take the longest cached prefix; return its length in tokens.

        At least one token is always left to compute: the model must produce the logits
        of the last position to sample the next token.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already owns blocks")
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks * self.block_size)
        for i in range(max_blocks):
            block = self._hash_to_block.get(seq.block_hashes[i])
            if block is None:
                break
            if self._block_content[block] != self._content(seq, i):
                break  # a hash collision: not our prefix
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            self._append(seq, block)
        seq.num_registered_blocks = len(seq.block_table)
        return len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_new_tokens: int, is_new: bool = False) -> bool:
        """Make room for num_new_tokens more tokens; False (and nothing changed) if it can't.

        A new sequence must also leave the watermark free, so admissions cannot eat the
        blocks running sequences need to grow. A partly filled last block that other samples
        share is copied first (copy-on-write): the new tokens go into the copy.
        """
        must_copy = self._shares_partial_last_block(seq)
        needed = self.num_blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) + must_copy
        if needed > len(self._free) - (self.num_watermark_blocks if is_new else 0):
            return False
        if must_copy:
            source = seq.block_table[-1]
            self._ref_counts[source] -= 1
            copy = self._take_free_block()
            seq.block_table[-1] = copy
            self._mark_changed(seq, len(seq.block_table) - 1)
            self._copies.append((source, copy))
            needed -= 1
        for _ in range(needed):
            self._append(seq, self._take_free_block())
        return True

    def _shares_partial_last_block(self, seq: Sequence) -> bool:
        return (seq.num_computed_tokens % self.block_size != 0 and len(seq.block_table) * self.block_size
                > seq.num_computed_tokens and self._ref_counts[seq.block_table[-1]] > 1)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._reset(block)  # reused for new tokens: the old prefix is evicted from the cache
        self._ref_counts[block] = 1
        return block

    def _append(self, seq: Sequence, block: int) -> None:
        self._mark_changed(seq, len(seq.block_table))
        seq.block_table.append(block)

    @staticmethod
    def _mark_changed(seq: Sequence, index: int) -> None:
        changed = seq.block_table_changed_from
        seq.block_table_changed_from = index if changed is None else min(changed, index)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks seq holds past what its tokens need (a verification allocated
        for every draft; the rejected ones' blocks hold nothing anyone will read)."""
        needed = self.num_blocks_needed(seq.num_tokens)
        for block in reversed(seq.block_table[needed:]):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)  # never published: reuse first
        if len(seq.block_table) > needed:
            del seq.block_table[needed:]
            self._mark_changed(seq, needed)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, copy) blocks of the copy-on-writes since the last call: their K/V must be
        copied before the next forward writes into the copies."""
        copies, self._copies = self._copies, []
        return copies

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly full, computed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, num_full * self.block_size)
        is_recording = self._is_recording_events
        run: list[int] = []  # consecutive blocks published now: one BlockStored event
        for i in range(seq.num_registered_blocks, num_full):
            block, block_hash = seq.block_table[i], seq.block_hashes[i]
            if block_hash not in self._hash_to_block and self._block_hash[block] is None:
                self._hash_to_block[block_hash] = block
                self._block_hash[block] = block_hash
                self._block_content[block] = self._content(seq, i)
                if is_recording:
                    run.append(i)
            elif run:
                self._record_stored(seq, run)
                run = []
        if run:
            self._record_stored(seq, run)
        seq.num_registered_blocks = num_full

    def _record_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One BlockStored for blocks just published: their tokens are the tuples the cache
        keeps for its hit checks (_block_content), joined, not sliced from the sequence again."""
        first = indices[0]
        contents = [self._block_content[seq.block_table[i]][2] for i in indices]
        self._events.append(BlockStored(
            block_hashes=tuple(seq.block_hashes[i] for i in indices),
            parent_block_hash=seq.block_hashes[first - 1] if first else None,
            token_ids=contents[0] if len(contents) == 1 else tuple(chain.from_iterable(contents)),
            block_size=self.block_size))

    def take_events(self) -> list[KvCacheEvent]:
        """The prefix-cache changes since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> set[int]:
        """Hashes of every block the prefix cache can serve now (tests, introspection)."""
        return set(self._hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (their KV stays until reused, unreachable). Refused (False)
        while any block is referenced: a running sequence's blocks must keep their hashes."""
        if self.num_used_blocks:
            return False
        for block in range(self.num_blocks):
            if self._block_hash[block] is not None:
                self._block_hash[block] = None
                self._block_content[block] = None
                self._generation[block] += 1
        self._hash_to_block.clear()
        if self._is_recording_events:
            self._events.append(AllBlocksCleared())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of the parent's prompt with a new sample of it (ref counts); a
        partly filled last block is copied later, by whichever sample first writes into it."""
        for block in parent.block_table:
            self._ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_prompt_tokens // self.block_size
        child.block_table_changed_from = 0

    def _reset(self, block: int) -> None:
        """A free block taken for new tokens: whatever prefix it cached is evicted."""
        old_hash = self._block_hash[block]
        if old_hash is not None:
            if self._hash_to_block.get(old_hash) == block:
                del self._hash_to_block[old_hash]
                if self._is_recording_events:
                    self._events.append(BlockRemoved((old_hash,)))
            self._block_hash[block] = None
            self._block_content[block] = None
            self._generation[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks go to the LRU first: they are the
        least likely to be shared, so they are evicted first."""
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0
        seq.block_table_changed_from = 0
