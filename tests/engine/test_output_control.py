"""logit_bias, allowed_token_ids and bad_words through LLM.generate, and vocabulary checks."""
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, BeamSearchParams, SamplingParams

A, B = ord("a"), ord("b")  # the byte tokenizer: token i is byte i


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir[0], num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=256)


def tokens(llm, prompt, **kw):
    kw = dict(dict(temperature=0.0, max_tokens=12, ignore_eos=True), **kw)
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].token_ids


def test_logit_bias_forces_and_forbids(llm):
    prompt = random_prompts(np.random.default_rng(0), [10])[0]
    assert tokens(llm, prompt, logit_bias={A: 100}) == [A] * 12
    plain = tokens(llm, prompt)
    banned = tokens(llm, prompt, logit_bias={t: -100 for t in set(plain)})
    assert not set(banned) & set(plain)
    sampled = tokens(llm, prompt, temperature=1.0, seed=3, logit_bias={str(A): 100, B: 100})
    assert set(sampled) <= {A, B} and len(set(sampled)) == 2


def test_allowed_token_ids(llm):
    prompt = random_prompts(np.random.default_rng(1), [10])[0]
    for kw in (dict(), dict(temperature=1.3, seed=5, top_k=2), dict(repetition_penalty=2.0)):
        assert set(tokens(llm, prompt, allowed_token_ids=[7, 40, 99], **kw)) <= {7, 40, 99}, kw


def test_bad_words(llm):
    """A single-token bad word never appears; a two-token one never completes: with 'a' forced by a
    bias, banning "aa" alternates 'a' with the next best token."""
    prompt = random_prompts(np.random.default_rng(2), [10])[0]
    assert A not in tokens(llm, prompt, logit_bias={A: 100}, bad_words=["a"])
    out = tokens(llm, prompt, logit_bias={A: 100}, bad_words=["aa"])
    assert out[::2] == [A] * 6 and A not in out[1::2]
    sampled = tokens(llm, prompt, temperature=1.0, seed=1, logit_bias={A: 5, B: 5}, bad_words=["ab", "b"])
    assert B not in sampled and A in sampled


def test_vocabulary_checks_refuse_before_device_work_and_engine_keeps_serving(llm):
    prompt = [5, 6, 7]
    for params, field in ((SamplingParams(logit_bias={256: 1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[3, 300]), "allowed_token_ids"),
                          (BeamSearchParams(beam_width=129), "beam_width")):
        with pytest.raises(ValueError, match=field):
            if isinstance(params, BeamSearchParams):
                llm.beam_search([prompt], params)
            else:
                llm.generate([prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4))[0].sequences) == 3
    assert len(tokens(llm, prompt, logprobs=20)) == 12
