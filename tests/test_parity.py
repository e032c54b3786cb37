"""Greedy tokens equal transformers' exactly (float32), through preemption and chunked prefill."""
import numpy as np
import pytest

from conftest import hf_greedy, random_prompts
from jpaged import LLM, SamplingParams

PROMPT_LENS = [1, 7, 16, 33, 300, 64, 129, 5]
MAX_TOKENS = 24
_oracle_cache = {}


def oracle(name, model, prompt):
    key = (name, tuple(prompt))
    if key not in _oracle_cache:
        _oracle_cache[key] = hf_greedy(model, prompt, MAX_TOKENS)
    return _oracle_cache[key]


def check_parity(name, hf_model, llm, prompts):
    # min_tokens bans EOS as transformers' min_new_tokens does, so both pick from the same logits
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = oracle(name, hf_model, prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        got_lps = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        np.testing.assert_allclose(got_lps, ref_logprobs, atol=1e-4)
        assert got.finish_reason == "length"
    metrics = llm.get_metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"], "blocks leaked"
    return metrics


@pytest.mark.parametrize("model_fixture,block_size,num_blocks", [
    ("llama_dir", 16, 30),
    ("llama_dir", 1, 420),
    ("llama_dir", 32, 16),
    ("qwen2_dir", 16, 30),
    ("tied_llama_dir", 16, 30),
])
def test_greedy_parity_with_preemption(request, model_fixture, block_size, num_blocks):
    path, hf_model = request.getfixturevalue(model_fixture)
    llm = LLM(path, block_size=block_size, num_kv_blocks=num_blocks, max_model_len=512,
              max_num_batched_tokens=256)
    prompts = random_prompts(np.random.default_rng(0), PROMPT_LENS)
    metrics = check_parity(model_fixture, hf_model, llm, prompts)
    assert metrics["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert metrics["peak_kv_cache_usage"] > 0.8


@pytest.mark.parametrize("budget", [16, 2048])
def test_chunked_prefill_same_tokens(llama_dir, budget):
    path, hf_model = llama_dir
    llm = LLM(path, max_num_batched_tokens=budget, num_kv_blocks=128, max_model_len=512)
    prompts = random_prompts(np.random.default_rng(1), [300, 3, 45, 17])
    check_parity("llama_dir", hf_model, llm, prompts)
