#!/usr/bin/env bash
# Installs Google's Tunix (google-tunix) and jpaged into their own venv, so that the main
# environment never sees Tunix's pins (safetensors<0.8, its datasets/grain/tfds stack):
#   $JPAGED_TUNIX_DIR (default ~/.cache/jpaged/tunix): google-tunix, the main environment's jax,
#   jaxlib, flax, numpy, optax versions, jpaged (`pip install -e <repo> --no-deps`) and jpaged's
#   runtime deps at versions that satisfy Tunix's pins.
# The venv is self-contained (no --system-site-packages: from inside a venv that flag links the
# base interpreter's packages, not the venv's). Idempotent: a venv whose marker matches the
# requirement set below is kept. tests/integrations/test_tunix.py runs Tunix's GRPO loop in it.
#
#   bash scripts/setup_tunix.sh        # JPAGED_TUNIX_DIR defaults to ~/.cache/jpaged/tunix
set -euo pipefail
PYTHON=${PYTHON:-python}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TUNIX_DIR=${JPAGED_TUNIX_DIR:-$HOME/.cache/jpaged/tunix}
TUNIX_VERSION=${JPAGED_TUNIX_VERSION:-0.1.7}

fail() { echo "setup_tunix: $*" >&2; exit 1; }
version_of() {  # the main environment's version of a distribution, so both envs compute alike
  "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null \
    || fail "the main environment ($PYTHON) lacks $1"
}
REQUIREMENTS=(
  "google-tunix==$TUNIX_VERSION"
  "jax==$(version_of jax)" "jaxlib==$(version_of jaxlib)" "flax==$(version_of flax)"
  "numpy==$(version_of numpy)" "optax==$(version_of optax)"
  "safetensors<0.8"                       # Tunix's pin (the main environment has 0.8)
  transformers tokenizers gguf jinja2 absl-py tqdm "llguidance>=1.0" orbax-checkpoint pytest
)
MARKER="${REQUIREMENTS[*]}"

if [[ -f "$TUNIX_DIR/.requirements" && "$(cat "$TUNIX_DIR/.requirements")" == "$MARKER" ]] \
   && "$TUNIX_DIR/bin/python" -c "import tunix, jpaged" 2>/dev/null; then
  echo "tunix venv: ready ($TUNIX_DIR, google-tunix $TUNIX_VERSION)"
  exit 0
fi
echo "tunix venv: installing ${REQUIREMENTS[*]} into $TUNIX_DIR"
rm -rf "$TUNIX_DIR"
"$PYTHON" -m venv "$TUNIX_DIR" || fail "could not create a venv at $TUNIX_DIR (python -m venv)"
PIP=("$TUNIX_DIR/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "${REQUIREMENTS[@]}" || fail "pip could not install: ${REQUIREMENTS[*]}"
"${PIP[@]}" --no-deps -e "$REPO" || fail "pip could not install jpaged from $REPO (--no-deps -e)"
JAX_PLATFORMS=cpu "$TUNIX_DIR/bin/python" -c "import tunix.rl.rl_cluster" \
  || fail "google-tunix $TUNIX_VERSION installed but 'import tunix.rl.rl_cluster' fails"
JAX_PLATFORMS=cpu "$TUNIX_DIR/bin/python" -c "import jpaged.integrations.tunix" \
  || fail "jpaged installed but 'import jpaged.integrations.tunix' fails in $TUNIX_DIR"
echo "$MARKER" > "$TUNIX_DIR/.requirements"
"$TUNIX_DIR/bin/python" -m pip freeze --exclude-editable > "$TUNIX_DIR/versions.txt"
echo "tunix venv: ready ($TUNIX_DIR, versions in $TUNIX_DIR/versions.txt)"
