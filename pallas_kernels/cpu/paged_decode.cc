// Paged decode attention for the CPU: an XLA FFI custom call (built and loaded by
// pallas_kernels/cpu_decode.py).
//
// For every sequence s < num_seqs with exactly one query token (a decode row), the query heads of
// token query_start_loc[s] attend to the first seq_lens[s] keys of the sequence's blocks; every
// other output row is zero. One work item is one (sequence, KV head): its G = Hq / Hkv query heads
// walk the sequence's blocks once, block by block, with an online softmax (one rescale per block),
// reading each key and value row straight from the pool (no gathered copy). Work items are shared
// between the calling thread and XLA's intra-op thread pool.
//
// Layout (pallas_kernels/reference.py): q [T, Hq, D]; k_pages, v_pages [Hkv, NB, BS, D] float32;
// block_tables [S, B], seq_lens [S], query_start_loc [S + 1], num_seqs [] int32.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::function<void(int64_t)> run;
};

// Runs work items until none is left; the last finisher wakes the caller.
void Drain(const std::shared_ptr<Work>& work) {
  int64_t finished = 0;
  for (int64_t i; (i = work->next.fetch_add(1)) < work->total; ++finished) work->run(i);
  if (finished && work->done.fetch_add(finished) + finished == work->total) {
    std::lock_guard<std::mutex> lock(work->mu);
    work->cv.notify_all();
  }
}

float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 (a score minus its running max), in a form the compiler vectorizes: 2^n e^r
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

// q, out: [G, D]; k, v: one KV head's pages [NB, BS, D]; table: the sequence's blocks. Each key and
// value row is loaded once for the G query heads; exponentials are vectorized over a block.
void AttendRow(const float* q, const float* k, const float* v, const int32_t* table, int64_t len,
               int64_t G, int64_t D, int64_t BS, float scale, float* out) {
  std::vector<float> acc(G * D, 0.f), m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f),
      s(G * BS);
  for (int64_t first = 0; first < len; first += BS) {
    const int64_t block = table[first / BS];
    const float* kb = k + block * BS * D;
    const float* vb = v + block * BS * D;
    const int64_t n = std::min(BS, len - first);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t g = 0; g < G; ++g) s[g * BS + t] = Dot(q + g * D, kb + t * D, D) * scale;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * BS;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
      const float m_new = std::max(m[g], block_max);
      const float correction = std::exp(m[g] - m_new);  // 0 on the first block
      float row_sum = 0.f;
#pragma omp simd reduction(+ : row_sum)
      for (int64_t t = 0; t < n; ++t) {
        sg[t] = ExpNonPositive(sg[t] - m_new);
        row_sum += sg[t];
      }
      l[g] = l[g] * correction + row_sum;
      m[g] = m_new;
      float* a = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] *= correction;
    }
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = vb + t * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * BS + t];
        float* a = acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * vt[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[g * D + d] * inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                           ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto vd = v_pages.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      kd[3] != qd[2] || qd[1] % kd[0] != 0 || seq_lens.dimensions().size() != 1 ||
      seq_lens.dimensions()[0] != td[0] || query_start_loc.dimensions()[0] != td[0] + 1) {
    return ffi::Error::InvalidArgument("jpaged_paged_decode: inconsistent shapes");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[0], NB = kd[1], BS = kd[2];
  const int64_t S = td[0], B = td[1], G = Hq / Hkv;
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* qsl = query_start_loc.typed_data();
  const int64_t rows = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), S);
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * Hq * D);

  std::vector<int64_t> decode;  // sequences with one query token and some context
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens[r];
    if (qsl[r + 1] - qsl[r] == 1 && len > 0 && qsl[r] < T) {
      if (len > B * BS) return ffi::Error::InvalidArgument("jpaged_paged_decode: seq_len exceeds its block table");
      for (int64_t b = 0; b < (len + BS - 1) / BS; ++b) {
        if (tables[r * B + b] < 0 || tables[r * B + b] >= NB) {
          return ffi::Error::InvalidArgument("jpaged_paged_decode: block id out of the pool");
        }
      }
      decode.push_back(r);
    }
  }
  auto work = std::make_shared<Work>();
  work->total = static_cast<int64_t>(decode.size()) * Hkv;
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  work->run = [&](int64_t item) {
    const int64_t r = decode[item / Hkv], h = item % Hkv, token = qsl[r];
    const int64_t offset = (token * Hq + h * G) * D;
    AttendRow(qp + offset, kp + h * NB * BS * D, vp + h * NB * BS * D, tables + r * B, lens[r], G, D, BS,
              scale, o + offset);
  };
  if (work->total == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { Drain(work); });
  Drain(work);
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done.load() == work->total; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));
