"""KV blocks one sequence holds with sliding-window layers, before (every layer keeps every block)
and after (windowed layers keep only their window's blocks), from the engine's own KV cache
managers: a prompt is prefilled in chunks, then decoded token by token to the context length.

  python scripts/kv_window_memory.py                          # 8,192 tokens, window 1,024, block 16
  python scripts/kv_window_memory.py --context 32768 --window 4096

Memory is counted in layer-blocks (a block of one layer's K and V), so that a pool whose blocks
hold fewer layers (a hybrid model's, see `jpaged.core.kv_cache_layout`) compares with one whose
blocks hold them all.
"""
from absl import app, flags

from jpaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jpaged.core.kv_cache_layout import kv_cache_layout
from jpaged.core.kv_cache_manager import NULL_BLOCK, KVCacheManager
from jpaged.core.request import Sequence
from jpaged.utils import cdiv

F = flags.FLAGS


def define_flags() -> None:
    """The script's flags (defined when it runs, so that importing `blocks_held` defines none)."""
    flags.DEFINE_integer("context", 8192, "Tokens in the sequence at the end")
    flags.DEFINE_integer("window", 1024, "Sliding window of the windowed layers")
    flags.DEFINE_integer("block_size", 16, "Tokens per KV block")
    flags.DEFINE_integer("chunk", 2048, "Prompt tokens per prefill step (max_num_batched_tokens)")


def layer_windows(pattern: str, window: int) -> list[int | None]:
    """Per layer window of a model by name: all windowed, Gemma 2's 1:1, Gemma 3's 5:1."""
    return {"Mistral 7B (32 layers, all windowed)": [window] * 32,
            "Gemma 2 9B (42 layers, 1:1)": [window, None] * 21,
            "Gemma 3 12B (48 layers, 5:1)": ([window] * 5 + [None]) * 8}[pattern]


def blocks_held(windows: list[int | None], context: int, block_size: int, chunk: int) -> tuple[int, int, int]:
    """(blocks held at the end, the most held during decode, layers per block) for one sequence."""
    layout = kv_cache_layout(windows)
    num_blocks = 2 * layout.num_groups * cdiv(context, block_size)
    kv = (HybridKVCacheManager(layout, num_blocks, block_size, enable_prefix_caching=False) if layout.num_groups > 1
          else KVCacheManager(num_blocks, block_size, False, sliding_window=layout.group_windows[0]))
    seq = Sequence(token_ids=[1] * context, num_prompt_tokens=context)

    def held():
        tables = [g.block_table(seq) for g in kv.groups] if layout.num_groups > 1 else [kv.block_table(seq)]
        return sum(b != NULL_BLOCK for t in tables for b in t)

    peak = 0
    while seq.num_computed_tokens < context:
        n = min(chunk, context - seq.num_computed_tokens) if seq.num_computed_tokens < chunk else 1
        assert kv.allocate_slots([seq], n) is not None
        seq.num_computed_tokens += n
        if n == 1:
            peak = max(peak, held())
    return held(), peak, layout.num_tensors


def main(_):
    bs, context, window = F.block_size, F.context, F.window
    print(f"KV blocks per sequence at {context} tokens, window {window}, block size {bs} (prefill chunks of "
          f"{F.chunk}); layer-blocks = blocks x layers per block")
    print(f"{'model':38s} {'before':>18s} {'after (at the end / decode peak)':>36s} {'after/before':>13s}")
    for name in ("Mistral 7B (32 layers, all windowed)", "Gemma 2 9B (42 layers, 1:1)", "Gemma 3 12B (48 layers, 5:1)"):
        windows = layer_windows(name, window)
        before = cdiv(context, bs) * len(windows)
        end, peak, per_block = blocks_held(windows, context, bs, F.chunk)
        after = f"{end} x {per_block} = {end * per_block} / {peak * per_block}"
        print(f"{name:38s} {cdiv(context, bs):>5d} x {len(windows)} = {before:>6d} {after:>36s} "
              f"{end * per_block / before:>12.1%}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
