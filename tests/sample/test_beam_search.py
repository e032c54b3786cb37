"""In-engine beam search equals transformers' generate(num_beams=k, do_sample=False)."""
import numpy as np
import pytest
import torch

from conftest import random_prompts
from jpaged import LLM, BeamSearchParams


def hf_beams(model, prompt, k, max_new_tokens, length_penalty=1.0, eos_token_id=None):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=k, num_return_sequences=k, do_sample=False,
                             max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                             eos_token_id=eos_token_id, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[:row.index(eos_token_id) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (3, 0.5)])
def test_beam_search_matches_transformers(llama_dir, k, length_penalty):
    path, hf_model = llama_dir
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, block_size=4)
    prompts = random_prompts(np.random.default_rng(k), [5, 23])
    params = BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=length_penalty, ignore_eos=True)
    results = llm.beam_search(prompts, params)
    for prompt, result in zip(prompts, results):
        ref_seqs, ref_scores = hf_beams(hf_model, prompt, k, 12, length_penalty)
        assert [s.token_ids for s in result.sequences] == ref_seqs
        np.testing.assert_allclose([s.score for s in result.sequences], ref_scores, atol=1e-4)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_beam_search_with_eos_matches_transformers(llama_dir):
    path, hf_model = llama_dir
    llm = LLM(path, num_kv_blocks=128, max_model_len=256, block_size=4)
    prompt = random_prompts(np.random.default_rng(9), [11])[0]
    probe, _ = hf_beams(hf_model, prompt, 3, 10)
    eos = probe[1][3]  # a token that the beams do produce, so some hypotheses end early
    llm.llm_engine.eos_token_ids = (eos,)
    result = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    ref_seqs, ref_scores = hf_beams(hf_model, prompt, 3, 10, eos_token_id=eos)
    assert any(s[-1] == eos for s in ref_seqs)
    assert [s.token_ids for s in result.sequences] == ref_seqs
    np.testing.assert_allclose([s.score for s in result.sequences], ref_scores, atol=1e-4)


def test_beams_share_blocks_and_survive_preemption(llama_dir):
    path, _ = llama_dir
    prompts = random_prompts(np.random.default_rng(3), [40, 33, 27])
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    roomy = LLM(path, num_kv_blocks=256, max_model_len=256, block_size=8)
    expected = [[s.token_ids for s in r.sequences] for r in roomy.beam_search(prompts, params)]
    # 4 beams of a 40-token prompt share its 5 full blocks: far fewer than 4 private copies would need
    assert round(roomy.get_metrics()["peak_kv_cache_usage"] * 256) < 3 * 4 * 8
    unshared = LLM(path, num_kv_blocks=256, max_model_len=256, block_size=8, share_forked_blocks=False)
    assert [[s.token_ids for s in r.sequences] for r in unshared.beam_search(prompts, params)] == expected
    assert unshared.get_metrics()["peak_kv_cache_usage"] > roomy.get_metrics()["peak_kv_cache_usage"]
    tight = LLM(path, num_kv_blocks=30, max_model_len=256, block_size=8)
    got = [[s.token_ids for s in r.sequences] for r in tight.beam_search(prompts, params)]
    assert tight.get_metrics()["num_preemptions"] > 0
    assert got == expected
    m = tight.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_aborting_a_beam_search_frees_its_blocks(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=256, block_size=4)
    engine = llm.llm_engine
    prompt = random_prompts(np.random.default_rng(4), [18])[0]
    engine.add_request("beams", prompt, BeamSearchParams(beam_width=3, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    out = engine.abort_request("beams")
    assert out.finished and len(out.outputs) == 3
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 4 for c in out.outputs)  # 4 steps, 4 tokens
    assert not engine.has_unfinished_requests()
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
