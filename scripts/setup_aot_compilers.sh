#!/usr/bin/env bash
# Installs the real TPU and CUDA compilers for deviceless ahead-of-time compiles, each in its own
# venv so that the main environment never sees them (both plugins change what `import jax` does):
#   $JPAGED_AOT_DIR/tpu: libtpu (jax[tpu] at the installed jax version): Mosaic + XLA TPU
#   $JPAGED_AOT_DIR/gpu: jax-cuda12-plugin + jax-cuda12-pjrt at that version, nvidia-cuda-nvcc-cu12
#                        (ptxas), absl-py (for Mosaic GPU's import): XLA GPU + Triton + ptxas
# Each venv sees the site-packages of the interpreter that runs this script ($PYTHON: a venv's, a
# conda env's or the base interpreter's) through a .pth file, so it reuses that environment's jax,
# jaxlib, numpy and absl and only adds the compilers. (`python -m venv --system-site-packages` would
# not do: run from inside a venv it links the *base* interpreter's site-packages, not the venv's.)
# Idempotent: a venv whose marker names the installed jax version and the same main environment is
# kept. `pallas_kernels.aot` finds them; `tests/kernels/test_aot_kernels.py` compiles every kernel in them.
#
#   bash scripts/setup_aot_compilers.sh        # JPAGED_AOT_DIR defaults to ~/.cache/jpaged/aot
set -euo pipefail
PYTHON=${PYTHON:-python}
AOT_DIR=${JPAGED_AOT_DIR:-$HOME/.cache/jpaged/aot}

fail() { echo "setup_aot_compilers: $*" >&2; exit 1; }

JAX_VERSION=$("$PYTHON" -c 'import jax; print(jax.__version__)' 2>/dev/null) \
  || fail "'$PYTHON' cannot import jax: install jpaged into that environment first (pip install -e .)"
"$PYTHON" -c 'import absl, numpy' 2>/dev/null \
  || fail "'$PYTHON' cannot import absl-py and numpy: install jpaged into that environment first (pip install -e .)"
# The running interpreter's site-packages directories (venv, conda, the base interpreter, the user
# site): what the compiler venvs add to their path.
MAIN_SITE=$("$PYTHON" -m pallas_kernels.aot.venv site-dirs) \
  || fail "'$PYTHON -m pallas_kernels.aot.venv' failed: run this script from the jpaged checkout after pip install -e ."
[[ -n "$MAIN_SITE" ]] || fail "'$PYTHON' reports no site-packages directory on its path"
MARKER="$JAX_VERSION
$MAIN_SITE"

make_venv() {  # name, import check, pip requirements...
  local name=$1 check=$2 dir="$AOT_DIR/$1"
  shift 2
  if [[ -f "$dir/.jax-version" && "$(cat "$dir/.jax-version")" == "$MARKER" ]]; then
    echo "aot venv $name: ready ($dir, jax $JAX_VERSION)"
    return
  fi
  echo "aot venv $name: installing $* into $dir"
  rm -rf "$dir"
  "$PYTHON" -m venv "$dir" || fail "'$PYTHON -m venv $dir' failed (on Debian/Ubuntu: apt-get install python3-venv)"
  "$PYTHON" -m pallas_kernels.aot.venv link "$dir" >/dev/null || fail "could not link $dir to the main environment"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" \
    || fail "pip could not install $* into $dir (its error is above)"
  JAX_PLATFORMS=cpu "$dir/bin/python" -c "$check" \
    || fail "the $name venv at $dir does not pass its check: $check"
  echo "$MARKER" > "$dir/.jax-version"
}

make_venv tpu "import libtpu, jax, absl; assert jax.__version__ == '$JAX_VERSION'" \
  "jax[tpu]==$JAX_VERSION"
make_venv gpu "import jax_plugins.xla_cuda12, jax, absl; assert jax.__version__ == '$JAX_VERSION'" \
  "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION" nvidia-cuda-nvcc-cu12 absl-py
