// The LoRA deltas of one step's tokens on the CPU: out_i[t] = (x[t] @ a_i[slot[t]]) @ b_i[slot[t]]
// for every projection i of one input (a layer's q, k and v; its gate and up), the adapters' factors
// stacked in slots, a_i [G, K, R] and b_i [G, R, N_i] (R: the slots' rank, zero-padded), and zero
// rows for the tokens of slot 0 (the base model, padding); float32, row-major; an XLA FFI custom call
// (built and loaded by library.py).
//
// Segmented, as Punica's SGMV is on a GPU: the tokens are grouped by slot, and each group goes
// through its own slot's factors only, in blocks of up to kRows tokens that share every factor row
// read (the block's R-wide intermediate stays in a small buffer on the stack, in L1, between the two
// products). A dense form
// that sends every token through every slot's factors does G times the work; gathering each token's
// factors reads them once per token. Work items (one block of one projection) are shared with XLA's
// intra-op thread pool (common.h).

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

constexpr int64_t kRows = 4;               // tokens of one slot per block
constexpr int64_t kVecs = 2;               // vectors per column panel (a panel: kVecs * kLanes columns)
constexpr int64_t kPanel = kVecs * kLanes;
constexpr int64_t kMaxRank = 512;          // the widest slot rank a block's intermediate holds

// out[j, c0:c0+kPanel] = sum_k in[j][k] * w[k, c0:c0+kPanel] for the B rows of the block (in[j]:
// each row's inputs, K of them; w: leading dim ld).
template <int B>
void PanelBlock(const float* const* in, const float* w, int64_t K, int64_t ld, int64_t c0, float* const* out) {
  Vec acc[B][kVecs] = {};
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) wv[c] = Load(w + k * ld + c0 + kLanes * c);
    for (int j = 0; j < B; ++j) {
      const Vec xv = Vec{} + in[j][k];
      for (int64_t c = 0; c < kVecs; ++c) acc[j][c] += xv * wv[c];
    }
  }
  for (int j = 0; j < B; ++j) {
    for (int64_t c = 0; c < kVecs; ++c) Store(out[j] + c0 + kLanes * c, acc[j][c]);
  }
}

// out[j, :N] = in[j][:K] @ w[K, N] for the rows of one block (rows <= kRows): whole panels by
// PanelBlock, the columns past the last whole panel one at a time.
void BlockProduct(int64_t rows, const float* const* in, const float* w, int64_t K, int64_t N, float* const* out) {
  const int64_t whole = N / kPanel * kPanel;
  for (int64_t c0 = 0; c0 < whole; c0 += kPanel) {
    switch (rows) {
      case 1: PanelBlock<1>(in, w, K, N, c0, out); break;
      case 2: PanelBlock<2>(in, w, K, N, c0, out); break;
      case 3: PanelBlock<3>(in, w, K, N, c0, out); break;
      default: PanelBlock<kRows>(in, w, K, N, c0, out); break;
    }
  }
  for (int64_t c = whole; c < N; ++c) {
    for (int64_t j = 0; j < rows; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += in[j][k] * w[k * N + c];
      out[j][c] = sum;
    }
  }
}

struct Projection {
  const float* a;  // [G, K, R]
  const float* b;  // [G, R, N]
  float* out;      // [T, N]
  int64_t N;
};

struct Block {
  int64_t projection, slot, first, rows;  // tokens[first : first + rows], all of slot `slot`
};

ffi::Error LoraImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                    ffi::RemainingArgs factors, ffi::RemainingRets outs) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || slots.dimensions().size() != 1 || slots.dimensions()[0] != xd[0]) {
    return ffi::Error::InvalidArgument("jpaged_lora: expected x [T, K] and slots [T]");
  }
  const int64_t T = xd[0], K = xd[1];
  if (factors.size() != 2 * outs.size() || outs.size() == 0) {
    return ffi::Error::InvalidArgument("jpaged_lora: expected an (a, b) pair of factors per output");
  }
  int64_t G = -1, R = -1;
  std::vector<Projection> projections;
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto a = factors.get<ffi::Buffer<ffi::F32>>(2 * i);
    const auto b = factors.get<ffi::Buffer<ffi::F32>>(2 * i + 1);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!a.has_value() || !b.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("jpaged_lora: factors and outputs must be float32");
    }
    const auto ad = a->dimensions(), bd = b->dimensions(), od = (*out)->dimensions();
    if (G < 0) G = ad.size() == 3 ? ad[0] : -1, R = ad.size() == 3 ? ad[2] : -1;
    if (ad.size() != 3 || bd.size() != 3 || od.size() != 2 || ad[0] != G || ad[1] != K || ad[2] != R ||
        bd[0] != G || bd[1] != R || od[0] != T || od[1] != bd[2]) {
      return ffi::Error::InvalidArgument(
          "jpaged_lora: expected a [G, K, R], b [G, R, N] and out [T, N] with one G and R for all projections");
    }
    projections.push_back({a->typed_data(), b->typed_data(), (*out)->typed_data(), bd[2]});
  }
  if (R > kMaxRank) return ffi::Error::InvalidArgument("jpaged_lora: slot rank above 512");
  // The tokens grouped by slot (a counting sort, stable); a slot outside [0, G) counts as slot 0.
  const int32_t* s = slots.typed_data();
  auto slot_of = [&](int64_t t) { return s[t] > 0 && s[t] < G ? static_cast<int64_t>(s[t]) : 0; };
  std::vector<int64_t> starts(G + 1, 0), tokens(T);
  for (int64_t t = 0; t < T; ++t) ++starts[slot_of(t) + 1];
  for (int64_t g = 0; g < G; ++g) starts[g + 1] += starts[g];
  std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < T; ++t) tokens[fill[slot_of(t)]++] = t;
  std::vector<Block> blocks;
  for (int64_t p = 0; p < static_cast<int64_t>(projections.size()); ++p) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t first = starts[g]; first < starts[g + 1]; first += kRows) {
        blocks.push_back({p, g, first, std::min(kRows, starts[g + 1] - first)});
      }
    }
  }
  const float* xp = x.typed_data();
  jpaged::ParallelFor(pool, static_cast<int64_t>(blocks.size()), [&](int64_t i) {
    const Block& block = blocks[i];
    const Projection& p = projections[block.projection];
    const float* in[kRows];
    float* out[kRows];
    for (int64_t j = 0; j < block.rows; ++j) {
      in[j] = xp + tokens[block.first + j] * K;
      out[j] = p.out + tokens[block.first + j] * p.N;
    }
    if (block.slot == 0) {
      for (int64_t j = 0; j < block.rows; ++j) std::memset(out[j], 0, p.N * sizeof(float));
      return;
    }
    alignas(64) float h[kRows][kMaxRank];
    float* hw[kRows];
    const float* hr[kRows];
    for (int64_t j = 0; j < kRows; ++j) hw[j] = h[j], hr[j] = h[j];
    BlockProduct(block.rows, in, p.a + block.slot * K * R, K, R, hw);       // h = x @ a[slot]
    BlockProduct(block.rows, hr, p.b + block.slot * R * p.N, R, p.N, out);  // out = h @ b[slot]
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedLora, LoraImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .RemainingArgs()                 // a_0, b_0, a_1, b_1, ...
                                  .RemainingRets());               // one delta [T, N_i] per (a_i, b_i)
