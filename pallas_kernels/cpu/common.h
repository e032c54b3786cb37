// What the CPU kernels share: the vector type of the instruction set, running work items on XLA's
// intra-op thread pool, a vectorizable exp for non-positive arguments and tanh.
#ifndef JPAGED_CPU_COMMON_H_
#define JPAGED_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace jpaged {

// Floats per vector register (AVX-512, AVX/AVX2, SSE) and GCC's vector of that width: a vector
// wider than the registers is kept in memory by the compiler, and is slow.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

#ifdef __AVX512F__
// Lane t of the result is the sum of v[t]'s 16 lanes: a transposing reduction tree (16 -> 8 -> 4
// -> 2 -> 1 vectors), three instructions per pair instead of a horizontal sum per vector.
inline __m512 SumLanes16(const __m512* v) {
  __m512 r[8], quad[4], pair[2];
  for (int i = 0; i < 8; ++i) {  // r[i]: v[2i] in lanes 0-7, v[2i+1] in lanes 8-15 (partial sums)
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // quad[i]: 128-bit chunk c holds v[4i + c]
    quad[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // pair[i]: chunk c holds v[8i + c] (2 lanes), v[8i + 4 + c] (2 lanes)
    pair[i] = _mm512_add_ps(_mm512_shuffle_ps(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(quad[2 * i], quad[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Lane 4c + j now holds the sum of v[4j + c]: transpose the 4 x 4 lane grid back.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
#endif

// A spin-wait hint to the core (x86's pause).
inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// How long ParallelFor's caller spins for its helpers' last items before it sleeps.
constexpr int64_t kSpinMicros = 50;

// How many threads run a ParallelFor: the calling thread and pool.num_threads() - 1 helpers, one
// per core of the pool (the caller is not one of the pool's threads: a helper for every pool thread
// would put one thread more than there are cores to work, and measured slower).
inline int64_t Workers(xla::ffi::ThreadPool& pool) { return std::max<int64_t>(1, pool.num_threads()); }

// Runs run(0) ... run(total - 1) on Workers(pool) threads, the calling one among them, items handed
// out one at a time (they may differ in cost); returns when all are done.
inline void ParallelFor(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> run) {
  struct Work {
    std::atomic<int64_t> next{0}, done{0};
    int64_t total;
    std::function<void(int64_t)> run;
    std::mutex mu;
    std::condition_variable cv;
  };
  if (total <= 0) return;
  auto work = std::make_shared<Work>();
  work->total = total;
  work->run = std::move(run);
  auto drain = [work] {  // a helper that starts after every item is taken does nothing
    int64_t finished = 0;
    for (int64_t i; (i = work->next.fetch_add(1)) < work->total; ++finished) work->run(i);
    if (finished && work->done.fetch_add(finished) + finished == work->total) {
      std::lock_guard<std::mutex> lock(work->mu);
      work->cv.notify_all();
    }
  };
  for (int64_t i = 0, helpers = std::min<int64_t>(Workers(pool) - 1, total - 1); i < helpers; ++i) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  // The helpers' last items end within an item's time: the caller waits for them spinning up to
  // kSpinMicros before it sleeps, since a sleeping thread resumes only when the kernel wakes it.
  const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
  while (work->done.load(std::memory_order_acquire) != work->total) {
    for (int i = 0; i < 64; ++i) Pause();
    if (std::chrono::steady_clock::now() > spin_end) break;
  }
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == work->total; });
}

// exp(x) for x <= 0 (a value minus its running max), in a form the compiler vectorizes: 2^n e^r
// with |r| <= ln2 / 2 and Cephes' degree-6 polynomial for e^r (~1e-7 relative error); 0 below -88.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -88.f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -88.f ? 0.f : p * two_n;
}

// tanh(x) from ExpNonPositive, in a form the compiler vectorizes (absolute error ~1e-7).
inline float Tanh(float x) {
  const float e = ExpNonPositive(-2.f * std::fabs(x));
  return std::copysign((1.f - e) / (1.f + e), x);
}

}  // namespace jpaged

#endif  // JPAGED_CPU_COMMON_H_
