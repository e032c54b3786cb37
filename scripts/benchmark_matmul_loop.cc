// The C++ matmul's panel loop (pallas_kernels/cpu/matmul.cc, `Panels`) without XLA: its thread
// pool's hand-off and XLA's other work left out, to see how near the loop itself comes to the FMA
// peak. The weight is cycled through `copies` copies (cold when they exceed the caches), the work
// split into items of `panels` panels as MatmulImpl splits it (default: the whole width in one
// item). The form: `n` the weight [K, N] as it lies (`Panels`, the default), `t` stored transposed
// (`DotRows`, w [N, K]: a tied embedding's logits), `p` packed panel by panel (`PackedPanels`,
// w [N / 64, K, 64]; `panels` then counts packed panels). `threads` > 1 share each call's items
// as MatmulImpl's threads do (the helpers spin between calls: no wake-up cost). Prints the least
// and the median time of 30 calls, and GFLOP/s at each.
//
// Build and run from the repository root (the include path is jaxlib's; -march as the library's):
//   g++ -O3 -march=native -fopenmp-simd -ffast-math -fno-finite-math-only -std=c++17
//       -I "$(python -c 'import jax; print(jax.ffi.include_dir())')"
//       scripts/benchmark_matmul_loop.cc -o /tmp/matmul_loop -lpthread       (one command)
//   /tmp/matmul_loop M K N [copies [panels [form [threads]]]]  # e.g. /tmp/matmul_loop 32 512 32000 4 32
#include "../pallas_kernels/cpu/matmul.cc"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

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
    std::fprintf(stderr, "usage: %s M K N [copies [panels [n|t|p [threads]]]]\n", argv[0]);
    return 2;
  }
  const int64_t M = std::atoll(argv[1]), K = std::atoll(argv[2]), N = std::atoll(argv[3]);
  const char form = argc > 6 ? argv[6][0] : 'n';
  const int64_t width = form == 'p' ? kPackedPanel : kPanel, panels = N / width;
  const int64_t copies = argc > 4 ? std::atoll(argv[4]) : 1;
  const int64_t per_item = argc > 5 ? std::atoll(argv[5]) : panels;
  const int threads = argc > 7 ? std::atoi(argv[7]) : 1;
  if ((M <= kFewRows && form != 't') || panels == 0 || copies < 1 || per_item < 1 || threads < 1 ||
      (form != 'n' && form != 't' && form != 'p') || (form == 'p' && N % kPackedPanel != 0)) {
    std::fprintf(stderr, "expected M > %ld (FewRows serves fewer), N >= %ld (a multiple of %ld packed), copies, "
                 "panels and threads >= 1, a form n, t or p\n", static_cast<long>(kFewRows),
                 static_cast<long>(width), static_cast<long>(kPackedPanel));
    return 2;
  }
  auto x = Floats(M * K), out = Floats(M * N), w = Floats(static_cast<size_t>(K) * N * copies);
  const int64_t items = (panels + per_item - 1) / per_item;
  const float* weight = w.get();
  std::atomic<int64_t> next{items}, done{0};
  std::atomic<int> call{0};
  std::atomic<bool> stop{false};
  auto drain = [&] {  // takes items of the current call until none is left
    int64_t finished = 0;
    for (int64_t i; (i = next.fetch_add(1)) < items; ++finished) {
      const int64_t p0 = i * per_item, p1 = std::min(panels, p0 + per_item);
      if (form == 't') {
        DotRows(x.get(), weight, M, K, N, p0 * kPanel, p1 * kPanel, out.get());
      } else if (form == 'p') {
        PackedPanels(x.get(), weight, M, K, N, p0, p1, out.get());
      } else {
        Panels(x.get(), weight, M, K, N, p0, p1, out.get());
      }
    }
    done.fetch_add(finished);
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) {
    helpers.emplace_back([&] {
      for (int seen = 0; !stop.load();) {
        if (call.load() != seen) {
          seen = call.load();
          drain();
        } else {
          jpaged::Pause();
        }
      }
    });
  }
  std::vector<double> times;
  for (int run = 0; run < 33; ++run) {
    weight = w.get() + static_cast<size_t>(run % copies) * K * N;
    done = 0;
    const auto start = std::chrono::steady_clock::now();
    next = 0;
    call.fetch_add(1);
    drain();
    while (done.load() != items) jpaged::Pause();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (run >= 3) times.push_back(seconds);
  }
  stop = true;
  for (auto& helper : helpers) helper.join();
  std::sort(times.begin(), times.end());
  const double flops = 2.0 * M * K * (panels * width), best = times.front(), median = times[times.size() / 2];
  std::printf("[%ld, %ld] x [%ld, %ld]%s, %ld copies, items of %ld panels, %d thread%s: least %.3f ms (%.1f GFLOP/s), "
              "median %.3f ms (%.1f GFLOP/s)\n",
              static_cast<long>(M), static_cast<long>(K), static_cast<long>(K), static_cast<long>(N),
              form == 't' ? " (stored transposed)" : form == 'p' ? " (packed)" : "", static_cast<long>(copies),
              static_cast<long>(per_item), threads, threads == 1 ? "" : "s", best * 1e3, flops / best / 1e9,
              median * 1e3, flops / median / 1e9);
  return 0;
}
