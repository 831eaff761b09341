"""The random block-operations driver that the block manager's property tests share: sequences
added (their cached prefix first), grown by a token, and freed, as the scheduler would."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from tests.helpers import fake_seq


def block_op_lists(names: list[str], max_slot: int, max_tokens: int, max_ops: int) -> st.SearchStrategy:
    """Lists of (op name, sequence slot, a length or token): the driver's input."""
    return st.lists(st.tuples(st.sampled_from(names), st.integers(0, max_slot), st.integers(1, max_tokens)),
                    max_size=max_ops)


def run_block_ops(bm: BlockManager, ops: list[tuple[str, int, int]],
                  prompt_tokens: Callable[[int, int], list[int]]) -> Iterator[tuple[str, dict[int, Sequence]]]:
    """Run ops on bm, yielding after each one its name and the live sequences (slot -> sequence,
    the same dict throughout). "add" starts a sequence of n tokens (prompt_tokens(slot, n)) in an
    empty slot, "grow" appends token n to a live one, "free" ends it; an op that cannot be done
    (an add into a taken slot, no room) leaves things as they were, and any other name is the
    caller's to carry out when it is yielded."""
    live: dict[int, Sequence] = {}
    for op, slot, n in ops:
        if op == "add" and slot not in live:
            seq = fake_seq(str(slot), n)
            seq.prompt_token_ids = prompt_tokens(slot, n)
            seq.num_computed_tokens = bm.allocate_cached_prefix(seq)
            if bm.allocate(seq, seq.num_uncomputed_tokens, is_new=True):
                seq.num_computed_tokens = seq.num_tokens
                bm.register_computed_blocks(seq)
                live[slot] = seq
            else:
                bm.free(seq)
        elif op == "grow" and slot in live:
            seq = live[slot]
            seq.output_token_ids.append(n)
            if bm.allocate(seq, 1):
                seq.num_computed_tokens += 1
                bm.register_computed_blocks(seq)
            else:
                seq.output_token_ids.pop()
        elif op == "free" and slot in live:
            bm.free(live.pop(slot))
        yield op, live
