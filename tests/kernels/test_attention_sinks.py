"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, with no
value) in every paged attention kernel: the jnp reference against a numpy loop, the Pallas TPU and
GPU kernels (interpret mode here) against the reference, with sliding windows, padding rows and
prefill chunks after cached tokens; without sinks nothing changes."""
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from test_kernels import INTERPRET, KERNEL_BACKENDS, Case, as_np, check, decode_case, np_context


def np_sink_ragged(q, k_pages, v_pages, tables, seq_lens, qsl, num_seqs, scale, sinks, window=None):
    """softmax over [scale * q.k_j ..., sink] (the sink's weight dropped) . v, row by row."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    group = q.shape[1] // k_pages.shape[0]
    out = np.zeros_like(q)
    for s in range(num_seqs):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            pos = seq_lens[s] - q_len + i
            for h in range(q.shape[1]):
                keys = np_context(k_pages, tables[s], pos + 1, h // group, window)
                values = np_context(v_pages, tables[s], pos + 1, h // group, window)
                logits = np.array([scale * float(np.dot(q[qsl[s] + i, h], k)) for k in keys] + [float(sinks[h])])
                w = np.exp(logits - logits.max())
                w /= w.sum()
                out[qsl[s] + i, h] = (w[:-1, None] * np.asarray(values)).sum(0) if keys else 0.0
    return out


def _sinks(case, seed=3):
    # large enough that a sink takes much of the weight, as trained gpt-oss sinks do
    return jnp.asarray(np.random.default_rng(seed).normal(1.0, 2.0, case.num_kv_heads * case.group), jnp.float32)


RAGGED = Case(seqs=[(5, 5), (1, 20), (0, 7), (17, 33), (1, 1), (40, 56)], block_size=8, max_seqs=8,
              extra_tokens=7)
DECODE = decode_case([0, 1, 15, 16, 17, 100], block_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 9])
def test_reference_with_sinks_vs_numpy(window):
    args, kw = RAGGED.build()
    sinks = _sinks(RAGGED)
    out = pk.ragged_paged_attention_reference(*args, sinks=sinks, sliding_window=window, num_queries_per_block=4,
                                              pages_per_compute_block=2, **kw)
    q, k, v, bt, sl, qsl, ns = args
    expected = np_sink_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl), np.asarray(qsl),
                              int(ns[0]), kw["scale"], np.asarray(sinks), window)
    check(out, expected, jnp.float32)
    plain = pk.ragged_paged_attention_reference(*args, sliding_window=window, **kw)
    assert not np.allclose(as_np(out)[:5], as_np(plain)[:5], atol=1e-3), "the sinks were meant to show"
    (q, k, v, bt, sl, _, _), kw = DECODE.build()
    sinks = _sinks(DECODE)
    out = pk.paged_attention_reference(q, k, v, bt, sl, sinks=sinks, sliding_window=window, **kw)
    check(out, np_sink_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl),
                              np.arange(q.shape[0] + 1), q.shape[0], kw["scale"], np.asarray(sinks), window),
          jnp.float32)


@pytest.mark.slow  # Pallas interpret mode: minutes here
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("window", [None, 20])
def test_kernels_with_sinks_match_the_reference(backend, window):
    kw = dict(sliding_window=window, backend=backend, interpret=INTERPRET)
    (q, k, v, bt, sl, _, _), skw = DECODE.build()
    sinks = _sinks(DECODE)
    out = pk.paged_attention(q, k, v, bt, sl, sinks=sinks, pages_per_compute_block=2, **kw, **skw)
    check(out, pk.paged_attention_reference(q, k, v, bt, sl, sinks=sinks, sliding_window=window, **skw),
          jnp.float32)
    assert not np.any(as_np(out)[np.asarray(sl) == 0])  # an empty row stays zero
    args, skw = RAGGED.build()
    sinks = _sinks(RAGGED)
    out = pk.ragged_paged_attention(*args, sinks=sinks, pages_per_compute_block=2, **kw, **skw)
    check(out, pk.ragged_paged_attention_reference(*args, sinks=sinks, sliding_window=window, **skw), jnp.float32)
    num_real = int(args[5][int(args[6][0])])
    assert not np.any(as_np(out)[num_real:])  # padding rows are zeros


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_with_sinks_and_a_group_that_is_not_a_power_of_two(backend):
    """Three query heads per kv head: the GPU kernels pad the group (and its sinks) to 16 rows."""
    case = Case(seqs=[(2, 40), (1, 17), (12, 12)], block_size=16, group=3, max_seqs=4)
    args, skw = case.build()
    sinks = _sinks(case)
    out = pk.ragged_paged_attention(*args, sinks=sinks, backend=backend, interpret=INTERPRET, **skw)
    check(out, pk.ragged_paged_attention_reference(*args, sinks=sinks, **skw), jnp.float32)
    q, k, v, bt, sl = args[:5]
    out = pk.paged_attention(q[:3], k, v, bt[:3], sl[:3], sinks=sinks, backend=backend, interpret=INTERPRET, **skw)
    check(out, pk.paged_attention_reference(q[:3], k, v, bt[:3], sl[:3], sinks=sinks, **skw), jnp.float32)


def test_bad_sinks_raise():
    (q, k, v, bt, sl, _, _), kw = DECODE.build()
    for fn in (pk.paged_attention_reference, pk.paged_attention):
        with pytest.raises(ValueError, match="sinks"):
            fn(q, k, v, bt, sl, sinks=jnp.zeros(3), **kw)
