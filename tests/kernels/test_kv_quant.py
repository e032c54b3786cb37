"""8-bit KV cache (``kv_cache_dtype="int8" | "fp8"``): quantization, attention on every backend,
export of the quantized kernels, and the engine end to end (prefix caching, swap, forks, TP=2).

Layers, as in ``test_kernels.py``: ``quant.quantize`` is checked against its error bound; the jnp
reference with 8-bit pages against float attention (and exactly against the reference on the
dequantized pages); the Pallas kernels, interpreted, against the reference on the same 8-bit pages.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from conftest import COMMON, _save, random_prompts
from jpaged import LLM, SamplingParams
from jpaged.config import CacheConfig, check_kv_cache_dtype
from jpaged.config_resolution import engine_config
from jpaged import testing

QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
_PLATFORM = jax.default_backend()
INTERPRET = os.environ.get("PALLAS_INTERPRET", "0" if _PLATFORM in ("tpu", "gpu") else "1") == "1"
KERNEL_BACKENDS = ["tpu", "gpu"] if INTERPRET else ["tpu" if _PLATFORM == "tpu" else "gpu"]
# Kernels vs reference on the same 8-bit pages: they differ only in summation order (float32
# queries) or in bfloat16 rounding of queries/weights (bfloat16 queries), as in test_kernels.py.
KERNEL_TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _bits(x):
    return np.asarray(x).view(np.uint8)


# ---------------------------------------------------------------------------
# Quantization.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", QDTYPES)
def test_quantize_round_trip_error_bound(name):
    rng = np.random.default_rng(0)
    # Rows of very different magnitudes (bfloat16 scales keep float32's range), one zero row.
    mags = np.array([1e-6, 1e-3, 1.0, 30.0, 1e4])[:, None, None]
    x = (rng.standard_normal((5, 3, 64)) * mags).astype(np.float32)
    x[0, 0] = 0.0
    values, scales = pk.quantize(jnp.asarray(x), QDTYPES[name])
    assert values.dtype == QDTYPES[name] and values.shape == x.shape
    assert scales.dtype == pk.SCALE_DTYPE and scales.shape == x.shape[:-1]
    back = _f32(pk.dequantize(values, scales))
    s = _f32(scales)[..., None]
    amax = np.abs(x).max(-1, keepdims=True)
    np.testing.assert_allclose(s, amax / (127 if name == "int8" else 448), rtol=2**-8)
    err = np.abs(back - x)
    if name == "int8":  # half a step of the (rounded) scale per value
        bound = 0.5 * s * (1 + 1e-3)
    else:  # e4m3: 3 mantissa bits -> relative 2^-4, subnormals (step 2^-9 * scale) below 2^-6 * scale
        bound = 2**-4 * np.abs(x) + 2**-10 * s + 1e-30
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.all(back[0, 0] == 0) and float(_f32(scales)[0, 0]) == 0.0
    # Each row's largest value survives to within the scale's rounding (no clipping loss).
    np.testing.assert_allclose(np.abs(back).max(-1), amax[..., 0], rtol=2**-7)


def test_kv_bytes_per_token_meet_the_targets():
    """head_dim 64: 8-bit values + a 2-byte scale per (token, head) = 66 bytes vs 256 (f32), 128 (bf16);
    a float32 scale (68 bytes) would miss 3.8x."""
    d = 64
    row = pk.quant.bytes_per_row(d, jnp.int8)
    assert row == pk.quant.bytes_per_row(d, jnp.float8_e4m3fn) == 66
    assert pk.quant.bytes_per_row(d, jnp.float32) == 256 and pk.quant.bytes_per_row(d, jnp.bfloat16) == 128
    assert 256 / row >= 3.8 and 128 / row >= 1.9
    assert 256 / (d + 4) < 3.8


# ---------------------------------------------------------------------------
# Attention with 8-bit pages.
# ---------------------------------------------------------------------------


def _case(name, q_dtype=jnp.float32, seed=0, kvh=2, group=2, d=64, bs=8, num_blocks=32):
    """Float pages, the same pages written through 8-bit ``write_kv``, and a ragged batch."""
    rng = np.random.default_rng(seed)
    lens = np.array([37, 1, 20, 9, 0], np.int32)       # context per sequence (incl. new)
    q_lens = np.array([5, 1, 20, 1, 0], np.int32)      # prefill continuation, decode, prompt, decode
    max_blocks = 6
    tables = rng.permutation(num_blocks)[:5 * max_blocks].reshape(5, max_blocks).astype(np.int32)
    num_tokens = 32
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    qsl = np.minimum(qsl, qsl[4])
    k = rng.standard_normal((kvh, num_blocks, bs, d)).astype(np.float32)
    v = rng.standard_normal((kvh, num_blocks, bs, d)).astype(np.float32)
    k *= rng.uniform(0.5, 4.0, (kvh, num_blocks, bs, 1)).astype(np.float32)  # per-token magnitudes
    q = rng.standard_normal((num_tokens, kvh * group, d)).astype(np.float32)
    # Quantize the whole float pool through write_kv (every slot once).
    pools = _zero_pool(QDTYPES[name], kvh, num_blocks, bs, d)
    rows = lambda x: jnp.asarray(x.reshape(kvh, -1, d).swapaxes(0, 1))  # noqa: E731  [slots, kvh, d]
    slots = jnp.arange(num_blocks * bs, dtype=jnp.int32)
    kq, vq, words = pk.write_kv_reference(pools[0], pools[1], rows(k), rows(v), slots,
                                          kv_scales=pools[2])
    args = dict(block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens),
                query_start_loc=jnp.asarray(qsl), num_seqs=jnp.array([4], jnp.int32))
    return (jnp.asarray(q, q_dtype), (jnp.asarray(k), jnp.asarray(v)), (kq, vq, words), args)


def _zero_pool(dtype, kvh, num_blocks, bs, d):
    return tuple(jnp.zeros(shape, dt) for shape, dt in pk.pool.layer_arrays(kvh, num_blocks, bs, d, dtype))


def _slot_scales(words, block_size):
    """The float32 ``(k_scales, v_scales)`` ``[kvh, blocks, block_size]`` of scale words."""
    return pk.unpack_scales(pk.quant.block_words(words, block_size))


def _dequantized(pages, words, which):
    scales = _slot_scales(words, pages.shape[2])[which][:, :pages.shape[1]]
    return pk.dequantize(pages, scales)


def _ragged_ref(q, k, v, args, **kw):
    return pk.ragged_paged_attention_reference(q, k, v, args["block_tables"], args["seq_lens"],
                                               args["query_start_loc"], args["num_seqs"], scale=0.125, **kw)


# Outputs are ~0.57 in mean magnitude: int8 errs ~1% on average, fp8 (3 mantissa bits) ~4%.
@pytest.mark.slow
@pytest.mark.parametrize("name,max_err,mean_err", [("int8", 0.08, 0.01), ("fp8", 0.3, 0.04)])
def test_reference_8bit_vs_float_attention(name, max_err, mean_err):
    q, (k, v), (kq, vq, words), args = _case(name)
    out_8bit = _f32(_ragged_ref(q, kq, vq, args, kv_scales=words))
    out_float = _f32(_ragged_ref(q, k, v, args))
    err = np.abs(out_8bit - out_float)[:27]  # the real tokens
    assert err.max() < max_err and err.mean() < mean_err, (err.max(), err.mean())
    assert err.max() > 0  # the 8-bit path is really taken
    # Exactly attention over the dequantized pages: the reference dequantizes before its math.
    deq = _f32(_ragged_ref(q, _dequantized(kq, words, 0), _dequantized(vq, words, 1), args))
    np.testing.assert_allclose(out_8bit, deq, atol=1e-6, rtol=1e-6)
    # Decode entry point: same rows.
    dec = _f32(pk.paged_attention_reference(q[:5], kq, vq, args["block_tables"], args["seq_lens"],
                                            scale=0.125, kv_scales=words))
    full = _f32(_ragged_ref(q[:5], kq, vq, dict(args, query_start_loc=jnp.arange(6, dtype=jnp.int32),
                                                 num_seqs=jnp.array([5], jnp.int32)), kv_scales=words))
    np.testing.assert_allclose(dec, full, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", QDTYPES)
def test_kernels_vs_reference_on_8bit_pages(name, q_dtype, backend):
    q, _, (kq, vq, words), args = _case(name, q_dtype, seed=1)
    scales = dict(kv_scales=words)
    expected = _f32(_ragged_ref(q, kq, vq, args, **scales))
    got = pk.ragged_paged_attention(q, kq, vq, args["block_tables"], args["seq_lens"], args["query_start_loc"],
                                    args["num_seqs"], scale=0.125, pages_per_compute_block=2,
                                    backend=backend, interpret=INTERPRET, **scales)
    np.testing.assert_allclose(_f32(got), expected, **KERNEL_TOL[q_dtype])
    # Decode kernel: one query per sequence, sequences of every length (incl. 0).
    qd = q[:5]
    expected = _f32(pk.paged_attention_reference(qd, kq, vq, args["block_tables"], args["seq_lens"],
                                                 scale=0.125, **scales))
    got = pk.paged_attention(qd, kq, vq, args["block_tables"], args["seq_lens"], scale=0.125,
                             pages_per_compute_block=2, backend=backend, interpret=INTERPRET, **scales)
    np.testing.assert_allclose(_f32(got), expected, **KERNEL_TOL[q_dtype])
    # With a sliding window and a soft cap: scale words of pages that start mid-row.
    knobs = dict(sliding_window=11, logits_soft_cap=3.0)
    expected = _f32(_ragged_ref(q, kq, vq, args, **scales, **knobs))
    got = pk.ragged_paged_attention(q, kq, vq, args["block_tables"], args["seq_lens"], args["query_start_loc"],
                                    args["num_seqs"], scale=0.125, pages_per_compute_block=3,
                                    backend=backend, interpret=INTERPRET, **scales, **knobs)
    np.testing.assert_allclose(_f32(got), expected, **KERNEL_TOL[q_dtype])


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", QDTYPES)
def test_write_and_copy_kernels_on_8bit_pools(name, backend):
    rng = np.random.default_rng(2)
    kvh, nb, bs, d = 2, 40, 8, 64
    qdt = QDTYPES[name]
    k_pages, v_pages, words = _zero_pool(qdt, kvh, nb, bs, d)
    k_pages = v_pages = jnp.asarray(rng.integers(-100, 100, k_pages.shape), jnp.float32).astype(qdt)
    scales = jnp.asarray(rng.uniform(0, 1, (2,) + words.shape), pk.SCALE_DTYPE)
    pools = (k_pages, v_pages, pk.pack_scales(scales[0], scales[1]))
    new = [jnp.asarray(rng.standard_normal((40, kvh, d)) * 3, jnp.bfloat16) for _ in range(2)]
    # Random slots, a prefill run across a 128-slot scale row, padding.
    slots = jnp.asarray(np.r_[rng.permutation(nb * bs)[:18], np.arange(120, 140), -1, -5], jnp.int32)
    want = pk.write_kv_reference(*pools[:2], *new, slots, kv_scales=pools[2])
    got = pk.write_kv(*pools[:2], *new, slots, backend=backend, interpret=INTERPRET, kv_scales=pools[2])
    assert len(got) == 3
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))
    # The written rows dequantize to the new K within int8/fp8 precision.
    block, off = int(slots[0]) // bs, int(slots[0]) % bs
    k_scale = _slot_scales(got[2], bs)[0][:, block, off]
    np.testing.assert_allclose(_f32(got[0][:, block, off]) * _f32(k_scale)[:, None],
                               _f32(new[0][0]), atol=0.08 * float(jnp.max(jnp.abs(new[0][0]))))
    # Copies within one 128-slot scale row (blocks 1 -> 6) and across rows (17 -> 2, 33 -> 30).
    src, dst = jnp.array([1, 17, -1, 4, 33], jnp.int32), jnp.array([6, 2, 8, -1, 30], jnp.int32)
    want = pk.copy_blocks_reference(*got[:2], src, dst, kv_scales=got[2])
    copied = pk.copy_blocks(*got[:2], src, dst, backend=backend, interpret=INTERPRET, kv_scales=got[2])
    for a, b in zip(copied, want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    before, after = (pk.quant.block_words(x[2], bs) for x in (got, copied))
    np.testing.assert_array_equal(np.asarray(after[:, 6]), np.asarray(before[:, 1]))  # scales moved
    np.testing.assert_array_equal(np.asarray(after[:, 7]), np.asarray(before[:, 7]))  # neighbours kept


def test_scales_and_page_dtypes_must_match():
    f32 = jnp.zeros((2, 4, 8, 16), jnp.float32)
    i8 = jnp.zeros((2, 4, 8, 16), jnp.int8)
    words = jnp.zeros(pk.quant.scales_shape(2, 4, 8), jnp.uint32)
    new = jnp.zeros((3, 2, 16), jnp.float32)
    slots = jnp.arange(3, dtype=jnp.int32)
    assert len(pk.write_kv(f32, f32, new, new, slots)) == 2  # auto: unchanged
    with pytest.raises(ValueError, match="need kv_scales"):
        pk.write_kv(i8, i8, new, new, slots)
    with pytest.raises(ValueError, match="kv_scales are for int8"):
        pk.write_kv(f32, f32, new, new, slots, kv_scales=words)
    with pytest.raises(ValueError, match="scales_shape"):
        pk.copy_blocks(i8, i8, slots, slots, kv_scales=words[:, :2])
    with pytest.raises(ValueError, match="block_size that divides 128"):
        pk.pool.layer_arrays(2, 4, 24, 16, jnp.int8)


def test_scale_words_round_trip():
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((5, 7)) * 10.0 ** rng.integers(-20, 20, (5, 7)), pk.SCALE_DTYPE)
            for _ in range(2))
    k_back, v_back = pk.unpack_scales(pk.pack_scales(k, v))
    np.testing.assert_array_equal(_f32(k_back), _f32(k))
    np.testing.assert_array_equal(_f32(v_back), _f32(v))


# ---------------------------------------------------------------------------
# Export: the quantized kernels lower for TPU and CUDA.
# ---------------------------------------------------------------------------

CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
FALLBACK_OPS = ("stablehlo.gather", "stablehlo.scatter", "stablehlo.while")


def _export_calls(qdt, q_dtype=jnp.bfloat16, kvh=2, group=4, d=128, bs=16, nb=64):
    s, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = s((kvh, nb, bs, d), qdt)
    words = s(pk.quant.scales_shape(kvh, nb, bs), jnp.uint32)
    tables, lens = s((6, 12), i32), s((6,), i32)
    return {
        "paged_attention": (lambda q, kp, vp, w, t, n: pk.paged_attention(
            q, kp, vp, t, n, kv_scales=w, scale=0.1),
            (s((6, kvh * group, d), q_dtype), pages, pages, words, tables, lens), {}),
        "ragged_paged_attention": (lambda q, kp, vp, w, t, n, qsl, ns: pk.ragged_paged_attention(
            q, kp, vp, t, n, qsl, ns, kv_scales=w, scale=0.1),
            (s((40, kvh * group, d), q_dtype), pages, pages, words, tables, lens, s((7,), i32), s((1,), i32)), {}),
        "write_kv": (lambda kp, vp, w, kn, vn, slots: pk.write_kv(kp, vp, kn, vn, slots, kv_scales=w),
                     (pages, pages, words, s((40, kvh, d), q_dtype), s((40, kvh, d), q_dtype), s((40,), i32)),
                     dict(donate_argnums=(0, 1, 2))),
        "copy_blocks": (lambda kp, vp, w, a, b: pk.copy_blocks(kp, vp, a, b, kv_scales=w),
                        (pages, pages, words, s((5,), i32), s((5,), i32)), dict(donate_argnums=(0, 1, 2))),
    }


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("name", QDTYPES)
@pytest.mark.parametrize("op", ["paged_attention", "ragged_paged_attention", "write_kv", "copy_blocks"])
def test_quantized_kernels_export(op, name, platform):
    fn, args, jit_kw = _export_calls(QDTYPES[name])[op]
    text = jax.export.export(jax.jit(fn, **jit_kw), platforms=[platform],
                             disabled_checks=pk.EXPORT_DISABLED_CHECKS)(*args).mlir_module()
    assert CUSTOM_CALL[platform] in text
    for bad in FALLBACK_OPS:
        assert bad not in text, f"{op} ({name}) on {platform} fell back to XLA ({bad})"
    if op in ("write_kv", "copy_blocks"):  # pages and scale words all alias their outputs
        assert text.count("tf.aliasing_output") == 3


# ---------------------------------------------------------------------------
# Settings.
# ---------------------------------------------------------------------------


def test_kv_cache_dtype_validation():
    with pytest.raises(ValueError, match="CacheConfig.kv_cache_dtype='int4'"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype.*TPU"):
        check_kv_cache_dtype("fp8", "pallas", "tpu")
    with pytest.raises(ValueError, match="kv_cache_dtype.*compute capability >= 8.9"):
        check_kv_cache_dtype("fp8", "pallas", "gpu", "8.0")
    for ok in [("fp8", "pallas", "gpu", "9.0"), ("fp8", "xla", "tpu"), ("int8", "pallas", "tpu"),
               ("fp8", "xla", "cpu"), ("auto", "pallas", "tpu")]:
        check_kv_cache_dtype(*ok)
    # LLM(...) keywords reach CacheConfig.
    assert engine_config(None, kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(None, kv_cache_dtype="float8")


def test_engine_flag():
    from absl import flags

    from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args

    fv = flags.FlagValues()
    define_engine_flags(fv)
    fv(["prog", "--kv_cache_dtype=int8"])
    assert llm_args(fv)[1] == {"kv_cache_dtype": "int8"}
    with pytest.raises(flags.IllegalFlagValueError):
        fv2 = flags.FlagValues()
        define_engine_flags(fv2)
        fv2(["prog", "--kv_cache_dtype=int4"])


# ---------------------------------------------------------------------------
# The engine.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hd64_dir(tmp_path_factory):
    """A tiny GQA Llama with head_dim 64 (4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig

    cfg = dict(COMMON, hidden_size=256, intermediate_size=256, num_attention_heads=4)
    return _save(tmp_path_factory, "hd64", LlamaConfig(num_key_value_heads=2, **cfg))


def _blocks(path, **kw):
    llm = LLM(path, kv_cache_memory_bytes=4 << 20, block_size=16, max_num_seqs=1024, max_model_len=512, **kw)
    return llm.get_metrics()["num_total_blocks"], llm


@pytest.mark.slow
def test_blocks_per_byte_budget(hd64_dir):
    path, _ = hd64_dir
    f32, _ = _blocks(path)  # CPU auto: float32
    int8, llm = _blocks(path, kv_cache_dtype="int8")
    fp8, _ = _blocks(path, kv_cache_dtype="fp8")
    bf16, _ = _blocks(path, dtype="bfloat16")
    assert int8 == fp8 and int8 >= 3.8 * f32 and int8 >= 1.9 * bf16, (f32, bf16, int8)
    k_pages, v_pages, kv_scales = testing.device_kv(llm).caches[0]
    assert k_pages.dtype == jnp.int8 and kv_scales.dtype == jnp.uint32
    assert k_pages.shape[:3] == (2, int8, 16) and kv_scales.shape == pk.quant.scales_shape(2, int8, 16)


def _generate(path, tp, prompts, **kw):
    llm = LLM(path, tensor_parallel_size=tp, num_kv_blocks=40, block_size=8, max_model_len=256,
              max_num_batched_tokens=64, enable_prefix_caching=True, preemption_mode="swap", **kw)
    copies = []
    pool = testing.device_kv(llm)
    real_copy = pool.copy_blocks
    pool.copy_blocks = lambda c: (copies.extend(c), real_copy(c))[1]
    greedy = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=1)
    forks = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, min_tokens=12)
    outs = llm.generate(prompts + prompts[:2], greedy, use_tqdm=False)  # repeats hit the prefix cache
    forked = llm.generate(prompts[:1], forks, use_tqdm=False)[0]  # forks share blocks: copy-on-write
    assert len(forked.outputs) == 2 and all(len(c.token_ids) == 12 for c in forked.outputs)
    m = llm.get_metrics()
    assert m["num_swap_outs"] > 0 and m["prefix_cache_hits"] > 0 and copies, "swap, prefix cache and CoW ran"
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.slow
def test_engine_int8_prefix_swap_forks_tp(hd64_dir):
    """int8 KV through prefix caching, swap preemption, n=2 forks (copy-on-write) and TP=2: every
    block free at the end, identical tokens at TP 1 and 2, and greedy tokens mostly as with auto KV."""
    assert len(jax.devices()) >= 2, "conftest sets --xla_force_host_platform_device_count=8"
    path, _ = hd64_dir
    prompts = random_prompts(np.random.default_rng(0), [70, 9, 33, 51, 18, 64])
    _, auto = _generate(path, 1, prompts)
    _, int8 = _generate(path, 1, prompts, kv_cache_dtype="int8")
    llm, int8_tp2 = _generate(path, 2, prompts, kv_cache_dtype="int8")
    assert [c.token_ids for c in int8_tp2] == [c.token_ids for c in int8]
    scales = testing.device_kv(llm).caches[0][2]
    assert scales.sharding.spec == jax.sharding.PartitionSpec("model", None, None)
    assert scales.addressable_shards[0].data.shape[0] == 1  # scales shard with their heads
    # A random model has near-ties (top-2 logprob gaps down to 0.02), so a sequence may diverge;
    # up to where it does, the chosen tokens' logprobs stay close (int8 KV: ~0.03 nats on average
    # on this model, whose random weights amplify any perturbation; fp8 is ~3x that).
    agree, lp_err = 0, []
    for x, y in zip(auto, int8):
        n = next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), len(x.token_ids))
        agree += n
        lp_err += [abs(x.logprobs[i][t] - y.logprobs[i][t]) for i, t in enumerate(x.token_ids[:n])]
    assert agree >= 0.6 * sum(len(x.token_ids) for x in auto), agree
    assert np.mean(lp_err) < 0.04 and max(lp_err) < 0.15, (np.mean(lp_err), max(lp_err))


@pytest.mark.slow
def test_engine_fp8_prefix_swap_forks(hd64_dir):
    """fp8 KV (the XLA path here) through prefix caching, swap and copy-on-write, no block leaked."""
    path, _ = hd64_dir
    prompts = random_prompts(np.random.default_rng(1), [70, 9, 33, 51, 18, 64])
    llm, outs = _generate(path, 1, prompts, kv_cache_dtype="fp8")
    assert testing.device_kv(llm).caches[0][0].dtype == jnp.float8_e4m3fn
    assert all(len(c.token_ids) == 12 for c in outs)
