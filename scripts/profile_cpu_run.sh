#!/usr/bin/env bash
# Where the CPU time of a benchmark run goes, by kind of work, from `perf record` samples (Linux
# `perf`, not a Python package). The C++ kernels run inside XLA's program as custom calls, which a
# `jax.profiler` trace does not show; perf's samples do, by symbol.
#
# Runs `scripts/benchmark_throughput.py` with the given flags under `perf record` and sums the
# samples of its timed run: the seconds the benchmark reports for it, ending at the last C++ matmul
# sample (the run's last step). Prints CPU-seconds per kind: the C++ matmul (`Panels` and its
# `PanelLoop`s, which an AVX-512 build keeps apart, `FewRows`, `DotRows`, `DotBlock`), the C++
# attention (`Attend*`), XLA's own dots (YNNPACK's `ynn::` kernels), the Python interpreter
# (libpython), the rest (XLA's other code, the kernel, libc). With both cores busy, a kind's
# wall-clock share is its CPU-seconds over twice the span.
#
#   bash scripts/profile_cpu_run.sh --workload fixed --num_requests 32
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "profile_cpu_run.sh: needs Linux perf (e.g. apt install linux-perf)" >&2; exit 2; }
hz=499
data=$(mktemp --suffix=.perf.data)
out=$(mktemp)
trap 'rm -f "$data" "$out"' EXIT
PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" perf record -q -F "$hz" -o "$data" -- \
  python scripts/benchmark_throughput.py "$@" | tee "$out"
# the timed run's seconds: "... steps 19  16.8 s (+0.1 s compiling ..." (the last run printed)
seconds=$(grep -oE 'steps [0-9]+ +[0-9.]+ s' "$out" | tail -1 | awk '{print $3}')
[ -n "$seconds" ] || { echo "profile_cpu_run.sh: no timed run in the benchmark's output" >&2; exit 1; }
perf script -i "$data" -F time,ip,sym,dso 2>/dev/null | awk -v hz="$hz" -v seconds="$seconds" -v matmul="Panel|FewRows|DotRows|DotBlock" '
  { t = $1 + 0; tm[NR] = t; line[NR] = $0; if ($0 ~ matmul) last = t }
  END {
    if (!last) { print "profile_cpu_run.sh: no C++ matmul samples (did the kernels serve?)"; exit 1 }
    start = last - seconds
    for (i = 1; i <= NR; i++) {
      if (tm[i] < start || tm[i] > last) continue
      total++; s = line[i]
      if (s ~ matmul) kind["C++ matmul"]++
      else if (s ~ /Attend/) kind["C++ attention"]++
      else if (s ~ /ynn::/) kind["XLA dot"]++
      else if (s ~ /libpython/) kind["Python"]++
      else kind["rest"]++
    }
    printf "timed run: %.2f s, %d samples = %.2f CPU-s at %d Hz (both cores busy: %.2f)\n", last - start, total, total / hz, hz, 2 * (last - start)
    for (k in kind) printf "  %-14s %6.2f CPU-s  %5.1f%%\n", k, kind[k] / hz, 100 * kind[k] / total
  }'
