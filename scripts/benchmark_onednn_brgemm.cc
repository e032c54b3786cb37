// oneDNN's ukernel API (dnnl::ukernel::brgemm), float32, on one decode-step matmul shape, to set
// beside the C++ kernel's figures from `scripts/benchmark_kernels.py --mode=matmul` (docs/cpu.md,
// "Alternatives to writing more by hand, measured"): out[M, N] = x[M, K] @ w[K, N].
//
// The weight is either packed into column panels [N / nb][K][nb] first (a GEMM library's layout;
// the packing is not timed) or read where it lies, row-major with leading dimension N (as jpaged's
// kernel reads it). Two threads (the caller and one worker spinning between calls) split the
// panels; before each call a 64 MiB buffer is written, so the weight comes from memory. Prints the
// least of 7 calls and the largest difference from a plain triple loop.
//
// The ukernel API is not in a binary package (PyPI's onednn is built without it, apt's libdnnl
// predates it); build oneDNN from source with it (each command one line; 20-35 minutes on 2 cores):
//   cmake -S oneDNN -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DONEDNN_EXPERIMENTAL_UKERNEL=ON
//     -DONEDNN_CPU_RUNTIME=SEQ -DONEDNN_GPU_RUNTIME=NONE -DONEDNN_BUILD_TESTS=OFF
//     -DONEDNN_BUILD_EXAMPLES=OFF -DONEDNN_BUILD_GRAPH=OFF -DONEDNN_ENABLE_WORKLOAD=INFERENCE
//     -DONEDNN_ENABLE_PRIMITIVE=MATMUL
//   ninja -C build
// then this file:
//   g++ -O2 -std=c++17 -IoneDNN/include -Ibuild/include scripts/benchmark_onednn_brgemm.cc
//     -Lbuild/src -ldnnl -lpthread -Wl,-rpath,$PWD/build/src -o brgemm_bench
//   ./brgemm_bench M K N nb [packed: 1 (default) or 0]
#include <oneapi/dnnl/dnnl_ukernel.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

using dnnl::memory;
using dnnl::ukernel::brgemm;
using dt = memory::data_type;

namespace {

struct Call {
  const float* x;
  const float* w;  // the panels, or the weight itself
  float* out;
  long K, N, nb;
  bool packed;
  brgemm *full, *tail;  // nb columns; the last panel's N % nb (null when 0)
};

Call call;
std::atomic<long> started{0}, finished{0};
std::vector<unsigned char> scratch[2];

// Panels [np * t / 2, np * (t + 1) / 2) of the call, thread t of 2.
void RunShare(int t) {
  const long panels = (call.N + call.nb - 1) / call.nb;
  const std::vector<std::pair<memory::dim, memory::dim>> offsets{{0, 0}};
  for (long p = panels * t / 2; p < panels * (t + 1) / 2; ++p) {
    brgemm* kernel = (p == panels - 1 && call.tail) ? call.tail : call.full;
    const float* w = call.w + (call.packed ? p * call.K * call.nb : p * call.nb);
    kernel->execute(call.x, w, offsets, call.out + p * call.nb, scratch[t].data());
  }
}

void Worker() {
  for (long seen = 0;;) {
    long now;
    while ((now = started.load(std::memory_order_acquire)) == seen) {
    }
    if (now < 0) return;
    seen = now;
    RunShare(1);
    finished.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s M K N nb [packed: 1 or 0]\n", argv[0]);
    return 2;
  }
  const long M = std::atol(argv[1]), K = std::atol(argv[2]), N = std::atol(argv[3]), nb = std::atol(argv[4]);
  const bool packed = argc < 6 || std::atoi(argv[5]) != 0;
  if (brgemm::get_B_pack_type(dt::f32, dt::f32) != dnnl::ukernel::pack_type::no_trans) {
    std::fprintf(stderr, "this CPU's f32 brgemm wants its weight transformed: not measured here\n");
    return 1;
  }
  auto make = [&](long n) {
    auto* kernel = new brgemm(M, n, K, 1, K, packed ? nb : N, N, dt::f32, dt::f32, dt::f32);
    kernel->set_add_C(false);
    if (!kernel->finalize()) {
      std::fprintf(stderr, "brgemm M=%ld N=%ld K=%ld: not supported on this CPU\n", M, n, K);
      std::exit(1);
    }
    kernel->generate();
    return kernel;
  };
  brgemm* full = make(nb);
  brgemm* tail = N % nb ? make(N % nb) : nullptr;
  for (auto& s : scratch) s.resize(std::max<size_t>(full->get_scratchpad_size(), 64));

  const long panels = (N + nb - 1) / nb;
  std::vector<float> x(M * K), w(K * N), packed_w(panels * K * nb, 0.f), out(M * N), ref(M * N, 0.f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 13) / 13.f - 0.5f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 5) % 11) / 11.f - 0.5f;
  for (long p = 0; p < panels; ++p)
    for (long k = 0; k < K; ++k)
      for (long j = 0; j < nb && p * nb + j < N; ++j) packed_w[(p * K + k) * nb + j] = w[k * N + p * nb + j];
  call = Call{x.data(), packed ? packed_w.data() : w.data(), out.data(), K, N, nb, packed, full, tail};

  std::thread worker(Worker);
  std::vector<char> evict(64 << 20);
  double best = 1e9;
  for (int run = 0; run < 7; ++run) {
    std::memset(evict.data(), run, evict.size());
    const auto start = std::chrono::steady_clock::now();
    const long n = started.load() + 1;
    started.store(n, std::memory_order_release);
    RunShare(0);
    while (finished.load(std::memory_order_acquire) < n) {
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  started.store(-1);
  worker.join();

  for (long i = 0; i < M; ++i)
    for (long k = 0; k < K; ++k)
      for (long j = 0; j < N; ++j) ref[i * N + j] += x[i * K + k] * w[k * N + j];
  double err = 0;
  for (long i = 0; i < M * N; ++i) err = std::max(err, static_cast<double>(std::fabs(ref[i] - out[i])));
  std::printf("%s [%ld, %ld] x [%ld, %ld], panels of %ld: %.3f ms, %.1f GFLOP/s, weight %.1f GB/s, max |diff| %.1e\n",
              packed ? "packed" : "in place", M, K, K, N, nb, best * 1e3, 2.0 * M * K * N / best / 1e9,
              K * N * 4 / best / 1e9, err);
  return 0;
}
