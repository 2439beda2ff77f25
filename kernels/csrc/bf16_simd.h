#pragma once
// AVX512-BF16 helpers shared by the bf16 attention kernels (attention_bf16.cpp, attention_amx.cpp): bf16 loads, cache
// rows read as bf16 (an fp8 cache's widened), a 16-lane exp, the cache offsets of a run of tokens and their prefetch.
#include "attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PS_AVX512_BF16 1
#include <immintrin.h>
#include <type_traits>
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

// A row of n zeros of a cache's type (all-zero bytes: +0 in every format).
template <typename C>
inline const C* zero_row(int64_t n) {
  thread_local std::vector<C> zero;
  if (int64_t(zero.size()) < n) zero.assign(n, C{});
  return zero.data();
}

// The bf16 bits of fp8 codes 0-127 (the sign is bit 7 of the byte, bit 15 of the bf16): every e4m3 and e5m2 value,
// subnormals included, is a bf16 normal. Codes that are NaN or inf in fp8 come out as the finite values their bits
// would have with a normal exponent, as common.h's widen_fp8 gives them (quantization never writes them).
template <int MANT, int BIAS>
struct Fp8ToBf16 {
  alignas(64) uint16_t bits[128];
  Fp8ToBf16() {
    for (int c = 0; c < 128; ++c) {
      const int e = c >> MANT, m = c & ((1 << MANT) - 1);
      const float f = e ? std::ldexp(1.f + float(m) / (1 << MANT), e - BIAS) : std::ldexp(float(m), 1 - BIAS - MANT);
      uint32_t w; std::memcpy(&w, &f, sizeof w);
      bits[c] = uint16_t(w >> 16);  // exact: at most 3 mantissa bits
    }
  }
};

// 32 elements of a cache row as bf16; fp8 through a 128-entry table (two 64-entry word permutes and a select).
template <int MANT, int BIAS>
inline __m512i widen_fp8_32(const uint8_t* p) {
  static const Fp8ToBf16<MANT, BIAS> table;
  const __m512i* t = reinterpret_cast<const __m512i*>(table.bits);
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i lo = _mm512_permutex2var_epi16(t[0], w, t[1]), hi = _mm512_permutex2var_epi16(t[2], w, t[3]);
  const __m512i mag = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), hi);
  return _mm512_or_si512(mag, _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000))));
}
inline __m512i load_row32(const bf16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i load_row32(const fp8_e4m3_t* p) { return widen_fp8_32<3, 7>(&p->bits); }
inline __m512i load_row32(const fp8_e5m2_t* p) { return widen_fp8_32<2, 15>(&p->bits); }

// Prefetches `bytes` from `skip` elements into the rows of keys [t, min(t + 16, L)): into L1 where `to_l1`, else
// into L2.
template <typename C>
inline void prefetch_rows(const C* cache, const int64_t* off, int64_t t, int64_t L, int64_t skip, int64_t bytes,
                          bool to_l1) {
  for (int64_t u = t; u < std::min(t + 16, L); ++u)
    for (int64_t b = 0; b < bytes; b += 64) {
      const char* p = (const char*)(cache + off[u] + skip) + b;
      if (to_l1) _mm_prefetch(p, _MM_HINT_T0);
      else _mm_prefetch(p, _MM_HINT_T1);
    }
}

}  // namespace abf
}  // namespace ps
#endif
