"""Deviceless ahead-of-time compiles of the MLA decode kernel for real TPU and GPU targets.

Run inside a target's compiler venv (`pallas_kernels.aot.venv`, ``scripts/setup_aot_compilers.sh``)::

    JAX_PLATFORMS=cpu ~/.cache/jpaged/aot/tpu/bin/python -m pallas_kernels.paged_mla.aot --target v6e

One JSON line per case, as `pallas_kernels.aot.sweep` prints. Cases: DeepSeek-V3's latent row
(kv_lora_rank 512 + rope 64, so halves of 288) with its 128 heads and the 16 heads of one device
of an 8-way tensor-parallel slice, blocks of 16 and 64 tokens, float32 and bfloat16 pages, 32
sequences of up to 4,096 tokens; and a 512-wide row (448 + 64: halves of 256) that the Triton
kernel takes. On GPU targets DeepSeek's 288-wide halves are not power-of-two tiles: those cases
compile the auto dispatch, which runs the jnp kernel there (`pallas.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.aot import targets
from pallas_kernels.aot.compile import compile_for
from pallas_kernels.paged_mla.pallas import mla_paged_decode
from pallas_kernels.pallas.common import gpu_supported

KV_LORA_RANKS = ((512, 64), (448, 64))  # (kv_lora_rank, rope): V3's 576-wide row; a 512-wide one
HEADS = (128, 16)
BLOCK_SIZES = (16, 64)
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class MLACase:
    kv_lora_rank: int
    rope_dim: int
    heads: int
    block_size: int
    dtype: str
    num_seqs: int = 32
    max_len: int = 4096

    @property
    def name(self) -> str:
        return f"mla_paged_decode-{self.dtype}-r{self.kv_lora_rank}-p{self.rope_dim}-h{self.heads}-bs{self.block_size}"

    def build(self, backend: str):
        """``(fn, args)``: the kernel for ``backend`` ("tpu" or "gpu"; "auto" where the GPU kernel
        does not take the shape) and its arguments as ``jax.ShapeDtypeStruct``."""
        s = jax.ShapeDtypeStruct
        half = (self.kv_lora_rank + self.rope_dim) // 2
        pages = self.max_len // self.block_size
        num_blocks = self.num_seqs * pages // 2 + 1
        if backend == "gpu" and not gpu_supported(half, self.block_size):
            backend = None
        fn = functools.partial(mla_paged_decode, kv_lora_rank=self.kv_lora_rank,
                               scale=(128 + self.rope_dim) ** -0.5, backend=backend)
        page = s((1, num_blocks, self.block_size, half), jnp.dtype(self.dtype))
        args = [s((self.num_seqs, self.heads, 2 * half), jnp.dtype(self.dtype)), page, page,
                s((self.num_seqs, pages), jnp.int32), s((self.num_seqs,), jnp.int32)]
        return fn, args


def cases() -> list[MLACase]:
    return [MLACase(r, p, h, bs, dt) for (r, p), h, bs, dt in
            itertools.product(KV_LORA_RANKS, HEADS, BLOCK_SIZES, DTYPES)]


def sweep(target: str, only: str | None = None, out=sys.stdout) -> list[dict]:
    """Compiles every case (names containing ``only``, when given) for ``target``; writes and
    returns one record per case."""
    backend = "tpu" if targets.get(target).platform == "tpu" else "gpu"
    records = []
    for case in cases():
        if only and only not in case.name:
            continue
        fn, args = case.build(backend)
        result = compile_for(target, fn, *args)
        record = dict(target=target, case=case.name, **dataclasses.asdict(result))
        records.append(record)
        print(json.dumps(record), file=out, flush=True)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(targets.TARGETS))
    parser.add_argument("--only", default=None, help="compile only cases whose name contains this")
    args = parser.parse_args(argv)
    records = sweep(args.target, args.only)
    failed = [r["case"] for r in records if not r["ok"]]
    print(f"{len(records) - len(failed)} of {len(records)} compiled", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
