"""How a step runs: piece by piece (embed, one jit per layer structure, head), its shapes fixed at
start with `precompile`, its time accounted per part."""
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, SamplingParams
from jpaged.runner import model_runner
from jpaged.engine.step_timing import step_class
from jpaged.runner.buckets import StepBuckets
from jpaged.sample.sampler import argmax

ENGINE = dict(num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_layer_by_layer_matches_the_whole_model_jit(llama_dir, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = random_prompts(rng, [5, 40, 17, 3])
    by_layer = LLM(llama_dir[0], **ENGINE)
    assert by_layer.llm_engine.runner.pieces is not None
    tokens = [o.outputs[0].token_ids for o in by_layer.generate(prompts, greedy(12), use_tqdm=False)]
    monkeypatch.setattr(model_runner.LayerPieces, "of", classmethod(lambda cls, model: None))
    whole = LLM(llama_dir[0], **ENGINE)
    assert whole.llm_engine.runner.pieces is None
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, greedy(12), use_tqdm=False)] == tokens
    assert by_layer.llm_engine.runner.num_compilations > 0


def test_precompile_leaves_nothing_to_compile_while_serving(llama_dir):
    llm = LLM(llama_dir[0], precompile=True, **ENGINE)
    compiled = llm.get_metrics()["num_compilations"]
    runner = llm.llm_engine.runner
    assert runner.buckets.token_buckets(128) == [2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 120, 24)
    params = [greedy(int(n)) if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=int(n),
                                                           ignore_eos=True)
              for i, n in enumerate(rng.integers(1, 30, 24))]
    outs = llm.generate(random_prompts(rng, lengths), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.get_metrics()["num_compilations"] == compiled
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_step_buckets_and_sampled_row_buckets():
    from jpaged.utils import step_bucket
    sizes = sorted({step_bucket(n) for n in range(1, 2049)})
    assert sizes == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 384, 512, 768,
                     1024, 1536, 2048]
    rows_bucket = StepBuckets.rows
    assert rows_bucket(70, 80) == 80  # a decode step: its rows fill its tokens
    assert rows_bucket(70, 2048) == 128 and rows_bucket(3, 512) == 4  # prompt tokens too: a power of two
    assert rows_bucket(90, 96) == 96 and rows_bucket(200, 112) == 224  # never fewer rows than sampled


def test_a_steps_shapes_depend_on_its_token_count_alone(llama_dir):
    runner = LLM(llama_dir[0], **ENGINE).llm_engine.runner
    assert runner.buckets.shape(1, 1, 1) == (2, 2, 16)        # max_model_len 256 / block 16 columns
    assert runner.buckets.shape(5, 3, 3) == runner.buckets.shape(5, 1, 16) == (8, 8, 16)
    assert runner.buckets.shape(21, 3, 2) == (24, 8, 16)       # from 24 on, powers of two and their 1.5x
    assert runner.buckets.shape(33, 2, 1) == (48, 8, 16)       # rows: at most the max_num_seqs bucket
    assert runner.buckets.shape(33, 12, 1) == (48, 16, 16)     # unless forks make more sequences


def test_step_timings_account_for_every_step(llama_dir):
    llm = LLM(llama_dir[0], **ENGINE)
    timings = llm.llm_engine.step_timings
    llm.generate(random_prompts(np.random.default_rng(2), [10, 20]), greedy(6), use_tqdm=False)
    assert timings.steps >= 6 and timings.tokens >= 30 + 6
    assert min(timings.schedule, timings.prepare, timings.device, timings.post) >= 0
    assert timings.device > 0
    assert "ms" in timings.summary()
    # by kind of step: the prompt steps and the decode steps (two rows), every model step counted once
    assert set(timings.by_class) == {"prompt/verification", "decode, <= 8 rows"}
    assert sum(steps for steps, _ in timings.by_class.values()) == timings.steps
    total = sum(getattr(timings, p) for p in ("schedule", "prepare", "device", "post"))
    assert sum(seconds for _, seconds in timings.by_class.values()) == pytest.approx(total)
    assert timings.class_summary()[0].startswith("prompt/verification: ")


def test_a_step_is_classed_by_its_tokens_and_rows():
    assert step_class(3, 40) == step_class(1, 2) == "prompt/verification"  # a prompt chunk, a verification
    assert step_class(1, 1) == "decode, 1 row" and step_class(2, 2) == "decode, <= 8 rows"
    assert step_class(33, 33) == "decode, <= 64 rows" and step_class(300, 300) == "decode, > 256 rows"


@pytest.mark.parametrize("shape", [(4, 7), (3, 1000), (1, 2)])
def test_argmax_takes_the_first_of_equal_maxima(shape):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, shape).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), x.argmax(-1))
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :] = -np.inf
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), x.argmax(-1))


def test_executables_one_decode_step_dispatches(llama_dir, monkeypatch):
    """On the CPU a step runs as pieces: embed, one call per (up to six) layers, the sampled rows,
    the head and the sampler; a whole-step runner (what TPU/GPU run) dispatches one executable."""
    def dispatched(llm):
        runner, calls = llm.llm_engine.runner, []
        real_call, real_note = runner.counter.call, runner.counter.note

        def call(name, *args, **kw):
            calls.append(name)
            return real_call(name, *args, **kw)

        def note(name, *args):  # the layer calls are noted, then called directly
            if name.startswith("layers"):
                calls.append(name)
            return real_note(name, *args)

        monkeypatch.setattr(runner.counter, "call", call)
        monkeypatch.setattr(runner.counter, "note", note)
        llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)  # a prefill step, then one decode step
        return calls[len(calls) // 2:]

    assert dispatched(LLM(llama_dir[0], **ENGINE)) == ["embed", "layers0x2", "rows", "head", "sample"]
    monkeypatch.setattr(model_runner.LayerPieces, "of", classmethod(lambda cls, model: None))
    assert dispatched(LLM(llama_dir[0], **ENGINE)) == ["step"]
