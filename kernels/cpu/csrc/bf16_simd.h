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

// exp as exp8 (Cody-Waite reduction, degree-6 polynomial), 16 lanes: common.h's AVX-512 exp16v.
inline __m512 exp16(__m512 x) { return (__m512)exp16v((f32x16)x); }

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

// The bf16 bits of fp8 code c < 128 (a magnitude; the sign is bit 7 of the byte, bit 15 of the bf16) with `mant`
// mantissa bits and exponent bias `bias`: every e4m3 and e5m2 value, subnormals included, is a bf16 normal. Codes
// that are NaN or inf in fp8 come out as the finite values their bits would have with a normal exponent, as
// common.h's widen_fp8 gives them (quantization never writes them).
constexpr uint16_t fp8_bf16_bits(int c, int mant, int bias) {
  const int e = c >> mant, m = c & ((1 << mant) - 1);
  if (e) return uint16_t((e - bias + 127) << 7 | m << (7 - mant));
  if (!m) return 0;
  int top = 0;  // a subnormal m x 2^(1 - bias - mant), normalized: 2^top <= m
  while (m >> (top + 1)) ++top;
  return uint16_t((top + 1 - bias - mant + 127) << 7 | (m - (1 << top)) << (7 - top));
}

// The 128 codes' bf16 bits, as words and split into low and high bytes (for byte permutes). Namespace-scope
// constants: a function-local static's guard check in a kernel's loop is a possible call, around which the compiler
// kept the loop's accumulators in memory (an fp8 decode row ran at half speed).
template <int MANT, int BIAS>
struct Fp8ToBf16 {
  alignas(64) uint16_t bits[128] = {};
  alignas(64) uint8_t lo[128] = {};
  alignas(64) uint8_t hi[128] = {};
  constexpr Fp8ToBf16() {
    for (int c = 0; c < 128; ++c) {
      bits[c] = fp8_bf16_bits(c, MANT, BIAS);
      lo[c] = uint8_t(bits[c]);
      hi[c] = uint8_t(bits[c] >> 8);
    }
  }
};
template <int MANT, int BIAS>
inline constexpr Fp8ToBf16<MANT, BIAS> kFp8ToBf16{};

#ifdef __AVX512VBMI__
struct ByteIndex {
  alignas(64) uint8_t dup[64] = {};  // byte i <- byte i / 2: each of 32 bytes into both bytes of its word
  alignas(64) uint8_t zip[64] = {};  // byte 2j <- byte j, 2j + 1 <- byte 32 + j: two 32-byte rows zipped
  constexpr ByteIndex() {
    for (int i = 0; i < 64; ++i) dup[i] = uint8_t(i / 2), zip[i] = uint8_t(i / 2 + (i % 2) * 32);
  }
};
inline constexpr ByteIndex kByteIndex{};

// 32 elements of a cache row as bf16; fp8 through byte permutes (VBMI), three shuffle-port instructions where the
// word permutes below take six: each code goes to both bytes of its word, the even bytes look up the low byte of its
// bf16 and the odd ones the high byte (a 128-byte two-register permute reads the low 7 bits: the magnitude), then
// the sign is or-ed in.
template <int MANT, int BIAS>
inline __m512i widen_fp8_32(const uint8_t* p) {
  const auto& table = kFp8ToBf16<MANT, BIAS>;
  const __m512i* lo = reinterpret_cast<const __m512i*>(table.lo);
  const __m512i* hi = reinterpret_cast<const __m512i*>(table.hi);
  const __m512i codes = _mm512_permutexvar_epi8(_mm512_load_si512(kByteIndex.dup),
                                                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p)));
  __m512i r = _mm512_mask2_permutex2var_epi8(lo[0], codes, 0x5555555555555555ull, lo[1]);
  r = _mm512_mask2_permutex2var_epi8(hi[0], r, 0xAAAAAAAAAAAAAAAAull, hi[1]);
  return _mm512_ternarylogic_epi32(r, codes, _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // r | (codes & sign)
}

// load_pairs32 (below) of two fp8 rows: their bytes zipped, then each byte's bf16 low and high bytes looked up and
// unpacked into words, which come out in load_pairs32's order: five shuffle-port instructions where widening each
// row and pairing the words take eight.
// Codes `x` (64 bytes) as bf16 words by their bytes: lo = the bf16's low byte, hi = its high byte with the sign.
template <int MANT, int BIAS>
inline void fp8_bf16_bytes(__m512i x, __m512i& lo, __m512i& hi) {
  const auto& table = kFp8ToBf16<MANT, BIAS>;
  const __m512i* tl = reinterpret_cast<const __m512i*>(table.lo);
  const __m512i* th = reinterpret_cast<const __m512i*>(table.hi);
  lo = _mm512_permutex2var_epi8(tl[0], x, tl[1]);
  hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(th[0], x, th[1]), x, _mm512_set1_epi8(int8_t(0x80)), 0xF8);
}

template <int MANT, int BIAS>
inline void widen_fp8_pairs32(const uint8_t* a, const uint8_t* b, __m512i& lo, __m512i& hi) {
  const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                        _mm256_loadu_si256((const __m256i*)b), 1);
  __m512i l, h;
  fp8_bf16_bytes<MANT, BIAS>(_mm512_permutexvar_epi8(_mm512_load_si512(kByteIndex.zip), ab), l, h);
  lo = _mm512_unpacklo_epi8(l, h);
  hi = _mm512_unpackhi_epi8(l, h);
}

// 64 elements of an fp8 row as bf16 in lane order (four shuffle-port instructions, against six for two
// widen_fp8_32): word 8l + i of `w0` is element 16l + i and of `w1` element 16l + 8 + i, l < 4, i < 8. A dot product
// takes its other operand in the same order (lane_order64).
template <int MANT, int BIAS>
inline void widen_fp8_lanes64(const uint8_t* p, __m512i& w0, __m512i& w1) {
  __m512i l, h;
  fp8_bf16_bytes<MANT, BIAS>(_mm512_loadu_si512(p), l, h);
  w0 = _mm512_unpacklo_epi8(l, h);
  w1 = _mm512_unpackhi_epi8(l, h);
}
template <typename C> constexpr bool has_lane_order64() { return !std::is_same_v<C, bf16_t>; }
inline void widen_lanes64(const fp8_e4m3_t* p, __m512i& w0, __m512i& w1) { widen_fp8_lanes64<3, 7>(&p->bits, w0, w1); }
inline void widen_lanes64(const fp8_e5m2_t* p, __m512i& w0, __m512i& w1) { widen_fp8_lanes64<2, 15>(&p->bits, w0, w1); }

// 64 bf16 (two vectors of 32) in widen_fp8_lanes64's order.
inline void lane_order64(const bf16_t* p, __m512i& w0, __m512i& w1) {
  alignas(64) static constexpr struct Idx {
    int16_t w[2][32] = {};
    constexpr Idx() { for (int i = 0; i < 32; ++i) w[0][i] = int16_t(i / 8 * 16 + i % 8), w[1][i] = w[0][i] + 8; }
  } idx{};
  const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 32);
  w0 = _mm512_permutex2var_epi16(a, _mm512_loadu_si512(idx.w[0]), b);
  w1 = _mm512_permutex2var_epi16(a, _mm512_loadu_si512(idx.w[1]), b);
}
#else
template <typename C> constexpr bool has_lane_order64() { return false; }
template <typename C> inline void widen_lanes64(const C*, __m512i&, __m512i&) {}
inline void lane_order64(const bf16_t*, __m512i&, __m512i&) {}
// 32 elements of a cache row as bf16; fp8 through a 128-entry table (two 64-entry word permutes and a select).
template <int MANT, int BIAS>
inline __m512i widen_fp8_32(const uint8_t* p) {
  const __m512i* t = reinterpret_cast<const __m512i*>(kFp8ToBf16<MANT, BIAS>.bits);
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i lo = _mm512_permutex2var_epi16(t[0], w, t[1]), hi = _mm512_permutex2var_epi16(t[2], w, t[3]);
  const __m512i mag = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), hi);
  return _mm512_or_si512(mag, _mm512_and_si512(_mm512_slli_epi16(w, 8), _mm512_set1_epi16(int16_t(0x8000))));
}
#endif
inline __m512i load_row32(const bf16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i load_row32(const fp8_e4m3_t* p) { return widen_fp8_32<3, 7>(&p->bits); }
inline __m512i load_row32(const fp8_e5m2_t* p) { return widen_fp8_32<2, 15>(&p->bits); }

// Two keys' rows, 32 elements of each, paired for vdpbf16ps: word 4l + i of `lo` is (a[8l + i], b[8l + i]) and of
// `hi` (a[8l + 4 + i], b[8l + 4 + i]), l < 4, i < 4.
template <typename C>
inline void load_pairs32(const C* a, const C* b, __m512i& lo, __m512i& hi) {
#ifdef __AVX512VBMI__
  if constexpr (std::is_same_v<C, fp8_e4m3_t>) return widen_fp8_pairs32<3, 7>(&a->bits, &b->bits, lo, hi);
  if constexpr (std::is_same_v<C, fp8_e5m2_t>) return widen_fp8_pairs32<2, 15>(&a->bits, &b->bits, lo, hi);
#endif
  const __m512i x = load_row32(a), y = load_row32(b);
  lo = _mm512_unpacklo_epi16(x, y);
  hi = _mm512_unpackhi_epi16(x, y);
}

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
