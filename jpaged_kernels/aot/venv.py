"""The compiler venvs of ``scripts/setup_aot_compilers.sh`` and running a sweep inside one.

Each platform's compiler lives in its own venv (``$JPAGED_AOT_DIR/tpu``, ``$JPAGED_AOT_DIR/gpu``,
default ``~/.cache/jpaged/aot``): the plugins change what a plain ``import jax`` does, so they
stay out of the main environment, and a test drives them through a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess

from jpaged_kernels.aot import targets

SETUP = "bash scripts/setup_aot_compilers.sh"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def aot_dir() -> str:
    return os.environ.get("JPAGED_AOT_DIR", os.path.expanduser("~/.cache/jpaged/aot"))


def python(platform: str) -> str:
    """The venv interpreter for ``platform`` (``"tpu"`` or ``"cuda"``)."""
    return os.path.join(aot_dir(), "tpu" if platform == "tpu" else "gpu", "bin", "python")


def missing(platform: str) -> str | None:
    """Why the venv of ``platform`` cannot be used (None when it is ready)."""
    path = python(platform)
    marker = os.path.join(os.path.dirname(os.path.dirname(path)), ".jax-version")
    if not (os.path.exists(path) and os.path.exists(marker)):
        return f"no {platform} compiler venv at {os.path.dirname(os.path.dirname(path))}: run `{SETUP}`"
    return None


def environment(platform: str) -> dict:
    """Environment of a compile subprocess: this checkout first on the path, no device sought,
    C++ logs on (ptxas's spill warnings)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    env.pop("XLA_FLAGS", None)  # host-platform flags of the caller's tests mean nothing here
    if platform == "tpu":
        env.pop("JAX_PLATFORMS", None)
        env.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # quiets libtpu's host probe
        # libtpu takes /tmp/libtpu_lockfile for the one process that may drive the chips; a
        # deviceless compile drives none, so two sweeps (or another job's compile) may run.
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    else:
        env["JAX_PLATFORMS"] = "cpu"  # else the CUDA plugin looks for a GPU and never registers
    return env


def run_sweep(target: str, preset: str, only: str | None = None, timeout: float = 3600):
    """Runs ``jpaged_kernels.aot.sweep`` for ``target`` in its venv.

    Returns:
      ``(records, stderr)``: one dict per compiled case (see ``sweep.py``) and the process's
      stderr (its last line counts the cases that compiled).
    """
    platform = targets.get(target).platform
    cmd = [python(platform), "-m", "jpaged_kernels.aot.sweep", "--target", target,
           "--preset", preset]
    if only:
        cmd += ["--only", only]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=environment(platform), cwd=_REPO_ROOT)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return records, proc.stderr
