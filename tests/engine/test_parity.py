"""Greedy tokens equal transformers' exactly (float32), through preemption and chunked prefill."""
import numpy as np
import pytest

from conftest import assert_greedy_parity, random_prompts
from jpaged import LLM

PROMPT_LENS = [1, 7, 16, 33, 300, 64, 129, 5]


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
    metrics = assert_greedy_parity(model_fixture, hf_model, llm, prompts)
    assert metrics["num_preemptions"] > 0, "the pool was meant to be small enough to preempt"
    assert metrics["peak_kv_cache_usage"] > 0.8


@pytest.mark.parametrize("budget", [16, 2048])
def test_chunked_prefill_same_tokens(llama_dir, budget):
    path, hf_model = llama_dir
    llm = LLM(path, max_num_batched_tokens=budget, num_kv_blocks=128, max_model_len=512)
    prompts = random_prompts(np.random.default_rng(1), [300, 3, 45, 17])
    assert_greedy_parity("llama_dir", hf_model, llm, prompts)
