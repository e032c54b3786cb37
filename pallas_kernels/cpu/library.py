"""Builds, caches and registers the C++ CPU kernels' shared library.

The sources (``*.cc``, ``common.h`` beside this file) are compiled on first use with the system
C++ compiler (``$CXX``, ``g++`` or ``c++``) against the XLA FFI headers that jaxlib ships, into
``~/.cache/jpaged/cpu_kernels`` under a name keyed by the sources, the flags, the jaxlib version and
the CPU, then registered as XLA custom calls for the CPU platform. A build that fails leaves nothing
behind, and `available` is then False (with one log line), so callers keep the XLA paths. The
measured choices of where each kernel serves (`measure`) are kept beside the library.
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

CPU_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(CPU_DIR, name) for name in ("paged_attention.cc", "greedy.cc", "matmul.cc", "lora.cc", "probe.cc")]
HEADERS = [os.path.join(CPU_DIR, "common.h")]
TARGETS = {"jpaged_paged_attention": "JpagedPagedAttention", "jpaged_greedy": "JpagedGreedy",
           "jpaged_matmul": "JpagedMatmul", "jpaged_matmul_t": "JpagedMatmulTransposed",
           "jpaged_matmul_packed": "JpagedMatmulPacked", "jpaged_lora": "JpagedLora", "jpaged_probe": "JpagedProbe"}  # custom call name: its handler's symbol
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-ffast-math",
         "-fno-finite-math-only", "-std=c++17", "-shared", "-fPIC"]
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jpaged", "cpu_kernels")

logger = logging.getLogger("jpaged")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cpu_id() -> str:
    """The CPU's model name and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor()
    return "".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


def library_key(cxx: str) -> str:
    """What the library depends on: sources, compiler and flags, jaxlib, CPU."""
    sources = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            sources += f.read()
    return hashlib.sha256(sources + " ".join([cxx] + FLAGS).encode() + jax.lib.__version__.encode()
                          + cpu_id().encode()).hexdigest()[:16]


def build(cxx: str) -> str:
    """The shared library's path, compiled into the cache unless it is there already."""
    path = os.path.join(CACHE_DIR, f"jpaged_cpu-{library_key(cxx)}.so")
    if os.path.exists(path):
        return path
    os.makedirs(CACHE_DIR, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: a concurrent build never loads a half-written file
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


_registered: list = []  # (the loaded library, its path), once: XLA refuses a second handler for one name


def register(path: str) -> None:
    if not _registered:
        library = ctypes.cdll.LoadLibrary(path)
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        library.JpagedProbeSeconds.restype = ctypes.c_double
        library.JpagedProbeSeconds.argtypes = [ctypes.c_int64]
        _registered.append((library, path))


def probe_seconds(slot: int) -> float:
    """How long the operation after ``jpaged_probe`` slot ``slot`` took, in the last program run."""
    return _registered[0][0].JpagedProbeSeconds(slot)


def choices_path() -> str:
    """The file beside the loaded library that keeps the measured choices (`measure`)."""
    return os.path.splitext(_registered[0][1])[0] + ".choices.json"


def forced() -> bool | None:
    """``JPAGED_CPU_KERNELS``: "1" forces the C++ kernels on wherever they can serve (True), "0" off
    (False); unset, the measured choice decides (None)."""
    value = os.environ.get("JPAGED_CPU_KERNELS")
    if value in (None, ""):
        return None
    if value not in ("0", "1"):
        logger.warning("JPAGED_CPU_KERNELS=%r: expected 0 or 1; the measured choice decides", value)
        return None
    return value == "1"


@functools.cache
def available() -> bool:
    """Builds (once) and registers the kernels; False, with one log line, where that fails, and
    where ``JPAGED_CPU_KERNELS=0`` turns them off."""
    if forced() is False:
        return False
    cxx = compiler()
    if cxx is None:
        logger.info("no C++ compiler found: the C++ CPU kernels are off, the XLA paths serve")
        return False
    try:
        register(build(cxx))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("the C++ CPU kernels did not build (%s): the XLA paths are used", str(detail)[-2000:])
        return False
    return True
