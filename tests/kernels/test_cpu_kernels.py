"""The C++ CPU kernels (pallas_kernels/cpu/, XLA FFI custom calls) against numpy and the jnp paths:
paged attention (decode rows, prompt chunks), greedy sampling's reductions, the small matmul."""
import contextlib
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu as cpu_kernels
from pallas_kernels.cpu import library, measure
from test_kernels import Case, as_np, check, check_ragged_reference, decode_case, np_context, np_ragged

pytestmark = pytest.mark.skipif(library.compiler() is None, reason="no C++ compiler on this machine")


@pytest.fixture
def forced_on(monkeypatch):
    """The C++ kernels wherever they can serve, whatever was measured (the tests of where they can)."""
    monkeypatch.setenv("JPAGED_CPU_KERNELS", "1")


@pytest.fixture
def fresh_choices(tmp_path, monkeypatch):
    """No measured choice yet; they are kept in a file of the test's own."""
    assert cpu_kernels.available()
    monkeypatch.delenv("JPAGED_CPU_KERNELS", raising=False)
    monkeypatch.setattr(library, "choices_path", lambda: str(tmp_path / "choices.json"))
    for state in (measure._choices, measure._loaded, measure._logged, measure._measured):
        monkeypatch.setattr(measure, next(k for k, v in vars(measure).items() if v is state), type(state)())
    return tmp_path / "choices.json"


def test_kernel_builds_into_its_cache_and_registers(tmp_path, monkeypatch):
    monkeypatch.setattr(library, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(library, "FLAGS", [f if f != "-O3" else "-O0" for f in library.FLAGS])  # a quick build
    path = library.build(library.compiler())
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    assert library.build(library.compiler()) == path  # a second call reuses the file
    assert cpu_kernels.available()


@pytest.mark.parametrize("case", [
    decode_case([0, 1, 15, 16, 17, 40, 300], block_size=16),
    decode_case([3, 8, 9], block_size=8, group=1, num_kv_heads=3, head_dim=32),
    decode_case([1, 16, 31, 200], group=2, head_dim=128),
    Case(seqs=[(5, 5), (1, 20), (0, 7), (9, 33), (1, 1)], max_seqs=7, extra_tokens=3),
], ids=["decode_g4", "decode_mha", "decode_d128", "mixed_padded"])
def test_decode_rows_vs_numpy_and_zeros_elsewhere(case):
    args, kw = case.build()
    q, k, v, bt, sl, qsl, ns = args
    out = np.asarray(jax.jit(lambda *a: cpu_kernels.paged_decode(*a, scale=kw["scale"]))(*args))
    expected = np_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl), np.asarray(qsl),
                         int(ns[0]), kw["scale"])
    decode_rows = [int(qsl[s]) for s in range(int(ns[0])) if qsl[s + 1] - qsl[s] == 1 and sl[s] > 0]
    others = np.setdiff1d(np.arange(q.shape[0]), decode_rows)
    check(out[decode_rows], expected[decode_rows], jnp.float32)
    assert not out[others].any()


@pytest.mark.parametrize("case", [
    Case(seqs=[(40, 40), (1, 70), (23, 60), (1, 3), (16, 16), (17, 50), (2, 18)], max_seqs=9, extra_tokens=5),
    Case(seqs=[(33, 100), (1, 16), (5, 5)], group=2, head_dim=128),
    Case(seqs=[(19, 19), (1, 9), (6, 31), (20, 30), (40, 75)], group=3, num_kv_heads=1),
    Case(seqs=[(30, 45), (1, 12), (9, 9)], block_size=8, head_dim=32, group=1, num_kv_heads=3),
], ids=["g4_d64", "g2_d128", "g3_padded_rows", "generic_bs8_d32"])
def test_every_row_vs_numpy_prompt_chunks_with_context(case):
    """Prompts cut into 16-token chunks (a last partial one), after earlier context and alone, next
    to decode rows; the fast paths (blocks of 16, heads of 64 or 128, row blocks of 4 or 2 that a
    group of 3 does not fill, so one row block holds two tokens, across a key block's start when a
    chunk begins mid-block) and the generic one; padding rows stay zero."""
    args, kw = case.build()
    q, k, v, bt, sl, qsl, ns = args
    out = np.asarray(jax.jit(lambda *a: cpu_kernels.paged_attention(*a, scale=kw["scale"]))(*args))
    expected = np_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl), np.asarray(qsl),
                         int(ns[0]), kw["scale"])
    real = int(qsl[int(ns[0])])
    check(out[:real], expected[:real], jnp.float32)
    assert not out[real:].any()


def np_ragged_window_cap(q, k_pages, v_pages, block_tables, seq_lens, qsl, num_seqs, scale, window, cap):
    """`np_ragged` with a sliding window (a query at position p sees the keys j with
    p - window < j <= p) and a soft cap (each scaled score s becomes cap * tanh(s / cap))."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    group = q.shape[1] // k_pages.shape[0]
    out = np.zeros_like(q)
    for s in range(num_seqs):
        q_len = qsl[s + 1] - qsl[s]
        for i in range(q_len):
            pos = seq_lens[s] - q_len + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                keys = np.array(np_context(k_pages, block_tables[s], pos + 1, h // group)[lo:])
                values = np.array(np_context(v_pages, block_tables[s], pos + 1, h // group)[lo:])
                logits = scale * keys @ q[qsl[s] + i, h]
                if cap:
                    logits = cap * np.tanh(logits / cap)
                weights = np.exp(logits - logits.max())
                out[qsl[s] + i, h] = weights @ values / weights.sum()
    return out


@pytest.mark.parametrize("case", [
    decode_case([1, 15, 16, 17, 40, 300], block_size=16, share_prefix=False),
    decode_case([1, 16, 31, 200], group=2, head_dim=128, share_prefix=False),
    decode_case([3, 9, 30], block_size=8, group=1, num_kv_heads=3, head_dim=32, share_prefix=False),
    Case(seqs=[(40, 40), (1, 70), (23, 60), (17, 50), (2, 18)], max_seqs=7, extra_tokens=3, share_prefix=False),
    Case(seqs=[(33, 100), (1, 16), (5, 5)], group=2, head_dim=128, share_prefix=False),
    Case(seqs=[(30, 45), (1, 12), (9, 9)], block_size=8, head_dim=32, group=1, num_kv_heads=3, share_prefix=False),
], ids=["decode_g4", "decode_d128", "decode_generic", "chunks_g4_d64", "chunks_d128", "chunks_generic"])
@pytest.mark.parametrize("window,cap", [(1, None), (5, None), (16, 3.0), (17, None), (40, 3.0), (None, 3.0),
                                        (1000, None)])
def test_sliding_window_and_soft_cap_vs_numpy(case, window, cap):
    """Every path (decode rows, 16-token prompt chunks; blocks of 16 with heads of 64 or 128, and
    any sizes) with windows of one key, shorter and longer than a block and than the context, and
    a soft cap on scores large enough to feel it; the key blocks wholly before every query's window
    hold NaN, so reading one would show."""
    args, kw = case.build()
    q, k, v, bt, sl, qsl, ns = args
    q = q * 4  # scores of several units: the cap bends them
    k, v = np.array(k), np.array(v)
    bs = k.shape[2]
    for s in range(int(ns[0])):
        first_pos = int(sl[s]) - int(qsl[s + 1] - qsl[s])  # the earliest query of the sequence
        lo = max(0, first_pos - window + 1) if window else 0
        for b in range(lo // bs):
            k[:, int(bt[s, b])] = v[:, int(bt[s, b])] = np.nan
    run = jax.jit(lambda *a: cpu_kernels.paged_attention(*a, scale=kw["scale"], sliding_window=window,
                                                          logits_soft_cap=cap))
    out = np.asarray(run(q, jnp.asarray(k), jnp.asarray(v), bt, sl, qsl, ns))
    expected = np_ragged_window_cap(as_np(q), k, v, np.asarray(bt), np.asarray(sl), np.asarray(qsl), int(ns[0]),
                                    kw["scale"], window, cap)
    real = int(qsl[int(ns[0])])
    check(out[:real], expected[:real], jnp.float32)
    assert not out[real:].any()


def test_window_and_cap_must_be_positive():
    args, kw = decode_case([5]).build()
    for bad in (dict(sliding_window=0), dict(logits_soft_cap=0.0), dict(logits_soft_cap=-1.0)):
        with pytest.raises(ValueError):
            cpu_kernels.paged_attention(*args, scale=kw["scale"], **bad)


def test_more_query_tokens_than_context_is_an_error():
    args, kw = Case(seqs=[(8, 8), (1, 5)]).build()
    q, k, v, bt, sl, qsl, ns = args
    with pytest.raises(Exception, match="query tokens outside the batch or the context"):
        jax.block_until_ready(cpu_kernels.paged_attention(q, k, v, bt, sl.at[0].set(4), qsl, ns, scale=kw["scale"]))


def test_ragged_attention_with_the_kernel_for_decode_rows_vs_numpy():
    case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (2, 18), (1, 129)], block_size=8,
                max_seqs=9, extra_tokens=2)
    check_ragged_reference(case, decode_attention=cpu_kernels.paged_decode)


def test_used_for_float32_pages_only(forced_on):
    q = jnp.zeros((2, 4, 8), jnp.float32)
    pages = jnp.zeros((1, 4, 8, 8), jnp.float32)
    assert cpu_kernels.runs("paged_attention", q, pages)
    assert not cpu_kernels.runs("paged_attention", q.astype(jnp.bfloat16), pages.astype(jnp.bfloat16))
    assert not cpu_kernels.runs("paged_attention", q, pages.astype(jnp.int8), kv_scales=jnp.ones((1, 8, 128), jnp.uint32))


def test_a_block_id_outside_the_pool_is_an_error():
    args, kw = decode_case([20, 5]).build()
    q, k, v, bt, sl, qsl, ns = args
    bad = bt.at[0, 1].set(k.shape[1])
    with pytest.raises(Exception, match="block id out of the pool"):
        jax.block_until_ready(cpu_kernels.paged_decode(q, k, v, bad, sl, qsl, ns, scale=kw["scale"]))


def test_without_a_compiler_the_jnp_path_serves(monkeypatch):
    monkeypatch.setattr(library, "compiler", lambda: None)
    library.available.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert not cpu_kernels.runs("paged_attention", jnp.zeros((2, 4, 8)), jnp.zeros((1, 4, 8, 8)))
    finally:
        library.available.cache_clear()  # the next caller builds (or finds) it again


def test_greedy_matches_argmax_and_logsumexp_with_ties_nan_and_infinities():
    from jpaged.sample.sampler import argmax
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 1000)).astype(np.float32) * 4
    logits[1, [5, 600]] = 50.0  # a tie: the first index wins
    logits[2, 999] = 80.0  # the last index (and a tail shorter than the vector width: 1000 % 32)
    logits[3, 17] = np.nan
    logits[4] = -np.inf
    logits[5, 3] = np.inf
    logits[6, :10] = -np.inf  # masked tokens among finite ones
    tokens, lse = jax.jit(cpu_kernels.greedy)(jnp.asarray(logits))
    expected_tokens = np.asarray(argmax(jnp.asarray(logits)))
    expected_lse = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    tokens, lse = np.asarray(tokens), np.asarray(lse)
    assert tokens[3] == 999 and np.isnan(lse[3])  # a NaN row: the last index (XLA's max may skip a NaN)
    keep = [0, 1, 2, 4, 5, 6]
    np.testing.assert_array_equal(tokens[keep], expected_tokens[keep])
    assert list(tokens[1:3]) == [5, 999]
    np.testing.assert_allclose(lse[keep], expected_lse[keep], rtol=1e-6)  # +-inf where jnp has them


def test_greedy_sampling_through_the_kernel_equals_the_jnp_path(monkeypatch, forced_on):
    from jpaged.sample import sampler
    from jpaged.sample.sampling_batch import SamplingBatch
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((6, 300)).astype(np.float32))
    tensors = sampler.sampling_tensors(SamplingBatch(), 6)
    tensors.all_greedy, tensors.num_logprobs = True, 3
    with_kernel = jax.jit(sampler.sample)(logits, tensors)
    monkeypatch.setattr(library, "available", lambda: False)
    without = jax.jit(sampler.sample)(logits, tensors)
    for a, b in zip(with_kernel, without):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,k,n", [(1, 512, 768), (5, 7, 64), (6, 64, 130), (13, 100, 1000), (32, 300, 200),
                                   (2, 33, 5), (63, 200, 192), (4, 1001, 80), (32, 600, 1024), (20, 300, 2048),
                                   (26, 300, 16000), (32, 260, 16384)])
def test_matmul_vs_numpy(m, k, n):
    """Whole panels, a column tail, row blocks and their rest (up to 16 blocks sharing the next
    piece's prefetch), K across pieces; wide work items (N of 16,000: wide on up to ~30 threads),
    where the rows are spread over the blocks (26 rows: 6, 5, 5, 5, 5); rows 4 KiB apart (N a
    multiple of 1024) with enough blocks, where the first block copies each piece for the others;
    few rows with K split between work items (summed at the end), K not a multiple of the split."""
    rng = np.random.default_rng(m * n)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    out = np.asarray(jax.jit(cpu_kernels.matmul)(x, w))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("m,k,n", [(1, 576, 1000), (2, 7, 13), (5, 64, 6), (3, 100, 37), (64, 96, 130),
                                   (39, 70, 50), (8, 576, 4000), (4, 33, 9)])
def test_matmul_with_the_weight_transposed_vs_numpy(m, k, n):
    """``x @ w.T`` for ``w [N, K]``: blocks of 2 rows x 6 weight rows (with AVX-512 from 4 rows: 4 x
    4, summed across lanes at once) and their rest, K past the last whole vector."""
    rng = np.random.default_rng(m * n)
    x, w = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    out = np.asarray(jax.jit(cpu_kernels.matmul_t)(x, w))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    grads = jax.grad(lambda x, w: jnp.sum(jnp.sin(cpu_kernels.matmul_t(x, w))), argnums=(0, 1))(x, w)
    dense = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w.T)), argnums=(0, 1))(x, w)
    for a, b in zip(grads, dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)


def test_tied_logits_use_the_transposed_matmul(forced_on):
    """`layers.tied_or_head_logits` with a tied embedding: the C++ ``x @ table.T`` for float32 rows,
    the embedding's own ``attend`` otherwise; the same numbers."""
    from flax import nnx
    from jpaged.models import layers
    embed = nnx.Embed(300, 64, rngs=nnx.Rngs(0))
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32))
    hlo = jax.jit(lambda h: layers.tied_or_head_logits(embed, None, h)).lower(hidden).as_text()
    assert "jpaged_matmul_t" in hlo
    np.testing.assert_allclose(np.asarray(layers.tied_or_head_logits(embed, None, hidden)),
                               np.asarray(embed.attend(hidden)), rtol=1e-5, atol=1e-5)
    assert not cpu_kernels.runs("matmul_t", hidden.astype(jnp.bfloat16), embed.embedding[...].astype(jnp.bfloat16))


@pytest.mark.parametrize("rows", [11, 3])
def test_matmuls_of_several_weights_in_one_call(rows):
    """One call for several weights of different widths (whole panels, a column tail, one narrower
    than a panel): each output is its own x @ w, in the order given; with few rows each weight's
    rows split between work items by its width."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    ws = [rng.standard_normal((96, n)).astype(np.float32) for n in (256, 64, 130, 20)]
    hlo = jax.jit(cpu_kernels.matmuls).lower(x, ws).as_text()
    assert hlo.count("jpaged_matmul") == 1
    outs = jax.jit(cpu_kernels.matmuls)(x, ws)
    assert len(outs) == len(ws)
    for out, w in zip(outs, ws):
        np.testing.assert_allclose(np.asarray(out), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m,k,ns", [(1, 64, (64,)), (5, 100, (128, 64)), (7, 576, (576, 192, 192)),
                                    (32, 96, (256, 64)), (64, 33, (192,)), (40, 1536, (576,)),
                                    (16, 576, (576,)), (32, 576, (576, 192, 192)), (13, 96, (64, 64, 64))])
def test_packed_weights_give_the_same_sums(m, k, ns):
    """`matmuls_packed` on `pack_weight`'s copies ``[N / 64, K, 64]``: x @ w for each weight in one
    call, bit for bit the sums of `matmuls` where both run the panel loop (more rows than FewRows
    takes, which only AVX2 builds have: up to 6); also where an odd panel count on two workers has
    its last panel split by rows (9, 15 and 3 panels at 12 or more rows)."""
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
    ws = [jnp.asarray(rng.standard_normal((k, n)).astype(np.float32)) for n in ns]
    packed = [cpu_kernels.pack_weight(w) for w in ws]
    assert [p.shape for p in packed] == [(n // 64, k, 64) for n in ns]
    last = ns[0] // 64 - 1  # the last panel's row 3: columns 64 * last ... of the weight's row 3
    np.testing.assert_array_equal(np.asarray(packed[0][last, 3]), np.asarray(ws[0][3, 64 * last:]))
    assert jax.jit(cpu_kernels.matmuls_packed).lower(x, packed).as_text().count("jpaged_matmul_packed") == 1
    outs, plain = jax.jit(cpu_kernels.matmuls_packed)(x, packed), jax.jit(cpu_kernels.matmuls)(x, ws)
    for out, same, w in zip(outs, plain, ws):
        np.testing.assert_allclose(np.asarray(out), np.asarray(x, np.float64) @ np.asarray(w), rtol=1e-4, atol=1e-3)
        if m > 6:
            np.testing.assert_array_equal(np.asarray(out), np.asarray(same))


def test_pack_weight_needs_whole_panels():
    with pytest.raises(ValueError, match="100 columns are not a multiple of 64"):
        cpu_kernels.pack_weight(jnp.ones((8, 100), jnp.float32))


def test_linear_layers_use_the_matmul_for_few_rows_only(forced_on):
    """`layers.dot_general`: the C++ matmul for a decode step's rows, XLA's dot for a prompt's, and
    for anything that is not a float32 [M, K] @ [K, N]; the same numbers either way."""
    from jpaged.models import layers
    dense = jax.lax.dot_general
    dims = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 96)).astype(np.float32))
    for rows, custom in [(1, True), (cpu_kernels.MATMUL_ROWS, True), (cpu_kernels.MATMUL_ROWS + 1, False)]:
        x = jnp.asarray(rng.standard_normal((rows, 64)).astype(np.float32))
        hlo = jax.jit(lambda x, w: layers.dot_general(x, w, dims)).lower(x, w).as_text()
        assert ("jpaged_matmul" in hlo) == custom, rows
        np.testing.assert_allclose(np.asarray(layers.dot_general(x, w, dims)), np.asarray(dense(x, w, dims)),
                                   rtol=1e-5, atol=1e-5)
    half = jax.jit(lambda x, w: layers.dot_general(x, w, dims)).lower(jnp.ones((4, 64), jnp.bfloat16),
                                                                        w.astype(jnp.bfloat16)).as_text()
    assert "jpaged_matmul" not in half


def test_projections_of_one_input_share_one_call(forced_on):
    """`layers.project`: q, k and v (with biases) as one C++ call for a decode step's rows, as
    three XLA dots for a prompt's; layer by layer when one of them is not a plain `nnx.Linear`."""
    from flax import nnx
    from jpaged.models import layers
    rngs = nnx.Rngs(0)
    qkv = [layers.linear(64, n, True, jnp.float32, rngs) for n in (64, 32, 32)]
    for layer in qkv:
        layer.bias.set_value(jnp.asarray(np.random.default_rng(layer.bias.shape[0]).standard_normal(layer.bias.shape),
                                         jnp.float32))
    run = nnx.jit(lambda x, *ls: layers.project(x, *ls))
    for rows, calls in [(3, 1), (cpu_kernels.MATMUL_ROWS + 1, 0)]:
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32))
        hlo = jax.jit(lambda x: layers.project(x, *qkv)).lower(x).as_text()
        assert hlo.count("jpaged_matmul") == calls, rows
        for out, layer in zip(run(x, *qkv), qkv):
            np.testing.assert_allclose(np.asarray(out), np.asarray(x @ layer.kernel[...] + layer.bias[...]),
                                       rtol=1e-5, atol=1e-5)

    wide = [layers.linear(64, n, True, jnp.float32, rngs) for n in (64, 128)]
    for layer in wide:  # packed copies (`jpaged.runner.packed_weights`): the packed call, the same sums
        layer.packed_kernel = layers.PackedKernel(cpu_kernels.pack_weight(layer.kernel[...]))
    x = jnp.asarray(np.random.default_rng(7).standard_normal((7, 64)).astype(np.float32))
    assert jax.jit(lambda x: layers.project(x, *wide)).lower(x).as_text().count("jpaged_matmul_packed") == 1
    for out, layer in zip(run(x, *wide), wide):
        np.testing.assert_allclose(np.asarray(out), np.asarray(x @ layer.kernel[...] + layer.bias[...]),
                                   rtol=1e-5, atol=1e-5)

    class Scaled(nnx.Module):  # stands for a quantized layer the loader swapped in
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x):
            return 2 * self.inner(x)
    x = jnp.ones((2, 64), jnp.float32)
    mixed = layers.project(x, qkv[0], Scaled(qkv[1]))
    np.testing.assert_allclose(np.asarray(mixed[1]), 2 * np.asarray(qkv[1](x)), rtol=1e-6)
    assert jax.jit(lambda x: layers.project(x, qkv[0], Scaled(qkv[1]))).lower(x).as_text().count("jpaged_matmul") == 2


@pytest.mark.parametrize("t,k,r,ns,g", [(1, 64, 16, (64,), 5), (7, 96, 8, (130, 20), 3), (33, 100, 5, (64, 48, 48), 4),
                                         (300, 64, 64, (200,), 17)])
def test_lora_deltas_vs_numpy(t, k, r, ns, g):
    """Each token through its own slot's factors (blocks of 4 tokens of a slot and their rest, a rank
    and widths past whole panels), zero rows for slot 0 and for a slot outside the stacks; several
    projections of one input in one call, the same numbers as `models.lora.dense_delta`."""
    from jpaged.models.lora import dense_delta
    rng = np.random.default_rng(t * r)
    x = rng.standard_normal((t, k)).astype(np.float32)
    slots = rng.integers(0, g, t).astype(np.int32)
    slots[0] = g + 3  # outside the stacks: no adapter
    factors = [(rng.standard_normal((g, k, r)).astype(np.float32), rng.standard_normal((g, r, n)).astype(np.float32))
               for n in ns]
    assert jax.jit(cpu_kernels.lora).lower(x, slots, factors).as_text().count("jpaged_lora") == 1
    outs = jax.jit(cpu_kernels.lora)(x, slots, factors)
    own = np.where((slots > 0) & (slots < g), slots, 0)
    for out, (a, b) in zip(outs, factors):
        want = np.einsum("tr,tro->to", np.einsum("ti,tir->tr", x.astype(np.float64), a[own]), b[own])
        want[own == 0] = 0
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4 * np.sqrt(k * r))
        a0, b0 = a.copy(), b.copy()
        a0[0], b0[0] = 0, 0  # the engine's slot 0 holds zeros
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_delta(x, a0, b0, jnp.asarray(own))),
                                   rtol=1e-4, atol=1e-3)


def test_lora_stack_uses_the_kernel_for_float32_only():
    """`models.lora.LoRAStack.add` on the CPU: q, k and v's deltas in one C++ call for float32, the
    XLA dense form for bfloat16 (and for ranks above the kernel's); the same numbers as the XLA form."""
    from jpaged.models import lora
    rng = np.random.default_rng(1)
    dims = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32)}
    for dtype, calls in [(jnp.float32, 1), (jnp.bfloat16, 0)]:
        stack = lora.LoRAStack(dims, 4, 8, dtype, delta="dense")
        for projection in stack.projections.values():
            for factor in (projection.a, projection.b):
                value = rng.standard_normal(factor.shape).astype(np.float32)
                value[0] = 0
                factor.set_value(jnp.asarray(value, dtype))
        x = jnp.asarray(rng.standard_normal((12, 64)), dtype)
        slots = jnp.asarray(np.arange(12) % 4, jnp.int32)
        inputs = lora.LoRAInputs(slots, jnp.argsort(slots, stable=True), jnp.argsort(jnp.argsort(slots, stable=True)),
                                 jnp.bincount(slots, length=4))
        ys = tuple(jnp.zeros((12, n), dtype) for _, n in dims.values())
        names = tuple(dims)
        hlo = jax.jit(lambda x, ys: stack.add(names, x, ys, inputs)).lower(x, ys).as_text()
        assert hlo.count("jpaged_lora") == calls, dtype
        if dtype == jnp.float32:
            for name, out in zip(names, stack.add(names, x, ys, inputs)):
                p = stack.projections[name]
                np.testing.assert_allclose(np.asarray(out), np.asarray(lora.dense_delta(x, p.a[...], p.b[...], slots)),
                                           rtol=1e-5, atol=1e-5)
    x = jnp.zeros((3, 64), jnp.float32)
    assert cpu_kernels.runs("lora", x, jnp.zeros((2, 64, 512)), jnp.zeros((2, 512, 8)))
    assert not cpu_kernels.runs("lora", x, jnp.zeros((2, 64, 513)), jnp.zeros((2, 513, 8)))  # above kMaxRank


def test_matmul_is_differentiable():
    """`nnx.grad` through a few-row linear layer (training code) gets XLA's gradients."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((40, 70)).astype(np.float32))
    loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))  # noqa: E731
    ours = jax.grad(loss(cpu_kernels.matmul), argnums=(0, 1))(x, w)
    dense = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    w2 = jnp.asarray(rng.standard_normal((40, 30)).astype(np.float32))
    def two_weights(matmuls):
        def f(x, w, w2):
            y, y2 = matmuls(x, (w, w2))
            return jnp.sum(jnp.sin(y)) + jnp.sum(jnp.cos(y2))
        return jax.grad(f, argnums=(0, 1, 2))(x, w, w2)
    dense = two_weights(lambda x, ws: tuple(x @ w for w in ws))
    for a, b in zip(two_weights(cpu_kernels.matmuls), dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def jpaged_log(caplog):
    """caplog records the engine's INFO lines (its logger does not propagate once
    `jpaged.logger` configured it)."""
    jpaged_logger = logging.getLogger("jpaged")
    handler = None if jpaged_logger.propagate else caplog.handler
    if handler is not None:
        jpaged_logger.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="jpaged"):
            yield
    finally:
        if handler is not None:
            jpaged_logger.removeHandler(handler)


def test_the_measured_choice_is_kept_beside_the_library_and_reused(fresh_choices, monkeypatch, caplog):
    """A weight shape's row classes above one row are measured together at first use, kept in the
    file, logged in one line, and then read back (a second process, here a cleared cache) without
    measuring again; one row is measured on its own when first needed. (A quiet machine assumed:
    disturbed measurements are `test_a_disturbed_measurement_is_provisional_until_a_quiet_one`'s.)"""
    import json
    monkeypatch.setattr(measure, "busy", lambda: "")
    monkeypatch.setattr(measure, "SPREAD", float("inf"))
    with jpaged_log(caplog):
        first = measure.matmul(64, (96, 32), 5)
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert sorted(saved) == sorted(f"matmul [64] x [96+32] rows<={b}" for b in measure.MATMUL_ROWS[1:])
    assert all(e["cpp_ms"] > 0 and e["xla_ms"] > 0 and e["cpp"] == (e["cpp_ms"] <= measure.MARGIN * e["xla_ms"])
               for e in saved.values())
    assert saved["matmul [64] x [96+32] rows<=8"]["cpp"] == first
    lines = [r.getMessage() for r in caplog.records if "matmul [64] x [96+32]" in r.getMessage()]
    assert len(lines) == 1 and "rows<=8" in lines[0] and "measured in" in lines[0]

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")
    time_runs = measure.time_runs
    monkeypatch.setattr(measure, "time_runs", no_timing)
    measure._choices.clear()
    measure._loaded.clear()
    measure._measured.clear()
    assert measure.matmul(64, (96, 32), 20) == saved["matmul [64] x [96+32] rows<=32"]["cpp"]
    monkeypatch.setattr(measure, "time_runs", time_runs)
    measure.matmul(64, (96, 32), 1)
    assert "matmul [64] x [96+32] rows<=1" in json.loads(fresh_choices.read_text())[measure.context()]


def new_start():
    """What a new process sees: the choices file only."""
    for state in (measure._choices, measure._loaded, measure._logged, measure._measured):
        state.clear()


def injected(monkeypatch, *runs_per_class):
    """Every later measurement times its (C++, XLA) pair of each row class as given (milliseconds per
    repeat), in order; returns the number of measurements taken."""
    taken = []

    def time_runs(steps, args, evict=()):
        taken.append(1)
        pairs = runs_per_class[min(len(taken), len(runs_per_class)) - 1]
        return [[ms / 1e3 for ms in runs] for pair in pairs for runs in pair]
    monkeypatch.setattr(measure, "time_runs", time_runs)
    return taken


CLASSES = measure.MATMUL_ROWS[1:]  # the row classes measured together
MATMUL_KEYS = [f"matmul [64] x [96+32] rows<={b}" for b in CLASSES]
NOISY = [((1.0, 2.0, 1.9), (1.5, 1.6, 3.0))] * len(CLASSES)  # C++ looks faster by its one lucky repeat
QUIET = [((2.0, 2.04, 2.02), (1.5, 1.52, 1.51))] * len(CLASSES)  # XLA is faster


def test_packed_copies_are_measured_as_they_run(fresh_choices, monkeypatch):
    """``runs("matmul_packed", x, *weights)`` times the packed kernel on packed copies against XLA's
    dots on the weights, under a group of its own beside the plain matmul's; ``runs("matmul_t_packed",
    x, table)`` the packed kernel on a copy of ``table.T`` against XLA's ``x @ table.T``."""
    import json
    monkeypatch.setattr(measure, "busy", lambda: "")
    monkeypatch.setattr(measure, "SPREAD", float("inf"))
    timed = []
    time_runs = measure.time_runs
    monkeypatch.setattr(measure, "time_runs", lambda steps, args, evict=(): timed.append(
        [tuple(args[j].shape) for j in evict]) or time_runs(steps, args, evict))
    x, w = jnp.ones((20, 64), jnp.float32), jnp.ones((64, 128), jnp.float32)
    jax.jit(lambda x, w: cpu_kernels.runs("matmul_packed", x, w) and x).lower(x, w)  # measured while traced
    assert timed == [[(64, 128), (2, 64, 64)]]  # the weight and its packed copy, both evicted
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert sorted(saved) == sorted(f"matmul packed [64] x [128] rows<={b}" for b in measure.MATMUL_ROWS[1:])
    # a tied embedding's table [N, K]: the packed copy of its transpose against XLA's x @ table.T
    steps = []
    monkeypatch.setattr(measure, "time_runs", lambda s, args, evict=(): steps.append(s) or timed.append(
        [tuple(args[j].shape) for j in evict]) or time_runs(s, args, evict))
    table = jnp.ones((128, 64), jnp.float32)
    jax.jit(lambda x, t: cpu_kernels.runs("matmul_t_packed", x, t) and x).lower(x, table)
    assert timed[-1] == [(128, 64), (2, 64, 64)]
    rng = np.random.default_rng(0)
    t = rng.standard_normal((128, 64)).astype(np.float32)
    xs = [rng.standard_normal((b, 64)).astype(np.float32) for b in measure.MATMUL_ROWS[1:]]
    args = [t, cpu_kernels.pack_weight(t.T), *xs]
    for timed_step in steps[0][:2]:  # the C++ kernel's and XLA's steps of the first row class
        np.testing.assert_allclose(np.asarray(timed_step[0](*args)[0]), xs[0] @ t.T, rtol=1e-4, atol=1e-4)
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert {f"matmul_t packed [64] x [128, 64]^T rows<={b}" for b in measure.MATMUL_ROWS[1:]} <= set(saved)


def test_a_disturbed_measurement_is_provisional_until_a_quiet_one(fresh_choices, monkeypatch, caplog):
    """Repeats that disagree without a clear margin give a provisional choice: it serves this process,
    says so in its log line and is measured again at the next start, where the quiet measurement's
    choice is kept for good (no third measurement)."""
    import json
    monkeypatch.setattr(measure, "load_average", lambda: 0.0)
    taken = injected(monkeypatch, NOISY, QUIET)
    with jpaged_log(caplog):
        assert measure.matmul(64, (96, 32), 20) is True  # the noisy choice serves this process
        assert measure.matmul(64, (96, 32), 40) is True and len(taken) == 1
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert all(saved[k]["provisional"] and saved[k]["why"] == "repeats 100% apart" for k in MATMUL_KEYS)
    line = next(r.getMessage() for r in caplog.records if "matmul [64] x [96+32]" in r.getMessage())
    assert "provisional (repeats 100% apart; measured again at the next start)" in line

    new_start()
    assert measure.matmul(64, (96, 32), 20) is False and len(taken) == 2
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert all(saved[k] == {"cpp": False, "cpp_ms": 2.0, "xla_ms": 1.5} for k in MATMUL_KEYS), saved
    new_start()
    assert measure.matmul(64, (96, 32), 20) is False and len(taken) == 2  # decided: not measured again


def scaled(cpp_ms, xla_ms):
    """Agreeing repeats of each path per row class, at the given least times (ms)."""
    return [((c, c * 1.01, c * 1.02), (x, x * 1.01, x * 1.02)) for c, x in zip(cpp_ms, xla_ms)]


# C++ wins every class by ~25% on a quiet machine (times grow with the rows).
QUIET_CPP, QUIET_XLA = (0.1, 0.3, 0.6, 1.2, 2.4), (0.14, 0.4, 0.8, 1.6, 3.2)


@pytest.mark.parametrize("cpp_ms, why", [
    # other work slowed every C++ repeat of rows<=128 alike: 4x, more than at 256 rows
    ((0.1, 0.3, 0.6, 4.8, 2.4), "C++ slower than at rows<=256"),
    # ... or slowed C++ at rows<=32 by 1.7x, which flips the choice between two classes that chose C++
    ((0.1, 0.51, 0.6, 1.2, 2.4), "XLA chosen between classes that chose C++"),
])
def test_a_class_out_of_line_with_its_neighbours_is_provisional(fresh_choices, monkeypatch, cpp_ms, why):
    """Repeats that agree on a quiet machine can still all be slowed alike; a row class measured out
    of line with the classes beside it (a path slower than at more rows, or a choice unlike both its
    neighbours' that agree) is provisional, and the next start's quiet measurement decides it."""
    import json
    monkeypatch.setattr(measure, "load_average", lambda: 0.0)
    disturbed = scaled(cpp_ms, QUIET_XLA)
    odd = next(i for i, (a, b) in enumerate(zip(cpp_ms, QUIET_CPP)) if a != b)
    taken = injected(monkeypatch, disturbed, scaled(QUIET_CPP, QUIET_XLA))
    assert measure.out_of_line(dict(zip(MATMUL_KEYS, disturbed))) == {MATMUL_KEYS[odd]: why}
    measure.matmul(64, (96, 32), CLASSES[odd])
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert saved[MATMUL_KEYS[odd]]["provisional"] and saved[MATMUL_KEYS[odd]]["why"] == why
    assert not any(saved[k].get("provisional") for k in MATMUL_KEYS if k != MATMUL_KEYS[odd])

    new_start()  # the next process to need that class measures again
    measure.matmul(64, (96, 32), CLASSES[odd])
    saved = json.loads(fresh_choices.read_text())[measure.context()]
    assert len(taken) == 2 and saved[MATMUL_KEYS[odd]] == {"cpp": True, "cpp_ms": QUIET_CPP[odd],
                                                           "xla_ms": QUIET_XLA[odd]}
    assert measure.out_of_line(dict(zip(MATMUL_KEYS, scaled(QUIET_CPP, QUIET_XLA)))) == {}
    # a crossover (C++ below, XLA above some rows) is in line
    assert measure.out_of_line(dict(zip(MATMUL_KEYS, scaled(QUIET_CPP, (0.14, 0.4, 0.6, 1.1, 2.2))))) == {}


def test_a_busy_machine_decides_only_after_repeated_measurements(fresh_choices, monkeypatch):
    """On a busy machine (load above the cores) even agreeing repeats are provisional; a later quiet
    start still replaces them, and a machine busy at every start decides on the least times of
    `measure.MAX_MEASUREMENTS` measurements. A noisy but clear margin decides at once."""
    import json
    monkeypatch.setattr(measure, "load_average", lambda: 3.0 * measure.usable_cores())
    busy_cpp = [((1.0, 1.01, 1.0), (1.5, 1.5, 1.52))] * len(CLASSES)
    busy_xla = [((2.4, 2.4, 2.5), (1.2, 1.21, 1.2))] * len(CLASSES)
    taken = injected(monkeypatch, busy_cpp, busy_xla, busy_cpp, QUIET)
    for start in range(measure.MAX_MEASUREMENTS):
        new_start()
        measure.matmul(64, (96, 32), 20)
        entry = json.loads(fresh_choices.read_text())[measure.context()][MATMUL_KEYS[1]]
        assert entry["measurements"] == start + 1
        assert entry.get("provisional", False) == (start + 1 < measure.MAX_MEASUREMENTS)
    assert entry["cpp_ms"] == 1.0 and entry["xla_ms"] == 1.2 and entry["cpp"] is True
    new_start()
    measure.matmul(64, (96, 32), 20)
    assert len(taken) == measure.MAX_MEASUREMENTS  # decided for good

    assert measure.disturbed([1.0, 1.6], [2.0, 2.5]) == ""  # every C++ run beats every XLA run
    assert measure.disturbed([1.0, 1.6], [1.5, 2.5]) == "repeats 67% apart"
    assert measure.disturbed([1.0, 1.01], [1.5, 1.5], why_suspect="load 7.0 on 2 cores") == "load 7.0 on 2 cores"


def test_runs_follows_the_choice_and_the_environment_overrides_it(fresh_choices, monkeypatch):
    """`runs` serves a call with the C++ kernel where its class chose it, XLA where not;
    ``JPAGED_CPU_KERNELS=1`` forces the kernel wherever it can serve."""
    x, w = jnp.zeros((3, 64)), jnp.zeros((64, 48))
    logits, q, pages = jnp.zeros((4, 300)), jnp.zeros((2, 4, 8)), jnp.zeros((1, 4, 8, 8))
    for choice in (True, False):
        entry = {"cpp": choice, "cpp_ms": 1.0, "xla_ms": 1.0}
        measure._entries().update({"matmul [64] x [48] rows<=8": entry, "greedy [300] rows<=16": entry,
                                   "paged_attention heads 4/1 x 8, blocks of 8": entry,
                                   "matmul_t [64] x [48, 64]^T rows<=8": entry,
                                   "matmul_t packed [64] x [48, 64]^T rows<=8": entry})
        assert cpu_kernels.runs("matmul", x, w) == choice
        assert cpu_kernels.runs("matmul_t", x, w.T) == choice
        assert cpu_kernels.runs("matmul_t_packed", x, w.T) == choice
        assert cpu_kernels.runs("greedy", logits) == choice
        assert cpu_kernels.runs("paged_attention", q, pages) == choice
        monkeypatch.setenv("JPAGED_CPU_KERNELS", "1")
        assert cpu_kernels.runs("matmul", x, w) and cpu_kernels.runs("greedy", logits)
        monkeypatch.delenv("JPAGED_CPU_KERNELS")
    assert not cpu_kernels.runs("matmul", jnp.zeros((cpu_kernels.MATMUL_ROWS + 1, 64)), w)


def test_a_failed_measurement_keeps_xla_in_this_process_only(fresh_choices, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no")
    monkeypatch.setattr(measure, "time_runs", broken)
    assert not measure.greedy(100, 3)
    assert not measure._entries()["greedy [100] rows<=16"]["cpp"]
    assert not fresh_choices.exists()  # a later process measures again


def test_probes_time_each_step_of_one_program():
    """`measure.time_steps`: every step's own time, in order (a matmul with more rows takes longer
    than one with fewer: the order of the durations, not their size, is checked)."""
    w = np.ones((256, 2048), np.float32)
    small, big = np.ones((1, 256), np.float32), np.ones((64, 256), np.float32)
    seconds = measure.time_steps([(lambda w, s, b: s @ w, 1), (lambda w, s, b: b @ w @ w.T @ w, 2)],
                                 [w, small, big], evict=(0,))
    assert len(seconds) == 2 and 0 < seconds[0] < seconds[1] < 1
