#!/usr/bin/env bash
# Installs the real TPU and CUDA compilers for deviceless ahead-of-time compiles, each in its own
# venv so that the main environment never sees them (both plugins change what `import jax` does):
#   $JPAGED_AOT_DIR/tpu: libtpu (jax[tpu] at the installed jax version): Mosaic + XLA TPU
#   $JPAGED_AOT_DIR/gpu: jax-cuda12-plugin + jax-cuda12-pjrt at that version, nvidia-cuda-nvcc-cu12
#                        (ptxas), absl-py (for Mosaic GPU's import): XLA GPU + Triton + ptxas
# Both venvs reuse the main environment's jax, jaxlib, numpy (--system-site-packages), so they only
# add the compilers. Idempotent: a venv whose marker names the installed jax version is kept.
# `jpaged_kernels.aot` finds them; `tests/test_aot_kernels.py` compiles every kernel in them.
#
#   bash scripts/setup_aot_compilers.sh        # JPAGED_AOT_DIR defaults to ~/.cache/jpaged/aot
set -euo pipefail
PYTHON=${PYTHON:-python}
AOT_DIR=${JPAGED_AOT_DIR:-$HOME/.cache/jpaged/aot}
JAX_VERSION=$("$PYTHON" -c 'import jax; print(jax.__version__)')

make_venv() {  # name, import check, pip requirements...
  local name=$1 check=$2 dir="$AOT_DIR/$1"
  shift 2
  if [[ -f "$dir/.jax-version" && "$(cat "$dir/.jax-version")" == "$JAX_VERSION" ]]; then
    echo "aot venv $name: ready ($dir, jax $JAX_VERSION)"
    return
  fi
  echo "aot venv $name: installing $* into $dir"
  rm -rf "$dir"
  "$PYTHON" -m venv --system-site-packages "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
  JAX_PLATFORMS=cpu "$dir/bin/python" -c "$check"
  echo "$JAX_VERSION" > "$dir/.jax-version"
}

make_venv tpu "import libtpu, jax; assert jax.__version__ == '$JAX_VERSION'" \
  "jax[tpu]==$JAX_VERSION"
make_venv gpu "import jax_plugins.xla_cuda12, jax; assert jax.__version__ == '$JAX_VERSION'" \
  "jax-cuda12-plugin==$JAX_VERSION" "jax-cuda12-pjrt==$JAX_VERSION" nvidia-cuda-nvcc-cu12 absl-py
