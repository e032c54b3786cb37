"""Progress on start-up's waits: counted work prints `k/N, ~T s left` lines at a bounded rate off a
terminal, a slow phase says what it is doing, precompile reports its step shapes on stderr, and the
kernel-choice log line names its subject once."""
import io
import time

import pytest

from conftest import JpagedLog
from jpaged import progress


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_count_progress_lines_are_delayed_rate_bounded_and_estimate_time_left():
    clock, out = FakeClock(), io.StringIO()  # StringIO is no terminal: plain lines
    p = progress.CountProgress("precompile: step shapes", 10, stream=out, delay=5, interval=5, clock=clock)
    for t in (1, 2, 3, 6, 7, 8, 12, 13, 14, 20):  # one unit done at each of these times
        clock.now = t
        p.update()
    p.close()
    assert out.getvalue().splitlines() == [
        "jpaged: precompile: step shapes 4/10, ~9 s left",   # t=6: the first past the delay, 1.5 s a unit
        "jpaged: precompile: step shapes 7/10, ~5 s left",   # t=12: 5 s after the last line
        "jpaged: precompile: step shapes 10/10, ~0 s left",  # t=20
    ]


def test_count_progress_is_silent_for_a_short_wait():
    clock, out = FakeClock(), io.StringIO()
    p = progress.CountProgress("x", 3, stream=out, clock=clock)
    for t in (1, 2, 3):
        clock.now = t
        p.update()
    assert out.getvalue() == ""


def test_slow_phase_says_what_it_is_doing_and_a_fast_one_nothing():
    with JpagedLog() as log:
        with progress.phase("loading slow", delay=0.05):
            time.sleep(0.3)
        with progress.phase("loading fast", delay=5):
            pass
    assert log.messages[0] == "loading slow ..."
    assert log.messages[1].startswith("loading slow took ") and log.messages[1].endswith(" s")
    assert len(log.messages) == 2


def test_precompile_reports_its_step_shapes_on_stderr(llama_dir, capfd, monkeypatch):
    from jpaged import LLM

    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    LLM(llama_dir[0], num_kv_blocks=16, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, precompile=True)
    lines = [line for line in capfd.readouterr().err.splitlines() if "precompile: step shapes" in line]
    total = int(lines[-1].split("/")[1].split(",")[0])
    assert lines[0].startswith("jpaged: precompile: step shapes 1/") and lines[-1].startswith(
        f"jpaged: precompile: step shapes {total}/{total}, ~0 s left"), lines
    assert len(lines) == total


def test_kernel_choice_log_names_the_choice_once():
    from pallas_kernels.cpu import measure

    key = "matmul [8] x [8] rows<=8"
    measure._entries()[key] = {"cpp": True, "cpp_ms": 1.0, "xla_ms": 2.0}
    try:
        with JpagedLog() as log:
            measure._log("matmul [8] x [8]", [key], "cached in")
    finally:
        measure._choices.pop(key)
        measure._logged.discard(("matmul [8] x [8]", key))
    assert log.messages[0].startswith("kernel choice for matmul [8] x [8]: rows<=8: C++ (1.000 vs 2.000 ms) "
                                      "[C++ vs XLA time; cached in "), log.messages


def test_step_plan_lists_each_step_shape_once():
    """A step of as many rows as tokens is already decode-only: the plan held it twice on pallas."""
    from jpaged.entrypoints.aot import step_name
    from jpaged.runner.buckets import StepBuckets
    from jpaged.runner.precompile import step_plan

    buckets = StepBuckets(32, 8192, 16, "pallas")
    names = [step_name(s) for s in step_plan(buckets, max_tokens=2048, max_seqs=32, whole_step=True)]
    assert len(names) == len(set(names)) == 200
    assert "tokens=2 rows=2 greedy decode-only" in names and "tokens=32 rows=32 sampled decode-only" in names


def test_aot_summary_notes_more_max_num_seqs_than_the_pool_holds():
    from jpaged.entrypoints.aot import EngineCompile

    def result(fit):
        return EngineCompile(target="h100", num_devices=1, hbm_bytes=1, weight_bytes=0, kv_bytes_per_block=1,
                             num_blocks=fit * 16, kv_pool_bytes=0, max_temp_bytes=0, generated_code_bytes=0,
                             max_batch_at_max_model_len=fit, compile_seconds=0.0, steps=[])

    assert result(13).pool_note(32).startswith(
        "\nnote: max_num_seqs=32 but only 13 sequences of max_model_len fit in the pool (208 blocks)")
    assert result(32).pool_note(32) == ""


@pytest.mark.slow
def test_aot_compile_all_shapes_prints_a_total_each_shape_once_and_time_left(tmp_path):
    """scripts/aot_compile.py --shapes=all on a tiny Llama for an H100 (about a minute)."""
    import json

    import transformers

    from pallas_kernels.aot import venv
    from run_script import run_script

    if venv.missing("cuda") is not None:
        pytest.skip(venv.missing("cuda"))
    fields = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048).to_dict()
    (tmp_path / "llama.json").write_text(json.dumps(dict(fields, architectures=["LlamaForCausalLM"])))
    result = run_script("aot_compile.py", f"--model={tmp_path / 'llama.json'}", "--gpu=h100", "--max_num_seqs=4",
                        "--max_num_batched_tokens=8", "--max_model_len=256", "--num_kv_blocks=40", "--shapes=all",
                        timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "compiling 10 step shapes (after a probe of the largest one, which sizes the KV pool)"
    steps = [line for line in lines if line.startswith("OK ")]
    names = [line.split(":")[0] for line in steps]
    assert len(steps) == 10 and len(set(names)) == 10, steps
    assert steps[0].endswith(" s left]") and "[1/10, ~" in steps[0] and "[10/10, ~0 s left]" in steps[-1]
    assert "note: max_num_seqs=4 but only 2 sequences of max_model_len fit in the pool (40 blocks)" in result.stdout


START = """
import collections, json, sys
from jax._src import monitoring
events = collections.Counter()
monitoring.register_event_listener(lambda name, **kw: events.update([name]))
from jpaged import LLM
LLM(sys.argv[1], num_kv_blocks=8, max_model_len=32, max_num_seqs=1, max_num_batched_tokens=4, precompile=True,
    compilation_cache_dir=sys.argv[2])
print("CACHE " + json.dumps({k.rsplit("/", 1)[1]: v for k, v in events.items() if "compilation_cache" in k}))
"""


@pytest.mark.slow
def test_warm_second_start_compiles_nothing(llama_dir, tmp_path):
    """Two starts in fresh processes over one (fresh) persistent compilation cache: the second loads
    every executable from it and compiles none (about 45 s of CPU: two processes' imports and starts)."""
    import json
    import os
    import subprocess
    import sys

    from run_script import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
           and not k.startswith("JAX_PERSISTENT_CACHE")}
    env["PYTHONPATH"] = REPO_ROOT

    def start():
        proc = subprocess.run([sys.executable, "-c", START, llama_dir[0], str(tmp_path / "jax")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("CACHE "))[6:])

    cold, warm = start(), start()
    assert cold["tasks_using_cache"] == 1 and cold.get("cache_misses", 0) > 0, cold
    assert warm.get("cache_misses", 0) == 0 and warm["cache_hits"] == warm["compile_requests_use_cache"] > 0, warm


def test_cache_directory_set_by_the_application_still_keeps_short_compiles(tmp_path):
    """With JAX_COMPILATION_CACHE_DIR set (left alone), the engine still lowers JAX's 1 s floor on
    what the cache keeps, under which most CPU executables would compile again on every start."""
    import os
    import subprocess
    import sys

    from run_script import REPO_ROOT

    code = ("import jax; from jpaged.engine.startup import enable_compilation_cache; "
            "enable_compilation_cache(None); "
            "print(jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.update(PYTHONPATH=REPO_ROOT, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "app"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(tmp_path / "app"), "0.05"]
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "2"  # the application's own floor stays
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == [str(tmp_path / "app"), "2.0"], out.stderr[-2000:]


def test_default_cache_directory_is_one_per_processor(monkeypatch):
    """XLA:CPU compiles for the processor it runs on and JAX's cache key does not name it: machines
    of different processors sharing a home directory get a cache directory each."""
    import os

    from jpaged.engine import startup

    monkeypatch.setattr(startup, "cpu_id", lambda: "model name: A\nflags: fpu avx2")
    a = startup.default_compilation_cache_dir()
    monkeypatch.setattr(startup, "cpu_id", lambda: "model name: B\nflags: fpu avx2 avx512f")
    b = startup.default_compilation_cache_dir()
    root = os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "jax")
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == root
    assert len(os.path.basename(a)) == 16
