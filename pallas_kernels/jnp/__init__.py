"""The jnp paged attention and KV-pool updates, each with its Pallas kernel's signature."""

from pallas_kernels.jnp.attention import paged_attention_reference, ragged_paged_attention_reference
from pallas_kernels.jnp.cache_ops import copy_blocks_reference, write_kv_reference

__all__ = ["copy_blocks_reference", "paged_attention_reference", "ragged_paged_attention_reference",
           "write_kv_reference"]
