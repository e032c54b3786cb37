"""The Pallas kernels: Mosaic on TPU, Triton on GPU, interpret mode on any host."""

from jpaged_kernels.pallas.cache_ops import copy_blocks, write_kv
from jpaged_kernels.pallas.common import EXPORT_DISABLED_CHECKS
from jpaged_kernels.pallas.paged_attention import paged_attention
from jpaged_kernels.pallas.ragged_paged_attention import ragged_paged_attention

__all__ = ["EXPORT_DISABLED_CHECKS", "copy_blocks", "paged_attention", "ragged_paged_attention", "write_kv"]
