// A matmul for few rows on the CPU: out_i[M, N_i] = x[M, K] @ w_i[K, N_i] for one or more weights,
// float32, row-major; an XLA FFI custom call (built and loaded by library.py).
//
// A decode step multiplies a handful of rows by every weight matrix of the model: the weights are
// read once per step and do not fit the cache, so the step is bound by memory, and a matmul that
// first copies ("packs") the weight into its own layout, as a GEMM library does, reads and writes
// it one more time. This one streams the weight straight from where it lies, in panels of kPanel
// columns, piece by piece (kChunk rows of a panel): each block of up to kRows rows keeps its sums in
// vector registers while the piece goes by, the first block bringing the piece into the L1 cache
// for the others, and every block prefetching its share of the next piece into L2 meanwhile, so
// that memory keeps streaming while the blocks compute. With at most one block of rows
// (kFewRows), FewRows reads the weight in its own order instead, row after row across the whole
// width, each work item a contiguous range of the weight's rows (partial sums added at the end);
// with AVX-512 a lone block prefetches its own rows a little ahead. Otherwise runs of neighbouring
// panels of a weight (long runs of each weight row: memory streams better) are the work items.
// Items are shared with XLA's intra-op thread pool (common.h); the weights of one call (a layer's
// q, k and v; its gate and up) share one hand-off. jpaged_matmul_t takes the weight transposed, w [N, K] (DotRows).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

using jpaged::kLanes;
using jpaged::Load;
using jpaged::Store;
using jpaged::Vec;

// The register block per instruction set: kVecs vectors of kLanes floats per row (a panel of kPanel
// columns), kRows rows, kRows x kVecs accumulators. AVX-512 (32 registers): 4 x 4. AVX/AVX2 and SSE
// (16 registers): 6 x 2, which leaves registers for the weight row and the broadcast.
#ifdef __AVX512F__
constexpr int64_t kVecs = 4, kRows = 4;
constexpr int64_t kFewRows = 0;               // a lone block prefetches its own rows instead
#else
constexpr int64_t kVecs = 2, kRows = 6;
constexpr int64_t kFewRows = kRows;           // one block or less: FewRows
#endif
constexpr int64_t kPanel = kVecs * kLanes;    // columns per panel
constexpr int64_t kAheadRows = 16;            // how far ahead a lone row block prefetches its rows
constexpr int64_t kItemPanels = 32;           // most panels per work item (longer runs of each weight row)
constexpr int64_t kItemsPerWorker = 4;        // work items per thread, where there are enough panels
constexpr int64_t kFewItemsPerWorker = 2;     // the same for FewRows
constexpr int64_t kChunk = 64;                // weight rows per pass of the row blocks
constexpr int64_t kDepth = 8;                 // weight rows per pass of FewRows


// out[r, :kPanel] (+)= x[r, k0:k1] @ w[k0:k1, :kPanel] for the R rows from x / out (leading dims
// ldx, ldo; w at the panel's first column, leading dim N): the sums start from zero when k0 is 0,
// else from out. The first next_rows steps also prefetch a row of `next` (leading dim N) each:
// into L1 with `own_rows` (rows ahead of this block's own), else into L2 (the next piece).
template <int R>
void PanelRows(const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, int64_t N, float* out,
               int64_t ldo, const float* next, int64_t next_rows, bool own_rows) {
  Vec acc[R][kVecs] = {};
  if (k0 > 0) {
    for (int r = 0; r < R; ++r) {
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = Load(out + r * ldo + kLanes * c);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N;
    if (k - k0 < next_rows) {
      for (int64_t c = 0; c < kVecs; ++c) {
        if (own_rows) {
          __builtin_prefetch(next + (k - k0) * N + kLanes * c, 0, 3);
        } else {
          __builtin_prefetch(next + (k - k0) * N + kLanes * c, 0, 1);
        }
      }
    }
    Vec wv[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) wv[c] = Load(wk + kLanes * c);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) Store(out + r * ldo + kLanes * c, acc[r][c]);
  }
}

// PanelRows<rest> for the rest (1 <= rest <= R) of the rows past the last whole block.
template <int R>
void PanelRest(int64_t rest, const float* x, int64_t ldx, const float* w, int64_t k0, int64_t k1, int64_t N,
               float* out, int64_t ldo, const float* next, int64_t next_rows, bool own_rows) {
  if constexpr (R > 1) {
    if (rest < R) return PanelRest<R - 1>(rest, x, ldx, w, k0, k1, N, out, ldo, next, next_rows, own_rows);
  }
  PanelRows<R>(x, ldx, w, k0, k1, N, out, ldo, next, next_rows, own_rows);
}

// Panels [p0, p1) for every row, piece by piece: a k range of kChunk rows across the panels, then
// the next. While a piece's row blocks compute, they prefetch the next piece into L2, each block its
// share of its rows, so that memory streams all through the pass.
void Panels(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1, float* out) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  const bool alone = blocks == 1;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t p = p0; p < p1; ++p) {
      const float* wp = w + p * kPanel;
      const bool last_panel = p + 1 == p1;
      const int64_t next_k0 = last_panel ? k1 : k0;
      const float* next = w + next_k0 * N + (last_panel ? p0 : p + 1) * kPanel;
      int64_t next_rows = std::min(K, next_k0 + kChunk) - next_k0;
      if (alone) {  // one block, bound by memory: it prefetches its own rows kAheadRows ahead
        next = wp + (k0 + kAheadRows) * N;
        next_rows = std::max<int64_t>(0, std::min(k1, K - kAheadRows) - k0);
      }
      const int64_t share = (next_rows + blocks - 1) / blocks;  // next rows each block prefetches
      // The first of the next rows that the block of row m prefetches, its pointer and its count.
      const auto first_row = [&](int64_t m) { return std::min(next_rows, m / kRows * share); };
      const auto next_of = [&](int64_t m) { return next + first_row(m) * N; };
      const auto rows_of = [&](int64_t m) { return std::min(share, next_rows - first_row(m)); };
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) {
        PanelRows<kRows>(x + m * K, K, wp, k0, k1, N, out + m * N + p * kPanel, N, next_of(m), rows_of(m), alone);
      }
      const float* xm = x + m * K;
      float* om = out + m * N + p * kPanel;
      if (M > m) PanelRest<kRows - 1>(M - m, xm, K, wp, k0, k1, N, om, N, next_of(m), rows_of(m), alone);
    }
  }
}

// out[:R, c0:c1] = x[:R, ka:kb] @ w[ka:kb, c0:c1] (c0, c1: panels p0, p1) for R <= kRows rows, in
// the weight's own order: kDepth weight rows at a time, each read end to end across the columns
// (kDepth long sequential streams, which the hardware prefetcher follows), the sums reloaded from
// out between passes (they stay in L1).
template <int R>
void FewRows(const float* x, const float* w, int64_t K, int64_t N, int64_t ka, int64_t kb, int64_t p0, int64_t p1,
             float* out) {
  const int64_t c0 = p0 * kPanel, c1 = p1 * kPanel;
  for (int64_t k0 = ka; k0 < kb; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, kb - k0);
    float xs[R][kDepth];
    for (int r = 0; r < R; ++r) {
      for (int64_t u = 0; u < depth; ++u) xs[r][u] = x[r * K + k0 + u];
    }
    for (int64_t j = c0; j < c1; j += kVecs * kLanes) {
      Vec acc[R][kVecs] = {};
      if (k0 > ka) {
        for (int r = 0; r < R; ++r) {
          for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = Load(out + r * N + j + kLanes * c);
        }
      }
      for (int64_t u = 0; u < depth; ++u) {
        const float* wk = w + (k0 + u) * N + j;
        Vec wv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) wv[c] = Load(wk + kLanes * c);
        for (int r = 0; r < R; ++r) {
          for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += xs[r][u] * wv[c];
        }
      }
      for (int r = 0; r < R; ++r) {
        for (int64_t c = 0; c < kVecs; ++c) Store(out + r * N + j + kLanes * c, acc[r][c]);
      }
    }
  }
}

// FewRows<rows> for 1 <= rows <= R.
template <int R>
void FewRest(int64_t rows, const float* x, const float* w, int64_t K, int64_t N, int64_t ka, int64_t kb, int64_t p0,
             int64_t p1, float* out) {
  if constexpr (R > 1) {
    if (rows < R) return FewRest<R - 1>(rows, x, w, K, N, ka, kb, p0, p1, out);
  }
  FewRows<R>(x, w, K, N, ka, kb, p0, p1, out);
}

// Columns past the last whole panel (N not a multiple of kPanel): one sum at a time.
void Tail(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t n0, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < N; ++n) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += x[m * K + k] * w[k * N + n];
      out[m * N + n] = sum;
    }
  }
}

// out_i[M, N_i] = x[M, K] @ w_i[K, N_i] for each weight: one call for the projections of one input
// (q, k and v; gate and up), so that they share the thread pool's hand-off and its load balance.
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                      ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || weights.size() == 0 || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("jpaged_matmul: expected x [M, K] and one output per weight");
  }
  const int64_t M = xd[0], K = xd[1];
  struct Weight {
    const float* w;
    float* out;
    int64_t N;
  };
  std::vector<Weight> ws;
  int64_t total_panels = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value() || w->dimensions().size() != 2 || w->dimensions()[0] != K ||
        (*out)->dimensions().size() != 2 || (*out)->dimensions()[0] != M ||
        (*out)->dimensions()[1] != w->dimensions()[1]) {
      return ffi::Error::InvalidArgument("jpaged_matmul: expected float32 weights [K, N] and outputs [M, N]");
    }
    ws.push_back({w->typed_data(), (*out)->typed_data(), w->dimensions()[1]});
    total_panels += ws.back().N / kPanel;
  }
  // Work items. Few rows: a range of weight rows (K) across all of a weight's whole panels, so that
  // each item streams one contiguous piece of the weight (split by columns, a narrow weight gave
  // each item runs of a few hundred bytes per row), about kFewItemsPerWorker per worker in all,
  // each weight's share by its width; the items of one weight after its first sum into scratch
  // rows, added to the output at the end. More rows: runs of up to kItemPanels panels of one weight
  // (long runs of each weight row stream better), about kItemsPerWorker per worker. And the columns
  // past a weight's last whole panel.
  const bool few = kFewRows > 0 && M <= kFewRows;
  const int64_t target = (few ? kFewItemsPerWorker : kItemsPerWorker) * jpaged::Workers(pool);
  const int64_t per_item = std::clamp<int64_t>(total_panels / target, 1, kItemPanels);
  struct Item {
    int64_t weight, p0, p1, k0, k1;  // panels [p0, p1), weight rows [k0, k1); p0 < 0: the tail columns
    float* out;                      // the weight's output, or scratch rows [M, N]
  };
  std::vector<Item> items;
  std::vector<float> scratch;
  std::vector<std::pair<int64_t, int64_t>> sums;  // (weight, scratch offset) to add to its output
  const int64_t num_weights = static_cast<int64_t>(ws.size());
  std::vector<int64_t> splits(num_weights, 0);  // few rows: each weight's items (ranges of its rows)
  if (few) {
    int64_t scratch_size = 0;
    for (int64_t i = 0; i < num_weights; ++i) {
      const int64_t panels = ws[i].N / kPanel;
      const int64_t share = (target * panels + total_panels / 2) / std::max<int64_t>(total_panels, 1);
      splits[i] = panels == 0 ? 0 : std::clamp<int64_t>(share, 1, std::max<int64_t>(1, K / kDepth));
      scratch_size += std::max<int64_t>(0, splits[i] - 1) * M * ws[i].N;
    }
    scratch.resize(scratch_size);
  }
  int64_t offset = 0;
  for (int64_t i = 0; i < num_weights; ++i) {
    const int64_t panels = ws[i].N / kPanel;
    if (few) {
      // the first weight row of range j (whole kDepth passes; the last range ends at K)
      const auto row = [&](int64_t j) { return j == splits[i] ? K : K * j / splits[i] / kDepth * kDepth; };
      for (int64_t j = 0; j < splits[i]; ++j) {
        float* out = ws[i].out;
        if (j > 0) {
          out = scratch.data() + offset;
          sums.push_back({i, offset});
          offset += M * ws[i].N;
        }
        items.push_back({i, 0, panels, row(j), row(j + 1), out});
      }
    } else {
      for (int64_t p = 0; p < panels; p += per_item) {
        items.push_back({i, p, std::min(panels, p + per_item), 0, K, ws[i].out});
      }
    }
    if (ws[i].N % kPanel != 0) items.push_back({i, -1, -1, 0, K, ws[i].out});
  }
  const float* xp = x.typed_data();
  jpaged::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const Weight& w = ws[item.weight];
    if constexpr (kFewRows > 0) {
      if (item.p0 >= 0 && few) {
        return FewRest<std::max<int>(kFewRows, 1)>(M, xp, w.w, K, w.N, item.k0, item.k1, item.p0, item.p1, item.out);
      }
    }
    if (item.p0 >= 0) return Panels(xp, w.w, M, K, w.N, item.p0, item.p1, w.out);
    Tail(xp, w.w, M, K, w.N, w.N / kPanel * kPanel, w.out);
  });
  for (const auto& [i, offset] : sums) {  // the whole panels' columns of each scratch row
    const int64_t N = ws[i].N, width = N / kPanel * kPanel;
    for (int64_t m = 0; m < M; ++m) {
      float* o = ws[i].out + m * N;
      const float* part = scratch.data() + offset + m * N;
      for (int64_t n = 0; n < width; ++n) o[n] += part[n];
    }
  }
  return ffi::Error::Success();
}

// The sum of v's lanes.
inline float SumLanes(Vec v) {
  float sum = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
}

// With the weight stored transposed, w [N, K] (a tied embedding table used as the output
// projection): out[m, n] = x[m, :] . w[n, :], the weight read row after row where it lies. R rows
// of x and J rows of w at a time, R x J partial sums in registers along K, summed across their
// lanes at the end; the J weight rows (a few KB) stay in L1 while every block of x's rows passes.
constexpr int64_t kDotRows = 2, kDotWeightRows = 6;  // R x J = 12 accumulators of 16 registers

template <int R, int J>
void DotBlock(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  Vec acc[R][J] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = Load(x + r * K + k);
    for (int j = 0; j < J; ++j) {
      const Vec wv = Load(w + j * K + k);
      for (int r = 0; r < R; ++r) acc[r][j] += xv[r] * wv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      float sum = SumLanes(acc[r][j]);
      for (int64_t t = k; t < K; ++t) sum += x[r * K + t] * w[j * K + t];
      out[r * ldo + j] = sum;
    }
  }
}

// DotBlock<R, j> for 1 <= j <= J weight rows.
template <int R, int J>
void DotRest(int64_t rows, const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  if constexpr (J > 1) {
    if (rows < J) return DotRest<R, J - 1>(rows, x, w, K, out, ldo);
  }
  DotBlock<R, J>(x, w, K, out, ldo);
}

// out[:, n0:n1] for every row of x [M, K], w [N, K].
void DotRows(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; n += kDotWeightRows) {
    const int64_t rows = std::min(kDotWeightRows, n1 - n);
    const float* wn = w + n * K;
    int64_t m = 0;
    for (; m + kDotRows <= M; m += kDotRows) DotRest<kDotRows, kDotWeightRows>(rows, x + m * K, wn, K, out + m * N + n, N);
    for (; m < M; ++m) DotRest<1, kDotWeightRows>(rows, x + m * K, wn, K, out + m * N + n, N);
  }
}

// out[M, N] = x[M, K] @ w[N, K]^T, the rows of w shared with XLA's intra-op thread pool in runs of
// about kItemsPerWorker per worker.
ffi::Error MatmulTransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1] || od.size() != 2 || od[0] != xd[0] || od[1] != wd[0]) {
    return ffi::Error::InvalidArgument("jpaged_matmul_t: expected x [M, K], w [N, K] and out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const int64_t items = std::max<int64_t>(1, std::min(N / kDotWeightRows, kItemsPerWorker * jpaged::Workers(pool)));
  const int64_t per_item = ((N + items - 1) / items + kDotWeightRows - 1) / kDotWeightRows * kDotWeightRows;
  const float *xp = x.typed_data(), *wp = w.typed_data();
  float* o = out->typed_data();
  jpaged::ParallelFor(pool, (N + per_item - 1) / per_item, [&](int64_t i) {
    DotRows(xp, wp, M, K, N, i * per_item, std::min(N, (i + 1) * per_item), o);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()                 // weights
                                  .RemainingRets());               // one output per weight

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmulTransposed, MatmulTransposedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
