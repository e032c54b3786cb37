"""The Pallas MLA decode kernel compiles with the real TPU and CUDA compilers, without the hardware
(the venvs of ``scripts/setup_aot_compilers.sh``, as ``tests/kernels/test_aot_kernels.py``; a missing venv
fails with the command that makes it, ``JPAGED_SKIP_AOT=1`` skips).

Default run: DeepSeek-V3's shapes (128 heads, a 576-wide latent row, blocks of 16, bfloat16) on v6e
(Mosaic) and a power-of-two row on H100 (Triton). ``-m slow``: every case of
``pallas_kernels/paged_mla/aot.py`` on v5e, v6e, v5p, H100 and A100, with no ptxas spill.
"""
import json
import subprocess

import pytest

from pallas_kernels.aot import targets, venv
from pallas_kernels.paged_mla import aot
from test_aot_kernels import _require_venvs


def _sweep(target: str, only: str | None = None) -> list[dict]:
    _require_venvs([target])
    platform = targets.get(target).platform
    cmd = [venv.python(platform), "-m", "pallas_kernels.paged_mla.aot", "--target", target]
    proc = subprocess.run(cmd + (["--only", only] if only else []), capture_output=True, text=True,
                          timeout=3600, env=venv.environment(platform), cwd=venv._REPO_ROOT)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records, f"the {target} sweep compiled nothing:\n{proc.stderr[-3000:]}"
    return records


def _failures(records):
    return "\n".join(f"{r['case']}: {r['error']}" for r in records if not r["ok"])


@pytest.mark.parametrize("target, only", [("v6e", "bfloat16-r512-p64-h128-bs16"),
                                          ("h100", "bfloat16-r448-p64-h128-bs16")])
def test_deepseek_shapes_compile(target, only):
    records = _sweep(target, only)
    assert [r["case"] for r in records] == [f"mla_paged_decode-{only}"]
    assert not _failures(records), _failures(records)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v5e", "v6e", "v5p", "h100", "a100"])
def test_every_case_compiles(target):
    records = _sweep(target)
    assert [r["case"] for r in records] == [c.name for c in aot.cases()]
    assert not _failures(records), _failures(records)
    assert not [r for r in records if r["spills"]], "ptxas spilled registers"
