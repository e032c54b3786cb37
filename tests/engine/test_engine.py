"""Engine behaviour: sampling options, stops, seeds, logprobs, abort, streaming, bad input."""
import numpy as np
import pytest

from conftest import hf_greedy, random_prompts
from jpaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir[0], num_kv_blocks=96, max_model_len=512, max_num_batched_tokens=512)


def assert_all_free(llm):
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_prompt_forms_and_text(llm):
    text = "hello paged world"
    by_text, by_ids, by_dict = llm.generate(
        [text, llm.get_tokenizer().encode(text), {"prompt_token_ids": llm.get_tokenizer().encode(text)}],
        greedy(), use_tqdm=False)
    assert by_text.prompt == text
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    out = by_text.outputs[0]
    assert out.text == llm.get_tokenizer().decode(out.token_ids)
    assert_all_free(llm)


def test_seeded_sampling_same_alone_and_in_batch(llm):
    rng = np.random.default_rng(3)
    prompt = random_prompts(rng, [20])[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(rng, rng.integers(1, 60, 15))
    batch = [prompt] + others
    params = [seeded] + [SamplingParams(temperature=1.0, max_tokens=int(n), ignore_eos=True)
                         for n in rng.integers(1, 20, 15)]
    order = rng.permutation(16)
    outs = llm.generate([batch[i] for i in order], [params[i] for i in order], use_tqdm=False)
    in_batch = outs[int(np.where(order == 0)[0][0])].outputs[0].token_ids
    assert alone == in_batch
    assert llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], unseeded, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_free(llm)


def test_filters_that_leave_one_token_are_greedy(llm):
    prompt = random_prompts(np.random.default_rng(4), [30])[0]
    ref = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        p = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=7, **kw)
        assert llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids == ref, kw


def test_repetition_penalty_matches_transformers(llm, llama_dir):
    import torch

    prompt = random_prompts(np.random.default_rng(5), [12])[0]
    with torch.no_grad():
        ref = llama_dir[1].generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                    do_sample=False, repetition_penalty=1.5, pad_token_id=0)
    out = llm.generate([prompt], greedy(16, repetition_penalty=1.5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def penalized_greedy_reference(model, prompt, n, presence=0.0, frequency=0.0):
    """Greedy decoding from transformers' logits with vLLM's penalties, step by step: every
    generated token's logit minus ``frequency`` x its count so far and ``presence`` if it occurred."""
    import torch

    tokens = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
        counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=logits.shape[0])
        logits = logits - frequency * counts - presence * (counts > 0)
        tokens.append(int(logits.argmax()))
    return tokens


def test_presence_and_frequency_penalties_change_choices(llm, llama_dir):
    prompt = random_prompts(np.random.default_rng(6), [10])[0]
    plain = llm.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].token_ids
    assert plain == penalized_greedy_reference(llama_dir[1], prompt, 24)
    assert len(set(plain)) < len(plain), "the plain output must repeat a token for penalties to act on"
    for kw in (dict(presence=2.0), dict(frequency=2.0), dict(frequency=0.5), dict(presence=-1.0)):
        got = llm.generate([prompt], greedy(24, **{f"{k}_penalty": v for k, v in kw.items()}),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert got == penalized_greedy_reference(llama_dir[1], prompt, 24, **kw), kw
        if list(kw.values())[0] >= 2.0:
            assert got != plain and len(set(got)) > len(set(plain)), kw  # fewer repeats


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    prompt = random_prompts(np.random.default_rng(7), [25])[0]
    ref = llm.generate([prompt], greedy(10), use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = ref[2]
    first = ref.index(stop_tok)
    out = llm.generate([prompt], greedy(10, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = llm.generate([prompt], greedy(10, stop_token_ids=[stop_tok], min_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert stop_tok not in out.token_ids[:5] and len(out.token_ids) >= 6
    out = llm.generate([prompt], greedy(3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_strings_truncate_text(llm):
    tok = llm.get_tokenizer()
    prompt = "the quick brown fox"
    full = llm.generate([prompt], greedy(20), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:7]
    assert stop, "need generated text to cut"
    out = llm.generate([prompt], greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.find(stop)]
    assert stop not in out.text and tok.decode(out.token_ids).startswith(out.text)


def test_eos_stops_unless_ignored(llm):
    prompt = random_prompts(np.random.default_rng(8), [9])[0]
    ref = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    try:
        engine.eos_token_ids = (ref[3],)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:ref.index(ref[3]) + 1] and out.finish_reason == "stop"
        out = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref
    finally:
        engine.eos_token_ids = saved


def test_logprobs_top_k(llm, llama_dir):
    prompt = random_prompts(np.random.default_rng(9), [14])[0]
    ref_tokens, ref_lps = hf_greedy(llama_dir[1], prompt, 6)
    out = llm.generate([prompt], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref_tokens
    for entry, tok, ref in zip(out.logprobs, out.token_ids, ref_lps):
        assert tok in entry and len(entry) in (3, 4)
        assert abs(entry[tok] - ref) < 1e-4
        assert entry[tok] == pytest.approx(max(entry.values()))  # greedy picks the top token
    assert out.cumulative_logprob == pytest.approx(sum(ref_lps), abs=1e-3)


def test_engine_streaming_and_abort(llm):
    engine = llm.llm_engine
    prompts = random_prompts(np.random.default_rng(10), [40, 50, 60])
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, greedy(30))
    seen = {f"s{i}": 0 for i in range(3)}
    for _ in range(4):
        for out in engine.step():
            assert len(out.outputs[0].token_ids) >= seen[out.request_id]
            seen[out.request_id] = len(out.outputs[0].token_ids)
    aborted = engine.abort_request("s1")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"s0", "s2"}
    assert all(len(o.outputs[0].token_ids) == 30 for o in finished.values())
    assert_all_free(llm)


@pytest.mark.parametrize("prompt,params,field", [
    ([], None, "empty"),
    ([5, 999], None, "vocabulary"),
    ([-1], None, "vocabulary"),
    ([3] * 512, None, "max_model_len"),
    ([3, 4], "n0", "n="),
    ([3, 4], "big", "num_kv_blocks"),
    ([3, 4], "temp", "temperature"),
])
def test_bad_input_raises_before_work_and_engine_keeps_serving(llm, prompt, params, field):
    bad = {None: None, "n0": lambda: SamplingParams(n=0), "big": lambda: SamplingParams(n=8, max_tokens=400),
           "temp": lambda: SamplingParams(temperature=-1)}[params]
    good = random_prompts(np.random.default_rng(11), [6])[0]
    expected = llm.generate([good], greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=field):
        llm.generate([good, prompt], bad() if bad else greedy(5), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate([good], greedy(5), use_tqdm=False)[0].outputs[0].token_ids == expected
    assert_all_free(llm)


def test_bad_engine_settings(llama_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(llama_dir[0], block_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir[0], max_model_len=10**6)
    with pytest.raises(ValueError, match="preset"):
        LLM("no-such-preset")
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(llama_dir[0], not_a_setting=1)


def test_compilations_are_bounded(llm, llama_dir):
    prompts = random_prompts(np.random.default_rng(12), [3, 17, 31, 2, 64])
    uncached = LLM(llama_dir[0], num_kv_blocks=96, max_model_len=512, enable_prefix_caching=False)
    uncached.generate(prompts, greedy(12), use_tqdm=False)
    before = uncached.get_metrics()["num_compilations"]
    uncached.generate(prompts, greedy(12), use_tqdm=False)  # a second identical generate: nothing new
    assert uncached.get_metrics()["num_compilations"] == before
    llm.generate(prompts, greedy(12), use_tqdm=False)
    llm.generate(prompts, greedy(12), use_tqdm=False)  # prefix-cache hits: shorter prefills, new shapes
    before = llm.get_metrics()["num_compilations"]
    llm.generate(prompts, greedy(12), use_tqdm=False)  # the same shapes again: nothing new
    assert llm.get_metrics()["num_compilations"] == before


def test_sharded_safetensors_checkpoint_loads(llama_dir, tmp_path):
    path, hf_model = llama_dir
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    import glob
    assert len(glob.glob(str(tmp_path / "*.safetensors"))) > 1
    prompt = random_prompts(np.random.default_rng(13), [11])[0]
    ref = hf_greedy(hf_model, prompt, 8)[0]
    llm = LLM(str(tmp_path), num_kv_blocks=16, max_model_len=128)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref
