#pragma once
// Helpers shared by the CPU kernels: 8- and 16-wide fp32 vectors, bf16 loads and stores, a vectorizable exp, and
// a work queue over the kernels' threads (pool.h). Written with GCC/Clang vector extensions rather than
// intrinsics, so one source builds for whatever -march=native offers (AVX2, AVX-512 or NEON). Storage types are
// float and bf16_t (the bits of a bfloat16); arithmetic is always fp32.

// The tensor API only: each file parses it (torch/extension.h took twice as long; bindings.cpp adds pybind11).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include "pool.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include <unistd.h>
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace ps {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
// 16 lanes for the element-wise kernels: one zmm where AVX-512 has it (8-lane code ran at half the rate there).
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t bf16_t;
typedef uint8_t u8x8 __attribute__((vector_size(8)));
// The bytes of an fp8 KV cache (float8_e4m3fn, float8_e5m2): storage types only, widened to fp32 on load.
struct fp8_e4m3_t { uint8_t bits; };
struct fp8_e5m2_t { uint8_t bits; };

// bf16 bits widened to fp32 (exact), and fp32 rounded to bf16 to nearest even, as torch's float -> bfloat16.
template <typename F, typename U32, typename U16>
inline F widen_bf16(const bf16_t* p) {
  U16 h; std::memcpy(&h, p, sizeof h);
  U32 w = __builtin_convertvector(h, U32) << 16;
  F v; std::memcpy(&v, &w, sizeof v); return v;
}
template <typename U32, typename U16, typename F>
inline void round_bf16(bf16_t* p, F v) {
  U32 w; std::memcpy(&w, &v, sizeof w);
  w += 0x7FFFu + ((w >> 16) & 1u);
  U16 h = __builtin_convertvector(w >> 16, U16);
  std::memcpy(p, &h, sizeof h);
}
inline f32x8 load8(const float* p) { f32x8 v; std::memcpy(&v, p, sizeof v); return v; }
inline f32x8 load8(const bf16_t* p) { return widen_bf16<f32x8, u32x8, u16x8>(p); }
// fp8 bytes widened to fp32 times 2^(BIAS - 15), exactly (subnormals too): their exponent and mantissa bits read in
// fp16's fields, which the CPU widens in one instruction. The factor 2^(15 - BIAS) that restores the value
// (fp8_unit) folds into the caller's scales. Moving the bits into a float's fields instead made fp32 subnormals,
// and the multiply that re-biased them a microcode assist each: an fp8 cache read 3-4x slower than an fp32 one.
#if defined(__F16C__) && defined(__SSE4_1__)
template <int MANT, int BIAS>
inline f32x8 widen_fp8(const uint8_t* p) {
  constexpr int shift = 10 - MANT;  // the byte's exponent lands at fp16's bits 10+ and its sign (extended) at 15+
  const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), shift);
  if constexpr (shift == 8) return (f32x8)_mm256_cvtph_ps(h);
  else return (f32x8)_mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(int16_t(0x8000 | ((1 << (7 + shift)) - 1)))));
}
#else
template <int MANT, int BIAS>
inline f32x8 widen_fp8(const uint8_t* p) {
  constexpr uint32_t rebias_bits = uint32_t(127 + 112) << 23;  // the float 2^112: float fields read 2^(BIAS - 127)
  float rebias; std::memcpy(&rebias, &rebias_bits, sizeof rebias);
  u8x8 b; std::memcpy(&b, p, sizeof b);
  const u32x8 w = __builtin_convertvector(b, u32x8);
  const u32x8 bits = ((w & 0x80u) << 24) | ((w & 0x7Fu) << (23 - MANT));
  f32x8 v; std::memcpy(&v, &bits, sizeof v);
  return v * rebias;
}
#endif
// What load8 of a C row is multiplied by to give its values: 2^(15 - BIAS) for fp8, 1 for float and bf16.
template <typename C> constexpr float fp8_unit() { return 1.f; }
inline f32x8 load8(const fp8_e4m3_t* p) { return widen_fp8<3, 7>(&p->bits); }
inline f32x8 load8(const fp8_e5m2_t* p) { return widen_fp8<2, 15>(&p->bits); }
template <> constexpr float fp8_unit<fp8_e4m3_t>() { return 256.f; }
template <> constexpr float fp8_unit<fp8_e5m2_t>() { return 1.f; }
inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }
inline void store8(bf16_t* p, f32x8 v) { round_bf16<u32x8, u16x8>(p, v); }
inline f32x16 load16(const float* p) { f32x16 v; std::memcpy(&v, p, sizeof v); return v; }
#if defined(__AVX512F__) && defined(__AVX2__)
// widen_fp8 on 16 bytes at once (the same values; half the instructions per element).
template <int MANT>
inline f32x16 widen_fp8_16(const uint8_t* p) {
  constexpr int shift = 10 - MANT;
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                      shift);
  const __m256i mask = _mm256_set1_epi16(int16_t(0x8000 | ((1 << (7 + shift)) - 1)));
  if constexpr (shift == 8) return (f32x16)_mm512_cvtph_ps(h);
  else return (f32x16)_mm512_cvtph_ps(_mm256_and_si256(h, mask));
}
inline f32x16 load16(const fp8_e4m3_t* p) { return widen_fp8_16<3>(&p->bits); }
inline f32x16 load16(const fp8_e5m2_t* p) { return widen_fp8_16<2>(&p->bits); }
#endif
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same bits as the generic versions below, in one zmm each way: GCC split the generic widening and narrowing
// into 256-bit halves, which made the element-wise kernels 2-3x slower than their arithmetic.
inline f32x16 load16(const bf16_t* p) {
  return (f32x16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
}
inline void store16(bf16_t* p, f32x16 v) {
  const __m512i w = (__m512i)v;
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(w, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(w, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#else
inline f32x16 load16(const bf16_t* p) { return widen_bf16<f32x16, u32x16, u16x16>(p); }
inline void store16(bf16_t* p, f32x16 v) { round_bf16<u32x16, u16x16>(p, v); }
#endif
// The sum of the 16 lanes, pairwise (a tree, not a chain of 15 dependent adds).
inline float hsum16(f32x16 v) {
  const f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s[8]; std::memcpy(s, &h, sizeof s);
  return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}
inline float load1(const float* p) { return *p; }
inline float load1(const bf16_t* p) { uint32_t w = uint32_t(*p) << 16; float f; std::memcpy(&f, &w, 4); return f; }
inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16_t* p, float v) {
  uint32_t w; std::memcpy(&w, &v, 4);
  w += 0x7FFFu + ((w >> 16) & 1u);
  *p = bf16_t(w >> 16);
}

inline f32x8 splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
inline float hsum(f32x8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
// [sum(a0), sum(a1), ..., sum(a7)]: pairwise sums with lane shuffles, three levels deep.
inline f32x8 transpose_sum(f32x8 a0, f32x8 a1, f32x8 a2, f32x8 a3, f32x8 a4, f32x8 a5, f32x8 a6, f32x8 a7) {
#define PS_PAIR(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + \
                       __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define PS_QUAD(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + \
                       __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
  const f32x8 b01 = PS_PAIR(a0, a1), b23 = PS_PAIR(a2, a3), b45 = PS_PAIR(a4, a5), b67 = PS_PAIR(a6, a7);
  const f32x8 c0 = PS_QUAD(b01, b23), c4 = PS_QUAD(b45, b67);
#undef PS_PAIR
#undef PS_QUAD
  return __builtin_shufflevector(c0, c4, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(c0, c4, 4, 5, 6, 7, 12, 13, 14, 15);
}
inline float hmax(f32x8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// exp on F's lanes (I: the int vector of as many lanes): Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6
// Taylor polynomial (error < 2e-7 relative) and the exponent put back in the float's bits. Inputs are clamped to
// [-87, 88] (no denormals or inf).
template <typename F, typename I>
inline F vexp(F x) {
  x = x < -87.f ? F{} - 87.f : x;
  x = x > 88.f ? F{} + 88.f : x;
  F t = x * 1.44269504f;
  I n = __builtin_convertvector(t + (t < 0.f ? F{} - 0.5f : F{} + 0.5f), I);  // round half away
  F nf = __builtin_convertvector(n, F);
  F r = x - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  F p = F{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  I e = (n + 127) << 23;
  F scale; std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}
inline f32x8 exp8(f32x8 x) { return vexp<f32x8, i32x8>(x); }
#if defined(__AVX512F__)
// vexp on one zmm in its own instructions (min / max clamps, one rounding instruction, FMAs), where GCC's code for
// the generic selects and conversions cost more than the polynomial. The same values, but for x log2(e) exactly
// halfway between integers, which rounds to even here and away from zero there (r stays in the polynomial's range).
inline f32x16 exp16v(f32x16 v) {
  __m512 x = _mm512_min_ps(_mm512_max_ps((__m512)v, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
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
  return (f32x16)_mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#else
inline f32x16 exp16v(f32x16 x) { return vexp<f32x16, i32x16>(x); }
#endif

template <typename T> inline const T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T> inline T* mut_ptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Guided self-scheduling of [0, n) over a region's threads (pool.h): claim() hands out the next chunk [first,
// second), a 1 / (2 x threads) share of what is left but at least one, and first == n once all is given out. A thread
// that starts late (the other vCPU waking from its spin) or runs slower (host load on its core) takes less, where
// fixed halves made one wait for the other.
class ChunkQueue {
 public:
  ChunkQueue(int64_t n, int64_t threads) : n_(n), div_(2 * threads) {}
  std::pair<int64_t, int64_t> claim() {
    int64_t b = next_.load(std::memory_order_relaxed);
    for (;;) {
      if (b >= n_) return {n_, n_};
      const int64_t e = std::min(n_, b + std::max<int64_t>(1, (n_ - b) / div_));
      if (next_.compare_exchange_weak(b, e, std::memory_order_relaxed)) return {b, e};
    }
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_, div_;
};

// Runs body(storage type tag) for a float32 or bfloat16 tensor.
#define PS_DISPATCH(dtype, ...)                                                       \
  [&] {                                                                               \
    if ((dtype) == torch::kFloat) { using scalar = float; return __VA_ARGS__(); }     \
    TORCH_CHECK((dtype) == torch::kBFloat16, "float32 or bfloat16 only");             \
    using scalar = ps::bf16_t; return __VA_ARGS__();                                   \
  }()

}  // namespace ps
