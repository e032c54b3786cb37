"""The C++ CPU decode kernel (pallas_kernels/cpu/paged_decode.cc, an XLA FFI custom call) against
the numpy loops, alone and as the decode part of the xla backend's ragged attention."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_decode
from test_kernels import Case, as_np, check, check_ragged_reference, decode_case, np_ragged

pytestmark = pytest.mark.skipif(cpu_decode._compiler() is None, reason="no C++ compiler on this machine")


def test_kernel_builds_into_its_cache_and_registers(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_decode, "CACHE_DIR", str(tmp_path))
    path = cpu_decode._build(cpu_decode._compiler())
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    assert cpu_decode._build(cpu_decode._compiler()) == path  # a second call reuses the file
    assert cpu_decode.available()


@pytest.mark.parametrize("case", [
    decode_case([0, 1, 15, 16, 17, 40, 300], block_size=16),
    decode_case([3, 8, 9], block_size=8, group=1, num_kv_heads=3, head_dim=32),
    decode_case([1, 16, 31, 200], group=2, head_dim=128),
    Case(seqs=[(5, 5), (1, 20), (0, 7), (9, 33), (1, 1)], max_seqs=7, extra_tokens=3),
], ids=["decode_g4", "decode_mha", "decode_d128", "mixed_padded"])
def test_decode_rows_vs_numpy_and_zeros_elsewhere(case):
    args, kw = case.build()
    q, k, v, bt, sl, qsl, ns = args
    out = np.asarray(jax.jit(lambda *a: cpu_decode.paged_decode(*a, scale=kw["scale"]))(*args))
    expected = np_ragged(as_np(q), as_np(k), as_np(v), np.asarray(bt), np.asarray(sl), np.asarray(qsl),
                         int(ns[0]), kw["scale"])
    decode_rows = [int(qsl[s]) for s in range(int(ns[0])) if qsl[s + 1] - qsl[s] == 1 and sl[s] > 0]
    others = np.setdiff1d(np.arange(q.shape[0]), decode_rows)
    check(out[decode_rows], expected[decode_rows], jnp.float32)
    assert not out[others].any()


def test_ragged_attention_with_the_kernel_for_decode_rows_vs_numpy():
    case = Case(seqs=[(1, 70), (23, 40), (1, 3), (7, 7), (1, 33), (2, 18), (1, 129)], block_size=8,
                max_seqs=9, extra_tokens=2)
    check_ragged_reference(case, decode_attention=cpu_decode.paged_decode)


def test_used_for_float32_pages_only():
    q = jnp.zeros((2, 4, 8), jnp.float32)
    pages = jnp.zeros((1, 4, 8, 8), jnp.float32)
    assert cpu_decode.supports(q, pages)
    assert not cpu_decode.supports(q.astype(jnp.bfloat16), pages.astype(jnp.bfloat16))
    assert not cpu_decode.supports(q, pages.astype(jnp.int8), k_scales=jnp.ones((1, 4, 8), jnp.bfloat16))


def test_a_block_id_outside_the_pool_is_an_error():
    args, kw = decode_case([20, 5]).build()
    q, k, v, bt, sl, qsl, ns = args
    bad = bt.at[0, 1].set(k.shape[1])
    with pytest.raises(Exception, match="block id out of the pool"):
        jax.block_until_ready(cpu_decode.paged_decode(q, k, v, bad, sl, qsl, ns, scale=kw["scale"]))


def test_without_a_compiler_the_jnp_path_serves(monkeypatch):
    monkeypatch.setattr(cpu_decode, "_compiler", lambda: None)
    cpu_decode.available.cache_clear()
    try:
        assert not cpu_decode.available()
        assert not cpu_decode.supports(jnp.zeros((2, 4, 8)), jnp.zeros((1, 4, 8, 8)))
    finally:
        cpu_decode.available.cache_clear()  # the next caller builds (or finds) it again
