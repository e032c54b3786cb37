// Paged attention for the CPU, decode rows and prompt chunks: an XLA FFI custom call (built and
// loaded by library.py).
//
// Decode rows (a sequence s < num_seqs with one query token): the query heads of token
// query_start_loc[s] attend to the first seq_lens[s] keys of the sequence's blocks. One work item
// is one (sequence, KV head): its G = Hq / Hkv query heads walk the sequence's blocks once, block
// by block, with an online softmax (one rescale per block), reading each key and value row
// straight from the pool (no gathered copy) while the next block is prefetched: the pool is much
// larger than the cache, so decode attention is bound by memory. Blocks of 16 tokens and heads of
// 64 or 128 dims take a register-resident path with AVX-512 (AttendRow16).
//
// Prompt tokens (a sequence with more than one query token; only with the prefill attribute set):
// chunks of kChunkTokens tokens, each attending causally to the context before it and to itself.
// One work item is one (chunk, KV head): its tokens x G query heads share each key block, scored
// against it at once (AttendChunk16: blocks of 16, heads of 64 or 128; AttendChunk: any sizes).
// Items with the most context go first. Every other output row (padding) is zero; all items are
// shared with XLA's intra-op thread pool (common.h).
//
// Options (ScoreRule): logits_soft_cap c > 0 turns each scaled score s into c * tanh(s / c) (Gemma
// 2); sliding_window w > 0 lets a query at position p see the keys j with p - w < j <= p only, and
// key blocks wholly before its window are not read.
//
// Layout (pallas_kernels/jnp/attention.py): q [T, Hq, D]; k_pages, v_pages [Hkv, NB, BS, D] float32;
// block_tables [S, B], seq_lens [S], query_start_loc [S + 1], num_seqs [] int32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;
using jpaged::ExpNonPositive;
using jpaged::kLanes;
using jpaged::Vec;

namespace {

// The options every score goes through: a soft cap (cap > 0) and a sliding window (window > 0).
struct ScoreRule {
  int64_t window;
  float cap;
  // The first key position a query at position pos sees.
  int64_t First(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  // s[0, n) = cap * tanh(s / cap) where there is a cap.
  void Cap(float* s, int64_t n) const {
    if (cap <= 0.f) return;
    const float inv = 1.f / cap;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] = cap * jpaged::Tanh(s[t] * inv);
  }
};

// Keys [0, lo) and [hi, n) of s get -inf (outside a row's window, or after its position); returns
// the largest of the others.
inline float MaskKeys(float* s, int64_t n, int64_t lo, int64_t hi) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float block_max = kMinusInf;
#pragma omp simd reduction(max : block_max)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = t >= lo && t < hi ? s[t] : kMinusInf;
    block_max = std::max(block_max, s[t]);
  }
  return block_max;
}

float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Starts loading a block's key and value rows (bytes each) into the cache: the pool is far larger
// than the cache, so without this every block's first touch waits on memory.
inline void PrefetchBlock(const float* k, const float* v, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k) + i);
    __builtin_prefetch(reinterpret_cast<const char*>(v) + i);
  }
}

// One block of a query head's online softmax: turns the block's scores s[0, n) into
// exp(s - the new running max), adds their sum to l and moves m to the new max; returns the factor
// the head's accumulator is rescaled by (0 on the first block, where m is -inf).
inline float SoftmaxBlock(float* s, int64_t n, float block_max, float& m, float& l) {
  const float m_new = std::max(m, block_max);
  const float correction = std::exp(m - m_new);
  float row_sum = 0.f;
#pragma omp simd reduction(+ : row_sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = ExpNonPositive(s[t] - m_new);  // a masked score (-inf) gives 0
    row_sum += s[t];
  }
  l = l * correction + row_sum;
  m = m_new;
  return correction;
}

// out[i * ldq + g * D + d] = acc[row][d] / l[row] for row i * G + g of n tokens x G query heads
// (zeros where l is 0).
inline void WriteRows(const float* acc, const float* l, int64_t n, int64_t G, int64_t D, int64_t ldq, float* out) {
  for (int64_t r = 0; r < n * G; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    float* o = out + (r / G) * ldq + (r % G) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
  }
}

// acc[0, D) = acc * correction + sum over t < n of p[t] * v[t, 0, D): a row's online-softmax update
// with one block's values. kD > 0 fixes D at compile time, so that the row is summed in registers.
template <int kD>
inline void AddValues(float* acc, float correction, const float* p, const float* v, int64_t n, int64_t D) {
  if (kD > 0) D = kD;
  float local[kD > 0 ? kD : 1];
  float* a = kD > 0 ? local : acc;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) a[d] = acc[d] * correction;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* vt = v + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) a[d] += pt * vt[d];
  }
  if (kD > 0) std::memcpy(acc, local, sizeof(float) * D);
}

// q, out: [G, D]; k, v: one KV head's pages [NB, BS, D]; table: the sequence's blocks. Block by
// block, each query head in turn scores the block's keys, updates its online softmax (one rescale
// per block) and accumulates the block's values; the block stays in L1 for the G heads and the
// next block is prefetched. kD > 0 fixes the head size at compile time (D == kD), so that a head's
// query and accumulator rows live in registers.
template <int kD>
void AttendRow(const float* q, const float* k, const float* v, const int32_t* table, int64_t len,
               int64_t G, int64_t D, int64_t BS, float scale, const ScoreRule& rule, float* out) {
  if (kD > 0) D = kD;
  std::vector<float> acc(G * D, 0.f), m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f), s(BS);
  const int64_t num_blocks = (len + BS - 1) / BS, block_floats = BS * D, lo = rule.First(len - 1);
  for (int64_t b = lo / BS; b < num_blocks; ++b) {
    const float* kb = k + table[b] * block_floats;
    const float* vb = v + table[b] * block_floats;
    if (b + 1 < num_blocks) {
      PrefetchBlock(k + table[b + 1] * block_floats, v + table[b + 1] * block_floats, block_floats * 4);
    }
    const int64_t n = std::min(BS, len - b * BS);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      for (int64_t t = 0; t < n; ++t) s[t] = Dot(qg, kb + t * D, D) * scale;
      rule.Cap(s.data(), n);
      const float block_max = MaskKeys(s.data(), n, lo - b * BS, n);
      const float correction = SoftmaxBlock(s.data(), n, block_max, m[g], l[g]);
      AddValues<kD>(acc.data() + g * D, correction, s.data(), vb, n, D);
    }
  }
  WriteRows(acc.data(), l.data(), 1, G, D, G * D, out);
}

#ifdef __AVX512F__
using jpaged::SumLanes16;

// AttendRow for blocks of 16 tokens and D = 16 * kChunks, in AVX-512 registers: a block's 16 scores
// for one query head are one vector (SumLanes16), and the head's accumulator row stays in registers
// while the block's values are added.
template <int kChunks>
void AttendRow16(const float* q, const float* k, const float* v, const int32_t* table, int64_t len,
                 int64_t G, float scale, const ScoreRule& rule, float* out) {
  constexpr int64_t D = 16 * kChunks, BS = 16;
  std::vector<float> acc(G * D, 0.f), m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f);
  const int64_t num_blocks = (len + BS - 1) / BS, lo = rule.First(len - 1);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[BS];
  for (int64_t b = lo / BS; b < num_blocks; ++b) {
    const float* kb = k + table[b] * BS * D;
    const float* vb = v + table[b] * BS * D;
    if (b + 1 < num_blocks) PrefetchBlock(k + table[b + 1] * BS * D, v + table[b + 1] * BS * D, BS * D * 4);
    const int64_t n = std::min(BS, len - b * BS), first = std::max<int64_t>(0, lo - b * BS);
    const __mmask16 valid = static_cast<__mmask16>(((1u << n) - 1) & ~((1u << first) - 1));
    for (int64_t g = 0; g < G; ++g) {
      __m512 qg[kChunks], dots[BS];
      for (int c = 0; c < kChunks; ++c) qg[c] = _mm512_loadu_ps(q + g * D + 16 * c);
      for (int64_t t = 0; t < BS; ++t) {  // rows past n are in the block too; their scores are masked
        __m512 dot = _mm512_mul_ps(qg[0], _mm512_loadu_ps(kb + t * D));
        for (int c = 1; c < kChunks; ++c) dot = _mm512_fmadd_ps(qg[c], _mm512_loadu_ps(kb + t * D + 16 * c), dot);
        dots[t] = dot;
      }
      __m512 scores = _mm512_mul_ps(SumLanes16(dots), _mm512_set1_ps(scale));
      if (rule.cap > 0.f) {
        _mm512_store_ps(p, scores);
        rule.Cap(p, BS);
        scores = _mm512_load_ps(p);
      }
      scores = _mm512_mask_blend_ps(valid, minus_inf, scores);
      _mm512_store_ps(p, scores);
      const float correction = SoftmaxBlock(p, BS, _mm512_reduce_max_ps(scores), m[g], l[g]);
      __m512 a[kChunks];
      for (int c = 0; c < kChunks; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(&acc[g * D + 16 * c]), _mm512_set1_ps(correction));
      for (int64_t t = 0; t < n; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        for (int c = 0; c < kChunks; ++c) a[c] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vb + t * D + 16 * c), a[c]);
      }
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(&acc[g * D + 16 * c], a[c]);
    }
  }
  WriteRows(acc.data(), l.data(), 1, G, D, G * D, out);
}
#endif

// Query tokens per prompt chunk: a chunk's G heads x kChunkTokens tokens share each key block.
constexpr int64_t kChunkTokens = 16;
// AttendChunk16's query rows per register block for heads of 128 dims (AVX-512: 2 rows of 8 vectors).
constexpr int kWideRows = kLanes == 16 ? 2 : 4;

// qc[(i * G + g) * D + d] = q[i * ldq + g * D + d] * scale: a prompt chunk's n tokens x G query
// heads as rows, scaled once.
inline void GatherQueries(const float* q, int64_t ldq, int64_t n, int64_t G, int64_t D, float scale, float* qc) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < D; ++d) qc[(i * G + g) * D + d] = q[i * ldq + g * D + d] * scale;
    }
  }
}

// kt[d * BS + t] = key t's dimension d of a block (zeros for the rows past `keys`).
inline void TransposeKeys(const float* kb, int64_t keys, int64_t BS, int64_t D, float* kt) {
  for (int64_t t = 0; t < BS; ++t) {
    for (int64_t d = 0; d < D; ++d) kt[d * BS + t] = t < keys ? kb[t * D + d] : 0.f;
  }
}

// One chunk of a prompt for one KV head: tokens [t0, t0 + n) of q (q and out at the head's first
// query head, token stride ldq floats), at positions pos0 + i, attend causally to the sequence's
// keys through table. Key block by key block, the chunk's G * n query rows are scored against the
// block's keys (transposed once per block), then each row's online softmax is updated and the
// block's values added to its accumulator. Any block and head size; AttendChunk16 is the fast path.
void AttendChunk(const float* q, int64_t ldq, const float* k, const float* v, const int32_t* table, int64_t pos0,
                 int64_t n, int64_t G, int64_t D, int64_t BS, float scale, const ScoreRule& rule, float* out) {
  const int64_t R = n * G, len = pos0 + n, num_blocks = (len + BS - 1) / BS, block_floats = BS * D;
  std::vector<float> qc(R * D), acc(R * D, 0.f), m(R, -std::numeric_limits<float>::infinity()), l(R, 0.f);
  std::vector<float> kt(D * BS), s(BS);
  GatherQueries(q, ldq, n, G, D, scale, qc.data());
  for (int64_t b = rule.First(pos0) / BS; b < num_blocks; ++b) {
    const float* kb = k + table[b] * block_floats;
    const float* vb = v + table[b] * block_floats;
    if (b + 1 < num_blocks) {
      PrefetchBlock(k + table[b + 1] * block_floats, v + table[b + 1] * block_floats, block_floats * 4);
    }
    const int64_t first = b * BS, keys = std::min(BS, len - first);
    TransposeKeys(kb, keys, BS, D, kt.data());
    for (int64_t r = 0; r < R; ++r) {
      const int64_t pos = pos0 + r / G;
      const int64_t lo = rule.First(pos) - first, hi = std::min(keys, pos - first + 1);  // the keys it sees
      if (hi <= std::max<int64_t>(lo, 0)) continue;  // the block is wholly outside this row's window
      const float* qr = qc.data() + r * D;
      std::fill(s.begin(), s.end(), 0.f);
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
#pragma omp simd
        for (int64_t t = 0; t < BS; ++t) s[t] += qd * kt[d * BS + t];
      }
      rule.Cap(s.data(), BS);
      const float block_max = MaskKeys(s.data(), BS, lo, hi);
      const float correction = SoftmaxBlock(s.data(), BS, block_max, m[r], l[r]);
      AddValues<0>(acc.data() + r * D, correction, s.data(), vb, hi, D);
    }
  }
  WriteRows(acc.data(), l.data(), n, G, D, ldq, out);
}

// AttendChunk for blocks of 16 keys and heads of kD dims, kRows query rows at a time, in vector
// registers of the instruction set: a row's 16 scores are 16 / kLanes vectors, built from the
// block's transposed keys (each key-dimension vector loaded once for the kRows rows), and the rows'
// accumulators stay in registers while the block's values are added, kStep vectors of each row at a
// time.
template <int kD, int kRows>
void AttendChunk16(const float* q, int64_t ldq, const float* k, const float* v, const int32_t* table, int64_t pos0,
                   int64_t n, int64_t G, float scale, const ScoreRule& rule, float* out) {
  constexpr int64_t BS = 16, kScoreVecs = BS / kLanes, kRowVecs = kD / kLanes;
  constexpr int64_t kStep = kLanes == 16 ? kRowVecs : 2;  // 16 registers without AVX-512
  const int64_t R = n * G, padded = (R + kRows - 1) / kRows * kRows, len = pos0 + n;
  const int64_t num_blocks = (len + BS - 1) / BS;
  std::vector<Vec> qc(padded * kRowVecs), acc(padded * kRowVecs), kt(kD * kScoreVecs);  // zeros: padding rows stay 0
  std::vector<float> m(padded, -std::numeric_limits<float>::infinity()), l(padded, 0.f);
  float* qf = reinterpret_cast<float*>(qc.data());
  GatherQueries(q, ldq, n, G, kD, scale, qf);
  alignas(64) float p[kRows][BS];
  float correction[kRows];
  for (int64_t b = rule.First(pos0) / BS; b < num_blocks; ++b) {
    const float* kb = k + table[b] * BS * kD;
    const float* vb = v + table[b] * BS * kD;
    if (b + 1 < num_blocks) PrefetchBlock(k + table[b + 1] * BS * kD, v + table[b + 1] * BS * kD, BS * kD * 4);
    const int64_t first = b * BS, keys = std::min(BS, len - first);
    TransposeKeys(kb, keys, BS, kD, reinterpret_cast<float*>(kt.data()));  // kt[d * kScoreVecs + i]: keys of dim d
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      if (pos0 + (r0 + kRows - 1) / G < first) continue;  // the block is wholly after these rows' positions
      if (rule.First(pos0 + r0 / G) >= first + keys) continue;  // ... or wholly before their windows
      Vec sc[kRows][kScoreVecs] = {};
      for (int64_t d = 0; d < kD; ++d) {
        Vec kd[kScoreVecs];
        for (int i = 0; i < kScoreVecs; ++i) kd[i] = kt[d * kScoreVecs + i];
        for (int j = 0; j < kRows; ++j) {
          const float qd = qf[(r0 + j) * kD + d];
          for (int i = 0; i < kScoreVecs; ++i) sc[j][i] += qd * kd[i];
        }
      }
      int64_t last = 0;  // keys any of the rows sees
      for (int j = 0; j < kRows; ++j) {
        const int64_t pos = pos0 + (r0 + j) / G;
        const int64_t lo = rule.First(pos) - first, hi = std::min(keys, pos - first + 1);
        std::memcpy(p[j], sc[j], sizeof(p[j]));
        correction[j] = 1.f;
        if (hi > std::max<int64_t>(lo, 0)) {
          rule.Cap(p[j], BS);
          const float block_max = MaskKeys(p[j], BS, lo, hi);
          correction[j] = SoftmaxBlock(p[j], BS, block_max, m[r0 + j], l[r0 + j]);
          last = std::max(last, hi);
        } else {
          std::fill(p[j], p[j] + BS, 0.f);
        }
      }
      for (int64_t c0 = 0; c0 < kRowVecs; c0 += kStep) {
        Vec a[kRows][kStep];
        for (int j = 0; j < kRows; ++j) {
          for (int c = 0; c < kStep; ++c) a[j][c] = acc[(r0 + j) * kRowVecs + c0 + c] * correction[j];
        }
        for (int64_t t = 0; t < last; ++t) {
          Vec vt[kStep];
          for (int c = 0; c < kStep; ++c) vt[c] = jpaged::Load(vb + t * kD + (c0 + c) * kLanes);
          for (int j = 0; j < kRows; ++j) {
            const float pj = p[j][t];
            for (int c = 0; c < kStep; ++c) a[j][c] += pj * vt[c];
          }
        }
        for (int j = 0; j < kRows; ++j) {
          for (int c = 0; c < kStep; ++c) acc[(r0 + j) * kRowVecs + c0 + c] = a[j][c];
        }
      }
    }
  }
  WriteRows(reinterpret_cast<const float*>(acc.data()), l.data(), n, G, kD, ldq, out);
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                           ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> query_start_loc,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::ResultBuffer<ffi::F32> out, float scale,
                           int32_t prefill, int32_t sliding_window, float logits_soft_cap) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto vd = v_pages.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) ||
      kd[3] != qd[2] || qd[1] % kd[0] != 0 || seq_lens.dimensions().size() != 1 ||
      seq_lens.dimensions()[0] != td[0] || query_start_loc.dimensions()[0] != td[0] + 1) {
    return ffi::Error::InvalidArgument("jpaged_paged_attention: inconsistent shapes");
  }
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], Hkv = kd[0], NB = kd[1], BS = kd[2];
  const int64_t S = td[0], B = td[1], G = Hq / Hkv;
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* qsl = query_start_loc.typed_data();
  const int64_t rows = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), S);
  float* o = out->typed_data();
  std::memset(o, 0, sizeof(float) * T * Hq * D);
  const ScoreRule rule{std::max<int64_t>(sliding_window, 0), std::max(logits_soft_cap, 0.f)};

  // Work: (sequence, first query token of a prompt chunk, or -1 for a decode row); prompt chunks
  // first, the ones with the most context first, so that the long items do not come last.
  std::vector<std::pair<int64_t, int64_t>> work, decode;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens[r], q_len = qsl[r + 1] - qsl[r];
    if (len <= 0 || q_len <= 0 || (q_len > 1 && !prefill)) continue;
    if (qsl[r] < 0 || qsl[r + 1] > T || q_len > len) {
      return ffi::Error::InvalidArgument("jpaged_paged_attention: query tokens outside the batch or the context");
    }
    if (len > B * BS) return ffi::Error::InvalidArgument("jpaged_paged_attention: seq_len exceeds its block table");
    for (int64_t b = 0; b < (len + BS - 1) / BS; ++b) {
      if (tables[r * B + b] < 0 || tables[r * B + b] >= NB) {
        return ffi::Error::InvalidArgument("jpaged_paged_attention: block id out of the pool");
      }
    }
    if (q_len == 1) {
      decode.emplace_back(r, -1);
    } else {
      for (int64_t first = (q_len - 1) / kChunkTokens * kChunkTokens; first >= 0; first -= kChunkTokens) {
        work.emplace_back(r, first);
      }
    }
  }
  std::stable_sort(work.begin(), work.end(), [&](const auto& a, const auto& b) {
    auto context = [&](const auto& w) { return lens[w.first] - (qsl[w.first + 1] - qsl[w.first]) + w.second; };
    return context(a) > context(b);
  });
  work.insert(work.end(), decode.begin(), decode.end());
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  jpaged::ParallelFor(pool, static_cast<int64_t>(work.size()) * Hkv, [&](int64_t item) {
    const auto [r, first] = work[item / Hkv];
    const int64_t h = item % Hkv, head_floats = NB * BS * D;
    const float *kh = kp + h * head_floats, *vh = vp + h * head_floats;
    if (first >= 0) {  // a prompt chunk: tokens qsl[r] + first ... at positions from len - q_len + first
      const int64_t q_len = qsl[r + 1] - qsl[r], n = std::min(kChunkTokens, q_len - first);
      const int64_t offset = ((qsl[r] + first) * Hq + h * G) * D, pos0 = lens[r] - q_len + first;
      const float* qr = qp + offset;
      if (BS == 16 && D == 64) return AttendChunk16<64, 4>(qr, Hq * D, kh, vh, tables + r * B, pos0, n, G, scale, rule, o + offset);
      if (BS == 16 && D == 128) return AttendChunk16<128, kWideRows>(qr, Hq * D, kh, vh, tables + r * B, pos0, n, G, scale, rule, o + offset);
      return AttendChunk(qr, Hq * D, kh, vh, tables + r * B, pos0, n, G, D, BS, scale, rule, o + offset);
    }
    const int64_t offset = (qsl[r] * Hq + h * G) * D, len = lens[r];
    const float* qr = qp + offset;
#ifdef __AVX512F__
    if (BS == 16 && D == 64) return AttendRow16<4>(qr, kh, vh, tables + r * B, len, G, scale, rule, o + offset);
    if (BS == 16 && D == 128) return AttendRow16<8>(qr, kh, vh, tables + r * B, len, G, scale, rule, o + offset);
#endif
    auto attend = D == 64 ? AttendRow<64> : D == 128 ? AttendRow<128> : AttendRow<0>;
    attend(qr, kh, vh, tables + r * B, len, G, D, BS, scale, rule, o + offset);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedPagedAttention, PagedAttentionImpl,
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
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("prefill")
                                  .Attr<int32_t>("sliding_window")     // 0: none
                                  .Attr<float>("logits_soft_cap"));     // 0: none
