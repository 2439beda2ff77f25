#pragma once
// Weight-only int8 GEMM on int8 weights packed into 32-column panels, per-output-channel fp32 scales, and the
// widening of those panels to bf16 that it shares with the int8 MoE kernel (moe_bf16.cpp).
#include "common.h"
#include "gemm_bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PS_INT8_DP 1
#endif

namespace ps {

constexpr int64_t kQNR = 32;

typedef int8_t i8x16 __attribute__((vector_size(16)));

inline f32x16 widen_i8(const int8_t* p) {
#ifdef __AVX512F__
  // (GCC turns the generic conversion below into scalar code here)
  return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  i8x16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, i32x16), f32x16);
#endif
}
#ifdef PS_INT8_DP
// One int8 panel [K, 32] widened into vdpbf16ps's layout [K / 2, 32, 2] bf16 (exact: bf16 holds every int8).
inline void widen_panel(const int8_t* p, int64_t K2, bf16_t* w) {
  for (int64_t kk = 0; kk < K2; ++kk)
    for (int h = 0; h < 2; ++h) {
      const f32x16 e = widen_i8(p + 2 * kk * kQNR + 16 * h), o = widen_i8(p + (2 * kk + 1) * kQNR + 16 * h);
      u32x16 ue, uo;
      std::memcpy(&ue, &e, sizeof e);
      std::memcpy(&uo, &o, sizeof o);
      const u32x16 pair = uo | (ue >> 16);  // the low 16 bits of both are zero: their bf16 is exact
      std::memcpy(w + kk * 2 * kQNR + 32 * h, &pair, sizeof pair);
    }
}

// A whole panel of K (even) widened into this thread's buffer, which the next call overwrites.
inline const bf16_t* widened_panel(const int8_t* p, int64_t K) {
  thread_local std::vector<bf16_t> w;
  if (static_cast<int64_t>(w.size()) < K * kQNR) w.resize(K * kQNR);
  widen_panel(p, K / 2, w.data());
  return w.data();
}

#ifdef PS_AMX
// An int8 panel's B tiles widened a k step at a time into a buffer that stays in L1, for units of one row pair
// (which read each step once): the same bf16 as widen_panel's, without the whole widened panel's trip through L2.
// Alongside, the step two ahead is fetched into L1 and the same step of the thread's next panel (pf, or null) into
// L2: decode reads panels from memory, once.
struct WidenedSteps {
  const int8_t* p;
  const int8_t* pf;
  int64_t K, steps;
  mutable bf16_t buf[kAmxR * 2 * kAmxN] __attribute__((aligned(64)));
  WidenedSteps(const int8_t* p_, const int8_t* pf_, int64_t K_)
      : p(p_), pf(pf_), K(K_), steps((K_ + kAmxK - 1) / kAmxK) {}
  const bf16_t* step(int64_t t) const {
    constexpr int64_t bytes = kAmxK * kQNR;
    for (int64_t i = 0; i < bytes; i += 64) {
      if (t + 2 < steps) _mm_prefetch(reinterpret_cast<const char*>(p + (t + 2) * bytes + i), _MM_HINT_T0);
      if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + t * bytes + i), _MM_HINT_T1);
    }
    const int64_t pairs = std::min<int64_t>(kAmxR, (K - t * kAmxK) / 2);
    widen_panel(p + t * kAmxK * kQNR, pairs, buf);
    if (pairs < kAmxR) std::memset(buf + pairs * 2 * kAmxN, 0, (kAmxR - pairs) * 2 * kAmxN * sizeof(bf16_t));
    return buf;
  }
};

#endif
#endif

// x [M, K] fp32 or bf16 (rows may be strided), packed [P, K, 32] int8, scale [N] fp32, bias [N] of x's dtype or
// empty, out [M, N] of x's dtype or fp32, contiguous: out = (x @ q.T) * scale + bias. bf16 rows on AMX tiles where
// the CPU has them and use_amx.
void gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor bias, torch::Tensor out,
               bool use_amx = true);
// Whether this build has the AVX512-BF16 path for many bf16 rows (else every shape takes the FMA path).
bool gemm_int8_dp_built();

}  // namespace ps
