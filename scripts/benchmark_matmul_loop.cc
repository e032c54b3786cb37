// The C++ matmul's panel loop (pallas_kernels/cpu/matmul.cc, `Panels`) on one core, without XLA:
// its thread pool, its hand-off and the other core's memory traffic left out, to see how near the
// loop itself comes to the core's FMA peak. The weight is cycled through `copies` copies (cold when
// they exceed the caches), the work split into items of `panels` panels as MatmulImpl splits it
// (default: the whole width in one item); the least time of 30 runs, as GFLOP/s. With a sixth
// argument `t`, the transposed form's loop instead (`DotRows`, w [N, K]: a tied embedding's logits).
//
// Build and run from the repository root (the include path is jaxlib's; -march as the library's):
//   g++ -O3 -march=native -fopenmp-simd -ffast-math -fno-finite-math-only -std=c++17
//       -I "$(python -c 'import jax; print(jax.ffi.include_dir())')"
//       scripts/benchmark_matmul_loop.cc -o /tmp/matmul_loop          (one command)
//   /tmp/matmul_loop M K N [copies [panels [t]]]  # e.g. /tmp/matmul_loop 32 512 32000 4 32
#include "../pallas_kernels/cpu/matmul.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace {

struct Free {
  void operator()(float* p) const { std::free(p); }
};

// 64-byte aligned floats, as XLA's buffers are (a misaligned weight splits its cache lines).
std::unique_ptr<float[], Free> Floats(size_t n) {
  auto p = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<float>(i % 97) / 97.f - 0.5f;
  return std::unique_ptr<float[], Free>(p);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s M K N [copies [panels [t]]]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const int64_t copies = argc > 4 ? std::atoll(argv[4]) : 1, panels = N / kPanel;
  const int64_t per_item = argc > 5 ? std::atoll(argv[5]) : panels;
  const bool transposed = argc > 6 && argv[6][0] == 't';
  if ((M <= kFewRows && !transposed) || panels == 0 || copies < 1 || per_item < 1) {
    std::fprintf(stderr, "expected M > %ld (FewRows serves fewer), N >= %ld, copies and panels >= 1\n",
                 static_cast<long>(kFewRows), static_cast<long>(kPanel));
    return 2;
  }
  auto x = Floats(M * K), out = Floats(M * N), w = Floats(static_cast<size_t>(K) * N * copies);
  double best = 1e30;
  for (int run = 0; run < 33; ++run) {
    const float* weight = w.get() + static_cast<size_t>(run % copies) * K * N;
    const auto start = std::chrono::steady_clock::now();
    for (int64_t p = 0; p < panels; p += per_item) {
      if (transposed) {
        DotRows(x.get(), weight, M, K, N, p * kPanel, std::min(panels, p + per_item) * kPanel, out.get());
      } else {
        Panels(x.get(), weight, M, K, N, p, std::min(panels, p + per_item), out.get());
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (run >= 3) best = std::min(best, seconds);
  }
  const double flops = 2.0 * M * K * (panels * kPanel);
  std::printf("[%ld, %ld] x [%ld, %ld]%s, %ld copies, items of %ld panels: %.3f ms, %.1f GFLOP/s on one core\n",
              static_cast<long>(M), static_cast<long>(K), static_cast<long>(K), static_cast<long>(N),
              transposed ? " (stored transposed)" : "",
              static_cast<long>(copies), static_cast<long>(per_item), best * 1e3, flops / best / 1e9);
  return 0;
}
