"""Mixture-of-experts MLP on this CPU: the grouped matmul over the tokens routed to each expert
(`jpaged.models.moe.routed_experts`, what Mixtral and Qwen3-MoE run) against a dense loop that runs
every expert over every token and weights the outputs by the routing (zero for experts not chosen).

  python scripts/benchmark_moe.py                                  # Mixtral-like: 8 experts, top 2
  python scripts/benchmark_moe.py --hidden 4096 --intermediate 14336 --tokens 1,16
  python scripts/benchmark_moe.py --num_experts 128 --top_k 8 --intermediate 768   # Qwen3-MoE-like

The default shape is Mixtral's expert count and routing with its hidden and intermediate sizes
divided by 4 (one layer's experts: 352 MB in float32; Mixtral's own are 5.6 GB). Per token count
it prints both times (the least of ``--runs`` after a warm-up; compile time not counted), their
ratio, and the largest difference between the two outputs. Not a timed test: run it on a quiet
machine (the load average is printed before and after).
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench_common import describe_machine
from jpaged.models.moe import routed_experts

flags.DEFINE_list("tokens", ["1", "16", "256"], "Token counts to time")
flags.DEFINE_integer("hidden", 1024, "Hidden size")
flags.DEFINE_integer("intermediate", 3584, "Each expert's intermediate size")
flags.DEFINE_integer("num_experts", 8, "Experts")
flags.DEFINE_integer("top_k", 2, "Experts per token")
flags.DEFINE_integer("runs", 10, "Timed runs per case (the least counts)")
F = flags.FLAGS


def dense_experts(x, expert_ids, weights, gate_proj, up_proj, down_proj, *, act):
    """Every expert over every token, weighted by the routing (0 where not chosen)."""
    num_experts = gate_proj.shape[0]
    dense_weights = jnp.zeros((x.shape[0], num_experts), weights.dtype)
    dense_weights = dense_weights.at[jnp.arange(x.shape[0])[:, None], expert_ids].set(weights)

    def expert(e, out):
        h = act(x @ gate_proj[e]) * (x @ up_proj[e])
        return out + jax.lax.dynamic_index_in_dim(dense_weights, e, axis=1) * (h @ down_proj[e])

    return jax.lax.fori_loop(0, num_experts, expert, jnp.zeros_like(x))


def best_time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(F.runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv):
    del argv
    describe_machine()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    e, h, i = F.num_experts, F.hidden, F.intermediate
    scale = h ** -0.5
    gate, up = (jnp.asarray(rng.standard_normal((e, h, i)) * scale, jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, i, h)) * i ** -0.5, jnp.float32)
    print(f"experts {e} x [{h} -> {i} -> {h}], top {F.top_k}: {3 * gate.nbytes / 2**20:.0f} MiB of weights")
    grouped = jax.jit(lambda *a: routed_experts(*a, act=jax.nn.silu))
    dense = jax.jit(lambda *a: dense_experts(*a, act=jax.nn.silu))
    print(f"{'tokens':>6} {'grouped ms':>11} {'dense ms':>9} {'dense/grouped':>14} {'max |diff|':>11}")
    for t in map(int, F.tokens):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
        logits = rng.standard_normal((t, e))
        expert_ids = jnp.asarray(np.argsort(-logits, axis=1)[:, :F.top_k], jnp.int32)
        weights = jnp.asarray(rng.dirichlet(np.ones(F.top_k), t), jnp.float32)
        args = (x, expert_ids, weights, gate, up, down)
        g, d = best_time(grouped, *args), best_time(dense, *args)
        diff = float(jnp.max(jnp.abs(grouped(*args) - dense(*args))))
        print(f"{t:>6} {g * 1e3:>11.2f} {d * 1e3:>9.2f} {d / g:>14.2f} {diff:>11.2e}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    app.run(main)
