"""Paged multi-head latent attention (MLA, DeepSeek-V2/V3) over a latent KV pool.

Every query head attends to one shared latent row per token: ``[c_kv (kv_lora_rank), k_pe
(qk_rope_head_dim)]``. With the key and value up-projections absorbed into the query and the
output (`jpaged.models.deepseek`), a score is ``q_latent . row`` and the output is the
softmax-weighted sum of the rows' ``c_kv`` part, so each latent page is read once for all heads.

Pool layout: the row of width ``W = kv_lora_rank + qk_rope_head_dim`` is stored as two halves,
``k_pages[h, block, offset] = row[:W/2]`` and ``v_pages[h, block, offset] = row[W/2:]``, each
``[pool_heads, num_blocks, block_size, W/2]``: the engine's ordinary two-tensor pool (block
copies, swaps, prefix-cache tiers, copy-on-write all apply unchanged) at exactly ``W`` values per
token and layer. ``pool_heads`` is 1, or the tensor-parallel degree when each device holds its own
replica (the kernels read head 0 of the pages they are given).

- `mla_paged_attention_reference` (``reference.py``): the jnp kernel, ragged batches of prefill
  and decode tokens; the CPU path and what the Pallas kernels are tested against.
- `mla_paged_decode` (``pallas.py``): the Pallas decode kernel (one query per sequence), Mosaic
  TPU and Triton GPU, ``interpret=True`` anywhere.
"""
from pallas_kernels.paged_mla.pallas import mla_paged_decode
from pallas_kernels.paged_mla.reference import latent_rows, mla_paged_attention_reference, split_latent

__all__ = ["latent_rows", "mla_paged_attention_reference", "mla_paged_decode", "split_latent"]
