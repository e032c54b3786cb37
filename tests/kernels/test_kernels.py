"""Kernels (interpret mode on CPU) vs references vs dumb numpy loops.

Layers of trust: the numpy loops below are written for obviousness; the
pure-jnp references in ``pallas_kernels.jnp`` are checked against them;
the Pallas kernels (TPU/Mosaic and GPU/Triton variants, both interpreted) are
checked against the references. Lowering for real hardware is checked in
``test_kernels_export.py``.

Interpret mode: on by default off TPU/GPU. ``PALLAS_INTERPRET=0`` on a TPU or
GPU host runs the kernels compiled, and only that platform's kernel
(``scripts/accelerator_check.sh``); ``PALLAS_INTERPRET=1`` forces interpret
mode anywhere.

Tolerances: float32 atol = rtol = 2e-5 (kernels accumulate in float32 in a
different order); bfloat16 atol = rtol = 3e-2 (inputs are bfloat16 for both
sides; the kernels round softmax weights to bfloat16 before the PV matmul in
the ragged kernel and round the output to bfloat16).
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5),
       jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}
_PLATFORM = jax.default_backend()
INTERPRET = os.environ.get(
    "PALLAS_INTERPRET", "0" if _PLATFORM in ("tpu", "gpu") else "1") == "1"
# Interpreted, both kernels run on any host; compiled, only the platform's.
KERNEL_BACKENDS = (["tpu", "gpu"] if INTERPRET
                   else ["tpu" if _PLATFORM == "tpu" else "gpu"])


# ---------------------------------------------------------------------------
# Dumb numpy loops.
# ---------------------------------------------------------------------------


def np_attention_row(q_h, keys, values, scale, soft_cap=None):
  """softmax(scale * q.k) . v for one query head over visible keys (logits
  capped to ``soft_cap * tanh(s / soft_cap)`` with a soft cap)."""
  if len(keys) == 0:
    return np.zeros_like(q_h)
  logits = np.array([scale * float(np.dot(q_h, k)) for k in keys])
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  w = np.exp(logits - logits.max())
  w /= w.sum()
  return (w[:, None] * np.asarray(values)).sum(0)


def np_context(pages, table, seq_len, head, window=None):
  """Keys of one sequence and head, in position order, read slot by slot: the
  last ``window`` of the first ``seq_len`` positions (all without a window)."""
  block_size = pages.shape[2]
  first = 0 if window is None else max(0, seq_len - window)
  return [pages[head, table[p // block_size], p % block_size]
          for p in range(first, seq_len)]


def np_ragged(q, k_pages, v_pages, block_tables, seq_lens, qsl, num_seqs,
              scale, window=None, soft_cap=None):
  q = np.asarray(q, np.float64)
  k_pages = np.asarray(k_pages, np.float64)
  v_pages = np.asarray(v_pages, np.float64)
  num_tokens, hq, _ = q.shape
  group = hq // k_pages.shape[0]
  out = np.zeros_like(q)
  for s in range(int(num_seqs)):
    q_len = qsl[s + 1] - qsl[s]
    for i in range(q_len):
      pos = seq_lens[s] - q_len + i
      for h in range(hq):
        keys = np_context(k_pages, block_tables[s], pos + 1, h // group, window)
        vals = np_context(v_pages, block_tables[s], pos + 1, h // group, window)
        out[qsl[s] + i, h] = np_attention_row(q[qsl[s] + i, h], keys, vals,
                                              scale, soft_cap)
  return out


def np_paged(q, k_pages, v_pages, block_tables, seq_lens, scale, window=None,
             soft_cap=None):
  num_seqs = q.shape[0]
  qsl = np.arange(num_seqs + 1)
  # Decode == ragged with one row per sequence at position seq_len - 1.
  return np_ragged(q, k_pages, v_pages, block_tables, seq_lens, qsl,
                   num_seqs, scale, window, soft_cap)


def np_write_kv(k_pages, v_pages, k_new, v_new, slots):
  k, v = np.array(k_pages), np.array(v_pages)
  bs = k.shape[2]
  for t, slot in enumerate(slots):
    if slot >= 0:
      k[:, slot // bs, slot % bs] = k_new[t]
      v[:, slot // bs, slot % bs] = v_new[t]
  return k, v


def np_copy_blocks(k_pages, v_pages, src, dst):
  k, v = np.array(k_pages), np.array(v_pages)
  for a, b in zip(src, dst):
    if a >= 0 and b >= 0:
      k[:, b], v[:, b] = k[:, a], v[:, a]
  return k, v


# ---------------------------------------------------------------------------
# Cases.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
  """A batch: per sequence (q_len, seq_len); padding sequences at the end."""
  seqs: list[tuple[int, int]]
  block_size: int = 16
  head_dim: int = 64
  num_kv_heads: int = 2
  group: int = 4
  dtype: type = jnp.float32
  max_seqs: int | None = None  # >= len(seqs); extra rows are padding
  extra_tokens: int = 0  # padding rows after the last sequence
  share_prefix: bool = True  # seq 1 reuses seq 0's first block
  seed: int = 0

  def build(self):
    """Returns (args, kwargs) for ragged_paged_attention; pool has NaNs in
    every slot no sequence uses, so reading one would show."""
    rng = np.random.default_rng(self.seed)
    bs, d = self.block_size, self.head_dim
    max_seqs = self.max_seqs or len(self.seqs)
    pages = [-(-ctx // bs) for _, ctx in self.seqs]
    max_blocks = max(max(pages), 1) + 1
    num_blocks = sum(pages) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    used = np.zeros((num_blocks, bs), bool)
    nxt = 0
    for s, (_, ctx) in enumerate(self.seqs):
      tables[s, :pages[s]] = perm[nxt:nxt + pages[s]]
      nxt += pages[s]
      if (s == 1 and self.share_prefix and pages[0] > 1 and pages[1] > 1):
        tables[1, 0] = tables[0, 0]  # a shared (prefix) block
      for p in range(ctx):
        used[tables[s, p // bs], p % bs] = True
    shape = (self.num_kv_heads, num_blocks, bs, d)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    k[:, ~used] = np.nan
    v[:, ~used] = np.nan
    q_lens = [ql for ql, _ in self.seqs]
    num_tokens = sum(q_lens) + self.extra_tokens
    qsl = np.zeros(max_seqs + 1, np.int32)
    qsl[1:len(q_lens) + 1] = np.cumsum(q_lens)
    qsl[len(q_lens) + 1:] = sum(q_lens)
    seq_lens = np.zeros(max_seqs, np.int32)
    seq_lens[:len(self.seqs)] = [ctx for _, ctx in self.seqs]
    hq = self.num_kv_heads * self.group
    q = rng.standard_normal((num_tokens, hq, d)).astype(np.float32)
    cast = lambda x: jnp.asarray(x, self.dtype)
    args = (cast(q), cast(k), cast(v), jnp.asarray(tables),
            jnp.asarray(seq_lens), jnp.asarray(qsl),
            jnp.asarray([len(self.seqs)], jnp.int32))
    return args, dict(scale=1.0 / np.sqrt(d))


def decode_case(lens, **kw):
  return Case(seqs=[(1, n) for n in lens], **kw)


def check(out, expected, dtype):
  out = np.asarray(jnp.asarray(out, jnp.float32))
  assert not np.isnan(out).any()
  np.testing.assert_allclose(out, np.asarray(expected, np.float32),
                             **TOL[dtype])


def as_np(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


# ---------------------------------------------------------------------------
# References vs numpy loops.
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    decode_case([0, 1, 15, 16, 17, 40], block_size=16),
    decode_case([3, 8, 9], block_size=8, group=1, num_kv_heads=3),
], ids=["bs16_g4", "bs8_mha"])
def test_paged_reference_vs_numpy(case):
  (q, k, v, bt, sl, _, _), kw = case.build()
  out = pk.paged_attention_reference(q, k, v, bt, sl, **kw)
  expected = np_paged(q, as_np(k), as_np(v), np.asarray(bt), np.asarray(sl),
                      kw["scale"])
  check(out, expected, case.dtype)


def check_ragged_reference(case, window=None, soft_cap=None, **knobs):
  """The jnp ragged attention (with ``knobs``) against the numpy loops."""
  args, kw = case.build()
  out = pk.ragged_paged_attention_reference(
      *args, sliding_window=window, logits_soft_cap=soft_cap, **knobs, **kw)
  q, k, v, bt, sl, qsl, ns = args
  expected = np_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt),
                       np.asarray(sl), np.asarray(qsl), int(ns[0]),
                       kw["scale"], window, soft_cap)
  check(out, expected, case.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    Case(seqs=[(5, 5), (1, 20), (0, 7), (9, 33), (1, 1)], max_seqs=7,
         extra_tokens=3),
    Case(seqs=[(16, 40), (4, 4)], block_size=8, group=8, num_kv_heads=1,
         head_dim=128),
], ids=["mixed_padded", "mqa"])
def test_ragged_reference_vs_numpy(case):
  check_ragged_reference(case)


def test_reference_work_split_vs_numpy():
  """Small knobs: prefill chunks of 4 tokens in several batches, decode rows
  sorted longest first, one block per online-softmax step."""
  case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (2, 18)],
              block_size=8, max_seqs=8, extra_tokens=2)
  check_ragged_reference(case, num_queries_per_block=4, pages_per_compute_block=1)


# (sliding_window, logits_soft_cap): a window shorter than a block, one of a
# few blocks, one longer than every context; a cap that bites (the logits are
# ~N(0, 1) here) and one with a window.
KNOBS = {"w3": (3, None), "w20": (20, None), "w4096": (4096, None),
         "cap2": (None, 2.0), "w9_cap5": (9, 5.0)}


@pytest.mark.slow
@pytest.mark.parametrize("knobs", KNOBS)
def test_reference_window_and_soft_cap_vs_numpy(knobs):
  """Windows cut inside and across blocks, for prefill chunks that start
  after cached tokens and for decode rows; the cap on large logits."""
  window, cap = KNOBS[knobs]
  case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (30, 64)],
              block_size=8, max_seqs=8, extra_tokens=2)
  check_ragged_reference(case, window, cap, num_queries_per_block=4,
                         pages_per_compute_block=2)
  (q, k, v, bt, sl, _, _), kw = decode_case([0, 1, 9, 40, 100]).build()
  out = pk.paged_attention_reference(q, k, v, bt, sl, sliding_window=window,
                                     logits_soft_cap=cap, **kw)
  check(out, np_paged(as_np(q), as_np(k), as_np(v), np.asarray(bt),
                      np.asarray(sl), kw["scale"], window, cap), jnp.float32)


def test_reference_window_reads_only_the_window():
  """Blocks wholly before a row's window are never read: NaN there changes
  nothing."""
  case = decode_case([100, 37], block_size=8)
  (q, k, v, bt, sl, _, _), kw = case.build()
  out = pk.paged_attention_reference(q, k, v, bt, sl, sliding_window=16, **kw)
  poisoned = [x.at[:, bt[0, :10]].set(np.nan).at[:, bt[1, :2]].set(np.nan)
              for x in (k, v)]  # sequence 0 sees 84..99, sequence 1 sees 21..36
  got = pk.paged_attention_reference(q, *poisoned, bt, sl, sliding_window=16,
                                     **kw)
  check(got, out, jnp.float32)


def test_reference_decode_batches_vs_numpy():
  """More decode rows than one batch holds (`DECODE_ROWS`): sorted longest first, each batch
  loops to its own longest context, padding rows (a bucket of 64) are skipped; a prefill too."""
  from pallas_kernels.jnp import attention as reference
  lens = [3, 150, 17, 1, 64, 90, 33, 8, 121, 45, 2, 77, 16, 5, 60, 99, 31, 12, 140, 7]
  assert len(lens) > 2 * reference.DECODE_ROWS
  case = Case(seqs=[(1, n) for n in lens] + [(9, 30)], block_size=8, max_seqs=64, extra_tokens=5)
  check_ragged_reference(case)


def _cache_inputs(seed=0, dtype=jnp.float32, kvh=2, num_blocks=6, bs=8,
                  d=64, num_tokens=9):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((kvh, num_blocks, bs, d)).astype(np.float32)
  v = rng.standard_normal((kvh, num_blocks, bs, d)).astype(np.float32)
  kn = rng.standard_normal((num_tokens, kvh, d)).astype(np.float32)
  vn = rng.standard_normal((num_tokens, kvh, d)).astype(np.float32)
  slots = rng.permutation(num_blocks * bs)[:num_tokens].astype(np.int32)
  slots[1::3] = -1  # padding rows
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(k), cast(v), cast(kn), cast(vn), jnp.asarray(slots)


def test_cache_references_vs_numpy():
  k, v, kn, vn, slots = _cache_inputs()
  got = pk.write_kv_reference(k, v, kn, vn, slots)
  want = np_write_kv(k, v, kn, vn, np.asarray(slots))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), w)
  src = jnp.array([0, 3, -1, 2], jnp.int32)
  dst = jnp.array([4, 5, 1, -1], jnp.int32)
  got = pk.copy_blocks_reference(k, v, src, dst)
  want = np_copy_blocks(k, v, np.asarray(src), np.asarray(dst))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), w)


# ---------------------------------------------------------------------------
# Kernels (interpret mode) vs references.
# ---------------------------------------------------------------------------

# Representative decode configs: lengths 0, 1, block multiples and +/- 1, up
# to 2048; every block size, head dim, group and dtype appears at least once.
DECODE_CASES = {
    "bs16_d64_g4_f32": decode_case([0, 1, 15, 16, 17, 100], block_size=16),
    "bs8_d128_g1_bf16": decode_case([1, 7, 8, 9, 64], block_size=8,
                                    head_dim=128, group=1, num_kv_heads=4,
                                    dtype=jnp.bfloat16),
    "bs32_d64_g8_bf16": decode_case([31, 32, 33, 2048], block_size=32,
                                    group=8, num_kv_heads=1,
                                    dtype=jnp.bfloat16),
    "bs64_d128_g4_f32": decode_case([0, 63, 64, 65, 2047], block_size=64,
                                    head_dim=128),
}


def grid(cases, quick):
  """(case, backend) pairs: the ``quick`` ones in the default run, the rest marked slow (interpret
  mode compiles each kernel for tens of seconds on a cold cache)."""
  return [pytest.param(name, backend, marks=() if (name, backend) in quick else pytest.mark.slow)
          for name in cases for backend in KERNEL_BACKENDS]


@pytest.mark.parametrize("name,backend", grid(DECODE_CASES, quick={("bs16_d64_g4_f32", b) for b in KERNEL_BACKENDS}))
def test_paged_attention(name, backend):
  case = DECODE_CASES[name]
  (q, k, v, bt, sl, _, _), kw = case.build()
  out = pk.paged_attention(q, k, v, bt, sl, pages_per_compute_block=4,
                           backend=backend, interpret=INTERPRET, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  check(out, pk.paged_attention_reference(q, k, v, bt, sl, **kw), case.dtype)
  assert not np.any(as_np(out)[np.asarray(sl) == 0])  # empty -> zeros


RAGGED_CASES = {
    # Prefill, decode, empty and chunked-prefill rows; padding seqs + rows.
    "mixed_bs16_g4_f32": Case(
        seqs=[(5, 5), (1, 20), (0, 7), (17, 33), (1, 1), (16, 16)],
        max_seqs=8, extra_tokens=7),
    "chunk_bs8_d128_g8_bf16": Case(
        seqs=[(40, 2048), (1, 9), (8, 8)], block_size=8, head_dim=128,
        group=8, num_kv_heads=1, dtype=jnp.bfloat16, extra_tokens=3),
    "bs32_g1_bf16": Case(seqs=[(31, 31), (1, 65), (33, 64)], block_size=32,
                         group=1, num_kv_heads=4, dtype=jnp.bfloat16),
    "bs64_d64_g3_f32": Case(seqs=[(2, 129), (1, 64), (20, 63)],
                            block_size=64, group=3, max_seqs=4),
}


# the TPU kernel's ragged path is also in the default run through test_ragged_decode_rows_match_paged_attention
@pytest.mark.parametrize("name,backend", grid(RAGGED_CASES, quick={("bs32_g1_bf16", "gpu")}))
def test_ragged_paged_attention(name, backend):
  case = RAGGED_CASES[name]
  args, kw = case.build()
  out = pk.ragged_paged_attention(*args, pages_per_compute_block=2,
                                  backend=backend, interpret=INTERPRET, **kw)
  q = args[0]
  assert out.shape == q.shape and out.dtype == q.dtype
  check(out, pk.ragged_paged_attention_reference(*args, **kw), case.dtype)
  num_real = int(args[5][int(args[6][0])])
  assert not np.any(as_np(out)[num_real:])  # padding rows are zeros


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("knobs", ["w3", "w20", "w9_cap5"])
def test_kernels_window_and_soft_cap(knobs, backend):
  window, cap = KNOBS[knobs]
  kw = dict(sliding_window=window, logits_soft_cap=cap, backend=backend,
            interpret=INTERPRET)
  case = decode_case([0, 1, 15, 16, 17, 100], block_size=16, dtype=jnp.bfloat16)
  (q, k, v, bt, sl, _, _), skw = case.build()
  out = pk.paged_attention(q, k, v, bt, sl, pages_per_compute_block=2, **kw, **skw)
  check(out, pk.paged_attention_reference(q, k, v, bt, sl, sliding_window=window,
                                          logits_soft_cap=cap, **skw), case.dtype)
  case = Case(seqs=[(5, 5), (1, 20), (0, 7), (17, 33), (1, 1), (40, 56)],
              block_size=8, max_seqs=8, extra_tokens=7)
  args, skw = case.build()
  out = pk.ragged_paged_attention(*args, pages_per_compute_block=2, **kw, **skw)
  check(out, pk.ragged_paged_attention_reference(
      *args, sliding_window=window, logits_soft_cap=cap, **skw), case.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_read_only_the_window(backend):
  """Blocks wholly before every row's window are never fetched."""
  (q, k, v, bt, sl, qsl, ns), kw = Case(seqs=[(1, 100), (20, 60)],
                                         block_size=8).build()
  poisoned = [x.at[:, bt[0, :10]].set(np.nan).at[:, bt[1, 1:3]].set(np.nan)
              for x in (k, v)]  # seq 0 sees 84..99; seq 1's rows see 25..59
  knobs = dict(sliding_window=16, backend=backend, interpret=INTERPRET, **kw)
  want = pk.ragged_paged_attention(q, k, v, bt, sl, qsl, ns,
                                   pages_per_compute_block=1, **knobs)
  got = pk.ragged_paged_attention(q, *poisoned, bt, sl, qsl, ns,
                                  pages_per_compute_block=1, **knobs)
  check(got, want, jnp.float32)
  got = pk.paged_attention(q[:1], *poisoned, bt[:1], sl[:1],
                           pages_per_compute_block=1, **knobs)
  check(got, want[:1], jnp.float32)


def test_ragged_decode_rows_match_paged_attention():
  """A batch of q_len == 1 rows is the decode kernel's problem."""
  case = decode_case([1, 16, 17, 70], block_size=16)
  (q, k, v, bt, sl, qsl, ns), kw = case.build()
  backend = KERNEL_BACKENDS[0]
  decode = pk.paged_attention(q, k, v, bt, sl, backend=backend,
                              interpret=INTERPRET, **kw)
  ragged = pk.ragged_paged_attention(q, k, v, bt, sl, qsl, ns, backend=backend,
                                     interpret=INTERPRET, **kw)
  np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode),
                             atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_ragged_scalar_num_seqs_and_small_tiles():
  case = Case(seqs=[(3, 3), (20, 50), (1, 5)], max_seqs=5, extra_tokens=4)
  args, kw = case.build()
  args = args[:6] + (jnp.int32(2),)  # scalar; third sequence is padding now
  ref = pk.ragged_paged_attention_reference(*args, **kw)
  assert not np.any(np.asarray(ref)[23:])
  tiles = {"tpu": 32, "gpu": 4}
  for backend in KERNEL_BACKENDS:
    tile = tiles[backend]
    out = pk.ragged_paged_attention(*args, num_queries_per_block=tile,
                                    pages_per_compute_block=3,
                                    backend=backend, interpret=INTERPRET, **kw)
    check(out, ref, jnp.float32)


# Slot patterns of a write into 6 blocks of 16: random with padding; a prefill
# run over whole and partial tiles of rows (8 float32 / 16 bfloat16 rows), in
# reverse token order; decode rows in distinct blocks.
SLOT_PATTERNS = {
    "random": None,
    "runs": np.r_[np.arange(16, 61)[::-1], -1, 3, 70, 71, -1],
    "decode": np.array([5, 21, 37, -1, 53, 69, 90]),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("slots", SLOT_PATTERNS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv(backend, slots, dtype):
  pattern = SLOT_PATTERNS[slots]
  num_tokens = 9 if pattern is None else len(pattern)
  k, v, kn, vn, slot_mapping = _cache_inputs(dtype=dtype, kvh=2, bs=16, d=128,
                                             num_tokens=num_tokens)
  if pattern is not None:
    slot_mapping = jnp.asarray(pattern, jnp.int32)
  got = pk.write_kv(k, v, kn, vn, slot_mapping, backend=backend,
                    interpret=INTERPRET)
  want = np_write_kv(as_np(k), as_np(v), as_np(kn), as_np(vn),
                     np.asarray(slot_mapping))
  for g, w in zip(got, want):
    assert g.dtype == dtype
    np.testing.assert_array_equal(as_np(g), w)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_write_kv_duplicate_slots_write_one_of_the_rows(backend):
  k, v, kn, vn, _ = _cache_inputs(dtype=jnp.bfloat16, bs=16, num_tokens=5)
  slots = jnp.array([7, 7, 8, 7, -1], jnp.int32)
  got_k, _ = pk.write_kv(k, v, kn, vn, slots, backend=backend,
                         interpret=INTERPRET)
  row = as_np(got_k)[:, 0, 7]
  assert any(np.array_equal(row, as_np(kn)[t]) for t in (0, 1, 3))
  np.testing.assert_array_equal(as_np(got_k)[:, 0, 8], as_np(kn)[2])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copy_blocks(backend, dtype):
  k, v, *_ = _cache_inputs(dtype=dtype, kvh=3, bs=32, d=64, num_blocks=9)
  src = jnp.array([0, 3, -1, 2, 8], jnp.int32)
  dst = jnp.array([4, 5, 1, -1, 7], jnp.int32)
  got = pk.copy_blocks(k, v, src, dst, backend=backend, interpret=INTERPRET)
  want = pk.copy_blocks_reference(k, v, src, dst)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(as_np(g), as_np(w))


@pytest.mark.slow
def test_auto_backend_on_cpu_is_reference():
  case = Case(seqs=[(4, 10), (1, 17)])
  args, kw = case.build()
  out = pk.ragged_paged_attention(*args, **kw)
  check(out, pk.ragged_paged_attention_reference(*args, **kw), jnp.float32)
  q, k, v, bt, sl, _, _ = args
  out = pk.paged_attention(q[:2], k, v, bt, sl, **kw)
  check(out, pk.paged_attention_reference(q[:2], k, v, bt, sl, **kw),
        jnp.float32)


def test_donated_pool_is_updated_in_place():
  """Donating the pool to a jitted write_kv hands its buffers over: the inputs are deleted, the
  compiled module aliases k_pages -> output 0 and v_pages -> output 1, and the outputs hold the write."""
  k, v, kn, vn, slots = _cache_inputs()
  want = pk.write_kv_reference(k, v, kn, vn, slots)
  step = jax.jit(functools.partial(pk.write_kv, backend="tpu", interpret=True),
                 donate_argnums=(0, 1))
  hlo = step.lower(k, v, kn, vn, slots).compile().as_text()
  assert "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }" in hlo
  got = step(k, v, kn, vn, slots)
  assert k.is_deleted() and v.is_deleted(), "the donated pool was copied, not reused"
  assert not kn.is_deleted() and not slots.is_deleted()
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(RuntimeError, match="deleted|donated"):
    np.asarray(k)


def test_bad_inputs_raise():
  (q, k, v, bt, sl, qsl, ns), kw = Case(seqs=[(1, 4)]).build()
  with pytest.raises(ValueError, match="num_kv_heads"):
    pk.paged_attention(q[:, :3], k, v, bt, sl, **kw)
  with pytest.raises(ValueError, match="backend"):
    pk.paged_attention(q, k, v, bt, sl, backend="cuda", **kw)
  with pytest.raises(ValueError, match="query_start_loc"):
    pk.ragged_paged_attention(q, k, v, bt, sl, qsl[:-1], ns, **kw)
  with pytest.raises(ValueError, match="slot_mapping"):
    pk.write_kv(k, v, q[:, :2], q[:, :2], sl[:0])
  with pytest.raises(ValueError, match="not supported by the gpu"):
    pk.paged_attention(q[..., :48], k[..., :48], v[..., :48], bt, sl,
                       backend="gpu", **kw)


# ---------------------------------------------------------------------------
# Sweeps (pytest -m slow).
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_paged_attention_sweep(block_size, head_dim, group, dtype, backend):
  bs = block_size
  case = decode_case([0, 1, bs - 1, bs, bs + 1, 3 * bs, 2048],
                     block_size=bs, head_dim=head_dim, group=group,
                     dtype=dtype, seed=bs + head_dim + group)
  (q, k, v, bt, sl, _, _), kw = case.build()
  out = pk.paged_attention(q, k, v, bt, sl, backend=backend, interpret=INTERPRET,
                           **kw)
  check(out, pk.paged_attention_reference(q, k, v, bt, sl, **kw), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_ragged_paged_attention_sweep(block_size, head_dim, group, dtype,
                                      backend):
  bs = block_size
  case = Case(seqs=[(bs, bs), (1, bs + 1), (0, 3), (bs + 1, 3 * bs - 1),
                    (1, 1), (37, 2048)],
              block_size=bs, head_dim=head_dim, group=group, dtype=dtype,
              max_seqs=8, extra_tokens=5, seed=bs + head_dim + group)
  args, kw = case.build()
  out = pk.ragged_paged_attention(*args, backend=backend, interpret=INTERPRET,
                                  **kw)
  check(out, pk.ragged_paged_attention_reference(*args, **kw), dtype)
