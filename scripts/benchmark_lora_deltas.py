"""The C++ CPU LoRA kernel against the XLA form it replaces, per call, at bench-llama's shapes.

  python scripts/benchmark_lora_deltas.py                      # the library as the engine builds it
  python scripts/benchmark_lora_deltas.py --march=x86-64-v3    # an AVX2 build (into a temp cache)

One layer's LoRA calls (q/k/v, gate/up, down; 4 adapters of rank 16 + the base model's slot 0,
tokens round-robin over the 5 slots) at 8, 32 and 512 tokens: the median time of a jitted call of
`pallas_kernels.cpu.lora` and of `jpaged.models.lora.lora_delta` in its XLA ``"dense"`` form (the
gather at 8 tokens), the projections of one input together in both.
"""
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels.cpu import library

F = flags.FLAGS
flags.DEFINE_string("march", "native", "-march of the kernels' build (native: the engine's own build)")
flags.DEFINE_integer("calls", 60, "Timed calls per case (after a warm one)")

SHAPES = [("q/k/v 512 -> 512, 128, 128", 512, (512, 128, 128)), ("gate/up 512 -> 1408 x 2", 512, (1408, 1408)),
          ("down 1408 -> 512", 1408, (512,))]
SLOTS, RANK = 5, 16


def median_ms(f, *args) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(F.calls):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(argv):
    del argv
    if F.march != "native":
        library.CACHE_DIR = tempfile.mkdtemp()
        library.FLAGS = [f"-march={F.march}" if f == "-march=native" else f for f in library.FLAGS]
    from pallas_kernels import cpu
    from jpaged.models.lora import LoRAInputs, lora_delta
    if not cpu.available():
        raise SystemExit("the C++ CPU kernels did not build")
    rng = np.random.default_rng(0)
    ours = jax.jit(cpu.lora)
    xla = jax.jit(lambda x, inputs, factors: [lora_delta(x, a, b, inputs, "dense") for a, b in factors])
    print(f"-march={F.march}, {SLOTS} slots of rank {RANK}, median of {F.calls} calls")
    for name, k, widths in SHAPES:
        factors = [(jnp.asarray(rng.standard_normal((SLOTS, k, RANK)) * 0.01, jnp.float32),
                    jnp.asarray(rng.standard_normal((SLOTS, RANK, n)) * 0.01, jnp.float32)) for n in widths]
        for tokens in (8, 32, 512):
            x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
            slots = jnp.asarray(np.arange(tokens) % SLOTS, jnp.int32)
            order = jnp.argsort(slots, stable=True)
            inputs = LoRAInputs(slots, order, jnp.argsort(order), jnp.bincount(slots, length=SLOTS))
            cpp, dense = median_ms(ours, x, slots, factors), median_ms(xla, x, inputs, factors)
            print(f"{name:28s} tokens {tokens:4d}: C++ {cpp:7.3f} ms, XLA {dense:7.3f} ms ({dense / cpp:.1f}x)")


if __name__ == "__main__":
    app.run(main)
