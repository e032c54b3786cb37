// A matmul for few rows on the CPU: out_i[M, N_i] = x[M, K] @ w_i[K, N_i] for one or more weights,
// float32, row-major; an XLA FFI custom call (built and loaded by library.py).
//
// A decode step multiplies a handful of rows by every weight matrix of the model: the weights are
// read once per step and do not fit the cache, so the step is bound by memory, and a matmul that
// first copies ("packs") the weight into its own layout, as a GEMM library does, reads and writes
// it one more time. This one streams the weight straight from where it lies, in panels of kPanel
// columns, piece by piece (up to kChunk rows of a panel): each block of up to kRows rows keeps its
// sums in vector registers while the piece goes by, the first block bringing the piece into the L1
// cache for the others (or copying it there, where the weight's rows would all fall in one L1 set),
// and every block prefetching its share of the next piece into L2 meanwhile, so that memory keeps
// streaming while the blocks compute. With at most one block of rows
// (kFewRows), FewRows reads the weight in its own order instead, row after row across the whole
// width, each work item a contiguous range of the weight's rows (partial sums added at the end;
// not with AVX-512, where one block streams as fast). Otherwise runs of neighbouring
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
// columns), kRows rows, kRows x kVecs accumulators, leaving registers for the weight row and the
// broadcast. AVX-512 (32 registers): 6 x 4. AVX/AVX2 and SSE (16 registers): 6 x 2. With few row
// blocks (kShortBlocks) the pieces are kShortChunk rows. Measured per instruction set (docs/cpu.md).
#ifdef __AVX512F__
constexpr int64_t kVecs = 4, kRows = 6;
constexpr int64_t kFewRows = 0;               // never FewRows: one block streams as fast
constexpr int64_t kCopyBlocks = 0;            // never copied
constexpr int64_t kShortBlocks = 3, kShortChunk = 32;  // 8 KiB of a panel
constexpr bool kSpreadNarrow = true;          // spread the rows in narrow items too
constexpr bool kSpreadPrefetch = true;        // the next piece's prefetches spread over the piece
constexpr int64_t kPackedChunk = 1024;        // a packed weight's pieces past kShortBlocks blocks (256 KiB)
#else
constexpr int64_t kVecs = 2, kRows = 6;
constexpr int64_t kFewRows = kRows;           // one block or less: FewRows
constexpr int64_t kCopyBlocks = 4;            // row blocks from which a piece in one L1 set is copied
constexpr int64_t kShortBlocks = 2, kShortChunk = 64;  // 4 KiB of a panel
constexpr bool kSpreadNarrow = false;
constexpr bool kSpreadPrefetch = false;       // a row of it each step from the first (measured faster)
constexpr int64_t kPackedChunk = 64;          // 16 KiB of a packed panel
#endif
constexpr int64_t kPanel = kVecs * kLanes;    // columns per panel
constexpr int64_t kItemPanels = 32;           // most panels per work item (longer runs of each weight row)
constexpr int64_t kItemsPerWorker = 4;        // work items per thread, where there are enough panels
constexpr int64_t kFewItemsPerWorker = 2;     // the same for FewRows
constexpr int64_t kChunk = 4096 / kPanel;     // weight rows per pass of the row blocks (16 KiB of a panel)
constexpr int64_t kNarrowChunk = 64;          // the same for a narrow work item (kNarrowPanels) or one L1 set
constexpr int64_t kNarrowPanels = 8;          // most panels of a narrow work item
constexpr int64_t kDepth = 8;                 // weight rows per pass of FewRows


// acc[r] += x[r, k] * w_k[:kPanel] for the R rows (leading dim ldx), w_k a row of a panel; with
// kCopy, w_k is also stored at copy.
template <int R, bool kCopy>
inline void PanelStep(const float* x, int64_t ldx, int64_t k, const float* wk, float* copy, Vec (&acc)[R][kVecs]) {
  Vec wv[kVecs];
  for (int64_t c = 0; c < kVecs; ++c) wv[c] = Load(wk + kLanes * c);
  if constexpr (kCopy) {
    for (int64_t c = 0; c < kVecs; ++c) Store(copy + kLanes * c, wv[c]);
  }
  for (int r = 0; r < R; ++r) {
    const float xv = x[r * ldx + k];
    for (int64_t c = 0; c < kVecs; ++c) acc[r][c] += xv * wv[c];
  }
}

// out[r, :kPanel] (+)= x[r, k0:k1] @ piece for the R rows from x / out (leading dims ldx, ldo; the
// piece's row k - k0 at piece + (k - k0) * ldw: the weight's rows k0:k1 of one panel, or a copy of
// them): the sums start from zero when k0 is 0, else from out. Meanwhile the steps prefetch
// next_rows rows of `next` (leading dim N; the next piece) into L2 (kSpreadPrefetch). With kCopy,
// the piece is also copied to `copy` (kPanel floats a row) for the blocks after this one.
template <int R, bool kCopy>
void PanelLoop(const float* x, int64_t ldx, const float* piece, int64_t ldw, int64_t k0, int64_t k1, float* out,
               int64_t ldo, const float* next, int64_t N, int64_t next_rows, float* copy) {
  Vec acc[R][kVecs];
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) acc[r][c] = k0 > 0 ? Load(out + r * ldo + kLanes * c) : Vec{};
  }
  if constexpr (kSpreadPrefetch) {
    // The next rows' kVecs lines each, spread evenly over the steps (`due` counts lines owed times
    // steps): a burst of prefetches at the start would wait on the core's few fill buffers.
    const int64_t lines = next_rows * kVecs, steps = k1 - k0;
    for (int64_t k = k0, line = 0, due = 0; k < k1; ++k) {
      for (due += lines; due >= steps; due -= steps, ++line) {
        __builtin_prefetch(next + (line / kVecs) * N + kLanes * (line % kVecs), 0, 1);
      }
      PanelStep<R, kCopy>(x, ldx, k, piece + (k - k0) * ldw, copy + (k - k0) * kPanel, acc);
    }
  } else {  // a row of the next piece each step, from the first
    const int64_t prefetched = k0 + std::min(next_rows, k1 - k0);
    int64_t k = k0;
    for (; k < prefetched; ++k) {
      for (int64_t c = 0; c < kVecs; ++c) __builtin_prefetch(next + (k - k0) * N + kLanes * c, 0, 1);
      PanelStep<R, kCopy>(x, ldx, k, piece + (k - k0) * ldw, copy + (k - k0) * kPanel, acc);
    }
    for (; k < k1; ++k) PanelStep<R, kCopy>(x, ldx, k, piece + (k - k0) * ldw, copy + (k - k0) * kPanel, acc);
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < kVecs; ++c) Store(out + r * ldo + kLanes * c, acc[r][c]);
  }
}

// PanelLoop<rows> for 1 <= rows <= R, copying the piece where `copy` is not null.
template <int R>
void PanelRows(int64_t rows, const float* x, int64_t ldx, const float* piece, int64_t ldw, int64_t k0, int64_t k1,
               float* out, int64_t ldo, const float* next, int64_t N, int64_t next_rows, float* copy) {
  if constexpr (R > 1) {
    if (rows < R) return PanelRows<R - 1>(rows, x, ldx, piece, ldw, k0, k1, out, ldo, next, N, next_rows, copy);
  }
  if (copy) return PanelLoop<R, true>(x, ldx, piece, ldw, k0, k1, out, ldo, next, N, next_rows, copy);
  PanelLoop<R, false>(x, ldx, piece, ldw, k0, k1, out, ldo, next, N, next_rows, nullptr);
}

// Panels [p0, p1) for every row, piece by piece: a k range of kChunk rows across the panels, then
// the next. While a piece's row blocks compute, they prefetch the next piece into L2, each block its
// share of its rows, so that memory streams all through the pass. In a wide item (more than
// kNarrowPanels panels; in any with kSpreadNarrow) the rows are spread evenly over the blocks where
// each gets at least kRows - 1 (32 rows: 6, 6, 5, 5, 5, 5; not 6 x 5 and 2): a block of few rows has
// too few sums to hide the FMA's latency (8 rows: 6 and 2 measured faster than 4 and 4; in narrow
// items the spread measured slower with AVX2). Where the weight's rows lie a multiple of 4 KiB
// apart, every row of a piece falls in the same L1 set and they evict each other: with kCopyBlocks
// blocks or more the first block copies the piece into a contiguous buffer, which the other blocks
// read. Pieces are kShortChunk rows with at most kShortBlocks blocks, kNarrowChunk in a narrow item
// or in one L1 set and not copied (measured faster there), else kChunk.
void Panels(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1, float* out) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  const bool narrow_item = p1 - p0 <= kNarrowPanels;
  // every block gets at least kRows - 1 rows
  const bool spread = (kSpreadNarrow || !narrow_item) && M >= (kRows - 1) * blocks;
  const bool one_set = N * sizeof(float) % 4096 == 0;  // every row of a piece in the same L1 set
  const bool copy = kCopyBlocks > 0 && blocks >= kCopyBlocks && one_set;
  const int64_t chunk = blocks <= kShortBlocks            ? kShortChunk
                        : narrow_item || (one_set && !copy) ? kNarrowChunk
                                                            : kChunk;
  alignas(64) float copied[kChunk * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t k1 = std::min(K, k0 + chunk);
    for (int64_t p = p0; p < p1; ++p) {
      const float* wp = w + p * kPanel;
      const bool last_panel = p + 1 == p1;
      const int64_t next_k0 = last_panel ? k1 : k0;
      const float* next = w + next_k0 * N + (last_panel ? p0 : p + 1) * kPanel;
      const int64_t next_rows = std::min(K, next_k0 + chunk) - next_k0;
      const int64_t share = (next_rows + blocks - 1) / blocks;  // next rows each block prefetches
      for (int64_t b = 0, m = 0; b < blocks; ++b) {
        const int64_t rows = spread ? M / blocks + (b < M % blocks) : std::min(kRows, M - m);
        const int64_t first = std::min(next_rows, b * share);  // the first next row block b prefetches
        const int64_t prefetch = std::min(share, next_rows - first);
        const bool reads_copy = copy && b > 0;  // the first block copies the piece, the others read the copy
        PanelRows<kRows>(rows, x + m * K, K, reads_copy ? copied : wp + k0 * N, reads_copy ? kPanel : N, k0, k1,
                         out + m * N + p * kPanel, N, next + first * N, N, prefetch,
                         copy && b == 0 ? copied : nullptr);
        m += rows;
      }
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

// Columns per panel of a packed weight, [N / kPackedPanel, K, kPackedPanel] (pallas_kernels/cpu/
// ops.py packs it): a multiple of every instruction set's kPanel.
constexpr int64_t kPackedPanel = 64;
static_assert(kPackedPanel % kPanel == 0, "a packed panel holds whole panels");

// Panels [p0, p1) of a packed weight w [P, K, kPackedPanel] for every row, in memory order: each
// panel from its first row to its last, a piece (kShortChunk rows with at most kShortBlocks blocks,
// else kPackedChunk: with AVX-512 a whole panel of up to 1,024 rows, the blocks after the first
// reading it from L2, measured faster from 24 rows on) at a time, the next piece (the next
// rows of memory, into the next panel at a panel's end) prefetched into L2 by the row blocks, each
// its share, as Panels does. Where kPanel is narrower than a packed panel, each piece is passed
// once per kPanel columns (ldw kPackedPanel). Sums in the same order as Panels: the same results.
void PackedPanels(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1,
                  float* out) {
  const int64_t blocks = (M + kRows - 1) / kRows;
  const bool spread = M >= (kRows - 1) * blocks;
  const int64_t chunk = blocks <= kShortBlocks ? kShortChunk : kPackedChunk;
  const float* end = w + p1 * K * kPackedPanel;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
      const int64_t k1 = std::min(K, k0 + chunk);
      const float* piece = w + (p * K + k0) * kPackedPanel;
      const float* next = piece + (k1 - k0) * kPackedPanel;
      const int64_t next_rows = std::min<int64_t>(chunk, (end - next) / kPackedPanel);
      const int64_t share = (next_rows + blocks - 1) / blocks;  // next rows each block prefetches
      for (int64_t c = 0; c < kPackedPanel; c += kPanel) {
        for (int64_t b = 0, m = 0; b < blocks; ++b) {
          const int64_t rows = spread ? M / blocks + (b < M % blocks) : std::min(kRows, M - m);
          const int64_t first = std::min(next_rows, b * share);
          PanelRows<kRows>(rows, x + m * K, K, piece + c, kPackedPanel, k0, k1, out + m * N + p * kPackedPanel + c, N,
                           next + first * kPackedPanel + c, kPackedPanel, std::min(share, next_rows - first), nullptr);
          m += rows;
        }
      }
    }
  }
}

// out_i[M, N_i] = x[M, K] @ w_i for weights packed [N_i / kPackedPanel, K, kPackedPanel]: MatmulImpl
// for packed weights, the work items runs of neighbouring packed panels (contiguous memory), the
// last few one-panel items split by rows where they would leave a worker idle.
ffi::Error MatmulPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                            ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || weights.size() == 0 || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("jpaged_matmul_packed: expected x [M, K] and one output per weight");
  }
  const int64_t M = xd[0], K = xd[1];
  struct Weight {
    const float* w;
    float* out;
    int64_t panels;
  };
  std::vector<Weight> ws;
  int64_t total_panels = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto w = weights.get<ffi::Buffer<ffi::F32>>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value() || w->dimensions().size() != 3 || w->dimensions()[1] != K ||
        w->dimensions()[2] != kPackedPanel || (*out)->dimensions().size() != 2 || (*out)->dimensions()[0] != M ||
        (*out)->dimensions()[1] != w->dimensions()[0] * kPackedPanel) {
      return ffi::Error::InvalidArgument(
          "jpaged_matmul_packed: expected float32 weights [N / 64, K, 64] and outputs [M, N]");
    }
    ws.push_back({w->typed_data(), (*out)->typed_data(), w->dimensions()[0]});
    total_panels += ws.back().panels;
  }
  const int64_t workers = jpaged::Workers(pool), target = kItemsPerWorker * workers;
  const int64_t per_item = std::clamp<int64_t>(total_panels / target, 1, kItemPanels * kPanel / kPackedPanel);
  struct Item {
    int64_t weight, p0, p1, m0, m1;  // packed panels [p0, p1) for rows [m0, m1)
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(ws.size()); ++i) {
    for (int64_t p = 0; p < ws[i].panels; p += per_item) items.push_back({i, p, std::min(ws[i].panels, p + per_item), 0, M});
  }
  // One-panel items that do not share out evenly (SmolLM2's 576 columns, 9 panels, on 2 workers: 5
  // and 4) are split by rows among all the workers instead, where each part keeps a whole register
  // block. Each row's sums are the same whichever part computes them.
  const int64_t extra = static_cast<int64_t>(items.size()) % workers;
  if (per_item == 1 && extra > 0 && M >= workers * kRows) {
    std::vector<Item> last(items.end() - extra, items.end());
    items.resize(items.size() - extra);
    for (const Item& item : last) {
      for (int64_t j = 0; j < workers; ++j) items.push_back({item.weight, item.p0, item.p1, M * j / workers, M * (j + 1) / workers});
    }
  }
  const float* xp = x.typed_data();
  jpaged::ParallelFor(pool, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& item = items[i];
    const Weight& w = ws[item.weight];
    const int64_t N = w.panels * kPackedPanel;
    PackedPanels(xp + item.m0 * K, w.w, item.m1 - item.m0, K, N, item.p0, item.p1, w.out + item.m0 * N);
  });
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
// R x J = kDotRows x kDotWeightRows (12 accumulators of 16 registers), or with AVX-512 from kSquare
// rows kSquare x kSquare (DotSquare: 16 sums, summed across their lanes all at once).
constexpr int64_t kDotRows = 2, kDotWeightRows = 6, kSquare = 4;
constexpr int64_t kDotItemRows = 12;                 // weight rows per work item: a multiple of both J
constexpr int64_t kDotPrefetchBytes = 24 * 1024;     // most bytes of J weight rows that prefetch the next J

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

#ifdef __AVX512F__
// DotBlock<kSquare, kSquare>: the 16 sums in named registers (an array of them measured spilled),
// the last K % 16 under a mask, then one transposing lane sum (SumLanes16: ~31 instructions for
// all 16, where a lane sum each takes ~8) gives row r's 4 results in lanes 4r to 4r + 3.
void DotSquare(const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  // one step along K: x's 4 rows and w's 4 rows loaded by `load`, 16 multiply-adds
  const auto step = [&](auto load, int64_t k) __attribute__((always_inline)) {
    const __m512 x0 = load(x + k), x1 = load(x + K + k), x2 = load(x + 2 * K + k), x3 = load(x + 3 * K + k);
    __m512 wv = load(w + k);
    a00 = _mm512_fmadd_ps(x0, wv, a00), a10 = _mm512_fmadd_ps(x1, wv, a10);
    a20 = _mm512_fmadd_ps(x2, wv, a20), a30 = _mm512_fmadd_ps(x3, wv, a30);
    wv = load(w + K + k);
    a01 = _mm512_fmadd_ps(x0, wv, a01), a11 = _mm512_fmadd_ps(x1, wv, a11);
    a21 = _mm512_fmadd_ps(x2, wv, a21), a31 = _mm512_fmadd_ps(x3, wv, a31);
    wv = load(w + 2 * K + k);
    a02 = _mm512_fmadd_ps(x0, wv, a02), a12 = _mm512_fmadd_ps(x1, wv, a12);
    a22 = _mm512_fmadd_ps(x2, wv, a22), a32 = _mm512_fmadd_ps(x3, wv, a32);
    wv = load(w + 3 * K + k);
    a03 = _mm512_fmadd_ps(x0, wv, a03), a13 = _mm512_fmadd_ps(x1, wv, a13);
    a23 = _mm512_fmadd_ps(x2, wv, a23), a33 = _mm512_fmadd_ps(x3, wv, a33);
  };
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) step([](const float* p) { return _mm512_loadu_ps(p); }, k);
  if (k < K) {  // unmasked loads above: a mask on every step measured 10-20% slower
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    step([mask](const float* p) { return _mm512_maskz_loadu_ps(mask, p); }, k);
  }
  const __m512 acc[16] = {a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33};
  const __m512 sums = jpaged::SumLanes16(acc);
  _mm_storeu_ps(out, _mm512_castps512_ps128(sums));
  _mm_storeu_ps(out + ldo, _mm512_extractf32x4_ps(sums, 1));
  _mm_storeu_ps(out + 2 * ldo, _mm512_extractf32x4_ps(sums, 2));
  _mm_storeu_ps(out + 3 * ldo, _mm512_extractf32x4_ps(sums, 3));
}
#endif

// DotBlock<R, j> for 1 <= j <= J weight rows (DotSquare where it is a whole kSquare x kSquare).
template <int R, int J>
void DotRest(int64_t rows, const float* x, const float* w, int64_t K, float* out, int64_t ldo) {
  if constexpr (J > 1) {
    if (rows < J) return DotRest<R, J - 1>(rows, x, w, K, out, ldo);
  }
#ifdef __AVX512F__
  if constexpr (R == kSquare && J == kSquare) return DotSquare(x, w, K, out, ldo);
#endif
  DotBlock<R, J>(x, w, K, out, ldo);
}

// out[:, n0:n1] for every row of x [M, K], w [N, K], R rows of x at a time. Where J weight rows fit
// L1 with room to spare (kDotPrefetchBytes), each block of x's rows passing them prefetches its
// share of the next J rows' cache lines into L2, so that memory keeps streaming meanwhile (longer
// rows are read from L2 by every block anyway: there the prefetch measured slower).
template <int R, int J>
void DotRowsOf(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
  const int64_t blocks = M / R + M % R;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(float));
  const bool prefetch = J * row_bytes <= kDotPrefetchBytes;
  for (int64_t n = n0; n < n1; n += J) {
    const int64_t rows = std::min<int64_t>(J, n1 - n);
    const float* wn = w + n * K;
    const char* next = reinterpret_cast<const char*>(wn + rows * K);
    const int64_t lines = prefetch ? std::min<int64_t>(J, n1 - n - rows) * row_bytes / 64 : 0;
    const int64_t share = (lines + blocks - 1) / blocks;
    int64_t line = 0;
    const auto prefetch_share = [&] {
      for (const int64_t end = std::min(lines, line + share); line < end; ++line) {
        __builtin_prefetch(next + line * 64, 0, 1);
      }
    };
    int64_t m = 0;
    for (; m + R <= M; m += R) {
      prefetch_share();
      DotRest<R, J>(rows, x + m * K, wn, K, out + m * N + n, N);
    }
    for (; m < M; ++m) {
      prefetch_share();
      DotRest<1, J>(rows, x + m * K, wn, K, out + m * N + n, N);
    }
  }
}

// DotRowsOf with the blocks for M rows.
void DotRows(const float* x, const float* w, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1, float* out) {
#ifdef __AVX512F__
  if (M >= kSquare) return DotRowsOf<kSquare, kSquare>(x, w, M, K, N, n0, n1, out);
#endif
  DotRowsOf<kDotRows, kDotWeightRows>(x, w, M, K, N, n0, n1, out);
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
  const int64_t items = std::max<int64_t>(1, std::min(N / kDotItemRows, kItemsPerWorker * jpaged::Workers(pool)));
  const int64_t per_item = ((N + items - 1) / items + kDotItemRows - 1) / kDotItemRows * kDotItemRows;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmulPacked, MatmulPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .RemainingArgs()                 // packed weights
                                  .RemainingRets());               // one output per weight

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedMatmulTransposed, MatmulTransposedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]
