#pragma once
// AVX512-BF16 helpers shared by the bf16 attention kernels (attention_bf16.cpp, attention_amx.cpp): bf16 loads, a
// 16-lane exp and the cache offsets of a run of tokens.
#include "attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PS_AVX512_BF16 1
#include <immintrin.h>
namespace ps {
namespace abf {

inline __m512bh load_bh(const bf16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bcast_pair(const bf16_t* p) { int32_t w; std::memcpy(&w, p, 4); return (__m512bh)_mm512_set1_epi32(w); }

// exp as exp8 (Cody-Waite reduction, degree-6 polynomial), 16 lanes.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(nf, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(nf), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Offsets into the cache of tokens [t0, t1)'s rows (head 0), then `pad` times -1 (no token: a zero row).
inline const int64_t* token_offsets(const int32_t* table, int64_t t0, int64_t t1, int64_t pad, const AttnShape& sh) {
  thread_local std::vector<int64_t> off;
  off.resize(t1 - t0 + pad);
  for (int64_t t = t0; t < t1;) {
    const int64_t b = t / sh.bs, base = table[b] * sh.blk_stride, end = std::min(t1, (b + 1) * sh.bs);
    for (; t < end; ++t) off[t - t0] = base + (t - b * sh.bs) * sh.tok_stride;
  }
  for (int64_t t = t1 - t0; t < t1 - t0 + pad; ++t) off[t] = -1;
  return off.data();
}

inline const bf16_t* zero_row(int64_t n) {
  thread_local std::vector<bf16_t> zero;
  if (int64_t(zero.size()) < n) zero.assign(n, 0);
  return zero.data();
}

}  // namespace abf
}  // namespace ps
#endif
