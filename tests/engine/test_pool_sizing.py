"""The KV pool's size, decided by one function (`startup.num_kv_blocks`) for start-up and for the
AOT tool alike: num_kv_blocks, else kv_cache_memory_bytes, else the device's budget, else the CPU
default; capped to what max_num_seqs sequences use."""
import pytest

from jpaged.config import CacheConfig
from jpaged.engine.startup import num_kv_blocks

MiB = 1 << 20


def blocks(cache, *, per_block=MiB, per_seq=8, max_num_seqs=4, device_budget=None):
    return num_kv_blocks(cache, max_num_seqs, per_block=per_block, per_seq=per_seq, device_budget=device_budget)


def test_the_sources_in_order():
    assert blocks(CacheConfig(num_kv_blocks=5, kv_cache_memory_bytes=3 * MiB), device_budget=9 * MiB) \
        == (5, "num_kv_blocks", None)
    assert blocks(CacheConfig(kv_cache_memory_bytes=3 * MiB), device_budget=9 * MiB) \
        == (3, "kv_cache_memory_bytes", 3 * MiB)
    assert blocks(CacheConfig(memory_utilization=0.5), device_budget=9 * MiB) == (9, "memory_utilization=0.5", 9 * MiB)
    cpu = CacheConfig()
    assert blocks(cpu) == (min(cpu.cpu_default_bytes // MiB, 32), "the CPU default", cpu.cpu_default_bytes)


def test_capped_to_what_the_sequences_use_and_zero_when_nothing_fits():
    assert blocks(CacheConfig(kv_cache_memory_bytes=1000 * MiB), per_seq=8, max_num_seqs=4)[0] == 32
    assert blocks(CacheConfig(kv_cache_memory_bytes=MiB - 1))[0] == 0
    assert blocks(CacheConfig(), device_budget=-5)[0] == 0  # the weights took more than the share


@pytest.mark.parametrize("budget", [2 * MiB, 7 * MiB])
def test_the_aot_tool_honours_kv_cache_memory_bytes(budget):
    # what compile_engine asks: the chip's budget is large, the user's byte budget wins
    n, source, _ = blocks(CacheConfig(kv_cache_memory_bytes=budget), device_budget=64 * MiB)
    assert (n, source) == (budget // MiB, "kv_cache_memory_bytes")
