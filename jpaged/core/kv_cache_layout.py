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

Recurrent layers (`RECURRENT`: gated delta-net linear attention) keep no KV: a fixed-size state
per sequence, in a state pool of their own (`jpaged.core.recurrent_state`). They belong to no
group: layer j of them is ``(RECURRENT_GROUP, num_tensors + j)``, its state pool following the KV
pool tensors in the list of caches the model takes. Qwen3-Next (48 layers, every fourth full):
one global group of 12 tensors, then 36 state pools.
"""
from dataclasses import dataclass

from jpaged.utils import cdiv

RECURRENT = "recurrent"  # a layer's kind, in place of its window: it keeps a recurrent state, no KV
RECURRENT_GROUP = -1     # the group of a recurrent layer's (group, tensor) pair


@dataclass(frozen=True)
class KVCacheLayout:
    """``group_windows[g]``: group g's sliding window (None: global); ``layers[i]``: (group, pool
    tensor) of layer i; ``num_tensors``: pool tensors (each ``[kv_heads, num_blocks, block_size,
    head_dim]`` pages); ``num_recurrent``: recurrent layers (their state pools come after the
    tensors)."""

    group_windows: tuple[int | None, ...]
    layers: tuple[tuple[int, int], ...]
    num_tensors: int
    num_recurrent: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_trivial(self) -> bool:
        """One group and no recurrent layer, so a pool tensor per layer (every model whose layers
        share one window or none)."""
        return self.num_groups == 1 and not self.num_recurrent

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
    """The groups of layers with these sliding windows (None: global; `RECURRENT`: a recurrent
    layer), as the module docstring says."""
    layer_kinds = tuple(layer_windows)
    layer_windows = tuple(w for w in layer_kinds if w != RECURRENT)
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
    layers, num_recurrent = [], 0
    for w in layer_kinds:
        if w == RECURRENT:
            layers.append((RECURRENT_GROUP, per_group + num_recurrent))
            num_recurrent += 1
            continue
        j, n = seen[w], num_groups[w]
        layers.append((first_group[w] + j % n, j // n))
        seen[w] += 1
    return KVCacheLayout(tuple(group_windows), tuple(layers), per_group, num_recurrent)
