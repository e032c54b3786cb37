"""Decode windows (``num_scheduler_steps``): several decode steps per host round trip, each step's
tokens fed to the next on the device, with the same tokens, stops and frees as single steps."""
import threading

import numpy as np
import pytest

from conftest import assert_greedy_parity, random_prompts
from jpaged import LLM, SamplingParams

ENGINE = dict(num_kv_blocks=96, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)


def count_windows(llm, monkeypatch) -> list[int]:
    """The step count of every decode window ``llm`` runs from now on, each window's program
    compiled before it runs (not in the background while single steps go on)."""
    runner, windows = llm.llm_engine.runner, []
    execute, compiler = runner.execute, runner.window_compiler
    executable = compiler.executable

    def counted(out):
        results = execute(out)
        if len(results) > 1:
            windows.append(len(results))
        return results

    def compiled_first(key, fn, args, now=False):
        executable(key, fn, args, now=True)
        compiler.wait()
        return executable(key, fn, args)

    monkeypatch.setattr(runner, "execute", counted)
    monkeypatch.setattr(compiler, "executable", compiled_first)
    return windows


def test_windowed_greedy_decode_matches_transformers(llama_dir, monkeypatch):
    llm = LLM(llama_dir[0], num_scheduler_steps=4, **ENGINE)
    windows = count_windows(llm, monkeypatch)
    prompts = random_prompts(np.random.default_rng(0), [5, 40, 17, 3])
    assert_greedy_parity("llama", llama_dir[1], llm, prompts, max_tokens=24)  # min_tokens bans EOS
    assert windows and max(windows) == 4


def outputs(llm, prompts, params):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              [{t: round(lp, 4) for t, lp in step.items()} for step in (c.logprobs or [])])
             for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_windows_give_the_outputs_of_single_steps(llama_dir, monkeypatch):
    rng = np.random.default_rng(1)
    prompts = random_prompts(rng, [7, 30, 12, 50, 3, 21, 9])
    greedy = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=2)
    first = outputs(LLM(llama_dir[0], **ENGINE), prompts[:1], greedy)[0][0]
    stop_text = first[1][4:6]  # a stop string the greedy output reaches mid-window
    params = [greedy,
              SamplingParams(temperature=0.0, max_tokens=9, min_tokens=5, logprobs=1),
              SamplingParams(temperature=0.9, seed=3, max_tokens=17, top_k=20),
              SamplingParams(temperature=1.0, n=2, seed=4, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[int(t) for t in first[0][2:4]]),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)]  # ends at max_model_len
    prompts.append(random_prompts(rng, [245])[0])
    params[0] = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=2, stop=[stop_text])
    single = outputs(LLM(llama_dir[0], **ENGINE), prompts, params)
    llm = LLM(llama_dir[0], num_scheduler_steps=6, **ENGINE)
    windows = count_windows(llm, monkeypatch)
    assert outputs(llm, prompts, params) == single
    assert windows
    assert single[0][0][2] == "stop" and single[0][0][3] == stop_text
    assert single[-1][0][2] == "length" and len(single[-1][0][0]) == ENGINE["max_model_len"] - 245
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_windows_wait_for_the_host_when_a_step_needs_it(llama_dir, monkeypatch):
    llm = LLM(llama_dir[0], num_scheduler_steps=4, **{**ENGINE, "max_num_seqs": 1})
    windows = count_windows(llm, monkeypatch)
    prompts = random_prompts(np.random.default_rng(2), [6, 6])
    penalized = SamplingParams(temperature=0.0, max_tokens=8, presence_penalty=0.5)
    llm.generate(prompts[:1], penalized, use_tqdm=False)
    assert windows == []  # penalties read the output so far on the host
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)  # one sequence at a time: the second waits
    assert windows == [4, 3, 4, 3]  # each request's 7 decode steps in windows of at most 4
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8]
    assert llm.get_metrics()["num_free_blocks"] == llm.get_metrics()["num_total_blocks"]


def test_num_scheduler_steps_is_checked():
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(None, num_scheduler_steps=0)


def test_precompiled_windows_compile_nothing_while_serving(llama_dir):
    llm = LLM(llama_dir[0], num_scheduler_steps=4, precompile=True, **{**ENGINE, "max_num_seqs": 4})
    compiled = llm.get_metrics()["num_compilations"]
    rng = np.random.default_rng(3)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=int(n), ignore_eos=True)
              for i, n in enumerate(rng.integers(2, 12, 6))]
    outs = llm.generate(random_prompts(rng, rng.integers(2, 40, 6)), params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.get_metrics()["num_compilations"] == compiled


def test_a_window_compiling_in_the_background_runs_as_single_steps(llama_dir, monkeypatch):
    """Until its program is compiled (on another thread, once its batch shape has come back
    ``hot_after`` times), a planned window runs one single step: the same tokens, no wait; once
    compiled, the windows run."""
    llm = LLM(llama_dir[0], num_scheduler_steps=4, **{**ENGINE, "max_num_seqs": 2})
    runner = llm.llm_engine.runner
    compiler, release, results = runner.window_compiler, threading.Event(), []
    assert compiler.hot_after > 1
    short = SamplingParams(temperature=0.0, max_tokens=compiler.hot_after // 2, ignore_eos=True)
    llm.generate(random_prompts(np.random.default_rng(5), [4]), short, use_tqdm=False)
    assert not compiler._futures  # a shape seen for fewer steps compiles nothing
    compiler.hot_after = 3
    compile_one = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda *a: (release.wait(60), compile_one(*a)))
    execute = runner.execute

    def recorded(out):
        ran = execute(out)
        results.append((out.num_steps, len(ran)))
        return ran

    monkeypatch.setattr(runner, "execute", recorded)
    prompts = random_prompts(np.random.default_rng(4), [5, 9])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(llama_dir[0], num_scheduler_steps=1, **ENGINE).generate(
        prompts, greedy, use_tqdm=False)]
    first = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert any(planned > 1 for planned, _ in results) and all(ran == 1 for _, ran in results)
    release.set()
    compiler.wait()
    results.clear()
    again = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert any(ran > 1 for _, ran in results)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
