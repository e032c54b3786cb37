"""A layer's KV cache: the arrays it is made of, and whole-block moves between pools.

A layer cache is ``(k_pages, v_pages)`` with pages ``[num_kv_heads, num_blocks, block_size,
head_dim]``, or with 8-bit pages ``(k_pages, v_pages, kv_scales)`` (``quant.py``). Every array
leads with the kv-head axis, so a pool shards on axis 0. Pages index blocks on axis 1; scale words
through ``quant.block_words``: the helpers here hide the difference from callers that move whole
blocks (swap to and from host memory).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import quant


def layer_arrays(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int,
                 dtype) -> list[tuple[tuple[int, ...], jnp.dtype]]:
    """``(shape, dtype)`` of each array of one layer's cache."""
    pages = (num_kv_heads, num_blocks, block_size, head_dim)
    arrays = [(pages, jnp.dtype(dtype))] * 2
    if quant.is_quantized(dtype):
        quant.check_block_size(block_size)
        arrays.append((quant.scales_shape(num_kv_heads, num_blocks, block_size),
                       jnp.dtype(quant.SCALE_WORD_DTYPE)))
    return arrays


def _blocked(layer):
    """The layer's arrays, each seen as ``[num_kv_heads, blocks, block_size, ...]``."""
    block_size = layer[0].shape[2]
    return [x if i < 2 else quant.block_words(x, block_size) for i, x in enumerate(layer)]


def take_blocks(layer, blocks: jax.Array) -> tuple[jax.Array, ...]:
    """Blocks ``blocks [n]`` of every array of ``layer``: ``[num_kv_heads, n, block_size, ...]``
    each (pages, then the blocks' scale words)."""
    return tuple(x[:, blocks] for x in _blocked(layer))


def put_blocks(layer, blocks: jax.Array, data) -> tuple[jax.Array, ...]:
    """``layer`` with `take_blocks`'s ``data`` written into ``blocks`` (negative ids: dropped)."""
    out = []
    for x, blocked, d in zip(layer, _blocked(layer), data):
        dst = jnp.where(blocks < 0, blocked.shape[1], blocks)
        out.append(blocked.at[:, dst].set(d, mode="drop").reshape(x.shape))
    return tuple(out)
