"""prompt_logprobs=k against transformers (float32), with chunked prefill and a would-be prefix-cache hit."""
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, SamplingParams


def hf_prompt_logprobs(model, prompt):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def llm(llama_dir):  # 24 tokens per step: long prompts are prefilled in chunks
    return LLM(llama_dir[0], num_kv_blocks=64, block_size=8, max_model_len=256, max_num_batched_tokens=24)


def check(out, prompt, ref, k):
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        entry, row = lps[p], ref[p - 1]
        np.testing.assert_allclose(entry[prompt[p]], row[prompt[p]], atol=1e-4)
        top = np.argsort(-row)[:k]
        assert set(top) <= set(entry) and len(entry) <= k + 1
        np.testing.assert_allclose([entry[t] for t in top], row[top], atol=1e-4)


def test_equal_to_transformers_with_chunked_prefill_and_cache(llm, llama_dir):
    prompts = random_prompts(np.random.default_rng(0), [70, 9, 2])
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check(out, prompt, hf_prompt_logprobs(llama_dir[1], prompt), 3)
    again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # prompt logprobs need the prompt run, not read from the cache
    check(again, prompts[0], hf_prompt_logprobs(llama_dir[1], prompts[0]), 0)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_parallel_samples_share_one_report(llm, llama_dir):
    prompt = random_prompts(np.random.default_rng(1), [30])[0]
    out = llm.generate([prompt], SamplingParams(n=3, seed=2, max_tokens=4, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(out, prompt, hf_prompt_logprobs(llama_dir[1], prompt), 1)


def test_refused_above_the_vocabulary():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs=20"):
        SamplingParams(prompt_logprobs=20).validate_for_vocab(16)
