"""No request can crash, stall or poison the engine; nothing is left behind when a request ends.

Regression tests for each failure found by an adversarial user, a randomized stateful test of
add / step / abort / preempt / swap / fork / prefix hits on tiny pools, and a mixed load test.
"""
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.sampling_params import StructuredOutputsParams
from jpaged.engine.llm_engine import LLMEngine
from jpaged.config_resolution import engine_config
from jpaged import testing


def tiny_model(vocab_size=64, num_layers=1, seed=0):
    """A random Llama built in memory (no checkpoint, no torch), with visible greedy margins."""
    from flax import nnx

    from jpaged.models import ModelConfig
    from jpaged.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_hf(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
                                   hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=2))
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_llm(model, **kwargs) -> LLM:
    kwargs = {"block_size": 4, "max_model_len": 128, **kwargs}
    return LLM.from_engine(LLMEngine(engine_config(None, **kwargs), model=model))


def assert_clean(llm: LLM):
    """Every block free, no request and no per-request state left."""
    engine = llm.llm_engine
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    testing.block_pool(engine).check_invariants()
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.kv_cache.block_tables and not testing.swap_space(engine).swapped
    assert testing.swap_space(engine).num_used_blocks == 0


def greedy_reference(model, prompt, max_tokens):
    from jpaged.models.training import greedy_generate

    return list(greedy_generate(model, prompt, max_tokens))


# 1. Parallel sampling preempted by recompute with prefix caching on (the default) ------------------------
def test_parallel_samples_preempted_with_prefix_caching(model):
    rng = np.random.default_rng(0)
    long_prompt, short_prompt = rng.integers(3, 64, 40).tolist(), rng.integers(3, 64, 9).tolist()
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)]
    tight = make_llm(model, num_kv_blocks=18)
    outs = tight.generate([long_prompt, short_prompt], params, use_tqdm=False)
    assert tight.get_metrics()["num_preemptions"] > 0
    roomy = make_llm(model, num_kv_blocks=256)
    ref = roomy.generate([long_prompt, short_prompt], params, use_tqdm=False)
    for got, want in zip(outs, ref):  # seeded samples do not depend on preemption
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert outs[0].outputs[0].token_ids == greedy_reference(model, long_prompt, 20)
    assert_clean(tight)


# 2. A failing step ends only its requests; the engine goes on ----------------------------------------------
def test_failed_step_ends_its_requests_and_engine_keeps_serving(model, monkeypatch):
    llm = make_llm(model, num_kv_blocks=64)
    runner = llm.llm_engine.runner
    real_sample = runner._sample
    calls = {"n": 0}

    def failing_sample(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real_sample(*args)

    monkeypatch.setattr(runner, "_sample", failing_sample)
    prompt = list(range(3, 20))
    outs = llm.generate([prompt, prompt[::-1]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in outs} == {"error"}
    assert "injected device failure" in outs[0].outputs[0].stop_reason
    assert llm.get_metrics()["num_failed_steps"] == 1
    assert_clean(llm)
    again = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == greedy_reference(model, prompt, 8)
    assert_clean(llm)


def test_a_lost_kv_pool_is_rebuilt_and_running_requests_recompute(model, monkeypatch):
    """A failure after the pool was donated: a new pool, and requests not in that step recompute."""
    llm = make_llm(model, num_kv_blocks=64, max_num_batched_tokens=16)
    engine = llm.llm_engine
    long_prompt, short_prompt = list(range(3, 40)), [5, 6, 7]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", short_prompt, greedy)
    engine.step()  # "a" is now decoding
    runner = engine.runner
    real_forward = runner._run

    def forward_then_fail(*args):
        real_forward(*args)  # consumes the donated pool
        raise RuntimeError("failed after donation")

    monkeypatch.setattr(runner, "_run", forward_then_fail)
    engine.add_request("b", long_prompt, greedy)
    outs = engine.step()
    monkeypatch.setattr(runner, "_run", real_forward)
    assert {o.request_id: o.outputs[0].finish_reason for o in outs} == {"a": "error", "b": "error"}
    assert not runner.kv_pool.lost()
    outs = llm.generate([short_prompt, long_prompt], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy_reference(model, p, 6) for p in (short_prompt, long_prompt)]
    assert_clean(llm)


def test_validation_catches_what_used_to_fail_inside_the_step():
    small_vocab = tiny_model(vocab_size=24)
    llm = make_llm(small_vocab, num_kv_blocks=64)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[3, 4, 5]], SamplingParams(logprobs=25, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([[3, 4, 5]], BeamSearchParams(beam_width=13, max_tokens=4))
    assert_clean(llm)
    out = llm.generate([[3, 4, 5]], SamplingParams(logprobs=20, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 20
    assert_clean(llm)


@pytest.fixture(scope="module")
def text_llm(llama_dir):
    return LLM(llama_dir[0], num_kv_blocks=32, max_model_len=64)


@pytest.mark.parametrize("call, field", [
    (lambda llm: llm.generate("ok \ud800", use_tqdm=False), "prompts\\[0\\]: prompt"),
    (lambda llm: llm.generate({"prompt": "\udfff", "prompt_token_ids": [5]}, use_tqdm=False), "prompt"),
    (lambda llm: llm.generate({"prompt_token_ids": [5], "cache_salt": "\ud800"}, use_tqdm=False), "cache_salt"),
    (lambda llm: llm.chat([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
                          chat_template="{{ messages[0]['content'] }}", use_tqdm=False),
     "messages\\[0\\].content\\[0\\].text"),
    (lambda llm: SamplingParams(bad_words=["fine", "\ud800"]), "bad_words"),
    (lambda llm: SamplingParams(stop=["\ud800"]), "stop"),
    (lambda llm: SamplingParams(logit_bias={"\u00b2": 1}), "logit_bias"),       # "²": a digit to str.isdigit
    (lambda llm: SamplingParams(logit_bias={"\u0661": 1}), "logit_bias"),       # an Arabic-Indic 1
    (lambda llm: SamplingParams(logit_bias={"9" * 5000: 1}), "logit_bias"),     # past int()'s digit limit
    (lambda llm: StructuredOutputsParams(choice=["a", "\ud800"]), "choice\\[1\\]"),
    (lambda llm: StructuredOutputsParams(regex="\ud800+"), "regex"),
    (lambda llm: StructuredOutputsParams(json={"properties": {"\ud800": {}}}), "json"),
])
def test_text_the_tokenizer_cannot_take_is_a_value_error(text_llm, call, field):
    """A lone surrogate (valid in JSON and Python, not in UTF-8) made the tokenizer raise a
    TypeError; each text field now refuses it by name."""
    with pytest.raises(ValueError, match=field):
        call(text_llm)
    assert_clean(text_llm)


def test_text_too_long_for_max_model_len_is_refused_before_tokenizing(text_llm):
    """Every token of the byte tokenizer is one character: 65 characters cannot fit 64 tokens."""
    processor = text_llm.llm_engine.input_processor
    assert processor.max_prompt_chars == 64
    calls = []
    tokenizer = text_llm.get_tokenizer()
    real = tokenizer.encode
    try:
        tokenizer.encode = lambda *a, **kw: calls.append(a) or real(*a, **kw)
        with pytest.raises(ValueError, match="prompt: 100000 characters, more than max_model_len=64"):
            text_llm.generate("x" * 100_000, use_tqdm=False)
        with pytest.raises(ValueError, match="messages: .* characters, more than max_model_len=64"):
            text_llm.chat([{"role": "user", "content": "y" * 100}], chat_template="{{ messages[0]['content'] }}",
                          use_tqdm=False)
    finally:
        del tokenizer.encode
    assert calls == []  # refused before tokenizing
    assert_clean(text_llm)


def test_int64_values_never_reach_the_int32_step(model):
    """Found by the server fuzz: stop_token_ids past int32 (banned before min_tokens) and
    top_k = 2**63 overflowed the step's int32 arrays and failed it."""
    llm = make_llm(model, num_kv_blocks=32)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[3, 4]], SamplingParams(stop_token_ids=[2**63], min_tokens=2, max_tokens=3), use_tqdm=False)
    out = llm.generate([[3, 4]], SamplingParams(top_k=2**63, temperature=1.0, seed=0, max_tokens=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert llm.llm_engine.num_failed_steps == 0
    assert_clean(llm)


# 3. Requests that could never finish are refused ---------------------------------------------------------------
@pytest.mark.parametrize("setting, params", [
    (dict(max_num_batched_tokens=2), SamplingParams(n=4, max_tokens=4)),
    (dict(max_num_batched_tokens=2), BeamSearchParams(beam_width=4, max_tokens=4)),
    (dict(max_num_seqs=4), SamplingParams(n=8, max_tokens=4)),
])
def test_requests_that_could_never_run_are_refused(model, setting, params):
    llm = make_llm(model, num_kv_blocks=64, **setting)
    name = next(iter(setting))
    with pytest.raises(ValueError, match=name):
        if isinstance(params, BeamSearchParams):
            llm.beam_search([[3, 4, 5]], params)
        else:
            llm.generate([[3, 4, 5]], params, use_tqdm=False)
    assert_clean(llm)


def test_parallel_samples_readmitted_after_preemption_with_few_seq_slots(model):
    """n = max_num_seqs: after a preemption the n samples come back together."""
    llm = make_llm(model, num_kv_blocks=30, max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=24, ignore_eos=True)]
    outs = llm.generate([list(range(3, 30)), [7, 8, 9]], params, use_tqdm=False)
    assert [len(c.token_ids) for c in outs[1].outputs] == [24] * 4
    assert_clean(llm)


# 4. No per-request state left behind -----------------------------------------------------------------------------
def test_aborted_requests_leave_nothing(model):
    llm = make_llm(model, num_kv_blocks=128)
    engine = llm.llm_engine
    for i in range(30):
        engine.add_request(str(i), [3 + i % 50, 4, 5], SamplingParams(n=1 + i % 2, temperature=1.0, seed=i,
                                                                        max_tokens=50, ignore_eos=True))
    for _ in range(6):
        engine.step()
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    assert any(s.detokenizer is not None for s in seqs) or engine.tokenizer is None
    for i in range(30):
        engine.abort_request(str(i))
    assert all(s.detokenizer is None for s in seqs)
    assert_clean(llm)


# 5. cache_salt holds on every entry point --------------------------------------------------------------------------
def test_cache_salt_through_generate(model):
    llm = make_llm(model, num_kv_blocks=128)
    prompt = list(range(3, 40))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(salt):
        return llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], greedy,
                            use_tqdm=False)[0].num_cached_tokens

    assert cached("t1") == 0
    assert cached("t2") == 0        # another tenant shares nothing
    assert cached("t1") == 36       # the same tenant does (9 full blocks of 4; the last is recomputed)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": 3}], greedy, use_tqdm=False)
    assert_clean(llm)


# 7. Validation gaps ----------------------------------------------------------------------------------------------
def test_token_id_types_and_sampling_params_type(model):
    llm = make_llm(model, num_kv_blocks=64)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[True, 4, 5]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[3.0, 4, 5]], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: expected SamplingParams"):
        llm.generate([[3, 4, 5]], {"temperature": 0}, use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    as_numpy = llm.generate([np.array([3, 4, 5])], greedy, use_tqdm=False)[0]
    as_numpy_ints = llm.generate([[np.int64(3), np.int32(4), 5]], greedy, use_tqdm=False)[0]
    plain = llm.generate([[3, 4, 5]], greedy, use_tqdm=False)[0]
    assert as_numpy.outputs[0].token_ids == as_numpy_ints.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_clean(llm)


# 8. Threads ----------------------------------------------------------------------------------------------------------
def test_two_threads_share_one_llm(model):
    llm = make_llm(model, num_kv_blocks=128)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 64, n).tolist() for n in (5, 17, 9, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    results, errors = {}, []

    def worker(k):
        try:
            for _ in range(3):
                results[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == {0: expected, 1: expected}
    assert_clean(llm)


# 10. vLLM's stop-token text rule and include_stop_str_in_output ------------------------------------------------------
def test_stop_token_text_is_left_out(llama_dir):
    llm = LLM(llama_dir[0], num_kv_blocks=64, max_model_len=128)
    tok = llm.get_tokenizer()
    prompt = tok.encode("hello paged world")
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    stop_id = ids[2]
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert cut.token_ids == ids[:ids.index(stop_id) + 1] and cut.stop_reason == stop_id

    def text_of(k):  # the text of the first k tokens, ended by length (no stop token involved)
        return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].text

    k = len(cut.token_ids)
    assert cut.text == (text_of(k - 1) if k > 1 else "")
    kept = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                 stop_token_ids=[stop_id], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == text_of(k)
    stop = free.outputs[0].text[2:4]
    with_str = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert with_str.text.endswith(stop) and with_str.finish_reason == "stop"


# The randomized stateful test ------------------------------------------------------------------------------------------
class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort on a tiny pool (preemption, swap, forks and prefix hits all happen).

    After every operation: pool invariants, reference counts equal to the block tables holding
    each block, and no state for an ended request. Once drained: every block free, and every
    greedy request's tokens equal to a no-cache dense forward.
    """

    model = tiny_model(num_layers=1, seed=3)

    @initialize(num_blocks=st.integers(12, 40), mode=st.sampled_from(["recompute", "swap"]),
                prefix=st.booleans())
    def start(self, num_blocks, mode, prefix):
        self.llm = make_llm(self.model, num_kv_blocks=num_blocks, preemption_mode=mode,
                            swap_space_bytes=1 << 20, enable_prefix_caching=prefix, max_model_len=64,
                            max_num_batched_tokens=24, max_num_seqs=6)
        self.engine = self.llm.llm_engine
        self.next_id = 0
        self.greedy: dict[str, tuple[list[int], int]] = {}
        self.done: dict[str, object] = {}

    @rule(prefix=st.sampled_from([[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23], []]),
          tail=st.lists(st.integers(3, 63), min_size=1, max_size=12), max_tokens=st.integers(1, 10),
          kind=st.sampled_from(["greedy", "sample", "sample3", "beam"]))
    def add(self, prefix, tail, max_tokens, kind):
        request_id, prompt = str(self.next_id), prefix + tail
        self.next_id += 1
        if kind == "beam":
            params = BeamSearchParams(beam_width=2, max_tokens=max_tokens, ignore_eos=True)
        elif kind == "greedy":
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self.greedy[request_id] = (prompt, max_tokens)
        else:
            params = SamplingParams(n=3 if kind == "sample3" else 1, temperature=1.0, seed=self.next_id,
                                    max_tokens=max_tokens)
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError:  # refused before touching anything (e.g. could never fit the pool)
            assert request_id not in self.engine.requests
            self.greedy.pop(request_id, None)

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            for out in self.engine.step():
                if out.finished:
                    self.done[out.request_id] = out

    @precondition(lambda self: self.engine.requests)
    @rule(pick=st.integers(0, 1000))
    def abort(self, pick):
        ids = sorted(self.engine.requests)
        request_id = ids[pick % len(ids)]
        self.engine.abort_request(request_id)
        self.greedy.pop(request_id, None)

    @invariant()
    def blocks_consistent(self):
        kv = self.engine.kv_cache
        kv.pool.check_invariants()
        holders = [0] * kv.pool.num_blocks
        live = [s for r in self.engine.requests.values() for s in r.seqs]
        for seq in live:
            for b in kv.block_table(seq):
                holders[b] += 1
        assert holders == kv.pool.ref_counts
        assert set(kv.block_tables) <= {s.seq_id for s in live}
        assert set(testing.swap_space(self.engine).swapped) <= set(self.engine.requests)
        queued = list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting)
        assert sorted(r.request_id for r in queued) == sorted(self.engine.requests)

    def teardown(self):
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            for out in self.engine.step():
                if out.finished:
                    self.done[out.request_id] = out
        assert_clean(self.llm)
        for request_id, (prompt, max_tokens) in self.greedy.items():
            got = self.done[request_id].outputs[0].token_ids
            assert got == greedy_reference(self.model, prompt, max_tokens), request_id


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=8, stateful_step_count=25, deadline=None,
                                      suppress_health_check=list(HealthCheck))


# A mixed load with default settings ---------------------------------------------------------------------------------
def run_mixed_load(model, num_requests, seed=0, **settings_):
    llm = make_llm(model, num_kv_blocks=96, **settings_)
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append(rng.integers(3, 64, int(rng.integers(1, 60))).tolist())
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 30))))
        elif kind == 1:
            params.append(SamplingParams(n=int(rng.integers(2, 4)), temperature=0.8, top_p=0.9, seed=i,
                                         max_tokens=int(rng.integers(1, 20))))
        elif kind == 2:
            params.append(SamplingParams(temperature=1.0, top_k=5, presence_penalty=0.5, logprobs=2,
                                         max_tokens=int(rng.integers(1, 20)), stop_token_ids=[7]))
        else:
            params.append(SamplingParams(temperature=0.5, min_p=0.1, repetition_penalty=1.2,
                                         max_tokens=int(rng.integers(1, 20))))
    outs = []
    for start in range(0, num_requests, 50):
        outs += llm.generate(prompts[start:start + 50], params[start:start + 50], use_tqdm=False)
    assert all(o.finished for o in outs)
    assert all(c.finish_reason in ("stop", "length") for o in outs for c in o.outputs)
    assert_clean(llm)
    return llm


@pytest.mark.slow
def test_mixed_load_completes_without_leaks_and_bounded_compilations(model):
    llm = run_mixed_load(model, 100)
    first = llm.get_metrics()["num_compilations"]
    assert llm.get_metrics()["num_preemptions"] > 0
    rng = np.random.default_rng(9)
    llm2 = run_mixed_load(model, 100, seed=1)
    del rng
    assert llm2.get_metrics()["num_compilations"] <= first + 40


@pytest.mark.slow
def test_mixed_load_500_requests(model):
    llm = run_mixed_load(model, 500, seed=2)
    assert llm.get_metrics()["num_compilations"] < 200
