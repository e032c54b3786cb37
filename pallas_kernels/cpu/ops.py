"""The C++ CPU kernels as JAX functions (XLA FFI custom calls of `library`).

- ``paged_attention``: every row of a ragged batch, decode rows and 16-token prompt chunks, each
  reading its own blocks straight from the pool (``paged_attention.cc``); float32 pages.
- ``greedy``: each row's first maximum and log-sum-exp in one pass over the row (``greedy.cc``).
- ``matmul`` / ``matmuls``: float32 ``x [M, K] @ w [K, N]`` for few rows, the weight streamed once
  where it lies (``matmul.cc``); several weights of one input in one call. ``matmul_t``: the same
  with the weight stored transposed, ``x @ w.T`` for ``w [N, K]`` (a tied embedding's logits).
- ``lora``: the LoRA deltas of adapters stacked in slots, each token through its own slot's factors
  only (``lora.cc``); the projections of one input in one call.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import library


def _require() -> None:
    if not library.available():
        raise RuntimeError("the C++ CPU kernels are not available (no C++ compiler, or they did not build)")


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, num_seqs, *, scale,
                    prefill=True, sliding_window: int | None = None, logits_soft_cap: float | None = None):
    """float32 ``[T, Hq, D]``: the attention of every row (decode rows, and prompt chunks of 16
    tokens that attend causally); padding rows are zeros. ``prefill=False``: decode rows only, zeros
    in every other row. Arguments as `pallas_kernels.ragged_paged_attention`'s; ``sliding_window``:
    a query at position p attends the keys j with ``p - sliding_window < j <= p`` only;
    ``logits_soft_cap``: each scaled score s becomes ``cap * tanh(s / cap)`` (Gemma 2)."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}: expected a positive number of keys or None")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap}: expected a positive cap or None")
    _require()
    call = jax.ffi.ffi_call("jpaged_paged_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, k_pages, v_pages, i32(block_tables), i32(seq_lens), i32(query_start_loc),
                i32(num_seqs).reshape(()), scale=np.float32(scale), prefill=np.int32(prefill),
                sliding_window=np.int32(sliding_window or 0), logits_soft_cap=np.float32(logits_soft_cap or 0.0))


paged_decode = functools.partial(paged_attention, prefill=False)
paged_decode.__doc__ = "`paged_attention` of the decode rows only (zeros in every other row)."


def greedy(logits):
    """float32 ``[S, V]`` -> (int32 ``[S]``: the index of each row's first maximum; float32 ``[S]``:
    its log-sum-exp). A row with a NaN gives ``V - 1`` and NaN."""
    _require()
    rows = logits.shape[0]
    call = jax.ffi.ffi_call("jpaged_greedy", (jax.ShapeDtypeStruct((rows,), jnp.int32),
                                              jax.ShapeDtypeStruct((rows,), jnp.float32)))
    return call(logits.astype(jnp.float32))


def matmul(x, w):
    """float32 ``x [M, K] @ w [K, N]``. Differentiable: the backward pass is two XLA matmuls."""
    return matmuls(x, (w,))[0]


@jax.custom_vjp
def matmuls(x, weights):
    """``tuple(x @ w for w in weights)`` in one call (float32 ``x [M, K]``, each ``w [K, N_i]``): the
    projections of one input (a layer's q, k and v) share the call's hand-off to the thread pool.
    Differentiable like `matmul`."""
    _require()
    weights = tuple(weights)
    call = jax.ffi.ffi_call("jpaged_matmul", [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
                                              for w in weights])
    return tuple(call(x, *weights))


def _matmuls_forward(x, weights):
    return matmuls(x, weights), (x, tuple(weights))


def _matmuls_backward(saved, grads):
    x, weights = saved
    return sum(g @ w.T for g, w in zip(grads, weights)), tuple(x.T @ g for g in grads)


matmuls.defvjp(_matmuls_forward, _matmuls_backward)


@jax.custom_vjp
def matmul_t(x, w):
    """float32 ``x [M, K] @ w.T`` for ``w [N, K]``, read where it lies. Differentiable like `matmul`."""
    _require()
    call = jax.ffi.ffi_call("jpaged_matmul_t", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w)


def _matmul_t_forward(x, w):
    return matmul_t(x, w), (x, w)


def _matmul_t_backward(saved, grad):
    x, w = saved
    return grad @ w, grad.T @ x


matmul_t.defvjp(_matmul_t_forward, _matmul_t_backward)

PACKED_PANEL = 64  # columns per panel of a packed weight (matmul.cc's kPackedPanel)


def pack_weight(w):
    """``w [K, N]`` packed panel by panel for `matmuls_packed`: ``[N / 64, K, 64]``, panel ``p``
    holding columns ``64p .. 64p + 63`` row after row (``N`` a multiple of 64)."""
    k, n = w.shape
    if n % PACKED_PANEL:
        raise ValueError(f"pack_weight: the weight's {n} columns are not a multiple of {PACKED_PANEL}")
    return jnp.transpose(jnp.reshape(w, (k, n // PACKED_PANEL, PACKED_PANEL)), (1, 0, 2))


def matmuls_packed(x, packed):
    """`matmuls` for weights packed by `pack_weight`: ``tuple(x @ w for w in weights)`` from
    ``x [M, K]`` and each ``pack_weight(w) [N_i / 64, K, 64]``, bit for bit the same sums. Each work
    item then streams contiguous memory, which the CPU fetches from memory faster than the same
    bytes spread over every row of ``w`` (docs/cpu.md). Inference only (no gradient)."""
    _require()
    call = jax.ffi.ffi_call("jpaged_matmul_packed", [
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0] * w.shape[2]), jnp.float32) for w in packed])
    return tuple(call(x, *packed))


def lora(x, slots, factors):
    """``tuple(x[t] @ a[slots[t]] @ b[slots[t]] for (a, b) in factors)``, zero rows where
    ``slots[t]`` is 0 (the base model) or outside ``[0, G)``: float32 ``x [T, K]``, int32
    ``slots [T]``, each ``a [G, K, R]`` and ``b [G, R, N_i]`` (one G and R) -> ``[T, N_i]`` each."""
    _require()
    factors = tuple(factors)
    call = jax.ffi.ffi_call("jpaged_lora", [jax.ShapeDtypeStruct((x.shape[0], b.shape[2]), jnp.float32)
                                            for _, b in factors])
    return tuple(call(x, jnp.asarray(slots, jnp.int32), *(w for pair in factors for w in pair)))
