"""The Pallas kernels: Mosaic on TPU, Triton on GPU, interpret mode on any host."""

from pallas_kernels.pallas.cache_ops import copy_blocks, write_kv
from pallas_kernels.pallas.common import EXPORT_DISABLED_CHECKS
from pallas_kernels.pallas.paged_attention import paged_attention
from pallas_kernels.pallas.ragged_paged_attention import ragged_paged_attention

__all__ = ["EXPORT_DISABLED_CHECKS", "copy_blocks", "paged_attention", "ragged_paged_attention", "write_kv"]
