#!/usr/bin/env bash
# Kernel check on a TPU or GPU host, in under 5 minutes:
#   1. the kernel tests compiled for the device (PALLAS_INTERPRET=0: only that platform's kernel),
#      and the export tests;
#   2. benchmark_kernels.py: the Pallas decode kernel against dense attention, then the engine's
#      jnp attention (--mode=steps) on the device.
# On a host without one it says so and runs a short interpret-mode smoke test instead.
#
#   bash scripts/accelerator_check.sh   # output also in $ACCELERATOR_CHECK_LOG (default /tmp/accelerator_check.log)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log=${ACCELERATOR_CHECK_LOG:-${TMPDIR:-/tmp}/accelerator_check.log}
exec > >(tee "$log") 2>&1

platform=$(python -c "import jax; print(jax.default_backend())" 2>/dev/null)
echo "platform: ${platform:-unknown}; $(python -c 'import jax; print(jax.devices())' 2>/dev/null)"
status=0
if [[ "$platform" != "tpu" && "$platform" != "gpu" ]]; then
  echo "No TPU or GPU here: interpret-mode smoke test only (figures need an accelerator)."
  PALLAS_INTERPRET=1 timeout 240 python -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py \
    -k "test_paged_attention and bs16_d64_g4_f32 or test_write_kv" || status=$?
  exit $status
fi

echo "== kernel tests, compiled for $platform =="
PALLAS_INTERPRET=0 timeout 150 python -m pytest -q -p no:cacheprovider \
  tests/kernels/test_kernels.py tests/kernels/test_kernels_export.py || status=$?

echo "== paged (Pallas kernel) vs dense decode attention, bfloat16 =="
timeout 60 python scripts/benchmark_kernels.py --mode=dense --backend=pallas --dtype=bfloat16 \
  --batch=1,8,32 --context=256,1024,2048 --num_runs=20 || status=$?

echo "== engine xla attention on the device: old vs new formulation =="
timeout 60 python scripts/benchmark_kernels.py --mode=steps --num_runs=10 || status=$?
exit $status
