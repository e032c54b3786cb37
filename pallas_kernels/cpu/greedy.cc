// Greedy sampling's reductions for the CPU in one call: per row of float32 logits, the index of
// the first maximum and the log-sum-exp (an XLA FFI custom call, built with paged_attention.cc by
// pallas_kernels/cpu_kernels.py).
//
// XLA's CPU code runs these as three or four passes over the [rows, vocab] logits (a max, an index
// search as a reduce-window tree, the exp-sum), each over the whole batch; here the passes over a
// row (its maximum, the maximum's first index, the exp-sum) run while the row sits in the core's
// cache, and rows are shared with XLA's intra-op thread pool.
//
// The results match jnp's argmax and logsumexp: the first of equal maxima; a row of -inf gives
// index 0 and -inf, one with +inf the first +inf and +inf. A row with a NaN gives index vocab - 1
// and a NaN log-sum-exp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

// The largest of x[0, n) (n >= 1), NaN where any is NaN. Independent lanes, so that the compiler
// vectorizes without a dependency chain through one running maximum.
float MaxOf(const float* x, int64_t n) {
  constexpr int kLanes = 32;
  float lane_max[kLanes];
  int32_t lane_nan[kLanes] = {};
  std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      lane_max[j] = lane_max[j] > x[i + j] ? lane_max[j] : x[i + j];
      lane_nan[j] |= x[i + j] != x[i + j];
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  int32_t nan = 0;
  for (; i < n; ++i) {
    best = best > x[i] ? best : x[i];
    nan |= x[i] != x[i];
  }
  for (int j = 0; j < kLanes; ++j) {
    best = best > lane_max[j] ? best : lane_max[j];
    nan |= lane_nan[j];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

void GreedyRow(const float* x, int32_t vocab, int32_t* token, float* log_sum_exp) {
  const float best = MaxOf(x, vocab);
  if (std::isnan(best)) {
    *token = vocab - 1;
    *log_sum_exp = best;
    return;
  }
  int32_t first = vocab;
#pragma omp simd reduction(min : first)
  for (int32_t i = 0; i < vocab; ++i) first = std::min(first, x[i] == best ? i : vocab);
  *token = first;
  if (std::isinf(best)) {  // every logit -inf, or some +inf: what jax.nn.logsumexp gives
    *log_sum_exp = best;
    return;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int32_t i = 0; i < vocab; ++i) sum += jpaged::ExpNonPositive(x[i] - best);
  *log_sum_exp = best + std::log(sum);
}

ffi::Error GreedyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> tokens,
                      ffi::ResultBuffer<ffi::F32> log_sum_exp) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2 || dims[1] < 1 || dims[1] > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument("jpaged_greedy: logits must be [rows, vocab]");
  }
  const int32_t vocab = static_cast<int32_t>(dims[1]);
  const float* x = logits.typed_data();
  int32_t* t = tokens->typed_data();
  float* l = log_sum_exp->typed_data();
  jpaged::ParallelFor(pool, dims[0], [&](int64_t r) { GreedyRow(x + r * vocab, vocab, t + r, l + r); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedGreedy, GreedyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens
                                  .Ret<ffi::Buffer<ffi::F32>>());  // log_sum_exp
