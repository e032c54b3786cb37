"""The kernels of jpaged's paged KV cache, importable without ``jpaged``.

- ``pallas/``: the Pallas kernels, Mosaic on TPU and Triton on GPU (``paged_attention``,
  ``ragged_paged_attention``, ``write_kv``, ``copy_blocks``); each takes ``backend=`` (``None`` /
  ``"auto"``: the kernel of the platform being lowered for, the jnp path elsewhere; ``"tpu"``,
  ``"gpu"``, ``"xla"``) and ``interpret=True`` to run the Pallas kernel on any host.
- ``jnp/``: the jnp paged attention and cache updates, each with its kernel's signature
  (suffix ``_reference``): the ``xla`` backend, and what the kernels are tested against.
- ``cpu/``: C++ kernels for the CPU (XLA FFI custom calls, built on first use).
- ``quant.py``: 8-bit KV pages (int8 or float8_e4m3fn) with a scale per (token, kv head).
- ``pool.py``: the arrays of a layer's cache and whole-block moves between pools.
- ``platform.py``: the platform being traced for (a deviceless compile's target, not the host).
- ``aot/``: deviceless ahead-of-time compiles of the kernels for real TPU and GPU targets.

Pool layout, shared by all: ``k_pages``/``v_pages`` ``[num_kv_heads, num_blocks, block_size,
head_dim]`` (with 8-bit pages also ``kv_scales``, uint32 ``[num_kv_heads, ceil(num_blocks *
block_size / 128), 128]``: one word per slot holding its K and V scales); slot ``= block_id *
block_size + offset``; block tables int32 ``[num_seqs, max_blocks_per_seq]``. Attention takes
``sliding_window=`` and ``logits_soft_cap=`` on every backend.
"""

from pallas_kernels import pool, quant
from pallas_kernels.jnp import (
    copy_blocks_reference, paged_attention_reference, ragged_paged_attention_reference,
    write_kv_reference)
from pallas_kernels.pallas import (
    EXPORT_DISABLED_CHECKS, copy_blocks, paged_attention, ragged_paged_attention, write_kv)
from pallas_kernels.quant import KV_DTYPES, SCALE_DTYPE, dequantize, pack_scales, quantize, unpack_scales

__all__ = [
    "EXPORT_DISABLED_CHECKS",
    "KV_DTYPES",
    "SCALE_DTYPE",
    "copy_blocks",
    "copy_blocks_reference",
    "dequantize",
    "pack_scales",
    "paged_attention",
    "paged_attention_reference",
    "pool",
    "quant",
    "quantize",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "unpack_scales",
    "write_kv",
    "write_kv_reference",
]
