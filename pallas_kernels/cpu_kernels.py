"""The C++ kernels for the CPU, as XLA FFI custom calls: paged attention for decode rows and
prompt chunks (``cpu/paged_attention.cc``), greedy sampling's reductions (``cpu/greedy.cc``) and
the matmul of a few rows by a weight (``cpu/matmul.cc``).

XLA's CPU code for the jnp paged attention spends most of a step copying gathered pages and running
small batched matmuls; the C++ kernel reads each key and value row straight from the pool, with an
online softmax per block: one (sequence, KV head) per work item for a decode row, one (16-token
chunk, KV head) for a prompt, whose tokens share each key block. XLA runs greedy sampling's argmax
and log-sum-exp as several passes over the ``[rows, vocab]`` logits; the C++ one makes its passes
over a row while the row is in the cache. XLA's GEMM copies a weight into its own layout before
multiplying, which costs a decode step (a few rows, bound by reading the weights) 2-3x; the C++
matmul reads the weight where it lies. Work items go to XLA's intra-op thread pool. All are
compiled on first use into one library with the system C++ compiler (``g++`` or ``c++``) against
the FFI headers jaxlib ships, cached under ``~/.cache/jpaged/cpu_kernels`` (keyed by the sources,
the flags, the jaxlib version and the CPU), and registered as the custom calls
``jpaged_paged_attention``, ``jpaged_greedy`` and ``jpaged_matmul``. Without a compiler,
`available()` is False and callers keep the jnp paths.

``paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, num_seqs, scale=)``
attends every row of a ragged batch (`jpaged.attention`'s ``xla`` backend on a CPU);
``paged_decode`` only its decode rows (zeros elsewhere). Float32 pages only. ``greedy(logits)``
gives each row's first maximum and log-sum-exp. ``matmul(x, w)`` is float32 ``x [M, K] @ w [K, N]``,
``matmuls(x, weights)`` the same for several weights in one call (`jpaged.models.layers` uses them
for up to 64 rows).
"""
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

CPU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu")
SOURCES = [os.path.join(CPU_DIR, name) for name in ("paged_attention.cc", "greedy.cc", "matmul.cc")]
HEADERS = [os.path.join(CPU_DIR, "common.h")]
TARGETS = {"jpaged_paged_attention": "JpagedPagedAttention", "jpaged_greedy": "JpagedGreedy",
           "jpaged_matmul": "JpagedMatmul"}  # name: symbol
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-ffast-math",
         "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC"]
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "cpu_kernels")

logger = logging.getLogger("jpaged")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str) -> str:
    """The shared library's path, compiled into the cache unless it is there already."""
    sources = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(sources + " ".join([compiler] + FLAGS).encode()
                         + jax.lib.__version__.encode() + _cpu_id().encode()).hexdigest()[:16]
    path = os.path.join(CACHE_DIR, f"jpaged_cpu-{key}.so")
    if not os.path.exists(path):
        os.makedirs(CACHE_DIR, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
        os.close(fd)
        subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: a concurrent build never loads a half-written file
    return path


_registered: list = []  # the loaded library, once: XLA refuses a second handler for one name


def _register(path: str) -> None:
    if not _registered:
        library = ctypes.cdll.LoadLibrary(path)
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        _registered.append(library)


@functools.cache
def available() -> bool:
    """Builds (once) and registers the kernels; False, with one log line, where that fails, and
    where ``JPAGED_CPU_KERNELS=0`` turns them off (to compare with the jnp paths)."""
    if os.environ.get("JPAGED_CPU_KERNELS") == "0":
        return False
    compiler = _compiler()
    if compiler is None:
        logger.info("no C++ compiler found: the C++ CPU kernels are off, the jnp / XLA paths serve")
        return False
    try:
        _register(_build(compiler))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("the C++ CPU kernels did not build (%s): the jnp paths are used", str(detail)[-2000:])
        return False
    return True


def _require() -> None:
    if not available():
        raise RuntimeError("the C++ CPU kernels are not available (no C++ compiler, or they did not build)")


def supports(*arrays, k_scales=None) -> bool:
    """Whether the kernels can take these arrays: float32 (pages without scales), on a CPU."""
    return (k_scales is None and all(x.dtype == jnp.float32 for x in arrays)
            and jax.default_backend() == "cpu" and available())


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, num_seqs, *, scale,
                    prefill=True):
    """float32 ``[T, Hq, D]``: the attention of every row (decode rows, and prompt chunks of 16
    tokens that attend causally); padding rows are zeros. ``prefill=False``: decode rows only, zeros
    in every other row."""
    _require()
    call = jax.ffi.ffi_call("jpaged_paged_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return call(q, k_pages, v_pages, i32(block_tables), i32(seq_lens), i32(query_start_loc),
                i32(num_seqs).reshape(()), scale=np.float32(scale), prefill=np.int32(prefill))


paged_decode = functools.partial(paged_attention, prefill=False)
paged_decode.__doc__ = "`paged_attention` of the decode rows only (zeros in every other row)."


def greedy(logits):
    """float32 ``[S, V]`` -> (int32 ``[S]``: the index of each row's first maximum; float32 ``[S]``:
    its log-sum-exp). A row with a NaN gives ``V - 1`` and NaN (``jax.nn.logsumexp`` gives NaN too;
    XLA's max may skip the NaN, so `jpaged.sampler.argmax` gives some index in range)."""
    _require()
    rows = logits.shape[0]
    call = jax.ffi.ffi_call("jpaged_greedy", (jax.ShapeDtypeStruct((rows,), jnp.int32),
                                              jax.ShapeDtypeStruct((rows,), jnp.float32)))
    return call(logits.astype(jnp.float32))


def matmul(x, w):
    """float32 ``x [M, K] @ w [K, N]`` (``cpu/matmul.cc``: for few rows, the weight streamed once).
    Differentiable: the backward pass is two XLA matmuls."""
    return matmuls(x, (w,))[0]


@jax.custom_vjp
def matmuls(x, weights):
    """``tuple(x @ w for w in weights)`` in one call (float32 ``x [M, K]``, each ``w [K, N_i]``): the
    projections of one input (a layer's q, k and v) share the call's hand-off to the thread pool
    and its load balance. Differentiable like `matmul`."""
    _require()
    weights = tuple(weights)
    call = jax.ffi.ffi_call("jpaged_matmul", [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
                                              for w in weights])
    return tuple(call(x, *weights))


def _matmuls_forward(x, weights):
    return matmuls(x, weights), (x, tuple(weights))


def _matmuls_backward(saved, grads):
    x, weights = saved
    return sum(g @ w.T for g, w in zip(grads, weights)), tuple(x.T @ g for g in grads)


matmuls.defvjp(_matmuls_forward, _matmuls_backward)
