"""Compiling a batch's step shapes ahead (`jpaged/runner/batch_plan.py`, `ModelRunner.compile_ahead`):
the replay predicts the scheduler's steps, a first batch then meets only executables compiled
ahead (none compiles on the way), and the tokens are those of compiling each shape when met."""
import numpy as np
import pytest

from conftest import random_prompts
from jpaged import LLM, SamplingParams
from jpaged.runner.batch_plan import batch_steps, step_shapes
from jpaged.runner.buckets import StepBuckets
from jpaged.runner.model_runner import ModelRunner


def test_batch_steps_follow_the_budget_and_the_seats():
    """Three prompts of 10 tokens, 3 tokens out, a budget of 16 tokens, 2 seats: running requests
    first (decode tokens, the rest of a prompt), then admissions; a prompt's last chunk samples."""
    assert batch_steps([10, 10, 10], [3, 3, 3], max_num_batched_tokens=16, max_num_seqs=2) == [
        (16, 1), (5, 2), (2, 2), (11, 2), (1, 1), (1, 1)]


def test_step_shapes_are_the_padded_steps_once_each():
    buckets = StepBuckets(max_num_seqs=32, max_model_len=2048, block_size=16)
    shapes = step_shapes([128] * 32, [128] * 32, buckets, max_num_batched_tokens=2048)
    # 16 whole prompts; 16 decodes + 15 prompts + a chunk; 31 decodes + the chunk's rest; 32 decodes;
    # then the 15 + 1 admitted in the second step, one step behind; the last alone (tokens padded to 2)
    assert shapes == [(2048, 16), (2048, 32), (48, 32), (32, 32), (16, 16), (2, 2)]


def _recorded_steps(llm, prompts, params):
    """(tokens, sampled rows) of every step the engine runs for the batch."""
    runner = llm.llm_engine.runner
    steps, execute = [], runner.execute

    def record(out):
        steps.append((sum(len(s.token_ids) for s in out.seqs), len(out.sample_rows)))
        return execute(out)

    runner.execute = record
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.execute = execute
    return steps


def test_the_replay_is_the_schedulers_steps(llama_dir):
    rng = np.random.default_rng(3)
    lens = [37, 5, 64, 20, 90, 12]
    outs = [9, 30, 4, 17, 6, 25]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(rng, lens)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    llm = LLM(llama_dir[0], max_num_batched_tokens=48, max_num_seqs=3, enable_prefix_caching=False)
    assert _recorded_steps(llm, prompts, params) == batch_steps(lens, outs, max_num_batched_tokens=48, max_num_seqs=3)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_first_batch_meets_only_shapes_compiled_ahead(llama_dir, monkeypatch, temperature):
    """Every step piece the batch meets for the first time was compiled ahead (none compiles on the
    main thread), and the tokens equal those of an engine that compiles each shape when met."""
    met = []
    call = ModelRunner._call

    def spy(self, signature, fn, *args):
        if self._lowering is None and signature not in self.counter.signatures:
            met.append((signature[0], signature in self._ahead))
        return call(self, signature, fn, *args)

    monkeypatch.setattr(ModelRunner, "_call", spy)
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(rng, [40, 70, 25, 90, 33, 60, 18, 51])]
    params = SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=1)
    outputs = {}
    for ahead in (True, False):
        llm = LLM(llama_dir[0], max_num_batched_tokens=128, max_num_seqs=8, compile_ahead=ahead)
        met.clear()  # the start-up's own warm-up step
        outputs[ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if ahead:
            assert met and all(was_ahead for _, was_ahead in met), met
        else:
            assert met and not any(was_ahead for _, was_ahead in met)
    assert outputs[True] == outputs[False]


def test_compile_ahead_stays_off_where_it_does_not_apply(llama_dir):
    """With every shape compiled at start, or n > 1 (forks: more rows than the replay knows), nothing."""
    llm = LLM(llama_dir[0], max_num_batched_tokens=64, max_num_seqs=4)
    engine = llm.llm_engine
    engine.add_request("a", [5, 6, 7], SamplingParams(n=2, max_tokens=3))
    assert engine.compile_ahead() == 0
    engine.abort_request("a")
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=3))
    assert engine.compile_ahead() > 0
    engine.cancel_compiles()
    engine.abort_request("b")
    assert engine.kv_cache.pool.num_free_blocks == engine.num_blocks
