#pragma once
// The fp32 panel GEMM's register tile (gemm.cpp), shared with the fused MoE kernel (moe.cpp), which runs it on
// expert weights packed the same way.
#include "common.h"

namespace ps {

// kKC: the k block whose panel slice (16 KiB in fp32) stays in L1 while every row tile of a block runs on it.
constexpr int64_t kNR = 16, kMR = 6, kKC = 256;

// y[r][0:16] (+)= sum_k x[r][k] * p[k][0:16] for rows r < MR; y and bias may be narrower than 16 (ncols).
// With `next`, one cache line of it is prefetched per k: the panel slice the following tiles will need. W: the
// panel's storage, float or bf16_t (widened exactly: a bf16 panel gives the sums of its fp32 values, from half the
// bytes).
template <int MR, typename W = float>
inline void gemm_tile(const float* x, int64_t ldx, const W* p, int64_t kc, float* y, int64_t ldy,
                      int64_t ncols, bool accumulate, const float* bias, const W* next) {
  f32x8 a0[MR], a1[MR];
  f32x8 b0 = {}, b1 = {};
  if (bias != nullptr) {
    float t[kNR] = {};
    std::memcpy(t, bias, ncols * sizeof(float));
    b0 = load8(t); b1 = load8(t + 8);
  }
  for (int r = 0; r < MR; ++r) {
    if (!accumulate) { a0[r] = b0; a1[r] = b1; continue; }
    if (ncols == kNR) { a0[r] = load8(y + r * ldy); a1[r] = load8(y + r * ldy + 8); continue; }
    float t[kNR] = {};
    std::memcpy(t, y + r * ldy, ncols * sizeof(float));
    a0[r] = load8(t); a1[r] = load8(t + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (next != nullptr) __builtin_prefetch(next + k * kNR, 0, 3);
    const f32x8 w0 = load8(p + k * kNR), w1 = load8(p + k * kNR + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const f32x8 xv = splat(x[r * ldx + k]);
      a0[r] += xv * w0;
      a1[r] += xv * w1;
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (ncols == kNR) { store8(y + r * ldy, a0[r]); store8(y + r * ldy + 8, a1[r]); continue; }
    float t[kNR];
    store8(t, a0[r]); store8(t + 8, a1[r]);
    std::memcpy(y + r * ldy, t, ncols * sizeof(float));
  }
}

template <typename W>
using TileFnOf = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, bool, const float*,
                          const W*);
// The tile for 1 .. kMR rows.
template <typename W>
inline constexpr TileFnOf<W> kTilesOf[kMR + 1] = {nullptr, gemm_tile<1, W>, gemm_tile<2, W>, gemm_tile<3, W>,
                                                  gemm_tile<4, W>, gemm_tile<5, W>, gemm_tile<6, W>};
inline constexpr const auto& kTiles = kTilesOf<float>;

}  // namespace ps
