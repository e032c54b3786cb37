"""Compiles a function for a target without its hardware, and reports what the compiler said.

``compile_for`` runs ``jax.jit(fn).trace(*args).lower().compile()`` with every argument placed on
one abstract device of the target, and returns whether it compiled, the first lines of the error,
the compile time and ``memory_analysis()``. On a GPU target it also returns ptxas's register-spill
warnings: XLA logs them through its C++ logger (``TF_CPP_MIN_LOG_LEVEL=0``), so stderr is captured
at the file-descriptor level while the compiler runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
import time

import jax
from jax.experimental.layout import Format, Layout

from pallas_kernels.aot import targets

# "ptxas warning : Registers are spilled to local memory in function 'k', 8 bytes spill stores, 8 bytes spill loads"
_SPILL = re.compile(r"[Rr]egisters are spilled to local memory in function '([^']+)'"
                    r"(?:, (\d+) bytes spill stores, (\d+) bytes spill loads)?")
_MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                  "temp_size_in_bytes", "generated_code_size_in_bytes")


@dataclasses.dataclass
class CompileResult:
    """What compiling one function for one target gave.

    Attributes:
      ok: it compiled.
      error: the error's first lines ('' when ok).
      seconds: wall time of trace + lower + compile.
      cpu_seconds: CPU time of this process meanwhile (all threads; steadier than wall time on
        a loaded machine).
      memory: ``memory_analysis()`` fields in bytes (empty when it failed or has none).
      spills: ``(function, spill store bytes, spill load bytes)`` per ptxas spill warning.
    """

    ok: bool
    error: str = ""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory: dict = dataclasses.field(default_factory=dict)
    spills: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def captured_stderr():
    """Redirects file descriptor 2 (C++ logs included) to a temp file; yields a list that receives
    the captured text on exit."""
    out: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def parse_spills(log: str) -> list[tuple[str, int, int]]:
    """ptxas spill warnings in ``log``: ``(function, store bytes, load bytes)`` each."""
    return [(m[1], int(m[2] or 0), int(m[3] or 0)) for m in _SPILL.finditer(log)]


def _placed(args, device):
    sharding = jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]


def _formats(structs, sharding, row_major):
    """``in_shardings``/``out_shardings`` entries: arrays of rank >= 3 (the pool) pinned to
    row-major order when ``row_major``, the rest (and all without it) in the default layout."""
    def one(x):
        if row_major and x.ndim >= 3:
            return Format(Layout(major_to_minor=tuple(range(x.ndim))), sharding)
        return sharding
    return jax.tree.map(one, structs)


def _first_lines(err: Exception, limit: int = 6) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return "\n".join(lines[:limit])


def compile_for(target: str, fn, *args: jax.ShapeDtypeStruct, donate_argnums=(),
                row_major: bool = True) -> CompileResult:
    """Compiles ``jax.jit(fn, donate_argnums=...)`` for ``args`` on one chip of ``target``.

    Args:
      target: a name of `targets.TARGETS`.
      fn: the function; its static knobs already bound.
      args: shapes and dtypes of the arguments (any sharding is replaced).
      donate_argnums: as for ``jax.jit``.
      row_major: pin arguments and results of rank >= 3 (KV pool arrays) to row-major order,
        the order the kernels read. XLA:TPU's default order for an array whose row-major tiles
        would be padded (e.g. pages with head_dim 64) is another one, and XLA then copies the
        pool into row-major order around every kernel call (``temp_size_in_bytes`` shows it).

    Returns:
      A `CompileResult`.
    """
    device = targets.device(target)
    placed = _placed(args, device)
    sharding = jax.sharding.SingleDeviceSharding(device)
    outs = jax.eval_shape(fn, *args)
    jit_kw = dict(donate_argnums=donate_argnums,
                  in_shardings=_formats(tuple(placed), sharding, row_major),
                  out_shardings=_formats(outs, sharding, row_major))
    start, cpu_start = time.perf_counter(), time.process_time()
    # The default device is the target's, so lowering rules that ask it (Pallas TPU queries the
    # chip generation) see the target chip, not the host's CPU.
    with captured_stderr() as log, jax.default_device(device):
        try:
            compiled = jax.jit(fn, **jit_kw).trace(*placed).lower().compile()
            error = None
        except Exception as e:  # noqa: BLE001 - every compiler error is a result here
            error = e
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    spills = parse_spills(log[0])
    if error is not None:
        return CompileResult(False, _first_lines(error), seconds, cpu_seconds, spills=spills)
    analysis = compiled.memory_analysis()
    memory = {f: int(getattr(analysis, f)) for f in _MEMORY_FIELDS if hasattr(analysis, f)}
    return CompileResult(True, "", seconds, cpu_seconds, memory, spills)
