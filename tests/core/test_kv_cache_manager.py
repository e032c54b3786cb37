"""Host memory structures: invariants under random operations (hypothesis), and the basics."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.block_pool import BlockPool
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.utils import cdiv
from jpaged.core.request import Sequence


def check(manager: KVCacheManager, seqs):
    pool = manager.pool
    pool.check_invariants()
    holders = [0] * pool.num_blocks
    for seq in seqs:
        table = manager.block_table(seq)
        assert len(table) == cdiv(seq.num_computed_tokens, manager.block_size)
        for b in table:
            holders[b] += 1
    assert holders == pool.ref_counts, "ref counts must equal the number of tables holding each block"


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "abort"]),
                         st.integers(0, 10_000), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 4, 16]), num_blocks=st.integers(1, 40),
       prefix=st.booleans())
def test_random_operations_keep_invariants(ops, block_size, num_blocks, prefix):
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op == "add":
            seq = Sequence(token_ids=[pick % 7] * n, num_prompt_tokens=n)
            cached = manager.find_cached_blocks(seq)
            todo = seq.num_tokens - len(cached) * block_size
            used_before = manager.pool.num_used_blocks
            if manager.allocate_slots([seq], todo, [cached]) is not None:
                seq.num_computed_tokens += todo
                live.append(seq)
            else:  # all or nothing: a refused allocation changes nothing
                assert manager.pool.num_used_blocks == used_before and not manager.block_table(seq)
                assert seq.num_computed_tokens == 0
        elif live:
            seq = live[pick % len(live)]
            if op == "append":
                seq.token_ids.append(pick % 5)
                if manager.allocate_slots([seq], 1) is not None:
                    seq.num_computed_tokens += 1
                else:
                    seq.token_ids.pop()
            elif op == "fork":
                child = seq.fork(len(live))
                manager.fork(seq, child)
                live.append(child)
            else:  # free / abort release the same way
                manager.free(seq)
                live.remove(seq)
        manager.take_pending_copies()
        check(manager, live)
    for seq in live:
        manager.free(seq)
    assert manager.pool.num_free_blocks == num_blocks
    assert all(rc == 0 for rc in manager.pool.ref_counts)


def test_copy_on_write_copies_only_shared_partial_block():
    manager = KVCacheManager(10, 4, enable_prefix_caching=False)
    parent = Sequence(token_ids=list(range(6)), num_prompt_tokens=6)
    manager.allocate_slots([parent], 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    manager.fork(parent, child)
    assert manager.pool.num_used_blocks == 2
    child.token_ids.append(9)
    manager.allocate_slots([child], 1)  # writes into the shared, partly filled second block
    copies = manager.take_pending_copies()
    assert copies == [(manager.block_table(parent)[1], manager.block_table(child)[1])]
    assert manager.block_table(parent)[0] == manager.block_table(child)[0]  # the full block stays shared
    parent.token_ids.append(8)
    manager.allocate_slots([parent], 1)  # the last holder writes in place
    assert manager.take_pending_copies() == []


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, 11, None, (1,))
    pool.register(b, 22, None, (2,))
    pool.decref(a)
    pool.decref(b)
    assert pool.lookup(11, None, (1,)) == a
    assert pool.allocate() == a  # the first freed goes first
    assert pool.lookup(11, None, (1,)) is None and pool.lookup(22, None, (2,)) == b
    pool.check_invariants()


def test_prefix_match_never_covers_the_last_token():
    manager = KVCacheManager(8, 4)
    first = Sequence(token_ids=list(range(8)), num_prompt_tokens=8)
    manager.allocate_slots([first], 8, [[]])  # registers both blocks: full once the step has run
    first.num_computed_tokens = 8
    second = Sequence(token_ids=list(range(8)), num_prompt_tokens=8)
    cached = manager.find_cached_blocks(second)
    assert cached == manager.block_table(first)[:1]  # one block reused; the last block is recomputed
    assert manager.prefix_cache_hits == 0            # finding is pure
    manager.allocate_slots([second], 4, [cached])
    assert second.num_computed_tokens == 4 and manager.prefix_cache_hits == 4
