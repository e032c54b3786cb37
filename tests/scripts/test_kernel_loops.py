"""The C++ kernels' stand-alone loop benchmarks (scripts/benchmark_*_loop.cc) build with the kernels'
own compiler and flags and run at small sizes (smoke tests: no timing asserted); the attention
loop's kernel output is checked against its double-precision reference."""
import os
import re
import subprocess

import jax
import pytest

from pallas_kernels.cpu import library
from run_script import SCRIPTS

pytestmark = pytest.mark.skipif(library.compiler() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """Builds scripts/<name>.cc once per module; returns the binary's path."""
    built = {}

    def binary(name: str) -> str:
        if name not in built:
            flags = [f for f in library.FLAGS if f not in ("-shared", "-fPIC")]
            built[name] = str(tmp_path_factory.mktemp("loops") / name)
            subprocess.run([library.compiler(), *flags, "-I", jax.ffi.include_dir(),
                            os.path.join(SCRIPTS, f"{name}.cc"), "-o", built[name], "-lpthread"],
                           check=True, capture_output=True, timeout=300)
        return built[name]

    return binary


def run(binary: str, *args) -> str:
    return subprocess.run([binary, *map(str, args)], check=True, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.parametrize("order", [(), ("random",), ("in-order",)])
def test_attention_loop_matches_its_reference(build, order):
    out = run(build("benchmark_attention_loop"), 4, 64, 64, *order)
    assert f"{order[0] if order else 'random'}: " in out, out
    assert float(re.search(r"largest difference from the reference: (\S+)", out).group(1)) < 1e-5
    rates = re.findall(r"^(kernel cold|kernel hot|read cold, .*): ([0-9.]+) GB/s$", out, re.M)
    assert len(rates) == 4 and all(float(r) > 0 for _, r in rates), out


def test_attention_loop_rejects_a_pool_too_small(build):
    result = subprocess.run([build("benchmark_attention_loop"), "8", "512", "100"], capture_output=True, text=True)
    assert result.returncode == 2 and "pool_blocks" in result.stderr


def test_attention_loop_rejects_an_unknown_order(build):
    result = subprocess.run([build("benchmark_attention_loop"), "4", "64", "64", "sideways"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "random or in-order, not sideways" in result.stderr


@pytest.mark.parametrize("args", [(32, 64, 256, 2), (8, 64, 256, 2, 4, "t"), (32, 64, 256, 2, 1, "p", 2)])
def test_matmul_loop_runs(build, args):
    out = run(build("benchmark_matmul_loop"), *args)
    assert re.search(r"least [0-9.]+ ms \([0-9.]+ GFLOP/s\), median [0-9.]+ ms \([0-9.]+ GFLOP/s\)", out), out


def test_matmul_loop_rejects_a_packed_width_not_whole_panels(build):
    result = subprocess.run([build("benchmark_matmul_loop"), "32", "64", "100", "1", "1", "p"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "multiple of 64 packed" in result.stderr
