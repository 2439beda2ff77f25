// The memory read-rate probe the benchmarks hold memory-bound kernels against: every byte of a buffer read once, on
// the kernels' threads (each a contiguous share), 64-byte vector loads into four independent xor chains, with the
// next lines prefetched into L2 ahead of the loads as the GEMM kernels prefetch their next panel.

#include "fused.h"

namespace ps {

int64_t stream_read(torch::Tensor buffer) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.numel() * buffer.element_size() % 256 == 0,
              "a contiguous buffer of whole 256-byte lines");
  const char* base = static_cast<const char*>(buffer.data_ptr());
  const int64_t lines = buffer.numel() * buffer.element_size() / 256;
  constexpr int64_t kAhead = 32;  // 256-byte steps prefetched ahead: 8 KiB
  std::atomic<uint32_t> total{0};
  parallel_for(0, lines, 4096, [&](int64_t b, int64_t e) {
    u32x16 acc[4] = {};
    for (int64_t i = b; i < e; ++i) {
      const char* p = base + i * 256;
      if (i + kAhead < e)
        for (int j = 0; j < 4; ++j) __builtin_prefetch(p + kAhead * 256 + j * 64, 0, 2);
      for (int j = 0; j < 4; ++j) {
        u32x16 v;
        std::memcpy(&v, p + j * 64, sizeof v);
        acc[j] ^= v;
      }
    }
    const u32x16 x = acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
    uint32_t folded = 0;
    for (int j = 0; j < 16; ++j) folded ^= x[j];
    total.fetch_xor(folded, std::memory_order_relaxed);
  });
  return total.load();
}

}  // namespace ps
