// Decode attention's row loop (pallas_kernels/cpu/paged_attention.cc: AttendRow16 with AVX-512,
// AttendRow otherwise) on two threads without XLA, against loops that only read the same blocks:
// how near the kernel comes to what this machine's memory gives for its access pattern. SmolLM2's
// heads (9 query and 3 KV heads of 64 dims), blocks of 16 tokens: per block and KV head a key page
// and a value page of 4 KiB, at random places in the pool (`random`, the default) or each row's
// blocks side by side (`in-order`, as a prompt's blocks come off the engine's free queue).
//
// Prints GB/s of keys and values read (the mean of the calls after the first round):
//   kernel cold       every call's blocks fresh from a pool of `pool_blocks` blocks (not in cache)
//   kernel hot        16 blocks reused by every row (in L2): the loop's own speed
//   read cold, ...    a loop that only sums the same key and value pages, prefetching the next
//                     block whole (the kernel's way) or only its first 2 lines (the hardware
//                     streamer fetches the rest)
// and the kernel's largest difference from a double-precision softmax reference (first call).
//
// Build and run from the repository root (the include path is jaxlib's; -march as the library's):
//   g++ -O3 -march=native -mprefer-vector-width=512 -fopenmp-simd -ffast-math -fno-finite-math-only -std=c++17
//       -I "$(python -c 'import jax; print(jax.ffi.include_dir())')"
//       scripts/benchmark_attention_loop.cc -o /tmp/attention_loop -lpthread     (one command)
//   /tmp/attention_loop rows context [pool_blocks [random|in-order]]   # e.g. /tmp/attention_loop 128 512 40000
#include "../pallas_kernels/cpu/paged_attention.cc"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kHq = 9, kHkv = 3, kG = kHq / kHkv, kD = 64, kBS = 16;

// The sum of one sequence's key and value pages for one KV head, the next block's first `lines`
// cache lines prefetched (all of them: the kernel's PrefetchBlock).
float ReadRow(const float* k, const float* v, const int32_t* table, int64_t blocks, int64_t lines) {
  Vec acc[4] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* kb = k + table[b] * kBS * kD;
    const float* vb = v + table[b] * kBS * kD;
    if (b + 1 < blocks) PrefetchBlock(k + table[b + 1] * kBS * kD, v + table[b + 1] * kBS * kD, lines * 64);
    for (const float* page : {kb, vb}) {
      for (int64_t i = 0; i < kBS * kD; i += 4 * kLanes) {
        for (int j = 0; j < 4; ++j) acc[j] += jpaged::Load(page + i + j * kLanes);
      }
    }
  }
  float sum = 0.f;
  for (const Vec& a : acc) for (int64_t j = 0; j < kLanes; ++j) sum += a[j];
  return sum;
}

void AttendOne(const float* q, const float* k, const float* v, const int32_t* table, int64_t len, float* out) {
  const ScoreRule rule{0, 0.f};
#ifdef __AVX512F__
  AttendRow16<4>(q, k, v, table, len, kG, 0.125f, rule, out);
#else
  AttendRow<64>(q, k, v, table, len, kG, kD, kBS, 0.125f, rule, out);
#endif
}

// Runs `row(item)` for items [0, total) on two threads (items dealt alternately); seconds.
template <typename Row>
double TwoThreads(int64_t total, const Row& row) {
  const auto start = std::chrono::steady_clock::now();
  std::thread helper([&] { for (int64_t i = 1; i < total; i += 2) row(i); });
  for (int64_t i = 0; i < total; i += 2) row(i);
  helper.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s rows context [pool_blocks [random|in-order]]\n", argv[0]);
    return 2;
  }
  const int64_t rows = std::atoll(argv[1]), ctx = std::atoll(argv[2]) / kBS * kBS;
  const int64_t pool = argc > 3 ? std::atoll(argv[3]) : 40000, blocks = ctx / kBS;
  const int64_t per_call = rows * blocks, calls = pool / per_call;
  const std::string order = argc > 4 ? argv[4] : "random";
  if (order != "random" && order != "in-order") {
    std::fprintf(stderr, "order must be random or in-order, not %s\n", order.c_str());
    return 2;
  }
  if (blocks < 1 || calls < 2) {
    std::fprintf(stderr, "pool_blocks must hold two calls' blocks (rows * context / 16 each)\n");
    return 2;
  }
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.f, 0.5f);
  std::vector<float> k(kHkv * pool * kBS * kD), v(k.size()), q(rows * kHq * kD), out(q.size());
  for (auto* x : {&k, &v, &q}) for (float& f : *x) f = normal(rng);
  std::vector<int32_t> cold(pool), hot(per_call);
  for (int64_t i = 0; i < pool; ++i) cold[i] = static_cast<int32_t>(i);
  if (order == "random") std::shuffle(cold.begin(), cold.end(), rng);
  for (int64_t i = 0; i < per_call; ++i) hot[i] = cold[i] % 16;
  const double bytes = per_call * kHkv * 2.0 * kBS * kD * sizeof(float);

  auto attend = [&](const int32_t* tables) {
    return TwoThreads(rows * kHkv, [&](int64_t item) {
      const int64_t r = item / kHkv, h = item % kHkv, head = h * pool * kBS * kD, at = (r * kHq + h * kG) * kD;
      AttendOne(q.data() + at, k.data() + head, v.data() + head, tables + r * blocks, ctx, out.data() + at);
    });
  };
  auto read = [&](const int32_t* tables, int64_t lines) {
    std::vector<float> sums(rows * kHkv);
    return TwoThreads(rows * kHkv, [&](int64_t item) {
      const int64_t r = item / kHkv, h = item % kHkv, head = h * pool * kBS * kD;
      sums[item] = ReadRow(k.data() + head, v.data() + head, tables + r * blocks, blocks, lines);
    });
  };
  // GB/s over rounds of every call's blocks (cold) or the same blocks again (hot); round 0 warms up.
  auto rate = [&](auto run, bool fresh) {
    double seconds = 0;
    int64_t timed = 0;
    for (int round = 0; round < 3; ++round) {
      for (int64_t c = 0; c < calls; ++c) {
        const double s = run(fresh ? cold.data() + c * per_call : hot.data());
        if (round > 0) seconds += s, ++timed;
      }
    }
    return bytes * timed / seconds / 1e9;
  };

  // The first call's output against a double-precision softmax over the same keys and values.
  attend(cold.data());
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t hq = 0; hq < kHq; ++hq) {
      const int64_t h = hq / kG, head = h * pool * kBS * kD;
      std::vector<double> s(ctx), o(kD, 0.0);
      double m = -1e300, l = 0;
      for (int64_t t = 0; t < ctx; ++t) {
        const float* key = k.data() + head + (cold[r * blocks + t / kBS] * kBS + t % kBS) * kD;
        s[t] = 0;
        for (int64_t d = 0; d < kD; ++d) s[t] += double(q[(r * kHq + hq) * kD + d]) * key[d];
        s[t] *= 0.125;
        m = std::max(m, s[t]);
      }
      for (int64_t t = 0; t < ctx; ++t) {
        const double p = std::exp(s[t] - m);
        const float* value = v.data() + head + (cold[r * blocks + t / kBS] * kBS + t % kBS) * kD;
        l += p;
        for (int64_t d = 0; d < kD; ++d) o[d] += p * value[d];
      }
      for (int64_t d = 0; d < kD; ++d) {
        worst = std::max(worst, std::fabs(o[d] / l - out[(r * kHq + hq) * kD + d]));
      }
    }
  }
  std::printf("rows %lld, context %lld, pool %lld blocks, %s: %.1f MB of keys and values a call\n",
              static_cast<long long>(rows), static_cast<long long>(ctx), static_cast<long long>(pool), order.c_str(),
              bytes / 1e6);
  std::printf("kernel largest difference from the reference: %.2e\n", worst);
  std::printf("kernel cold: %.1f GB/s\n", rate(attend, true));
  std::printf("kernel hot: %.1f GB/s\n", rate(attend, false));
  std::printf("read cold, next block prefetched whole: %.1f GB/s\n", rate([&](const int32_t* t) { return read(t, kBS * kD / 16); }, true));
  std::printf("read cold, next block's first 2 lines prefetched: %.1f GB/s\n", rate([&](const int32_t* t) { return read(t, 2); }, true));
  return 0;
}
