"""C++ kernels for the CPU as XLA FFI custom calls: paged attention, greedy sampling, few-row
matmuls, segmented LoRA deltas. `runs` decides where they serve; `library` builds, caches and registers them."""

from pallas_kernels.cpu.dispatch import MATMUL_ROWS, runs
from pallas_kernels.cpu.library import available
from pallas_kernels.cpu.ops import (PACKED_PANEL, greedy, lora, matmul, matmul_t, matmuls, matmuls_packed, pack_weight,
                                    paged_attention, paged_decode)

__all__ = ["MATMUL_ROWS", "PACKED_PANEL", "available", "greedy", "lora", "matmul", "matmul_t", "matmuls", "matmuls_packed",
           "pack_weight", "paged_attention", "paged_decode", "runs"]
