// Paged attention for bf16 on AVX512-BF16 CPUs: the items of attention.cpp's plan, computed with vdpbf16ps.
//
// The generic kernel widens bf16 to fp32 8 lanes at a time, which made bf16 the slower dtype end to end. Here:
//
// - A decode row (one query position, all heads) scores 16 keys at a time: per key, D / 32 dot-product
//   instructions on the bf16 row as stored, then one transposing reduction for the 16 keys; each 16-key chunk is
//   done for all heads while in L1, and rows 32 keys ahead are prefetched: into L1 where the keys in flight fit a
//   quarter of it, else into L2. Softmax is fp32; the value pass takes two keys per instruction on V rows
//   interleaved once per chunk and KV head for its group's query heads, with the weights rounded to bf16, as in
//   prefill. The loops run by KV head, then its query heads. An fp8 row is widened with byte permutes where the CPU
//   has VBMI; with GQA once per chunk for the group's query heads.
// - A prefill item is one sequence's rows for one KV head. Its V rows are interleaved once in pairs of keys (the
//   operand layout of vdpbf16ps); then per tile of 16 query vectors (rows x GQA group) the scores S^T [keys, 16]
//   come from broadcasting K's element pairs in place against the tile's queries packed as pairs, softmax runs down
//   the key axis for the 16 lanes at once, and the weights, rounded to bf16 as torch's flash attention does for
//   reduced precision, multiply the paired V rows. Scores and sums are fp32.
// - A decode row of more than 512 keys runs as near-equal parts of at most 512 keys on any thread, each leaving
//   its top scores, sums of exponentials and unnormalized outputs; the thread that finishes a row's last part merges
//   them in part order, so the result follows from the row alone, not from the batch or the threads.
//
// Built only where the compiler targets AVX512-BF16; attention.cpp uses the generic kernel elsewhere.

#include "bf16_simd.h"

#ifdef PS_AVX512_BF16
namespace ps {
namespace abf {

// Lane j of the result is the sum of a[j]'s 16 lanes.
inline __m512 transpose_sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// exp(s - max) in place over s[0:n]; returns their sum, and the max in *max_out.
inline float softmax_row(float* s, int64_t n, float* max_out) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t));
  const __mmask16 tail = __mmask16((1u << (n - t)) - 1);
  if (t < n) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + t));
  *max_out = _mm512_reduce_max_ps(mv);
  const __m512 m = _mm512_set1_ps(*max_out);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < n) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), m));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_mask_add_ps(sum, tail, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// Two keys' V rows interleaved for vdpbf16ps: for 32 elements of d from c, word 4l + i of `lo` is
// (a[8l + i], b[8l + i]) and of `hi` (a[8l + 4 + i], b[8l + 4 + i]), l < 4, i < 4.
template <typename C>
inline void interleave(const C* a, const C* b, __m512bh& lo, __m512bh& hi) {
  __m512i x, y;
  load_pairs32(a, b, x, y);
  lo = (__m512bh)x;
  hi = (__m512bh)y;
}

// dst[0:32] = bf16((lo, hi) * w) with d back in order (the inverse of interleave's order).
inline void store_interleaved(bf16_t* dst, __m512 lo, __m512 hi, __m512 w) {
  const __m512i lo_idx = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i hi_idx = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __m512 first = _mm512_permutex2var_ps(lo, lo_idx, hi), second = _mm512_permutex2var_ps(lo, hi_idx, hi);
  _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(first, w)));
  _mm256_storeu_si256((__m256i*)(dst + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(second, w)));
}

// Whether the decode keys in flight (the chunk in use and 32 keys ahead: 48 rows) fit in a quarter of L1D (the
// rest holds the scores, the query and the outputs); where they do not, L1 prefetches are evicted before use or
// crowd out the rest, so prefetch into L2.
template <typename C>
inline bool prefetch_to_l1(const AttnShape& sh) {
  static const int64_t l1d = [] { const long n = sysconf(_SC_LEVEL1_DCACHE_SIZE); return n > 0 ? n : 32 << 10; }();
  return 4 * 48 * sh.tok_stride * int64_t(sizeof(C)) <= l1d;
}

// s[0:16] = scale x (the query head's elements `qv`) . (16 key rows, each at the head's first element).
template <int DV, typename R>
inline void score16(const __m512bh* qv, const R* const* rows, __m512 scale, float* s) {
  __m512 a[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) {
    __m512 x = _mm512_setzero_ps();
    if constexpr (has_lane_order64<R>() && DV % 2 == 0) {  // qv in lane order (lane_order64)
      for (int c = 0; c < DV; c += 2) {
        __m512i w0, w1;
        widen_lanes64(rows[j] + 32 * c, w0, w1);
        x = _mm512_dpbf16_ps(_mm512_dpbf16_ps(x, qv[c], (__m512bh)w0), qv[c + 1], (__m512bh)w1);
      }
    } else {
      for (int c = 0; c < DV; ++c) x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)load_row32(rows[j] + 32 * c));
    }
    a[j] = x;
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(transpose_sum16(a), scale));
}

// vi[2 (u DV + c) + {0, 1}] = the pair u's value rows (`rows`, each at the head's first element), elements
// [32 c, 32 c + 32), interleaved for vdpbf16ps: once per chunk and KV head, for the G query heads that read them.
template <int DV, typename R>
inline void interleave_pairs(const R* const* rows, int pairs, __m512bh* vi) {
  for (int u = 0; u < pairs; ++u)
    for (int c = 0; c < DV; ++c)
      interleave(rows[2 * u] + 32 * c, rows[2 * u + 1] + 32 * c, vi[2 * (u * DV + c)], vi[2 * (u * DV + c) + 1]);
}

// o[0:32 DV] (interleaved order) += the weights of `pairs` pairs of keys (bf16 pairs `pw`) x their value rows
// (interleave_pairs' `vi`).
template <int DV>
inline void accumulate_values(const int32_t* pw, const __m512bh* vi, int pairs, float* o) {
  __m512 a[2 * DV];
  for (int c = 0; c < 2 * DV; ++c) a[c] = _mm512_loadu_ps(o + 16 * c);
  for (int u = 0; u < pairs; ++u) {
    const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[u]);
    for (int c = 0; c < DV; ++c) {
      a[2 * c] = _mm512_dpbf16_ps(a[2 * c], w, vi[2 * (u * DV + c)]);
      a[2 * c + 1] = _mm512_dpbf16_ps(a[2 * c + 1], w, vi[2 * (u * DV + c) + 1]);
    }
  }
  for (int c = 0; c < 2 * DV; ++c) _mm512_storeu_ps(o + 16 * c, a[c]);
}

// Rows `rows[0:n]` (each the full token row of every KV head) widened to bf16 into `out` (n x Hkv x D).
template <typename C>
inline void widen_rows(const C* const* rows, int n, const AttnShape& sh, bf16_t* out) {
  const int64_t width = sh.Hkv * sh.D;
  for (int j = 0; j < n; ++j)
    for (int64_t i = 0; i < width; i += 32) _mm512_storeu_si512(out + j * width + i, load_row32(rows[j] + i));
}

// One query row (`qrow`, every head) against keys [t0, t1) of its sequence, 16 keys at a time (their rows, all
// heads, while in L1): per head hq, m[hq] = the highest score, l[hq] = the sum of exp(score - m[hq]) and acc[hq *
// D:] = the sum of bf16(exp(score - m[hq])) x V, in the value pass's interleaved order (store_interleaved undoes
// it). DV = D / 32.
template <int DV, typename C>
void decode_range(const bf16_t* qrow, const C* kc, const C* vc, const int32_t* table, int64_t t0,
                  int64_t t1, const AttnShape& sh, float* m, float* l, float* acc) {
  constexpr int64_t D = 32 * DV;
  thread_local std::vector<float> S;
  thread_local std::vector<bf16_t> P;
  const int64_t G = sh.G, Hq = sh.Hq, L = t1 - t0, Lp = (L + 15) / 16 * 16;
  S.resize(Hq * Lp);
  P.resize(Hq * Lp);
  std::fill(acc, acc + Hq * D, 0.f);
  const C* zero = zero_row<C>(sh.tok_stride);
  const int64_t* off = token_offsets(table, t0, t1, Lp - L, sh);
  const __m512 scale = _mm512_set1_ps(sh.scale);
  // An fp8 chunk read by G > 1 query heads is widened once into `wide`, for all of them; with G = 1 each row is
  // widened as it is used, 64 elements at a time in lane order (the query permuted to match) where D allows.
  constexpr bool fp8 = !std::is_same_v<C, bf16_t>;
  const bool staged = fp8 && G > 1;
  thread_local std::vector<bf16_t> wide, qlanes;
  const int64_t width = sh.Hkv * D;
  if (staged) wide.resize(16 * width);
  const bf16_t* qsrc = qrow;
  if (has_lane_order64<C>() && DV % 2 == 0 && !staged) {
    qlanes.resize(Hq * D);
    for (int64_t i = 0; i < Hq * D; i += 64) {
      __m512i w0, w1;
      lane_order64(qrow + i, w0, w1);
      _mm512_storeu_si512(&qlanes[i], w0);
      _mm512_storeu_si512(&qlanes[i + 32], w1);
    }
    qsrc = qlanes.data();
  }
  const C* rows[16];
  const C* head_rows[16];
  const bf16_t* wide_rows[16];
  __m512bh vi[16 * DV];  // a chunk's value rows of one KV head, interleaved
  // Rows 32 keys ahead are prefetched while a chunk is scored or summed; the chunk after the first one, here.
  const bool l1 = prefetch_to_l1<C>(sh);
  prefetch_rows(kc, off, 16, L, 0, sh.tok_stride * int64_t(sizeof(C)), l1);
  for (int64_t u0 = 0; u0 < L; u0 += 16) {
    for (int j = 0; j < 16; ++j) rows[j] = off[u0 + j] < 0 ? zero : kc + off[u0 + j];
    if (staged) widen_rows(rows, 16, sh, wide.data());
    for (int64_t h = 0; h < sh.Hkv; ++h) {
      prefetch_rows(kc, off, u0 + 32, L, h * D, D * int64_t(sizeof(C)), l1);
      if (staged)
        for (int j = 0; j < 16; ++j) wide_rows[j] = wide.data() + j * width + h * D;
      else
        for (int j = 0; j < 16; ++j) head_rows[j] = rows[j] + h * D;
      for (int64_t hq = h * G; hq < (h + 1) * G; ++hq) {
        __m512bh qv[DV];
        for (int c = 0; c < DV; ++c) qv[c] = load_bh(qsrc + hq * D + 32 * c);
        float* s = S.data() + hq * Lp + u0;
        if (staged)
          score16<DV>(qv, wide_rows, scale, s);
        else
          score16<DV>(qv, head_rows, scale, s);
      }
    }
  }
  // Weights rounded to bf16 (as in prefill and torch's reduced-precision attention), zero past L: the value pass
  // takes two keys per vdpbf16ps (a third of the instructions of widening V and fp32 FMAs).
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float* s = S.data() + hq * Lp;
    l[hq] = softmax_row(s, L, m + hq);
    bf16_t* pb = P.data() + hq * Lp;
    for (int64_t t = 0; t < Lp; t += 16) {
      const __mmask16 live = t + 16 <= L ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(0, L - t)) - 1);
      _mm256_storeu_si256((__m256i*)(pb + t), (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, s + t)));
    }
  }
  prefetch_rows(vc, off, 0, L, 0, sh.tok_stride * int64_t(sizeof(C)), l1);
  prefetch_rows(vc, off, 16, L, 0, sh.tok_stride * int64_t(sizeof(C)), l1);
  for (int64_t u0 = 0; u0 < L; u0 += 16) {
    const int pairs = int(std::min<int64_t>(16, L - u0) + 1) / 2;
    for (int j = 0; j < 2 * pairs; ++j) rows[j] = off[u0 + j] < 0 ? zero : vc + off[u0 + j];
    if (staged) widen_rows(rows, 2 * pairs, sh, wide.data());
    for (int64_t h = 0; h < sh.Hkv; ++h) {
      prefetch_rows(vc, off, u0 + 32, L, h * D, D * int64_t(sizeof(C)), l1);
      if (staged)
        for (int j = 0; j < 2 * pairs; ++j) wide_rows[j] = wide.data() + j * width + h * D;
      else
        for (int j = 0; j < 2 * pairs; ++j) head_rows[j] = rows[j] + h * D;
      if (staged)
        interleave_pairs<DV>(wide_rows, pairs, vi);
      else
        interleave_pairs<DV>(head_rows, pairs, vi);
      for (int64_t hq = h * G; hq < (h + 1) * G; ++hq)
        accumulate_values<DV>(reinterpret_cast<const int32_t*>(P.data() + hq * Lp + u0), vi, pairs, acc + hq * D);
    }
  }
}

// orow[hq] = acc[hq] x v_scale / l[hq], rounded to bf16, for every head.
inline void store_decode_row(bf16_t* orow, const float* acc, const float* l, const AttnShape& sh) {
  for (int64_t hq = 0; hq < sh.Hq; ++hq) {
    const __m512 w = _mm512_set1_ps(sh.v_scale / l[hq]);
    const float* o = acc + hq * sh.D;
    for (int64_t c = 0; c < sh.D / 32; ++c)
      store_interleaved(orow + hq * sh.D + 32 * c, _mm512_loadu_ps(o + 32 * c), _mm512_loadu_ps(o + 32 * c + 16), w);
  }
}

// One query position, every head, over its context (from its sliding window's first key).
template <int DV, typename C>
void decode_item(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                 const AttnItem& it, const AttnShape& sh) {
  thread_local std::vector<float> acc, m, l;
  acc.resize(sh.Hq * sh.D);
  m.resize(sh.Hq);
  l.resize(sh.Hq);
  decode_range<DV>(q + it.first_token * sh.q_stride, kc, vc, table, sh.first_key(it.ctx0), it.ctx0 + 1, sh,
                   m.data(), l.data(), acc.data());
  store_decode_row(out + it.first_token * sh.o_stride, acc.data(), l.data(), sh);
}

// One sequence's rows [r0, r1) for KV head h0. DV = D / 32.
template <int DV, typename C>
void prefill_item(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                  const AttnItem& it, const AttnShape& sh) {
  constexpr int64_t D = 32 * DV, D2 = D / 2;
  constexpr int MRK = 8;                                   // keys per score tile
  constexpr int MRO = DV == 1 ? 8 : std::max(1, 12 / DV);  // query vectors per output tile
  thread_local std::vector<int32_t> Vp, Qp, Pp;          // bf16 pairs as 32-bit words
  thread_local std::vector<float> St;
  const int64_t G = sh.G, h = it.h0, nq = (it.r1 - it.r0) * G;
  const int64_t L = it.ctx0 + it.r1, L2 = (L + 1) / 2;
  const C* zero = zero_row<C>(sh.tok_stride);
  const int64_t* off = token_offsets(table, 0, L, 0, sh);
  // K rows, read a pair of elements at a time: in place (bf16), or first widened into kb (fp8).
  thread_local std::vector<bf16_t> kb;
  const bf16_t* kzero = zero_row<bf16_t>(D);
  if constexpr (!std::is_same_v<C, bf16_t>) {
    kb.resize(L * D);
    for (int64_t t = 0; t < L; ++t)
      for (int c = 0; c < DV; ++c) _mm512_storeu_si512(&kb[t * D + 32 * c], load_row32(kc + off[t] + h * D + 32 * c));
  }
  auto key_row = [&](int64_t t) -> const bf16_t* {
    if constexpr (std::is_same_v<C, bf16_t>) return kc + off[t] + h * D;
    else return &kb[t * D];
  };
  thread_local std::vector<const C*> vrow;
  vrow.resize(2 * L2);
  for (int64_t t = 0; t < 2 * L2; ++t) vrow[t] = (t < L ? vc + off[t] : zero) + h * D;
  // V in pairs of keys: word (tp, 32c + 16 hi + 4l + i) = (v[2tp][d], v[2tp+1][d]), d = 32c + 8l + 4 hi + i.
  Vp.resize(L2 * D);
  for (int64_t tp = 0; tp < L2; ++tp) {
    const C* a = vrow[2 * tp];
    const C* b = vrow[2 * tp + 1];
    for (int c = 0; c < DV; ++c) {
      __m512bh lo, hi;
      interleave(a + 32 * c, b + 32 * c, lo, hi);
      _mm512_storeu_si512(Vp.data() + tp * D + 32 * c, (__m512i)lo);
      _mm512_storeu_si512(Vp.data() + tp * D + 32 * c + 16, (__m512i)hi);
    }
  }
  const __m512 scale = _mm512_set1_ps(sh.scale);
  const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int64_t nv = std::min<int64_t>(16, nq - q0);
    // Query vector q0 + i is row (q0 + i) / G of the item, group member (q0 + i) % G.
    const int64_t first_pos = it.ctx0 + it.r0 + q0 / G, Lt = it.ctx0 + it.r0 + (q0 + nv - 1) / G + 1;
    Qp.assign(D2 * 16, 0);
    alignas(64) int32_t row_pos[16];
    for (int64_t i = 0; i < 16; ++i) {
      row_pos[i] = int32_t(i < nv ? it.ctx0 + it.r0 + (q0 + i) / G : Lt);  // lanes past nv: see every key
      if (i >= nv) continue;
      const int64_t r = it.r0 + (q0 + i) / G, g = (q0 + i) % G;
      const int32_t* words = reinterpret_cast<const int32_t*>(q + (it.first_token + r) * sh.q_stride + (h * G + g) * D);
      for (int64_t dd = 0; dd < D2; ++dd) Qp[dd * 16 + i] = words[dd];
    }
    // Scores, transposed: St[t][i] for keys t < Lt.
    const int64_t Ltp = (Lt + 1) / 2 * 2;
    St.resize(Ltp * 16);
    for (int64_t t0 = 0; t0 < Lt; t0 += MRK) {
      const int mr = int(std::min<int64_t>(MRK, Lt - t0));
      const bf16_t* kr[MRK];
      for (int j = 0; j < MRK; ++j) kr[j] = j < mr ? key_row(t0 + j) : kzero;
      __m512 acc[MRK];
      for (int j = 0; j < MRK; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t dd = 0; dd < D2; ++dd) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(Qp.data() + dd * 16);
#pragma GCC unroll 8
        for (int j = 0; j < MRK; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], bcast_pair(kr[j] + 2 * dd), qv);
      }
      for (int j = 0; j < mr; ++j) _mm512_storeu_ps(St.data() + (t0 + j) * 16, _mm512_mul_ps(acc[j], scale));
    }
    // Softmax down the keys, 16 query vectors at once; a key past a lane's position weighs 0.
    const __m512i pos = _mm512_load_si512(row_pos);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < Lt; ++t) {
      const __mmask16 live = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(int32_t(t)));
      mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(St.data() + t * 16));
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < Ltp; ++t) {
      const __mmask16 live = t < first_pos + 1 ? __mmask16(0xFFFF)
                                               : _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(int32_t(t)));
      const __m512 e = t < Lt ? _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(St.data() + t * 16), mx)))
                              : _mm512_setzero_ps();
      _mm512_storeu_ps(St.data() + t * 16, e);
      sum = _mm512_add_ps(sum, e);
    }
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    // Weights as bf16 pairs of keys: Pp[tp][i] = (p[i][2tp], p[i][2tp+1]).
    const int64_t Lt2 = Ltp / 2;
    Pp.resize(Lt2 * 16);
    for (int64_t tp = 0; tp < Lt2; ++tp) {
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(St.data() + (2 * tp + 1) * 16),
                                                        _mm512_loadu_ps(St.data() + 2 * tp * 16));
      _mm512_storeu_si512(Pp.data() + tp * 16, _mm512_permutexvar_epi16(pair_idx, both));
    }
    // Output: O[i][:] = sum_t p[i][t] v[t][:], tiles of MRO query vectors by all of D.
    for (int64_t i0 = 0; i0 < nv; i0 += MRO) {
      const int mo = int(std::min<int64_t>(MRO, nv - i0));
      __m512 acc[MRO][2 * DV];
      for (int r = 0; r < MRO; ++r)
        for (int c = 0; c < 2 * DV; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t tp = 0; tp < Lt2; ++tp) {
        __m512bh pw[MRO];
        for (int r = 0; r < MRO; ++r) pw[r] = (__m512bh)_mm512_set1_epi32(Pp[tp * 16 + i0 + (r < mo ? r : 0)]);
        for (int c = 0; c < 2 * DV; ++c) {
          const __m512bh vv = (__m512bh)_mm512_loadu_si512(Vp.data() + tp * D + 16 * c);
          for (int r = 0; r < MRO; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pw[r], vv);
        }
      }
      for (int r = 0; r < mo; ++r) {
        const int64_t i = i0 + r, row = it.r0 + (q0 + i) / G, g = (q0 + i) % G;
        bf16_t* dst = out + (it.first_token + row) * sh.o_stride + (h * G + g) * D;
        const __m512 w = _mm512_set1_ps(inv[i] * sh.v_scale);
        for (int c = 0; c < DV; ++c) store_interleaved(dst + 32 * c, acc[r][2 * c], acc[r][2 * c + 1], w);
      }
    }
  }
}

template <int DV, typename C>
void item(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
          const AttnItem& it, const AttnShape& sh, const DecodeParts& split) {
  if (it.parts > 1) {
    float* p = split.scratch + it.slot * split.stride;
    decode_range<DV>(q + it.first_token * sh.q_stride, kc, vc, table, it.k0, it.k1, sh, p, p + sh.Hq, p + 2 * sh.Hq);
    // The thread that finishes a row's last part combines them all (in part order: the same whoever ran which).
    if (split.done[it.seq].fetch_add(1, std::memory_order_acq_rel) + 1 == it.parts) {
      thread_local std::vector<float> acc, l;
      acc.resize(sh.Hq * sh.D);
      l.resize(sh.Hq);
      combine_parts(split.scratch + (it.slot - it.part) * split.stride, it.parts, sh, acc.data(), l.data());
      store_decode_row(out + it.first_token * sh.o_stride, acc.data(), l.data(), sh);
    }
  } else if (it.r0 == 0 && it.r1 == 1 && it.h1 - it.h0 == sh.Hkv)  // not a prefill's 1-row last tile under MQA
    decode_item<DV>(q, kc, vc, out, table, it, sh);
  else
    for (int64_t h = it.h0; h < it.h1; ++h) {
      AttnItem one = it;
      one.h0 = h; one.h1 = h + 1;
      if (sh.amx) prefill_item_amx(q, kc, vc, out, table, one, sh);
      else prefill_item<DV, C>(q, kc, vc, out, table, one, sh);
    }
}

}  // namespace abf

bool attention_bf16_takes(const AttnShape& sh) { return sh.D % 32 == 0 && sh.D <= 256; }

template <typename C>
void attend_item_bf16(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                      const AttnItem& it, const AttnShape& sh, const DecodeParts& split) {
  switch (sh.D / 32) {
    case 1: return abf::item<1>(q, kc, vc, out, table, it, sh, split);
    case 2: return abf::item<2>(q, kc, vc, out, table, it, sh, split);
    case 3: return abf::item<3>(q, kc, vc, out, table, it, sh, split);
    case 4: return abf::item<4>(q, kc, vc, out, table, it, sh, split);
    case 5: return abf::item<5>(q, kc, vc, out, table, it, sh, split);
    case 6: return abf::item<6>(q, kc, vc, out, table, it, sh, split);
    case 7: return abf::item<7>(q, kc, vc, out, table, it, sh, split);
    default: return abf::item<8>(q, kc, vc, out, table, it, sh, split);
  }
}
#define PS_INSTANTIATE(C)                                                                                    \
  template void attend_item_bf16<C>(const bf16_t*, const C*, const C*, bf16_t*, const int32_t*, const AttnItem&, \
                                    const AttnShape&, const DecodeParts&);
PS_INSTANTIATE(bf16_t)
PS_INSTANTIATE(fp8_e4m3_t)
PS_INSTANTIATE(fp8_e5m2_t)
#undef PS_INSTANTIATE

}  // namespace ps
#else
namespace ps {
bool attention_bf16_takes(const AttnShape&) { return false; }
template <typename C>
void attend_item_bf16(const bf16_t*, const C*, const C*, bf16_t*, const int32_t*, const AttnItem&, const AttnShape&,
                      const DecodeParts&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}
template void attend_item_bf16<bf16_t>(const bf16_t*, const bf16_t*, const bf16_t*, bf16_t*, const int32_t*,
                                       const AttnItem&, const AttnShape&, const DecodeParts&);
template void attend_item_bf16<fp8_e4m3_t>(const bf16_t*, const fp8_e4m3_t*, const fp8_e4m3_t*, bf16_t*,
                                           const int32_t*, const AttnItem&, const AttnShape&, const DecodeParts&);
template void attend_item_bf16<fp8_e5m2_t>(const bf16_t*, const fp8_e5m2_t*, const fp8_e5m2_t*, bf16_t*,
                                           const int32_t*, const AttnItem&, const AttnShape&, const DecodeParts&);
}  // namespace ps
#endif
