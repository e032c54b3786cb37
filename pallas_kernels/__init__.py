"""Pallas kernels for paged attention over a block-pool KV cache.

Importable without ``jpaged``. Every kernel has a pure-jnp reference with the
same signature in ``pallas_kernels.reference`` (suffix ``_reference``).

Pool layout: ``k_pages``/``v_pages`` are ``[num_kv_heads, num_blocks,
block_size, head_dim]``; slot ``= block_id * block_size + offset``; block
tables are int32 ``[num_seqs, max_blocks_per_seq]``.

Each function takes ``backend=None`` (auto: Mosaic on TPU, Triton on CUDA,
XLA reference elsewhere), ``"tpu"``, ``"gpu"`` or ``"xla"``, and
``interpret=True`` to run a Pallas kernel on any host (auto + interpret =
the TPU kernel). See ``paged_attention.py`` for the backend notes.

8-bit KV (``quant.py``): with int8 or float8_e4m3fn pages every function also
takes ``k_scales``/``v_scales`` ``[num_kv_heads, num_blocks, block_size]``;
``write_kv`` quantizes, attention dequantizes.
"""

from pallas_kernels._common import EXPORT_DISABLED_CHECKS
from pallas_kernels.cache_ops import copy_blocks, write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.quant import KV_DTYPES, SCALE_DTYPE, dequantize, quantize
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import (
    copy_blocks_reference, paged_attention_reference,
    ragged_paged_attention_reference, write_kv_reference)

__all__ = [
    "EXPORT_DISABLED_CHECKS",
    "KV_DTYPES",
    "SCALE_DTYPE",
    "copy_blocks",
    "copy_blocks_reference",
    "dequantize",
    "paged_attention",
    "paged_attention_reference",
    "quantize",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
