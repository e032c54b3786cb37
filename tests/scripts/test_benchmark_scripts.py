"""The benchmark scripts run end to end on a tiny model (smoke tests: no timing asserted), and their
workloads and bench model come from the project itself."""
import sys

import numpy as np
import pytest

from run_script import SCRIPTS, run_python, run_script

sys.path.insert(0, SCRIPTS)
import bench_common  # noqa: E402
import workloads  # noqa: E402

sys.path.remove(SCRIPTS)


def run_benchmark(*flags):
    result = run_script("benchmark_throughput.py", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # a minute each: in .ci/run's slow part
def test_throughput_allocators_and_sharing(llama_dir):
    common = [f"--model={llama_dir[0]}", "--workload=sharegpt-like", "--num_requests=4", "--length_scale=0.05",
              "--max_model_len=256", "--num_kv_blocks=64"]
    out = run_benchmark(*common, "--allocator=paged,oracle")
    assert "paged / oracle" in out and out.count("Throughput:") == 2
    assert "memory: " in out and out.count("% of the time;") == 2  # the roofline of each run
    out = run_benchmark(*common, "--beam_width=2", "--sharing=both", "--shared_prefix=1-shot")
    assert "sharing on / off (paged)" in out


def test_single_stream_with_one_request_is_refused_before_any_work():
    result = run_script("benchmark_throughput.py", "--single_stream=8", "--num_requests=1")
    assert result.returncode != 0
    assert "--single_stream needs --num_requests >= 2" in result.stderr
    assert "GEMM peak" not in result.stdout  # refused before measuring the machine


def test_roofline_reads_every_weight_per_step_and_the_context_per_generated_token():
    """The benchmark's roofline: the matmuls' FLOPs at the GEMM peak or the memory floor (each model
    step reads every weight, each generated token the KV cache of its context) at the bandwidth,
    whichever takes longer."""
    from types import SimpleNamespace
    config = SimpleNamespace(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, intermediate_size=16,
                             num_layers=3, vocab_size=10)
    layers = 3 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16)  # q/k/v, o, gate/up/down
    assert bench_common.matmul_weights(config) == layers + 8 * 10
    assert bench_common.matmul_flops(config, 5, 2) == 2.0 * (layers * 5 + 8 * 10 * 2)
    # prompt 3 generating 4 reads contexts 3 + 4 + 5 + 6; prompt 10 generating 1 reads 10
    assert bench_common.memory_floor_bytes(100, 7, 2.0, [(3, 4), (10, 1)]) == 100 * 7 + 2.0 * (18 + 10)
    assert bench_common.roofline_seconds(3e9, 1e9, peak_gflops=1.0, bandwidth_gbs=0.5) == 3.0  # compute-bound
    assert bench_common.roofline_seconds(1e9, 4e9, peak_gflops=1.0, bandwidth_gbs=0.5) == 8.0  # memory-bound


@pytest.mark.slow
def test_kv_quant_report(llama_dir):
    """The byte table, then auto vs int8 KV at one byte budget: int8 gets ~3.5x the blocks (head_dim 16)."""
    result = run_script("kv_quant_report.py", f"--model={llama_dir[0]}", "--num_requests=4", "--length_scale=0.05",
                        "--kv_cache_memory_bytes=262144")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bench-llama   int8             1584" in result.stdout
    assert result.stdout.count("Throughput:") == 2 and "kv int8 / auto (paged): blocks 3.5" in result.stdout


@pytest.mark.slow
def test_serving_benchmark_runs(llama_dir, tmp_path):
    result = run_script("benchmark_serving.py", f"--model={llama_dir[0]}", "--workload=sharegpt-like",
                        "--num_requests=4", "--length_scale=0.05", "--max_model_len=256", "--num_kv_blocks=64",
                        "--allocator=paged", "--request_rates=4", "--warmup_requests=0", f"--out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "paged" in result.stdout


@pytest.mark.parametrize("name,n,mean_in,mean_out,lo,hi", [
    ("sharegpt-like", 200, 161, 338, 4, 1024),
    ("alpaca-like", 500, 19, 58, 4, 512),
])
def test_workload_shapes(name, n, mean_in, mean_out, lo, hi):
    prompts, outs = workloads.make_workload(name, 32000, seed=0)
    ins = np.array([len(p) for p in prompts])
    assert len(prompts) == len(outs) == n
    assert ins.min() >= 4 and np.min(outs) >= lo and ins.max() <= 1024 and np.max(outs) <= hi
    # clipping and truncation to ints pull the means a little below the distribution's
    assert 0.8 * mean_in < ins.mean() < 1.1 * mean_in and 0.8 * mean_out < np.mean(outs) < 1.1 * mean_out
    assert ins.std() > 0.4 * ins.mean()  # log-normal: a long tail, not near-constant lengths
    assert min(min(p) for p in prompts) >= 3 and max(max(p) for p in prompts) < 32000
    assert workloads.make_workload(name, 32000, seed=0) == (prompts, outs)  # seeded
    assert workloads.make_workload(name, 32000, seed=1) != (prompts, outs)


def test_fixed_workload_and_length_scale():
    prompts, outs = workloads.make_workload("fixed", 100)
    assert len(prompts) == 32 and {len(p) for p in prompts} == {128} and set(outs) == {128}
    prompts, outs = workloads.make_workload("fixed", 100, num_requests=3, length_scale=0.25)
    assert [len(p) for p in prompts] == [32] * 3 and outs == [32] * 3
    with pytest.raises(ValueError, match="workload='nope'"):
        workloads.make_workload("nope", 100)


WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # importing torch fails, as where it is not installed
sys.path.insert(0, sys.argv[2])
import bench_common
from jpaged import LLM, SamplingParams
path = bench_common.make_bench_model(sys.argv[1], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=300)
out = LLM(path, num_kv_blocks=16, max_model_len=64).generate(
    [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("generated", len(out[0].outputs[0].token_ids))
"""


def test_bench_model_is_built_without_torch_and_loads(tmp_path):
    """bench-llama's config, and a small model built the same way loads and generates in the engine
    (its tensor names are save_pretrained's; transformers loads the full one with no missing keys).
    The build runs in a process of its own where torch cannot be imported: hiding torch in this one
    would leave transformers believing it absent for the tests that follow."""
    assert {k: bench_common.BENCH_LLAMA[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                    "num_attention_heads", "num_key_value_heads", "vocab_size")} \
        == dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=32000)
    result = run_python("-c", WITHOUT_TORCH, str(tmp_path / "small"), SCRIPTS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generated 4" in result.stdout


def test_speculative_benchmark_runs(llama_dir):
    result = run_script("benchmark_speculative.py", f"--model={llama_dir[0]}", "--workloads=sharegpt", "--ks=2",
                        "--num_requests=2", "--length_scale=0.03", "--nosingle_stream")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sharegpt  batch  k=2" in result.stdout and "acceptance" in result.stdout
    assert "OUTPUTS DIFFER" not in result.stdout and "load average" in result.stdout


def test_moe_benchmark_runs():
    """Grouped vs dense experts at two token counts; both give the same outputs."""
    result = run_script("benchmark_moe.py", "--hidden=64", "--intermediate=128", "--num_experts=4", "--tokens=1,8",
                        "--runs=1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["1"], ["8"])]
    assert len(rows) == 2 and all(float(row[-1]) < 1e-4 for row in rows), result.stdout


@pytest.mark.slow
def test_startup_benchmark_runs(llama_dir):
    """A fresh process from start to the last token of the fixed batch, compilation cache cold."""
    result = run_script("benchmark_startup.py", f"--model={llama_dir[0]}", "--cache=cold",
                        "--kv_cache_memory_bytes=67108864")
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("batch    cold jpaged"))
    assert "4096 tokens" in line and "compilations" in line, result.stdout
