"""The compiler venvs of ``scripts/setup_aot_compilers.sh`` and running a sweep inside one.

Each platform's compiler lives in its own venv (``$JPAGED_AOT_DIR/tpu``, ``$JPAGED_AOT_DIR/gpu``,
default ``~/.cache/jpaged/aot``): the plugins change what a plain ``import jax`` does, so they
stay out of the main environment, and a test drives them through a subprocess.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys

from pallas_kernels.aot import targets

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


def main_site_dirs() -> list[str]:
    """The running interpreter's site-packages directories, in its path order: a venv's, a conda
    env's, the base interpreter's (Debian's dist-packages too) and the user site where enabled."""
    dirs = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(os.path.realpath(p) for p in dirs if os.path.isdir(p)))


def link_main_environment(venv_dir: str) -> str:
    """Makes the venv at ``venv_dir`` see this interpreter's packages after its own.

    Writes a ``.pth`` file into the venv's site-packages that adds :func:`main_site_dirs` with
    ``site.addsitedir`` (so their own ``.pth`` files, editable installs among them, apply too).
    ``python -m venv --system-site-packages`` is no substitute: run from inside a venv, it links
    the base interpreter's site-packages, not the venv's.

    Returns:
      The path of the ``.pth`` file.
    """
    venv_python = os.path.join(venv_dir, "bin", "python")
    purelib = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    path = os.path.join(purelib, "jpaged-main-environment.pth")
    with open(path, "w") as f:
        for d in main_site_dirs():
            f.write(f"import site; site.addsitedir({d!r})\n")
    return path


def run_sweep(target: str, preset: str, only: str | None = None, timeout: float = 3600):
    """Runs ``pallas_kernels.aot.sweep`` for ``target`` in its venv.

    Returns:
      ``(records, stderr)``: one dict per compiled case (see ``sweep.py``) and the process's
      stderr (its last line counts the cases that compiled).
    """
    platform = targets.get(target).platform
    cmd = [python(platform), "-m", "pallas_kernels.aot.sweep", "--target", target,
           "--preset", preset]
    if only:
        cmd += ["--only", only]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=environment(platform), cwd=_REPO_ROOT)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return records, proc.stderr


if __name__ == "__main__":  # used by scripts/setup_aot_compilers.sh
    if sys.argv[1:2] == ["site-dirs"]:
        print("\n".join(main_site_dirs()))
    elif sys.argv[1:2] == ["link"] and len(sys.argv) == 3:
        print(link_main_environment(sys.argv[2]))
    else:
        sys.exit("usage: python -m pallas_kernels.aot.venv site-dirs | link VENV_DIR")
