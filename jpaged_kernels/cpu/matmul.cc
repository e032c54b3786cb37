// A matmul for few rows on the CPU: out_i[M, N_i] = x[M, K] @ w_i[K, N_i] for one or more weights,
// float32, row-major; an XLA FFI custom call (built and loaded by pallas_kernels/cpu_kernels.py).
//
// A decode step multiplies a handful of rows by every weight matrix of the model: the weights are
// read once per step and do not fit the cache, so the step is bound by memory, and a matmul that
// first copies ("packs") the weight into its own layout, as a GEMM library does, reads and writes
// it one more time. This one streams the weight straight from where it lies, in panels of kPanel
// columns (64 with AVX-512), piece by piece (kChunk rows of a panel): each block of up to kRows
// rows keeps its sums in vector registers while the piece goes by, the first block bringing the
// piece into the L1 cache for the others, and every block prefetching its share of the next piece
// into L2 meanwhile, so that memory keeps streaming while the blocks compute (a lone block, 4 rows
// or fewer, prefetches its own rows a little ahead instead). Runs of up to kItemPanels neighbouring
// panels of a weight (long runs of each weight row: memory streams better) are shared with XLA's
// intra-op thread pool (common.h); the weights of one call (a layer's q, k and v; its gate and up)
// share one hand-off.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;

namespace {

typedef float Vec __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register, or 2 AVX ones

#ifdef __AVX512F__
constexpr int64_t kVecs = 4;                  // vectors per panel: 16 accumulators in 32 registers
#else
constexpr int64_t kVecs = 1;                  // (AVX2: a vector is 2 of its 16 registers)
#endif
constexpr int64_t kPanel = kVecs * 16;        // columns per panel
constexpr int64_t kRows = 4;                  // rows per register block: kRows x kVecs accumulators
constexpr int64_t kAheadRows = 16;            // how far ahead a lone row block prefetches its rows
constexpr int64_t kItemPanels = 32;           // most panels per work item (longer runs of each weight row)
constexpr int64_t kItemsPerWorker = 4;        // work items per thread, where there are enough panels
constexpr int64_t kChunk = 64;                // weight rows per pass of the row blocks (16 KB of a panel)

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

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
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = Load(out + r * ldo + 16 * c);
    }
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * N;
    if (k - k0 < next_rows) {
      for (int64_t c = 0; c < kVecs; ++c) {
        if (own_rows) {
          __builtin_prefetch(next + (k - k0) * N + 16 * c, 0, 3);
        } else {
          __builtin_prefetch(next + (k - k0) * N + 16 * c, 0, 1);
        }
      }
    }
    Vec wv[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) wv[c] = Load(wk + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) Store(out + r * ldo + 16 * c, acc[r][c]);
  }
}

// Panels [p0, p1) for every row, piece by piece: a k range of kChunk rows across the panels, then
// the next. While a piece's row blocks compute, they prefetch the next piece into L2, each block its
// share of its rows, so that memory streams all through the pass (the first block alone
// prefetching it left memory idle while the others computed: 10% slower at 32-48 rows).
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
      switch (M - m) {
        case 3: PanelRows<3>(xm, K, wp, k0, k1, N, om, N, next_of(m), rows_of(m), alone); break;
        case 2: PanelRows<2>(xm, K, wp, k0, k1, N, om, N, next_of(m), rows_of(m), alone); break;
        case 1: PanelRows<1>(xm, K, wp, k0, k1, N, om, N, next_of(m), rows_of(m), alone); break;
        default: break;
      }
    }
  }
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
  // Work items: runs of up to kItemPanels panels of one weight (long runs of each weight row stream
  // better), about kItemsPerWorker of them per worker (fewer: longer runs; more: the workers even
  // out), and the columns past a weight's last whole panel.
  const int64_t target = kItemsPerWorker * jpaged::Workers(pool);
  const int64_t per_item = std::clamp<int64_t>(total_panels / target, 1, kItemPanels);
  struct Item {
    int64_t weight, p0, p1;  // panels [p0, p1); p0 < 0: the tail columns
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(ws.size()); ++i) {
    const int64_t panels = ws[i].N / kPanel;
    for (int64_t p = 0; p < panels; p += per_item) items.push_back({i, p, std::min(panels, p + per_item)});
    if (ws[i].N % kPanel != 0) items.push_back({i, -1, -1});
  }
  const float* xp = x.typed_data();
  jpaged::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const Weight& w = ws[item.weight];
    if (item.p0 >= 0) return Panels(xp, w.w, M, K, w.N, item.p0, item.p1, w.out);
    Tail(xp, w.w, M, K, w.N, w.N / kPanel * kPanel, w.out);
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
