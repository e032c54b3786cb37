// Timing inside one XLA program, for the measurements that decide where a C++ kernel serves
// (measure.py): an XLA FFI custom call placed between the operations being timed.
//
// jpaged_probe(x, *after, *evict) -> copy of x, with attribute slot s: runs once every operand in
// `after` (the previous operation's results) is ready; records that time as the end of operation
// s - 1, writes back and evicts the `evict` buffers from every cache level (the weights or KV
// pages, so that the next operation reads them from memory, as a model's step does), copies x (the
// next operation's input, which it therefore waits for) and records the start of operation s.
// JpagedProbeSeconds(s) reads operation s's duration afterwards.

#include <chrono>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSlots = 4096;
double starts[kSlots], ends[kSlots];

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Evict(const void* data, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  const char* p = static_cast<const char*>(data);
  for (size_t i = 0; i < bytes; i += 64) _mm_clflush(p + i);
  _mm_mfence();
#else
  (void)data;
  (void)bytes;
#endif
}

ffi::Error ProbeImpl(ffi::AnyBuffer x, ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out, int64_t slot,
                     int64_t evict_from) {
  if (slot < 0 || slot >= kSlots || evict_from < 0 || evict_from > static_cast<int64_t>(rest.size())) {
    return ffi::Error::InvalidArgument("jpaged_probe: slot or evict_from out of range");
  }
  if (slot > 0) ends[slot - 1] = Now();
  for (size_t i = evict_from; i < rest.size(); ++i) {
    const auto buffer = rest.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return ffi::Error::InvalidArgument("jpaged_probe: expected buffers");
    Evict(buffer->untyped_data(), buffer->size_bytes());
  }
  std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  starts[slot] = Now();
  return ffi::Error::Success();
}

}  // namespace

extern "C" double JpagedProbeSeconds(int64_t slot) {
  return slot >= 0 && slot < kSlots ? ends[slot] - starts[slot] : -1.0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JpagedProbe, ProbeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .RemainingArgs()        // after..., evict...
                                  .Ret<ffi::AnyBuffer>()  // copy of x
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("evict_from"));
