"""KV-cache groups on the host: the layout of layers into groups, windows releasing the blocks they
have left behind, the hybrid manager over one pool, prefix hits per group, swaps, and the memory a
sequence holds at 8k tokens with a 1k window."""
import sys

from hypothesis import given, settings
from hypothesis import strategies as st
from run_script import SCRIPTS

from jpaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jpaged.core.kv_cache_layout import kv_cache_layout
from jpaged.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from jpaged.core.request import Sequence
from jpaged.core.swap_space import SwapSpace
from jpaged.utils import cdiv


def tables_of(kv, seq):
    if isinstance(kv, HybridKVCacheManager):
        return [g.block_table(seq) for g in kv.groups]
    return [kv.block_table(seq)]


def held(kv, seq) -> int:
    return sum(b != NULL_BLOCK for t in tables_of(kv, seq) for b in t)


def check(kv, seqs):
    """Reference counts equal the tables holding each block; released entries are a prefix."""
    kv.pool.check_invariants()
    holders = [0] * kv.pool.num_blocks
    for seq in seqs:
        for table in tables_of(kv, seq):
            assert len(table) == cdiv(seq.num_computed_tokens, kv.block_size)
            released = table.count(NULL_BLOCK)
            assert table[:released] == [NULL_BLOCK] * released
            for b in table[released:]:
                holders[b] += 1
    assert holders == kv.pool.ref_counts


def run(kv, seq, n):
    assert kv.allocate_slots([seq], n) is not None
    seq.num_computed_tokens += n


def test_layouts():
    gemma3 = kv_cache_layout(([1024] * 5 + [None]) * 8)
    assert gemma3.group_windows == (None,) + (1024,) * 5 and gemma3.num_tensors == 8
    assert gemma3.layers[:7] == ((1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (0, 0), (1, 1))
    gemma2 = kv_cache_layout([4096, None] * 21)
    assert gemma2.group_windows == (None, 4096) and gemma2.num_tensors == 21
    plain = kv_cache_layout([None] * 4)
    assert plain.is_trivial and plain.layers == ((0, 0), (0, 1), (0, 2), (0, 3)) and plain.num_tensors == 4
    mistral = kv_cache_layout([4096] * 32)
    assert mistral.is_trivial and mistral.group_windows == (4096,)
    uneven = kv_cache_layout([8, 8, 8, None])  # three windowed groups of one layer, one global
    assert uneven.num_groups == 4 and uneven.num_tensors == 1
    for layout in (gemma3, gemma2, plain, mistral, uneven):  # no two layers of one group share a tensor
        assert len(set(layout.layers)) == len(layout.layers)


def test_window_releases_blocks_it_left_behind():
    kv = KVCacheManager(64, 4, sliding_window=6)
    seq = Sequence(token_ids=list(range(40)), num_prompt_tokens=40)
    run(kv, seq, 10)  # a prompt chunk: all of its blocks (its queries see keys back to 0)
    assert held(kv, seq) == 3
    run(kv, seq, 1)   # the step at position 10 reads keys 5..10: block 0 is released
    assert kv.block_table(seq)[0] == NULL_BLOCK and held(kv, seq) == 2
    for _ in range(29):
        run(kv, seq, 1)
        check(kv, [seq])
        assert held(kv, seq) <= cdiv(6 - 1 + 1, 4) + 1  # the window's blocks + the new token's
    kv.free(seq)
    assert kv.pool.num_free_blocks == 64


def test_windowed_prefix_hit_needs_only_the_window_and_is_never_wrong():
    kv = KVCacheManager(64, 4, sliding_window=6)
    first = Sequence(token_ids=list(range(30)), num_prompt_tokens=30)
    run(kv, first, 30)
    run(kv, first, 1)   # releases blocks 0..5 (their cache entries stay, the blocks free)
    kv.free(first)
    again = Sequence(token_ids=list(range(30)) + [99], num_prompt_tokens=31)
    hit = kv.find_cached_blocks(again)
    assert len(hit) == 7 and hit[:6].count(NULL_BLOCK) == 5  # first new token (28) reads keys 23..28
    for _ in range(64):  # evict every free block: no hit at all, rather than a wrong one
        kv.pool.allocate()
    assert kv.find_cached_blocks(again) == []
    other = Sequence(token_ids=[5] + list(range(1, 30)) + [99], num_prompt_tokens=31)
    assert kv.find_cached_blocks(other) == []  # another prefix never hits


def test_hybrid_groups_share_one_pool_and_allocate_all_or_nothing():
    layout = kv_cache_layout([6, None, 6, None])
    kv = HybridKVCacheManager(layout, 20, 4)
    a = Sequence(token_ids=list(range(40)), num_prompt_tokens=40)
    run(kv, a, 12)
    assert held(kv, a) == 6  # 3 blocks in each group
    for _ in range(20):
        run(kv, a, 1)
        check(kv, [a])
    assert [held_g for held_g in map(lambda t: sum(b != NULL_BLOCK for b in t), tables_of(kv, a))] == [8, 2]
    b = Sequence(token_ids=list(range(60)), num_prompt_tokens=60)
    free = kv.pool.num_free_blocks
    assert kv.allocate_slots([b], 40) is None  # 10 + 10 blocks do not fit the 10 left: nothing taken
    assert kv.pool.num_free_blocks == free and not any(tables_of(kv, b))
    kv.free(a)
    assert kv.pool.num_free_blocks == 20


def test_hybrid_prefix_hit_holds_in_every_group():
    layout = kv_cache_layout([6, None])
    kv = HybridKVCacheManager(layout, 40, 4)
    first = Sequence(token_ids=list(range(30)), num_prompt_tokens=30)
    run(kv, first, 30)
    kv.free(first)
    again = Sequence(token_ids=list(range(30)), num_prompt_tokens=30)
    [bundles] = kv.find_cached_prefix([again])
    assert len(bundles) == 7  # (30 - 1) // 4 blocks, the last token recomputed
    full, window = zip(*bundles)
    assert NULL_BLOCK not in full and window[:5] == (NULL_BLOCK,) * 5
    assert kv.allocate_slots([again], 2, [bundles]) is not None and again.num_computed_tokens == 28
    again.num_computed_tokens += 2
    check(kv, [again])
    assert kv.prefix_cache_hits == 28
    kv.free(again)
    for block in window[5:]:  # the windowed group's last two blocks evicted, the global group's kept:
        kv.pool._forget(block)  # a shorter hit for both groups, whose windowed blocks are all there
    [bundles] = kv.find_cached_prefix([Sequence(token_ids=list(range(30)), num_prompt_tokens=30)])
    full, window = zip(*bundles)
    assert len(bundles) == 5 and window[3:] == window[3:5] and NULL_BLOCK not in window[3:]
    assert full == tuple(b for b, _ in zip(full, range(5)))


def test_swap_skips_released_blocks():
    space = SwapSpace(8)
    tables = {(1, 0): [3, 4, 5], (1, 1): [NULL_BLOCK, NULL_BLOCK, 7]}
    pairs = space.swap_out("r", tables)
    assert sorted(d for d, _ in pairs) == [3, 4, 5, 7] and space.num_used_blocks == 4
    back = space.swap_in("r", {(1, 0): [10, 11, 12], (1, 1): [NULL_BLOCK, NULL_BLOCK, 13]})
    assert sorted(d for _, d in back) == [10, 11, 12, 13] and space.num_used_blocks == 0


def test_memory_per_sequence_at_8k_context_with_a_1k_window():
    """The figure of docs/architecture.md (scripts/kv_window_memory.py): layer-blocks one sequence holds at
    8,192 tokens with a 1,024-token window, block size 16; before, every layer keeps all 512 blocks."""
    sys.path.insert(0, SCRIPTS)
    try:
        from kv_window_memory import blocks_held
    finally:
        sys.path.remove(SCRIPTS)
    assert blocks_held([1024] * 32, 8192, 16, 2048) == (64, 65, 32)  # all windowed: 64 of 512 blocks
    assert blocks_held(([1024] * 5 + [None]) * 8, 8192, 16, 2048) == (512 + 5 * 64, 512 + 5 * 65, 8)
    assert (512 + 5 * 64) * 8 / (512 * 48) < 0.28  # Gemma 3 12B's pattern: 27% of the layer-blocks


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "prefix"]), st.integers(0, 10_000),
                         st.integers(1, 30)), max_size=50)


@settings(max_examples=80, deadline=None)
@given(ops=ops, windows=st.sampled_from([(5,), (3, None), (8, 8, None), (None, 4, None, 4)]),
       block_size=st.sampled_from([1, 4]), num_blocks=st.integers(4, 40))
def test_random_operations_keep_invariants(ops, windows, block_size, num_blocks):
    layout = kv_cache_layout(windows)
    kv = (HybridKVCacheManager(layout, num_blocks, block_size) if layout.num_groups > 1
          else KVCacheManager(num_blocks, block_size, sliding_window=layout.group_windows[0]))
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op in ("add", "prefix"):
            tokens = [pick % 3] * n if op == "prefix" else [(pick + i) % 7 for i in range(n)]
            seq = Sequence(token_ids=tokens, num_prompt_tokens=n)
            [cached] = kv.find_cached_prefix([seq])
            todo = n - len(cached) * block_size
            free = kv.pool.num_free_blocks
            if kv.allocate_slots([seq], todo, [cached]) is not None:
                seq.num_computed_tokens += todo
                live.append(seq)
            else:
                assert kv.pool.num_free_blocks == free and seq.num_computed_tokens == 0
        elif live:
            seq = live[pick % len(live)]
            if op == "append":
                seq.token_ids.append(pick % 5)
                if kv.allocate_slots([seq], 1) is not None:
                    seq.num_computed_tokens += 1
                else:
                    seq.token_ids.pop()
            elif op == "fork":
                child = seq.fork(len(live))
                kv.fork(seq, child)
                live.append(child)
            else:
                kv.free(seq)
                live.remove(seq)
        kv.take_pending_copies()
        check(kv, live)
    for seq in live:
        kv.free(seq)
    assert kv.pool.num_free_blocks == num_blocks
