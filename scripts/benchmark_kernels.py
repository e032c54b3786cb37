"""Paged decode attention vs dense attention over a contiguous cache.

For each (batch, context) pair, builds a KV pool with shuffled block tables
and a dense ``[batch, context, num_kv_heads, head_dim]`` cache holding the
same tokens, then times one decode attention step of each (jitted,
``block_until_ready``, warmup runs, median of ``--num_runs``) and prints the
ratio paged / dense.

  python scripts/benchmark_kernels.py --batch=1,8,32 --context=512,2048
  python scripts/benchmark_kernels.py --backend=pallas   # on TPU / GPU

``--backend=xla`` times the pure-jnp reference (the CPU path).
``--backend=pallas`` times the Pallas kernel for the current platform; on CPU
that is interpret mode, useful as a smoke test only.
"""

import functools
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

_BATCH = flags.DEFINE_list("batch", ["1", "8", "32"], "Batch sizes.")
_CONTEXT = flags.DEFINE_list("context", ["256", "1024", "2048"],
                             "Context lengths (tokens per sequence).")
_NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 8, "KV heads.")
_GROUP = flags.DEFINE_integer("group", 4, "Query heads per KV head.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 128, "Head dimension.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_PAGES_PER_COMPUTE_BLOCK = flags.DEFINE_integer(
    "pages_per_compute_block", 8, "Kernel knob (pallas backend).")
_BACKEND = flags.DEFINE_enum("backend", "xla", ["xla", "pallas"],
                             "Paged implementation to time.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Activation and cache dtype.")
_NUM_RUNS = flags.DEFINE_integer("num_runs", 10, "Timed runs (median).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed runs after compiling.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


def dense_attention(q, k, v, seq_lens, *, scale):
  """q [B, Hq, D]; k, v [B, T, KVH, D]; attends to the first seq_lens[b]."""
  b, hq, d = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, kvh, hq // kvh, d)
  logits = jnp.einsum("bkgd,btkd->bkgt", qg, k,
                      preferred_element_type=jnp.float32) * scale
  mask = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]
  logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
  w = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgt,btkd->bkgd", w.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(q.shape).astype(q.dtype)


def time_fn(fn, *args):
  jax.block_until_ready(fn(*args))  # compile
  for _ in range(_WARMUP.value):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_NUM_RUNS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def make_inputs(rng, batch, context, dtype):
  kvh, d, bs = _NUM_KV_HEADS.value, _HEAD_DIM.value, _BLOCK_SIZE.value
  hq = kvh * _GROUP.value
  blocks_per_seq = -(-context // bs)
  num_blocks = batch * blocks_per_seq
  dense_k = rng.standard_normal((batch, blocks_per_seq * bs, kvh, d),
                                np.float32)
  dense_v = rng.standard_normal(dense_k.shape, np.float32)
  tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq)
  k_pages = np.zeros((kvh, num_blocks, bs, d), np.float32)
  v_pages = np.zeros_like(k_pages)
  # Block j of sequence b holds dense tokens [j * bs, (j + 1) * bs).
  k_blocks = dense_k.reshape(batch, blocks_per_seq, bs, kvh, d)
  v_blocks = dense_v.reshape(batch, blocks_per_seq, bs, kvh, d)
  k_pages[:, tables] = k_blocks.transpose(3, 0, 1, 2, 4)
  v_pages[:, tables] = v_blocks.transpose(3, 0, 1, 2, 4)
  q = rng.standard_normal((batch, hq, d), np.float32)
  cast = lambda x: jnp.asarray(x, dtype)
  seq_lens = jnp.full((batch,), context, jnp.int32)
  paged = (cast(q), cast(k_pages), cast(v_pages),
           jnp.asarray(tables, jnp.int32), seq_lens)
  dense = (cast(q), cast(dense_k), cast(dense_v), seq_lens)
  return paged, dense


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  scale = 1.0 / _HEAD_DIM.value ** 0.5
  platform = jax.default_backend()
  if _BACKEND.value == "xla":
    paged_fn = functools.partial(pk.paged_attention_reference, scale=scale)
  else:
    paged_fn = functools.partial(
        pk.paged_attention, scale=scale,
        pages_per_compute_block=_PAGES_PER_COMPUTE_BLOCK.value,
        interpret=platform == "cpu")
  paged_fn = jax.jit(paged_fn)
  dense_fn = jax.jit(functools.partial(dense_attention, scale=scale))
  rng = np.random.default_rng(_SEED.value)
  print(f"platform={platform} backend={_BACKEND.value} dtype={_DTYPE.value} "
        f"kv_heads={_NUM_KV_HEADS.value} group={_GROUP.value} "
        f"head_dim={_HEAD_DIM.value} block_size={_BLOCK_SIZE.value}")
  print(f"{'batch':>6} {'context':>8} {'paged_ms':>10} {'dense_ms':>10} "
        f"{'paged/dense':>12} {'max_abs_diff':>13}")
  for batch in map(int, _BATCH.value):
    for context in map(int, _CONTEXT.value):
      paged_args, dense_args = make_inputs(rng, batch, context, dtype)
      t_paged = time_fn(paged_fn, *paged_args)
      t_dense = time_fn(dense_fn, *dense_args)
      diff = jnp.max(jnp.abs(paged_fn(*paged_args).astype(jnp.float32)
                             - dense_fn(*dense_args).astype(jnp.float32)))
      print(f"{batch:>6} {context:>8} {t_paged * 1e3:>10.3f} "
            f"{t_dense * 1e3:>10.3f} {t_paged / t_dense:>12.2f} "
            f"{float(diff):>13.2e}", flush=True)


if __name__ == "__main__":
  app.run(main)
