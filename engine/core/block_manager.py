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

KV-cache groups (engine/execution/kv_cache_layout.py): `windows` names each group's sliding window
(None: full attention); a sequence holds one block table per group (seq.block_tables), all from
the one pool, and needs the sum of their blocks. A window group gives back, before each
allocation, the blocks wholly before the window of the next query (the entry then holds
NULL_BLOCK, a reserved block past the usable ones): a released block keeps its hash, like a
finished one, and a later prompt can revive it. A prefix hit is only as long as every group can
supply it: a full group needs every block before it, a window group only those the next query's
window reaches. One group (a model with one kind of layer) is exactly the single-table cache.

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
                 watermark: float = 0.0, is_recording_events: bool = True,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        """num_blocks: the usable blocks (a window group's null block is NULL_BLOCK == num_blocks,
        past them); windows: each KV-cache group's sliding window, None for full attention."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if not windows or any(w is not None and w <= 0 for w in windows):
            raise ValueError("windows: one per KV-cache group, each None or positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        self.null_block = num_blocks  # where a window group's released entries point
        # A window group's hit is checked against the first full group's table (exact: that
        # one is checked block by block from the start); with no full group, by its tokens alone.
        self._anchor_group = next((g for g, w in enumerate(windows) if w is None), None)
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_group = [0] * num_blocks  # the group whose prefix cache lists the block
        # What a published block holds: (parent block or -1, the parent's generation, its tokens),
        # checked on every hit. A block's generation grows each time it is reused for new
        # tokens, so a child never vouches for a parent that has since changed.
        self._block_content: list[tuple[int, int, tuple[int, ...]] | None] = [None] * num_blocks
        self._generation = [0] * num_blocks
        self._hash_to_block: list[dict[int, int]] = [{} for _ in windows]  # per group
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Prefix-cache changes since the last take_events(), for subscribers that route by what
        # this cache holds (a gateway's cache-aware policy); none while no one subscribes. Only
        # group 0's (the first full group, when there is one): it lists every cached prefix.
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
        """Blocks that cover num_tokens tokens (one group's table length)."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_released_blocks(self, num_computed_tokens: int, window: int | None) -> int:
        """Leading blocks a group no longer reads once num_computed_tokens are computed: those
        wholly before the window of the next query (at position num_computed_tokens, which sees
        keys past num_computed_tokens - window)."""
        if window is None:
            return 0
        return max(0, (num_computed_tokens - window + 1) // self.block_size)

    def num_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """Blocks, over every group, of a sequence of num_tokens tokens computed in chunks of
        at most max_chunk: the most it ever holds (a window group holds a chunk's blocks and
        the window before it)."""
        total = 0
        for window in self.windows:
            blocks = self.num_blocks_needed(num_tokens)
            if window is not None:
                blocks = min(blocks, self.num_blocks_needed(window + max_chunk) + 2)
            total += blocks
        return total

    def max_context_len(self, num_blocks: int, max_chunk: int) -> int:
        """The longest sequence whose blocks (num_blocks_held) fit in num_blocks."""
        lo, hi = 0, num_blocks * self.block_size * self.num_groups + max_chunk + 1
        while lo < hi:  # the largest length that fits; holding grows with the length
            mid = (lo + hi + 1) // 2
            if self.num_blocks_held(mid, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes to cover every full block of its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[i - 1] if i else 0
            seq.block_hashes.append(hash_block(parent, seq.token_ids_slice(i * bs, (i + 1) * bs)))

    def _content(self, seq: Sequence, group: int, i: int) -> tuple[int, int, tuple[int, ...]]:
        """What block i of seq's table of `group` must hold: its parent and tokens. A full
        group's parent is block i - 1 of its own table; a window group's is block i of the
        anchor (full) group's table, whose chain is checked from the start (its own parent may
        be released); with no full group, none (-1: the chained hash alone vouches for the
        tokens before the block)."""
        bs = self.block_size
        tokens = tuple(seq.token_ids_slice(i * bs, (i + 1) * bs))
        if self.windows[group] is None:
            parent = seq.block_tables[group][i - 1] if i else -1
        elif self._anchor_group is not None:
            parent = seq.block_tables[self._anchor_group][i]
        else:
            return -1, 0, tokens
        return parent, self._generation[parent] if parent >= 0 else 0, tokens

    def _cached_block(self, seq: Sequence, group: int, i: int) -> int | None:
        """The cached block that holds block i of seq for `group` (its table filled up to i and,
        for a window group, the anchor's up to i + 1), or None."""
        block = self._hash_to_block[group].get(seq.block_hashes[i])
        if block is None or self._block_content[block] != self._content(seq, group, i):
            return None  # not cached, or a hash collision: not our prefix
        return block

    def _ensure_tables(self, seq: Sequence) -> None:
        if len(seq.block_tables) != self.num_groups:
            seq.block_tables = [[] for _ in range(self.num_groups)]

    def _take_cached(self, seq: Sequence, group: int, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1
        self._append(seq, group, block)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """On first admission, take the longest cached prefix every group can supply; return its
        length in tokens.

        At least one token is always left to compute: the model must produce the logits
        of the last position to sample the next token.
        """
        if any(seq.block_tables):
            raise RuntimeError(f"sequence {seq.request_id} already owns blocks")
        self._ensure_tables(seq)
        if not self.enable_prefix_caching or seq.needs_every_prompt_position:
            return 0  # prompt logprobs, mean and CLS pooling need every prompt position computed
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._update_hashes(seq, max_blocks * self.block_size)
        if self.num_groups == 1 and self.windows[0] is None:  # the single-table cache
            for i in range(max_blocks):
                block = self._cached_block(seq, 0, i)
                if block is None:
                    break
                self._take_cached(seq, 0, block)
            seq.num_registered_blocks = len(seq.block_table)
            return len(seq.block_table) * self.block_size
        num_hit = self._num_hit_blocks(seq, max_blocks)
        for group, window in enumerate(self.windows):
            first = self.num_released_blocks(num_hit * self.block_size, window)
            seq.block_tables[group].extend([self.null_block] * first)
            for i in range(first, num_hit):
                self._take_cached(seq, group, self._hash_to_block[group][seq.block_hashes[i]])
        seq.num_registered_blocks = num_hit
        return num_hit * self.block_size

    def _num_hit_blocks(self, seq: Sequence, max_blocks: int) -> int:
        """The most leading blocks every group can supply (a full group: all of them; a window
        group: those the next query's window reaches). Reads the cache, takes nothing: the
        content checks walk a scratch table per full group."""
        num_hit = max_blocks
        tables = seq.block_tables
        for group, window in enumerate(self.windows):  # full groups first: their hits only shrink
            if window is not None:
                continue
            table = tables[group]
            for i in range(num_hit):
                block = self._cached_block(seq, group, i)
                if block is None:
                    num_hit = i
                    break
                table.append(block)
        while True:  # a window group's hit may be shorter; shorter ones need other blocks: recheck
            shortest = num_hit
            for group, window in enumerate(self.windows):
                if window is not None:
                    shortest = min(shortest, self._window_hit(seq, group, window, shortest))
            if shortest == num_hit:
                break
            num_hit = shortest
        for table in tables:
            table.clear()
        return num_hit

    def _window_hit(self, seq: Sequence, group: int, window: int, limit: int) -> int:
        """The longest hit of at most `limit` blocks a window group can supply: the blocks from
        the window's first to the hit's end all cached (scanned from the right: a run of
        cached blocks long enough to fill the window ends a hit)."""
        run_end = None
        for i in range(limit - 1, -1, -1):
            if self._cached_block(seq, group, i) is None:
                run_end = None
                continue
            if run_end is None:
                run_end = i + 1
            if i <= self.num_released_blocks(run_end * self.block_size, window):
                return run_end
        return 0

    def allocate(self, seq: Sequence, num_new_tokens: int, is_new: bool = False) -> bool:
        """Make room for num_new_tokens more tokens; False (and nothing changed but the release
        of out-of-window blocks, which is never undone) if it can't.

        A new sequence must also leave the watermark free, so admissions cannot eat the
        blocks running sequences need to grow. A partly filled last block that other samples
        share is copied first (copy-on-write): the new tokens go into the copy.
        """
        self._ensure_tables(seq)
        num_computed = seq.num_computed_tokens
        num_needed = self.num_blocks_needed(num_computed + num_new_tokens)
        needed = 0
        copies = []
        for group, window in enumerate(self.windows):
            if window is not None:
                self._release(seq, group, self.num_released_blocks(num_computed, window))
            must_copy = self._shares_partial_last_block(seq, group)
            copies.append(must_copy)
            needed += max(0, num_needed - len(seq.block_tables[group])) + must_copy
        if needed > len(self._free) - (self.num_watermark_blocks if is_new else 0):
            return False
        for group, table in enumerate(seq.block_tables):
            if copies[group]:
                source = table[-1]
                self._ref_counts[source] -= 1
                copy = self._take_free_block()
                table[-1] = copy
                self._mark_changed(seq, len(table) - 1)
                self._copies.append((source, copy))
            for _ in range(num_needed - len(table)):
                self._append(seq, group, self._take_free_block())
        return True

    def _release(self, seq: Sequence, group: int, num_released: int) -> None:
        """A window group's leading blocks up to num_released go back to the pool (their table
        entries to the null block). Published ones keep their hash, at the LRU's back like a
        finished sequence's: a later prompt may revive them."""
        table = seq.block_tables[group]
        null = self.null_block
        first = None
        for i in range(min(num_released, len(table)) - 1, -1, -1):  # from the window's edge back
            block = table[i]
            if block == null:
                break  # everything before is released already
            table[i] = null
            first = i
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
        if first is not None:
            self._mark_changed(seq, first)

    def _shares_partial_last_block(self, seq: Sequence, group: int) -> bool:
        table = seq.block_tables[group]
        return (seq.num_computed_tokens % self.block_size != 0 and len(table) * self.block_size
                > seq.num_computed_tokens and table[-1] != self.null_block and self._ref_counts[table[-1]] > 1)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        self._reset(block)  # reused for new tokens: the old prefix is evicted from the cache
        self._ref_counts[block] = 1
        return block

    def _append(self, seq: Sequence, group: int, block: int) -> None:
        table = seq.block_tables[group]
        self._mark_changed(seq, len(table))
        table.append(block)

    @staticmethod
    def _mark_changed(seq: Sequence, index: int) -> None:
        changed = seq.block_table_changed_from
        seq.block_table_changed_from = index if changed is None else min(changed, index)

    def _drop(self, block: int, is_published_kept: bool) -> None:
        """One reference to block gone; at none it goes to the free list (the LRU's back when
        is_published_kept and it has a hash, else the front: reused first)."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if not is_published_kept or self._block_hash[block] is None:
                self._free.move_to_end(block, last=False)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks seq holds past what its tokens need (a verification allocated
        for every draft; the rejected ones' blocks hold nothing anyone will read)."""
        needed = self.num_blocks_needed(seq.num_tokens)
        null = self.null_block
        for table in seq.block_tables:
            for block in reversed(table[needed:]):
                if block != null:
                    self._drop(block, is_published_kept=False)  # never published: reuse first
            if len(table) > needed:
                del table[needed:]
                self._mark_changed(seq, needed)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, copy) blocks of the copy-on-writes since the last call: their K/V must be
        copied before the next forward writes into the copies."""
        copies, self._copies = self._copies, []
        return copies

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly full, computed blocks to the prefix cache (each group's
        its own; a window group's blocks released before publishing stay unpublished). Tokens of a
        step still in flight (async scheduling) are not computed yet as far as the cache goes."""
        if not self.enable_prefix_caching:
            return
        num_full = (seq.num_computed_tokens - seq.num_inflight_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._update_hashes(seq, num_full * self.block_size)
        null = self.null_block
        for group in range(self.num_groups):
            table, hash_to_block = seq.block_tables[group], self._hash_to_block[group]
            is_recording = self._is_recording_events and group == 0
            run: list[int] = []  # consecutive blocks published now: one BlockStored event
            for i in range(seq.num_registered_blocks, num_full):
                block, block_hash = table[i], seq.block_hashes[i]
                if block != null and block_hash not in hash_to_block and self._block_hash[block] is None:
                    hash_to_block[block_hash] = block
                    self._block_hash[block] = block_hash
                    self._block_group[block] = group
                    self._block_content[block] = self._content(seq, group, i)
                    if is_recording:
                        run.append(i)
                elif run:
                    self._record_stored(seq, run)
                    run = []
            if run:
                self._record_stored(seq, run)
        seq.num_registered_blocks = num_full

    def _record_stored(self, seq: Sequence, indices: list[int]) -> None:
        """One BlockStored for blocks of group 0 just published: their tokens are the tuples the
        cache keeps for its hit checks (_block_content), joined, not sliced from the sequence again."""
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
        """Hashes of every block group 0's prefix cache can serve now (tests, introspection)."""
        return set(self._hash_to_block[0])

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
        for hash_to_block in self._hash_to_block:
            hash_to_block.clear()
        if self._is_recording_events:
            self._events.append(AllBlocksCleared())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share every block of the parent's prompt with a new sample of it (ref counts); a
        partly filled last block is copied later, by whichever sample first writes into it."""
        null = self.null_block
        for table in parent.block_tables:
            for block in table:
                if block != null:
                    self._ref_counts[block] += 1
        child.block_tables = [list(table) for table in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_prompt_tokens // self.block_size
        child.block_table_changed_from = 0

    def _reset(self, block: int) -> None:
        """A free block taken for new tokens: whatever prefix it cached is evicted."""
        old_hash = self._block_hash[block]
        if old_hash is not None:
            group = self._block_group[block]
            hash_to_block = self._hash_to_block[group]
            if hash_to_block.get(old_hash) == block:
                del hash_to_block[old_hash]
                if self._is_recording_events and group == 0:
                    self._events.append(BlockRemoved((old_hash,)))
            self._block_hash[block] = None
            self._block_content[block] = None
            self._generation[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks go to the LRU first: they are the
        least likely to be shared, so they are evicted first."""
        null = self.null_block
        for table in seq.block_tables:
            for block in reversed(table):
                if block != null:
                    self._drop(block, is_published_kept=True)
        seq.block_tables = [[] for _ in range(self.num_groups)]
        seq.num_registered_blocks = 0
        seq.block_table_changed_from = 0
