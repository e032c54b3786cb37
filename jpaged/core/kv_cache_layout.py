"""KV-cache groups: which block table and which pool tensor each layer uses (host only, no JAX).

Layers that attend differently keep different blocks: a global layer needs every block of a
sequence, a sliding-window layer only those its window reaches. As in vLLM's hybrid KV cache
manager, the layers are split into KV-cache groups of one attention type each; every group has
its own block table per sequence, and all groups take blocks from one block pool. A block id
means the same thing in every pool tensor, so a block must be the same size in every group: each
group holds (at most) ``num_tensors`` layers, and pool tensor t holds the t-th layer of whichever
group owns a block. A model with one attention type has one group and a tensor per layer.

Grouping: with ``g`` the fewest layers of any attention type, a type with ``c`` layers gets
``ceil(c / g)`` groups, its layers dealt out to them in turn (layer j of the type: group ``j % n``,
tensor ``j // n``), so a pattern that repeats (Gemma 3: five sliding-window layers, one global)
gives every repeat the same (group, tensor) pattern. Global groups come first, then windows from
the smallest. Gemma 3 12B (48 layers, 40 windowed): 1 global and 5 windowed groups of 8 layers.
"""
from dataclasses import dataclass

from jpaged.utils import cdiv


@dataclass(frozen=True)
class KVCacheLayout:
    """``group_windows[g]``: group g's sliding window (None: global); ``layers[i]``: (group, pool
    tensor) of layer i; ``num_tensors``: pool tensors (each ``[kv_heads, num_blocks, block_size,
    head_dim]`` pages)."""

    group_windows: tuple[int | None, ...]
    layers: tuple[tuple[int, int], ...]
    num_tensors: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_trivial(self) -> bool:
        """One group, so a pool tensor per layer (every model whose layers share one window or none)."""
        return self.num_groups == 1

    def max_blocks_per_seq(self, num_tokens: int, block_size: int, max_new_tokens: int) -> int:
        """The most blocks (all groups) one sequence of ``num_tokens`` holds at once when a step
        adds at most ``max_new_tokens`` tokens: a windowed group keeps the blocks from its window's
        first key to the last new token."""
        total = 0
        for window in self.group_windows:
            full = cdiv(num_tokens, block_size)
            total += full if window is None else min(full, cdiv(window - 1 + max_new_tokens, block_size) + 1)
        return total

    def max_tokens_per_seq(self, num_blocks: int, block_size: int, max_new_tokens: int, limit: int) -> int:
        """The most tokens (at most ``limit``) one sequence can hold in ``num_blocks`` blocks: the
        inverse of `max_blocks_per_seq` (0 when not even one token fits)."""
        lo, hi = 0, limit
        while lo < hi:  # max_blocks_per_seq grows with the token count
            mid = (lo + hi + 1) // 2
            if self.max_blocks_per_seq(mid, block_size, max_new_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_cache_layout(layer_windows) -> KVCacheLayout:
    """The groups of layers with these sliding windows (None: global), as the module docstring says."""
    layer_windows = tuple(layer_windows)
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    counts = {w: layer_windows.count(w) for w in kinds}
    per_group = min(counts.values())
    first_group, num_groups = {}, {}
    group_windows: list[int | None] = []
    for w in kinds:
        first_group[w], num_groups[w] = len(group_windows), cdiv(counts[w], per_group)
        group_windows += [w] * num_groups[w]
    seen = dict.fromkeys(kinds, 0)
    layers = []
    for w in layer_windows:
        j, n = seen[w], num_groups[w]
        layers.append((first_group[w] + j % n, j // n))
        seen[w] += 1
    return KVCacheLayout(tuple(group_windows), tuple(layers), per_group)
