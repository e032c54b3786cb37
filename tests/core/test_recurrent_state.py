"""Recurrent-state slots on the host (`jpaged.core.recurrent_state`): a slot per sequence taken with
its blocks all or nothing, forks sharing the parent's slot and copying it on the first write, the
last writer keeping the original, frees; the layout of recurrent layers; a scheduler whose slots
run short preempts and every slot comes back."""
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_layout import RECURRENT, RECURRENT_GROUP, kv_cache_layout
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.recurrent_state import NO_SLOT, RecurrentStateCache
from jpaged.core.request import Request, Sequence
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import StepResult
from jpaged.sampling_params import SamplingParams

import numpy as np


def cache(num_blocks=16, num_slots=4):
    return RecurrentStateCache(KVCacheManager(num_blocks, 4, enable_prefix_caching=False), num_slots)


def check(kv):
    """Reference counts equal the sequences holding each slot; free slots are held by none."""
    holders = [0] * kv.num_slots
    for slot in kv.slots.values():
        holders[slot] += 1
    assert holders == kv.ref_counts
    assert sorted(kv.free_slots) == [s for s in range(kv.num_slots) if not holders[s]]


def step(kv, seqs, n=1):
    assert kv.allocate_slots(seqs, n) is not None
    for seq in seqs:
        seq.num_computed_tokens += n


def test_layout_puts_state_pools_after_the_kv_tensors():
    layout = kv_cache_layout([RECURRENT, RECURRENT, RECURRENT, None] * 2)
    assert layout.num_tensors == 2 and layout.num_recurrent == 6 and not layout.is_trivial
    assert layout.layers == ((RECURRENT_GROUP, 2), (RECURRENT_GROUP, 3), (RECURRENT_GROUP, 4), (0, 0),
                             (RECURRENT_GROUP, 5), (RECURRENT_GROUP, 6), (RECURRENT_GROUP, 7), (0, 1))
    assert layout.max_blocks_per_seq(64, 16, 16) == 4  # the KV group alone holds blocks


def test_forks_share_a_slot_and_copy_it_on_write():
    kv = cache()
    parent = Sequence(token_ids=list(range(10)), num_prompt_tokens=10)
    step(kv, [parent], 10)
    slot = kv.state_slot(parent)
    children = [parent.fork(i) for i in (1, 2)]
    for child in children:
        kv.fork(parent, child)
    assert [kv.state_slot(s) for s in children] == [slot, slot] and kv.ref_counts[slot] == 3
    assert kv.take_pending_state_copies() == []  # nothing copied until a step writes
    family = [parent] + children
    assert kv.slots_needed(family) == 2
    step(kv, family)
    copies = kv.take_pending_state_copies()
    assert sorted(src for src, _ in copies) == [slot, slot]  # two writers copy, the last keeps the slot
    assert len({kv.state_slot(s) for s in family}) == 3 and kv.state_slot(children[-1]) == slot
    check(kv)
    for seq in family:
        kv.free(seq)
    assert kv.num_free_slots == kv.num_slots and kv.kv_cache.pool.num_free_blocks == 16
    assert kv.state_slot(parent) == NO_SLOT


def test_slots_and_blocks_are_taken_all_or_nothing():
    kv = cache(num_blocks=16, num_slots=1)
    a, b = (Sequence(token_ids=list(range(8)), num_prompt_tokens=8) for _ in range(2))
    step(kv, [a], 8)
    free_blocks = kv.kv_cache.pool.num_free_blocks
    assert kv.allocate_slots([b], 8) is None  # no slot left: no block taken either
    assert kv.kv_cache.pool.num_free_blocks == free_blocks and kv.state_slot(b) == NO_SLOT
    big = cache(num_blocks=2, num_slots=2)
    c = Sequence(token_ids=list(range(12)), num_prompt_tokens=12)
    assert big.allocate_slots([c], 12) is None and big.num_free_slots == 2  # no blocks: no slot taken


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["step", "fork", "free"])), max_size=40))
def test_random_forks_steps_and_frees_keep_the_counts(ops):
    kv = cache(num_blocks=64, num_slots=6)
    seqs = [Sequence(token_ids=list(range(5)), num_prompt_tokens=5)]
    step(kv, seqs, 5)
    for i, op in ops:
        seq = seqs[i % len(seqs)] if seqs else None
        if op == "step" and seqs and kv.slots_needed(seqs) <= kv.num_free_slots:
            step(kv, seqs)
            assert len({kv.state_slot(s) for s in seqs}) == len(seqs)  # after a step every writer owns its slot
        elif op == "fork" and seq is not None and len(seqs) < 6:
            child = seq.fork(len(seqs))
            kv.fork(seq, child)
            seqs.append(child)
        elif op == "free" and seq is not None:
            kv.free(seq)
            seqs.remove(seq)
        check(kv)
    for seq in seqs:
        kv.free(seq)
    assert kv.num_free_slots == kv.num_slots


def test_a_scheduler_short_of_slots_preempts_and_frees_them_all():
    """Two state slots, two requests of n = 2: the forks' copies need slots the other request holds,
    so the newer one is preempted (recompute); in the end every slot is free."""
    kv = cache(num_blocks=64, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, max_model_len=64)
    for i in range(2):
        scheduler.add_request(Request(str(i), None, [3, 4, 5, 6 + i], SamplingParams(n=2, max_tokens=3)))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        rows = len(out.sample_rows)
        assert all(s.state_slot >= 0 for s in out.seqs)
        assert len({s.state_slot for s in out.seqs}) == len(out.seqs)  # no two writers of one slot
        result = StepResult(tokens=np.full(rows, 7), logprobs=np.zeros(rows), top_ids=np.zeros((rows, 1), int),
                            top_logprobs=np.zeros((rows, 1)))
        scheduler.update_from_output(out, result)
        steps += 1
        assert steps < 50
    assert scheduler.num_preemptions > 0 and kv.num_free_slots == 2 and not kv.slots
