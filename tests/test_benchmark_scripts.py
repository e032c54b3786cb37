"""The throughput benchmark runs end to end on a tiny model (a smoke test: no timing asserted)."""
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def run_benchmark(*flags):
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "benchmark_throughput.py"), *flags],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_throughput_allocators_and_sharing(llama_dir):
    common = [f"--model={llama_dir[0]}", "--workload=sharegpt-like", "--num_requests=4", "--length_scale=0.05",
              "--max_model_len=256", "--num_kv_blocks=64"]
    out = run_benchmark(*common, "--allocator=paged,oracle")
    assert "paged / oracle" in out and out.count("Throughput:") == 2
    out = run_benchmark(*common, "--beam_width=2", "--sharing=both", "--shared_prefix=1-shot")
    assert "sharing on / off (paged)" in out


def test_serving_benchmark_runs(llama_dir, tmp_path):
    result = subprocess.run([sys.executable, os.path.join(SCRIPTS, "benchmark_serving.py"), f"--model={llama_dir[0]}",
                             "--workload=sharegpt-like", "--num_requests=4", "--length_scale=0.05",
                             "--max_model_len=256", "--num_kv_blocks=64", "--allocator=paged",
                             "--request_rates=4", "--warmup_requests=0", f"--out_dir={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "paged" in result.stdout
