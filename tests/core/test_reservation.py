"""The Orca reservation baselines: sizes per mode, first fit, external fragmentation, scheduler use."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import SchedulerConfig
from jpaged.core.block_pool import NoFreeBlocksError
from jpaged.core.reservation import ContiguousPool, ReservationKVCacheManager
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import StepResult
from jpaged.core.request import Request, Sequence
from jpaged.sampling_params import SamplingParams
from jpaged.utils import next_power_of_two as next_pow2
from jpaged import testing


def seq(prompt: int, output: int | None) -> Sequence:
    s = Sequence(token_ids=[5] * prompt, num_prompt_tokens=prompt)
    s.max_tokens = output
    return s


def test_next_pow2():
    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 300)] == [1, 1, 2, 4, 4, 8, 8, 16, 512]


@pytest.mark.parametrize("mode, prompt, output, tokens", [
    ("oracle", 5, 6, 11), ("pow2", 5, 6, 13), ("max", 5, 6, 32),
    ("oracle", 10, 30, 32), ("pow2", 10, 30, 32),           # pow2 capped at max_model_len
    ("oracle", 3, None, 32), ("pow2", 1, 1, 2), ("oracle", 4, 1, 5),
])
def test_reservation_sizes(mode, prompt, output, tokens):
    kv = ReservationKVCacheManager(64, 4, mode=mode, max_model_len=32)
    s = seq(prompt, output)
    assert kv.reservation_tokens(s) == tokens
    assert kv.allocate_slots([s], prompt) == [list(range(-(-tokens // 4)))]


def test_reservation_capped_at_pool():
    kv = ReservationKVCacheManager(5, 4, mode="max", max_model_len=64)
    assert kv.reservation_blocks(seq(3, 4)) == 5


def test_hand_made_trace_first_fit_and_external_fragmentation():
    """bs 4, 16 blocks. Reservations (oracle): A 3 blocks, B 4, C 2; free A; D needs 4 -> after C."""
    kv = ReservationKVCacheManager(16, 4, mode="oracle", max_model_len=64)
    a, b, c, d, e = seq(5, 6), seq(8, 8), seq(2, 6), seq(10, 6), seq(2, 2)  # 3, 4, 2, 4, 1 blocks
    for s in (a, b, c):
        assert kv.allocate_slots([s], s.num_tokens) is not None
    assert kv.reserved_blocks(a) == [0, 1, 2]
    assert kv.reserved_blocks(b) == [3, 4, 5, 6]
    assert kv.reserved_blocks(c) == [7, 8]
    assert kv.pool.free_runs == [[9, 7]] and kv.pool.num_used_blocks == 9
    # the block table covers only what has been allocated so far (the prompt), consecutively
    assert kv.block_table(a) == [0, 1] and kv.block_table(c) == [7]
    # later growth inside the reservation takes nothing from the pool
    a.num_computed_tokens = 5
    assert kv.allocate_slots([a], 1) == [[]]  # nothing new
    kv.allocate_slots([a], 4)
    assert kv.block_table(a) == [0, 1, 2] and kv.pool.num_free_blocks == 7
    with pytest.raises(RuntimeError, match="reserved"):
        kv.allocate_slots([a], 8)  # past the reservation: its max_tokens was wrong
    kv.free(a)
    assert kv.pool.free_runs == [[0, 3], [9, 7]]
    kv.allocate_slots([d], d.num_tokens)         # first fit skips the 3-block hole
    assert kv.reserved_blocks(d) == [9, 10, 11, 12]
    kv.allocate_slots([e], e.num_tokens)         # a 1-block run goes into the first hole
    assert kv.reserved_blocks(e) == [0]
    # 5 free blocks in holes of 2 and 3: a 4-block request cannot come in, though 5 >= 4
    big = seq(8, 8)
    assert kv.pool.num_free_blocks == 5 and kv.allocate_slots([big], 8) is None
    assert kv.external_fragmentation(big) == 5
    assert kv.external_fragmentation(seq(4, 4)) == 0   # 2 blocks fit the 2 and 3 holes
    assert kv.external_fragmentation(seq(4, 8)) == 2   # 3 blocks: only the 2-block hole strands
    assert kv.external_fragmentation(None) == 0
    assert kv.allocate_slots([seq(4, 8), seq(4, 8)], 4) is None  # both need 3; only one 3-block hole
    assert kv.pool.num_free_blocks == 5                            # (all or nothing)
    f, g = seq(4, 8), seq(4, 4)
    assert kv.allocate_slots([f, g], 4) is not None               # 3 -> [1..3], 2 -> [13, 14]
    # freeing merges holes on both sides
    for s in (b, c, d, e, f, g):
        kv.free(s)
        kv.pool.check_invariants()
    assert kv.pool.free_runs == [[0, 16]]


def test_metrics_and_fork_copies():
    kv = ReservationKVCacheManager(16, 4, mode="pow2", max_model_len=64)
    s = seq(6, 5)  # 6 + 8 = 14 tokens -> 4 blocks
    kv.allocate_slots([s], 6)
    s.num_computed_tokens = 6
    assert kv.usage() == 4 / 16 and kv.utilization([s]) == 6 / 16
    child = seq(6, 5)
    kv.fork(s, child)
    assert kv.reserved_blocks(child) == [4, 5, 6, 7]
    assert kv.take_pending_copies() == [(0, 4), (1, 5)] and kv.take_pending_copies() == []
    assert kv.find_cached_blocks(seq(6, 5)) == []
    kv.free(s)
    kv.free(child)
    kv.pool.check_invariants()
    assert kv.pool.num_free_blocks == 16
    with pytest.raises(ValueError, match="mode"):
        ReservationKVCacheManager(4, 4, mode="buddy", max_model_len=8)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=50),
       num_blocks=st.integers(1, 40))
def test_contiguous_pool_invariants(ops, num_blocks):
    pool = ContiguousPool(num_blocks)
    held = []
    for alloc, length, pick in ops:
        if alloc:
            fits = pool.fits([length])
            try:
                held.append((pool.allocate(length), length))
                assert fits
            except NoFreeBlocksError:
                assert not fits
        elif held:
            pool.free(*held.pop(pick % len(held)))
        pool.check_invariants()
    for run in held:
        pool.free(*run)
    assert pool.free_runs == [[0, num_blocks]]


def test_scheduler_admits_by_contiguous_runs_and_never_preempts():
    """The real scheduler over the manager: admission waits for a hole, not for free blocks."""
    kv = ReservationKVCacheManager(12, 4, mode="oracle", max_model_len=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv,
                      max_model_len=64)
    lens = [(4, 4), (4, 12), (4, 4), (8, 8)]  # 2, 4, 2, 4 blocks
    reqs = []
    for i, (p, o) in enumerate(lens):
        r = Request(str(i), None, [7] * p, SamplingParams(max_tokens=o, ignore_eos=True))
        r.seqs[0].max_tokens = o
        sched.add_request(r)
        reqs.append(r)
    out = sched.schedule()
    assert [sr.request_id for sr in out.requests] == ["0", "1", "2", "3"]
    assert kv.pool.num_free_blocks == 0
    while True:
        update_with_token(sched, out, 1)
        kv.pool.check_invariants()
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
    assert sched.num_preemptions == 0 and kv.pool.num_free_blocks == 12


def test_scheduler_blocks_on_external_fragmentation():
    kv = ReservationKVCacheManager(10, 4, mode="oracle", max_model_len=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv,
                      max_model_len=64)

    def add(i, p, o):
        r = Request(str(i), None, [7] * p, SamplingParams(max_tokens=o, ignore_eos=True))
        r.seqs[0].max_tokens = o
        sched.add_request(r)
        return r

    a, b, c = add(0, 4, 4), add(1, 4, 12), add(2, 4, 4)  # blocks 0-1, 2-5, 6-7; 8-9 free
    sched.schedule()
    sched.finish(a)                                     # holes: 0-1 and 8-9 (4 free blocks)
    d = add(3, 8, 8)                                    # needs 4 contiguous
    out = sched.schedule()
    assert d.request_id not in [sr.request_id for sr in out.requests] and list(sched.waiting) == [d]
    assert kv.pool.num_free_blocks == 4 and kv.external_fragmentation(d.seqs[0]) == 4
    sched.finish(c)                                     # 6-9 free now: it fits
    out = sched.schedule()
    assert d.request_id in [sr.request_id for sr in out.requests] and kv.reserved_blocks(d.seqs[0]) == [6, 7, 8, 9]
    del b


def update_with_token(sched, out, token):
    """Applies a step in which every sample row drew ``token``."""
    n = len(out.sample_rows)
    sched.update_from_output(out, StepResult([token] * n, [0.0] * n, [[]] * n, [[]] * n))


def tiny_llama():
    """A random one-layer Llama built in memory (no checkpoint, no torch)."""
    from flax import nnx

    from jpaged.models import ModelConfig
    from jpaged.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64,
                                   hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   eos_token_id=2))
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))


def test_engine_runs_each_allocator_with_paged_tokens():
    """Same model, kernels and scheduler: greedy tokens do not depend on the allocator."""
    from jpaged import LLM
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.config_resolution import engine_config

    model = tiny_llama()
    prompts = [[3 + i, 40, 50 + i, 9] * (i + 1) for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(3)]
    results = {}
    for allocator in ("paged", "max"):
        config = engine_config(None, allocator=allocator, num_kv_blocks=64, block_size=4, max_model_len=64)
        llm = LLM.from_engine(LLMEngine(config, model=model))
        results[allocator] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        m = llm.get_metrics()
        assert m["num_free_blocks"] == 64 and m["num_preemptions"] == 0
        testing.block_pool(llm).check_invariants()
    assert results["paged"] == results["max"]
    assert [len(t) for t in results["paged"]] == [3, 5, 7]
