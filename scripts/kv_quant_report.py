"""What an 8-bit KV cache buys: bytes per token and blocks per budget per KV dtype, then measured
throughput at one fixed KV memory budget.

  python scripts/kv_quant_report.py                       # table, then the measurement on CPU
  python scripts/kv_quant_report.py --measure=false       # table only
  python scripts/kv_quant_report.py --kv_cache_memory_bytes 4194304 --num_requests 128

The table uses the engine's own accounting (`pallas_kernels.quant.bytes_per_row`: ``head_dim``
values per token and KV head, plus a bfloat16 scale for int8/fp8) for bench-llama and two real
shapes. The measurement runs ``scripts/benchmark_throughput.py`` once with ``--kv_cache_dtype
auto,<8-bit>`` on bench-llama at ``--kv_cache_memory_bytes``: the same bytes hold more 8-bit blocks,
so more requests run at once (mean batch) when memory, not the queue, limits the batch.
"""
import os
import subprocess
import sys

import jax.numpy as jnp
from absl import app, flags

from pallas_kernels import quant
from bench_common import BENCH_LLAMA

F = flags.FLAGS
flags.DEFINE_string("model", None, "benchmark_throughput.py --model (default: bench-llama)")
flags.DEFINE_integer("kv_cache_memory_bytes", 2 << 20, "The fixed KV memory budget (per device)")
flags.DEFINE_integer("block_size", 16, "Tokens per KV block")
flags.DEFINE_bool("measure", True, "Also run benchmark_throughput.py at the budget")
flags.DEFINE_enum("quantized", "int8", ["int8", "fp8"], "The 8-bit dtype measured against auto")
flags.DEFINE_string("workload", "sharegpt-like", "benchmark_throughput.py --workload")
flags.DEFINE_integer("num_requests", 64, "benchmark_throughput.py --num_requests")
flags.DEFINE_float("length_scale", 0.1, "benchmark_throughput.py --length_scale (CPU: small)")
flags.DEFINE_integer("max_model_len", 256, "benchmark_throughput.py --max_model_len")

# (layers, kv heads, head_dim)
SHAPES = {
    "bench-llama": (BENCH_LLAMA["num_hidden_layers"], BENCH_LLAMA["num_key_value_heads"],
                    BENCH_LLAMA["hidden_size"] // BENCH_LLAMA["num_attention_heads"]),
    "SmolLM2-135M": (30, 3, 64),
    "Llama-3-8B": (32, 8, 128),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype) -> int:
    """K and V of every layer and KV head for one token."""
    return 2 * layers * kv_heads * quant.bytes_per_row(head_dim, dtype)


def print_table(budget: int, block_size: int) -> None:
    print(f"{'model':<13} {'kv dtype':<9} {'bytes/token':>11} {'tokens/GiB':>10} "
          f"{f'blocks in {budget / 2**20:g} MiB':>16}  vs float32  vs bfloat16")
    for model, shape in SHAPES.items():
        per = {name: bytes_per_token(*shape, dt) for name, dt in DTYPES.items()}
        for name, b in per.items():
            print(f"{model:<13} {name:<9} {b:>11} {2**30 // b:>10} {budget // (b * block_size):>16}  "
                  f"{per['float32'] / b:>9.2f}x {per['bfloat16'] / b:>10.2f}x")


def main(argv):
    del argv
    print_table(F.kv_cache_memory_bytes, F.block_size)
    if not F.measure:
        return
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_throughput.py")
    cmd = [sys.executable, script, f"--kv_cache_dtype=auto,{F.quantized}",
           f"--kv_cache_memory_bytes={F.kv_cache_memory_bytes}", f"--block_size={F.block_size}",
           f"--workload={F.workload}", f"--num_requests={F.num_requests}", f"--length_scale={F.length_scale}",
           f"--max_model_len={F.max_model_len}"] + ([f"--model={F.model}"] if F.model else [])
    print("\n$ " + " ".join(["python", "scripts/benchmark_throughput.py"] + cmd[2:]), flush=True)
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    app.run(main)
