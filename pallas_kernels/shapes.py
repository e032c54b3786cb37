"""Shape checks and integer helpers shared by every kernel of the package (Pallas, jnp, C++)."""

from __future__ import annotations

import numpy as np

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def cdiv(a, b):
    """Ceiling division of ints or int arrays."""
    return -(-a // b)


def is_power_of_2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_power_of_two(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def check_pools(k_pages, v_pages):
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_kv_heads, "
                         f"num_blocks, block_size, head_dim]; got {k_pages.shape} "
                         f"and {v_pages.shape}")


def check_attention_shapes(q, k_pages, v_pages, block_tables, seq_lens):
    num_q_heads, head_dim = q.shape[1:]
    check_pools(k_pages, v_pages)
    num_kv_heads = k_pages.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_pages head_dim "
                         f"{k_pages.shape[-1]}")
    if block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]:
        raise ValueError("block_tables must be [num_seqs, max_blocks] and "
                         f"seq_lens [num_seqs]; got {block_tables.shape}, "
                         f"{seq_lens.shape}")


def check_knobs(sliding_window, logits_soft_cap):
    """Raises unless the attention knobs are None or positive."""
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1; got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be None or > 0; got {logits_soft_cap!r}")


def check_sinks(sinks, num_q_heads: int):
    """Raises unless ``sinks`` is None or one value per query head ``[num_q_heads]``."""
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must be None or [num_q_heads={num_q_heads}]; got shape {tuple(sinks.shape)}")


def check_attention_chunk(attention_chunk):
    """Raises unless ``attention_chunk`` (chunked local attention) is None or an int >= 1."""
    if attention_chunk is not None and (int(attention_chunk) != attention_chunk or attention_chunk < 1):
        raise ValueError(f"attention_chunk must be None or an int >= 1; got {attention_chunk!r}")
