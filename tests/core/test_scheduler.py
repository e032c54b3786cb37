"""The scheduler alone: plain `Request`s, a real `KVCacheManager`, and sampled tokens handed back by
hand as a `StepResult` (no model, no runner, no engine)."""
import pytest

from jpaged.config import SchedulerConfig
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.request import Request
from jpaged.core.scheduler import Scheduler
from jpaged.core.scheduler_output import StepResult
from jpaged.sampling_params import SamplingParams


def make_scheduler(*, num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=False)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
    return Scheduler(config, kv, max_model_len=max_model_len), kv


def make_request(request_id: str, prompt_len: int, max_tokens: int, *, eos=(), **params) -> Request:
    params.setdefault("ignore_eos", not eos)
    request = Request(request_id, None, list(range(10, 10 + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=tuple(eos))
    request.seqs[0].max_tokens = max_tokens  # what the engine's input processor sets
    return request


def give_token(scheduler: Scheduler, out, token: int = 1):
    """Applies a step in which every sample row drew ``token``."""
    n = len(out.sample_rows)
    return scheduler.update_from_output(out, StepResult([token] * n, [0.0] * n, [[]] * n, [[]] * n))


def scheduled(out) -> list[tuple[str, int]]:
    return [(r.request_id, r.num_new_tokens) for r in out.requests]


def run_to_end(scheduler: Scheduler, max_steps: int = 200) -> list:
    outs = []
    while scheduler.has_unfinished_requests():
        assert len(outs) < max_steps, "the scheduler stopped making progress"
        outs.append(scheduler.schedule())
        give_token(scheduler, outs[-1])
    return outs


def test_prompts_are_admitted_in_order_and_chunked_to_the_token_budget():
    scheduler, _ = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 5, 4), make_request("b", 5, 4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert scheduled(out) == [("a", 5), ("b", 3)]  # b's prompt is cut to what the budget leaves
    assert [out.seqs[r.seq_row].request_id for r in out.sample_rows] == ["a"]  # b is mid-prompt: no sample
    give_token(scheduler, out)
    out = scheduler.schedule()
    assert scheduled(out) == [("a", 1), ("b", 2)]  # running first: a decodes, b finishes its prompt
    assert [out.seqs[r.seq_row].request_id for r in out.sample_rows] == ["a", "b"]


def test_max_num_seqs_holds_back_the_rest_until_one_finishes():
    scheduler, _ = make_scheduler(max_num_seqs=2)
    requests = [make_request(str(i), 4, 2 + i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    out = scheduler.schedule()
    assert [r for r, _ in scheduled(out)] == ["0", "1"] and list(scheduler.waiting) == [requests[2]]
    give_token(scheduler, out)
    give_token(scheduler, scheduler.schedule())  # "0" has its 2 tokens: it ends
    assert requests[0].finished and requests[0] not in scheduler.running
    assert [r for r, _ in scheduled(scheduler.schedule())] == ["1", "2"]


def test_requests_end_at_max_tokens_and_every_block_comes_back():
    scheduler, kv = make_scheduler()
    free_at_start = kv.pool.num_free_blocks
    requests = [make_request(str(i), 3 + i, 5 + i) for i in range(3)]
    for r in requests:
        scheduler.add_request(r)
    run_to_end(scheduler)
    for r in requests:
        seq = r.seqs[0]
        assert seq.finish_reason == "length" and seq.num_output_tokens == r.sampling_params.max_tokens
    assert kv.pool.num_free_blocks == free_at_start and not scheduler.requests


def test_an_eos_token_stops_a_sequence_after_min_tokens():
    scheduler, kv = make_scheduler()
    free_at_start = kv.pool.num_free_blocks
    r = make_request("r", 4, 10, eos=(1,), min_tokens=3)
    scheduler.add_request(r)
    outs = run_to_end(scheduler)
    assert r.seqs[0].finish_reason == "stop" and r.seqs[0].num_output_tokens == 3 and len(outs) == 3
    assert kv.pool.num_free_blocks == free_at_start


def test_a_full_pool_preempts_the_newest_request_which_recomputes_and_finishes():
    # 4 blocks of 4 tokens: two requests of 4 + 8 tokens (3 blocks each) cannot both run to the end
    scheduler, kv = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    free_at_start = kv.pool.num_free_blocks
    old, new = make_request("old", 4, 8), make_request("new", 4, 8)
    scheduler.add_request(old)
    scheduler.add_request(new)
    preempted = []
    steps = 0
    while scheduler.has_unfinished_requests():
        steps += 1
        assert steps < 100
        out = scheduler.schedule()
        preempted += out.preempted
        if "new" in out.preempted:
            assert new.seqs[0].num_computed_tokens == 0 and scheduler.waiting[0] is new  # recompute, at the front
        give_token(scheduler, out)
    assert preempted and set(preempted) == {"new"} and scheduler.num_preemptions == len(preempted)
    assert new.num_preemptions == len(preempted) and old.num_preemptions == 0
    for r in (old, new):
        assert r.seqs[0].finish_reason == "length" and r.seqs[0].num_output_tokens == 8
    assert kv.pool.num_free_blocks == free_at_start


def test_finish_frees_a_request_wherever_it_is_and_ids_are_unique():
    scheduler, kv = make_scheduler(max_num_seqs=1)
    free_at_start = kv.pool.num_free_blocks
    running, waiting = make_request("running", 6, 4), make_request("waiting", 6, 4)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    with pytest.raises(ValueError, match="request_id='running'"):
        scheduler.add_request(make_request("running", 2, 2))
    give_token(scheduler, scheduler.schedule())
    assert scheduler.running == [running] and list(scheduler.waiting) == [waiting]
    assert kv.pool.num_free_blocks < free_at_start
    scheduler.finish(waiting)
    scheduler.finish(running)
    assert not scheduler.has_unfinished_requests() and kv.pool.num_free_blocks == free_at_start
