"""Sharing the cache: parallel sampling with copy-on-write, automatic prefix caching."""
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, SamplingParams
from jpaged import testing


def blocks_at_peak(llm):
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    return round(m["peak_kv_cache_usage"] * m["num_total_blocks"])


def test_seed_article_example_114_blocks_instead_of_300(llama_dir):
    """1,000-token prompt, 4 samples of 200 tokens, block 16: 114 blocks shared vs 300 unshared."""
    prompt = random_prompts(np.random.default_rng(0), [1000])[0]
    params = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=200, ignore_eos=True)
    shared = LLM(llama_dir[0], block_size=16, num_kv_blocks=400, max_model_len=1300, enable_prefix_caching=False)
    out = shared.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 200 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4, "each sample has its own random stream"
    assert blocks_at_peak(shared) == 114
    unshared = LLM(llama_dir[0], block_size=16, num_kv_blocks=400, max_model_len=1300, enable_prefix_caching=False)
    single = SamplingParams(temperature=1.0, seed=0, max_tokens=200, ignore_eos=True)
    unshared.generate([prompt] * 4, single, use_tqdm=False)
    assert blocks_at_peak(unshared) == 300


def test_greedy_parallel_samples_equal_the_single_greedy_sample(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=256)
    prompts = random_prompts(np.random.default_rng(1), [13, 40])
    single = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    many = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    for one, three in zip(single, many):
        assert [c.index for c in three.outputs] == [0, 1, 2]
        assert all(c.token_ids == one.outputs[0].token_ids for c in three.outputs)
    blocks_at_peak(llm)


def test_parallel_samples_finish_independently_and_free_blocks(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=256, block_size=4)
    prompt = random_prompts(np.random.default_rng(2), [9])[0]
    probe = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]
    stop = probe.outputs[1].token_ids[4]
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                stop_token_ids=[stop]), use_tqdm=False)[0]
    for full, got in zip(probe.outputs, out.outputs):
        cut = full.token_ids.index(stop) + 1 if stop in full.token_ids else len(full.token_ids)
        assert got.token_ids == full.token_ids[:cut]
    blocks_at_peak(llm)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=16,
                                                   ignore_eos=True)])
def test_prefix_caching_on_and_off_give_identical_tokens(llama_dir, params):
    rng = np.random.default_rng(4)
    prefix = random_prompts(rng, [70])[0]
    prompts = [prefix + s for s in random_prompts(rng, [1, 5, 16, 33])] + [prefix[:48]]
    results = {}
    for caching in (False, True):
        llm = LLM(llama_dir[0], num_kv_blocks=96, max_model_len=256, enable_prefix_caching=caching,
                  max_num_batched_tokens=64)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + again]
        if caching:
            assert all(o.num_cached_tokens > 0 for o in again)
            assert llm.get_metrics()["prefix_cache_hits"] > 0
        blocks_at_peak(llm)
    assert results[False] == results[True]


def test_shared_prefix_across_32_requests_is_computed_once(llama_dir):
    rng = np.random.default_rng(5)
    prefix = random_prompts(rng, [64])[0]
    prompts = [prefix + s for s in random_prompts(rng, [8] * 32)]
    llm = LLM(llama_dir[0], num_kv_blocks=256, max_model_len=256, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    m = llm.get_metrics()
    assert m["prefix_cache_hits"] == 31 * 64
    assert m["prefix_cache_queries"] == 32 * 72
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [64] * 31


def test_cache_salt_isolates_prefixes(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=256)
    engine = llm.llm_engine
    prompt = random_prompts(np.random.default_rng(6), [40])[0]
    params = SamplingParams(temperature=0, max_tokens=1)
    for i, salt in enumerate(["a", "b", "a"]):
        engine.add_request(f"r{i}", prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            outs = engine.step()
        assert outs[0].num_cached_tokens == (32 if i == 2 else 0)


def test_swap_and_recompute_preemption_give_the_unpreempted_tokens(llama_dir):
    prompts = random_prompts(np.random.default_rng(7), [30, 50, 70, 90, 20, 60])
    params = SamplingParams(temperature=0.7, seed=11, max_tokens=40, ignore_eos=True)
    runs = {}
    for name, kw in {"roomy": dict(num_kv_blocks=200),
                     "recompute": dict(num_kv_blocks=22, preemption_mode="recompute"),
                     "swap": dict(num_kv_blocks=22, preemption_mode="swap"),
                     "swap_full": dict(num_kv_blocks=22, preemption_mode="swap", swap_space_bytes=1)}.items():
        llm = LLM(llama_dir[0], block_size=8, max_model_len=256, max_num_batched_tokens=128, **kw)
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        m = llm.get_metrics()
        assert (m["num_preemptions"] > 0) == (name != "roomy"), name
        assert (m["num_swap_outs"] > 0) == (name == "swap"), name
        assert testing.swap_space(llm).num_used_blocks == 0 and not testing.swap_space(llm).swapped
        blocks_at_peak(llm)
    assert runs["recompute"] == runs["roomy"]
    assert runs["swap"] == runs["roomy"]
    assert runs["swap_full"] == runs["roomy"]  # falls back to recompute
