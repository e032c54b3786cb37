"""Every Pallas kernel compiles with the real TPU and CUDA compilers, without the hardware.

The compilers (libtpu: Mosaic + XLA:TPU; jax-cuda12-plugin: XLA:GPU + Triton + ptxas) live in the
venvs of ``scripts/setup_aot_compilers.sh``, outside this test process (both plugins change what
``import jax`` does); each target's sweep runs in a subprocess there (``pallas_kernels.aot``). A
missing venv fails these tests with the command that creates it; ``JPAGED_SKIP_AOT=1`` skips
them instead.

Default run: a cross-section of the sweep (every kernel in every page dtype, each head_dim,
block_size, group and attention knob set at least once) on v5e, v6e and H100, and no ptxas
register spill in the H100 cross-section. ``-m slow``: the full grid (``aot/cases.py``) on v5e,
v6e, v5p, H100 and A100.
"""

import os
from concurrent import futures

import pytest

from pallas_kernels.aot import cases, targets, venv

OPT_OUT = "JPAGED_SKIP_AOT"
DEFAULT_TARGETS = ("v5e", "v6e", "h100")
FULL_TARGETS = ("v5e", "v6e", "v5p", "h100", "a100")


def _require_venvs(names):
    for platform in sorted({targets.get(n).platform for n in names}):
        why = venv.missing(platform)
        if why is None:
            continue
        if os.environ.get(OPT_OUT) == "1":
            pytest.skip(why)
        pytest.fail(f"{why} (or set {OPT_OUT}=1 to skip the deviceless compile tests)")


def _sweeps(names, preset):
    """``{target: records}``, the targets' sweeps run two at a time."""
    _require_venvs(names)
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = {n: pool.submit(venv.run_sweep, n, preset) for n in names}
        results = {n: run.result() for n, run in runs.items()}
    for name, (records, stderr) in results.items():
        if not records:
            pytest.fail(f"the {name} sweep compiled nothing:\n{stderr[-3000:]}")
    return {name: records for name, (records, _) in results.items()}


@pytest.fixture(scope="module")
def cross_section():
    return _sweeps(DEFAULT_TARGETS, "cross_section")


def _failures(records):
    return "\n".join(f"{r['case']}: {r['error']}" for r in records if not r["ok"])


def _expected(name, preset):
    return [c.name for c in cases.cases_for(preset, targets.get(name).kv_dtypes)]


@pytest.mark.slow
@pytest.mark.parametrize("target", DEFAULT_TARGETS)
def test_cross_section_compiles(cross_section, target):
    records = cross_section[target]
    assert [r["case"] for r in records] == _expected(target, "cross_section")
    assert not _failures(records), _failures(records)


def _spills(records):
    return "\n".join(f"{r['case']}: {r['spills']}" for r in records if r["spills"])


def test_no_register_spills_on_h100(cross_section):
    """ptxas (``--warn-on-spills``, through XLA's log) reports no spilled registers."""
    records = cross_section["h100"]
    assert any(r["case"].startswith("ragged_paged_attention") for r in records)
    assert not _spills(records), _spills(records)


def test_pool_stays_in_place(cross_section):
    """The cache ops alias every pool array (no copy of the pool) and use no pool-sized temp."""
    for target, records in cross_section.items():
        for r in records:
            if r["case"].startswith(("write_kv", "copy_blocks")):
                memory = r["memory"]
                assert memory["alias_size_in_bytes"] > 0.99 * memory["output_size_in_bytes"], r
                assert memory["temp_size_in_bytes"] < 0.01 * memory["output_size_in_bytes"], r


@pytest.mark.slow
@pytest.mark.parametrize("target", FULL_TARGETS)
def test_full_sweep_compiles(target):
    records = _sweeps([target], "full")[target]
    assert [r["case"] for r in records] == _expected(target, "full")
    assert not _failures(records), _failures(records)
    assert not _spills(records), _spills(records)
