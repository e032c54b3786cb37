"""Speculative decoding (docs/speculative.md): proposals from prompt lookup or a draft model,
verified in one step. Greedy tokens equal transformers' on every model family; sampled tokens equal
those without speculation (the coupled rejection rule); paged memory stays exact."""
import numpy as np
import pytest

from conftest import assert_greedy_parity, random_prompts
from jpaged import LLM, BeamSearchParams, SamplingParams
from jpaged.sampling_params import StructuredOutputsParams
from jpaged.core.kv_cache_manager import KVCacheManager
from jpaged.core.request import Sequence
from jpaged.sample.rejection_sampler import leading_matches
from jpaged.spec_decode import SpeculativeConfig
from jpaged.spec_decode.ngram_proposer import NgramProposer
from test_models_paper import gpt2_dir, opt_dir  # noqa: F401 (fixtures)
from test_sampler_stats import fixed_logits_dir  # noqa: F401 (fixture)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    """Prompts that share 16 first tokens (prefix-cache hits) and repeat a phrase (prompt lookup
    finds it) around random tokens."""
    rng = np.random.default_rng(seed)
    shared, phrase = rng.integers(3, vocab, 16).tolist(), rng.integers(3, vocab, 6).tolist()
    return [shared + rng.integers(3, vocab, n).tolist() + phrase * 3 + rng.integers(3, vocab, 3).tolist()
            + phrase[:2] for n in lengths]


def spec_metrics(llm) -> dict:
    return {k: v for k, v in llm.get_metrics().items() if k.startswith("spec_decode")}


# Host pieces --------------------------------------------------------------------------------------------
def test_ngram_proposer_takes_the_longest_latest_match():
    p = NgramProposer(min_n=1, max_n=3, k=3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]) == [8, 5, 2]   # "2 3" twice: the latest wins
    assert p.propose([7, 1, 2, 3, 4, 5, 0, 1, 2, 3]) == [4, 5, 0]       # the longest suffix, "1 2 3"
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert p.propose([1, 2, 3, 1, 2], max_tokens=1) == [3]
    assert p.propose([1, 2, 3, 4]) == []                                 # no earlier occurrence
    assert p.propose([5, 5]) == [5]                                      # what is left of the sequence
    assert NgramProposer(min_n=2, max_n=3, k=3).propose([1, 9, 4, 1]) == []  # a 1-gram is too short


def test_leading_matches_counts_the_accepted_prefix():
    sampled = np.array([[4, 5, 6, 7], [4, 9, 6, 7], [1, 5, 6, 7], [4, 5, 6, 7]])
    drafts = np.array([[4, 5, 6], [4, 5, 6], [4, 5, 6], [4, 5, -1]])
    assert leading_matches(sampled, drafts).tolist() == [3, 1, 0, 2]


def test_reserved_slots_are_never_copied_and_rejected_blocks_go_back():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    parent = Sequence(token_ids=list(range(6)), num_prompt_tokens=6)
    assert kv.allocate_slots([parent], 6) is not None
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    kv.fork(parent, child)
    assert kv.reserve_slots([child], 5)  # proposal slots past a shared block: grown, not copied
    assert kv.take_pending_copies() == [] and len(kv.block_table(child)) == 3
    kv.free_blocks_past(child, 7)        # one proposal accepted: the third block held only rejected ones
    assert len(kv.block_table(child)) == 2 and kv.pool.num_free_blocks == 14
    kv.free(child)
    kv.free(parent)
    assert kv.pool.num_free_blocks == 16


def test_config_is_checked_before_anything_loads():
    from jpaged.config_resolution import engine_config

    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad, match in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "draft_model"}, "model"), ({"k": 2}, "unknown"), ("{oops", "JSON")]:
        with pytest.raises(ValueError, match=match):
            engine_config(None, speculative_config=bad)
    with pytest.raises(ValueError, match="num_scheduler_steps=4"):
        engine_config(None, speculative_config=NGRAM, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="allocator='max'"):
        engine_config(None, speculative_config=NGRAM, allocator="max")


def test_engine_flag_takes_json():
    from absl import flags

    from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args

    fv = flags.FlagValues()
    define_engine_flags(fv)
    fv(["prog", '--speculative_config={"method": "ngram", "num_speculative_tokens": 3}'])
    _, kwargs = llm_args(fv)
    from jpaged.config_resolution import engine_config
    assert engine_config(None, **kwargs).speculative_config.num_speculative_tokens == 3


def test_prometheus_exposes_the_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from jpaged.entrypoints.metrics import _EngineCollector
    from jpaged.spec_decode.stats import SpecDecodeStats

    stats = SpecDecodeStats()
    stats.add(4, 3)
    stats.add(2, 0)
    collector = _EngineCollector({"model_name": "m"})
    collector.snapshot = stats.as_metrics()
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'jpaged:spec_decode_num_draft_tokens_total{model_name="m"} 6.0' in text
    assert 'jpaged:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0' in text
    assert 'jpaged:spec_decode_acceptance_rate{model_name="m"} 0.5' in text
    assert 'jpaged:spec_decode_mean_accepted_length{model_name="m"} 2.5' in text


# Greedy: transformers' tokens, every model family --------------------------------------------------------
SLOW = pytest.mark.slow


@pytest.mark.parametrize("model_fixture,mode", [("llama_dir", "recompute"), pytest.param("llama_dir", "swap", marks=SLOW),
                                                pytest.param("opt_dir", "recompute", marks=SLOW),
                                                pytest.param("gpt2_dir", "swap", marks=SLOW)])
def test_greedy_tokens_equal_transformers_through_preemption(request, model_fixture, mode):
    path, hf_model = request.getfixturevalue(model_fixture)
    llm = LLM(path, block_size=8, num_kv_blocks=28, max_model_len=256, max_num_batched_tokens=64,
              preemption_mode=mode, enable_prefix_caching=True, speculative_config=NGRAM)
    prompts = repetitive_prompts(0, [3, 30, 11, 50])
    metrics = assert_greedy_parity(model_fixture, hf_model, llm, prompts, max_tokens=20)
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["spec_decode_num_accepted_tokens"] > 0
    if mode == "swap":
        assert metrics["num_swap_outs"] > 0


@pytest.mark.slow
def test_draft_model_greedy_equals_transformers(llama_dir, tmp_path_factory):
    """The target as its own draft accepts everything; a random draft of another shape, almost
    nothing: both give transformers' tokens."""
    from conftest import COMMON, _save
    from transformers import LlamaConfig

    path, hf_model = llama_dir
    prompts = random_prompts(np.random.default_rng(3), [5, 40, 17])
    same = LLM(path, num_kv_blocks=64, max_model_len=256, block_size=8, max_num_batched_tokens=64,
               speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})
    assert_greedy_parity("llama_dir", hf_model, same, prompts, max_tokens=20)
    m = spec_metrics(same)
    assert m["spec_decode_acceptance_rate"] == 1.0 and m["spec_decode_mean_accepted_length"] == 4.0
    other, _ = _save(tmp_path_factory, "draft", LlamaConfig(**{**COMMON, "num_hidden_layers": 1, "hidden_size": 32,
                                                               "num_key_value_heads": 1}))
    llm = LLM(path, num_kv_blocks=12, max_model_len=256, block_size=8, max_num_batched_tokens=64,
              preemption_mode="swap", speculative_config={"method": "draft_model", "model": other,
                                                          "num_speculative_tokens": 2})
    metrics = assert_greedy_parity("llama_dir", hf_model, llm, prompts, max_tokens=20)
    assert metrics["num_preemptions"] > 0 and metrics["spec_decode_num_drafts"] > 0


def test_draft_with_another_vocabulary_is_refused(llama_dir, gpt2_dir, tmp_path_factory):  # noqa: F811
    from conftest import COMMON, _save
    from transformers import LlamaConfig

    small, _ = _save(tmp_path_factory, "vocab128", LlamaConfig(**{**COMMON, "vocab_size": 128, "num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="128 tokens, the target's 256"):
        LLM(llama_dir[0], num_kv_blocks=16, speculative_config={"method": "draft_model", "model": small})


# Sampling: the tokens of no speculation -------------------------------------------------------------------
def outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [{t: round(lp, 4) for t, lp in step.items()} for step in (c.logprobs or [])])
             for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [NGRAM, pytest.param({"method": "draft_model", "model": "SELF",
                                                        "num_speculative_tokens": 3}, marks=SLOW)],
                         ids=["ngram", "draft"])
def test_every_setting_gives_the_outputs_of_no_speculation(llama_dir, spec):
    """Stops mid-acceptance (stop strings, stop tokens, max_tokens, max_model_len), seeded sampling
    with filters and penalties, n > 1, bad words, logprobs, structured output: all equal to decoding
    one token a step."""
    path = llama_dir[0]
    engine = dict(num_kv_blocks=96, max_model_len=128, block_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    prompts = repetitive_prompts(1, [7, 30, 12, 3, 21, 9, 15, 4, 6])
    base = LLM(path, **engine)
    first = outputs(base, prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, stop=[first[1][5:7]]),
              SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5, logprobs=1),
              SamplingParams(temperature=0.9, seed=3, max_tokens=17, top_k=20, top_p=0.9),
              SamplingParams(temperature=1.0, n=3, seed=4, max_tokens=11, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[int(t) for t in first[0][4:6]]),
              SamplingParams(temperature=0.7, seed=5, max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.4,
                             bad_words=[first[1][8:10]] if len(first[1]) > 9 else None),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),  # ends at max_model_len
              SamplingParams(temperature=0.0, max_tokens=8,  # decodes without proposals
                             structured_outputs=StructuredOutputsParams(choice=["spec", "decode"]))]
    expected = outputs(base, prompts, params)
    spec = dict(spec, model=path) if spec.get("model") == "SELF" else spec
    llm = LLM(path, speculative_config=spec, **engine)
    assert outputs(llm, prompts, params) == expected
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"] and m["spec_decode_num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="speculative_config"):  # refused, and the engine goes on
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4))
    assert outputs(llm, prompts[:2], params[:2]) == expected[:2]


@SLOW
def test_tensor_parallel_two_devices(llama_dir):
    path = llama_dir[0]
    prompts = repetitive_prompts(2, [9, 33, 18])
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, n=2, seed=9, max_tokens=12, ignore_eos=True)]
    settings = dict(num_kv_blocks=40, block_size=8, max_model_len=256, max_num_batched_tokens=64)
    expected = [outputs(LLM(path, **settings), prompts, p) for p in params]
    llm = LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **settings)
    assert [outputs(llm, prompts, p) for p in params] == expected
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0


# Sampling statistics with speculation on (the harness of test_sampler_stats.py) ---------------------------
@pytest.fixture(scope="module")
def spec_stats_llm(fixed_logits_dir):
    from test_sampler_stats import N
    return LLM(fixed_logits_dir, num_kv_blocks=3 * N, block_size=16, max_model_len=64, max_num_seqs=N,
               max_num_batched_tokens=4 * N, dtype="float32",
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})


@pytest.mark.parametrize("setting", [
    dict(top_k=10, top_p=0.95, min_p=0.1, temperature=1.5),
    pytest.param(dict(temperature=1.0), marks=SLOW),
    pytest.param(dict(presence_penalty=-1.0, frequency_penalty=0.7, repetition_penalty=1.4, top_k=10), marks=SLOW),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_distribution_is_the_targets(spec_stats_llm, setting):
    """Every step's tokens fit the distribution the setting defines given the earlier tokens (a
    fixed-logits model: Pearson's chi-square, seeded), while proposals are accepted."""
    from test_sampler_stats import assert_fits, reference_probs, sample_tokens

    before = spec_metrics(spec_stats_llm)["spec_decode_num_accepted_tokens"]
    tokens = sample_tokens(spec_stats_llm, max_tokens=4, seed=91, **setting)
    for step in range(4):
        expected = sum(reference_probs(history=row[:step], **setting) for row in tokens)
        assert_fits(tokens[:, step], expected, f"{setting} step {step}")
    assert spec_metrics(spec_stats_llm)["spec_decode_num_accepted_tokens"] > before + 20


# Ahead-of-time compilation -----------------------------------------------------------------------------------
@SLOW  # a minute or more each: in .ci/run's slow part
@pytest.mark.parametrize("whole_step", [False, True], ids=["layer_pieces", "whole_step"])
def test_precompiled_verification_compiles_nothing_while_serving(llama_dir, monkeypatch, whole_step):
    """Verification steps take their shapes from the step buckets (rows up to max_num_seqs * (1 + k)):
    after ``precompile`` none compiles, on the CPU's layer pieces and as one whole jitted step (the
    TPU/GPU path), with a draft model too."""
    from jpaged.runner import model_runner

    if whole_step:
        monkeypatch.setattr(model_runner.LayerPieces, "of", classmethod(lambda cls, model: None))
    path = llama_dir[0]
    spec = NGRAM if whole_step else {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    llm = LLM(path, precompile=True, num_kv_blocks=64, max_model_len=128, block_size=8, max_num_batched_tokens=32,
              max_num_seqs=4, speculative_config=spec)
    assert max(llm.llm_engine.runner.buckets.row_buckets(32)) > 4  # verification rows of 4 sequences
    compiled = llm.get_metrics()["num_compilations"]
    rng = np.random.default_rng(4)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(n), ignore_eos=True)
              for i, n in enumerate(rng.integers(4, 16, 6))]
    outs = llm.generate(repetitive_prompts(4, rng.integers(1, 20, 6)), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert llm.get_metrics()["num_compilations"] == compiled


@SLOW
def test_pallas_backend_with_speculation(llama_dir):
    """The Pallas kernels (interpret mode on CPU): verification chunks through the ragged kernel, the
    draft's proposal loop through the decode kernel; the xla backend's tokens."""
    prompts = repetitive_prompts(5, [1, 20])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = outputs(LLM(llama_dir[0], num_kv_blocks=24, max_model_len=128, block_size=8), prompts, params)
    for spec in (NGRAM, {"method": "draft_model", "model": llama_dir[0], "num_speculative_tokens": 2}):
        llm = LLM(llama_dir[0], attention_backend="pallas", num_kv_blocks=24, max_model_len=128, block_size=8,
                  max_num_batched_tokens=32, speculative_config=spec)
        assert outputs(llm, prompts, params) == expected
        assert llm.get_metrics()["spec_decode_num_drafts"] > 0
