// Prefill attention on AMX tiles: the bf16 kernel's prefill items (one sequence's query rows for one KV head) on
// CPUs with AMX, where vdpbf16ps ran them at a tenth of the linears' rate.
//
// Per item, the keys are laid out once as the B operand of S = Q K^T (K^T in pairs of d: word [dd][t] =
// (k[t][2dd], k[t][2dd + 1]), by 16 x 16 word transposes) and the values as the B operand of O = P V (pairs of
// keys: word [tp][d] = (v[2tp][d], v[2tp + 1][d])), zero past the last key. Then per tile of 16 query vectors
// (rows x GQA group): the scores of every key the tile sees, a softmax along each row in fp32 (keys past the row's
// position weigh 0), the weights rounded to bf16 (as the vdpbf16ps kernel and torch's flash attention do for
// reduced precision) and O summed over keys 32 at a time. Every sum runs over the same aligned steps from key 0,
// so a row's result depends on its own keys only, not on the rows it shares a tile or a batch with.

#include "amx.h"
#include "bf16_simd.h"

namespace ps {
#if defined(PS_AMX) && defined(PS_AVX512_BF16)
namespace {

constexpr int64_t kStep = 32;  // keys per k step of P V, and the unit every key count is rounded up to

// r[0..15], rows of 16 32-bit words, transposed in place: afterwards r[j] holds word j of every row.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + c], 128-bit lane l: word 4l + c of rows 4i .. 4i + 3.
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, x, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, x, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, y, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, y, 0xDD);
  }
}

// kt[dd * Lp + t] = (k[t][2dd], k[t][2dd + 1]) for head h's d pairs dd < D / 2 and keys t < Lp (zeros from L on).
template <typename C>
void keys_transposed(const C* kc, const int64_t* off, int64_t L, int64_t Lp, int64_t h, const AttnShape& sh,
                     int32_t* kt) {
  const C* zero = abf::zero_row<C>(sh.tok_stride);
  for (int64_t t0 = 0; t0 < Lp; t0 += 16)
    for (int64_t c = 0; c < sh.D / 32; ++c) {
      __m512i r[16];
      if (c == 0) abf::prefetch_rows(kc, off, t0 + 16, L, h * sh.D, sh.D * int64_t(sizeof(C)), true);
      for (int j = 0; j < 16; ++j)
        r[j] = abf::load_row32((off[t0 + j] < 0 ? zero : kc + off[t0 + j] + h * sh.D) + 32 * c);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kt + (16 * c + j) * Lp + t0, r[j]);
    }
}

// vp[tp * D + d] = (v[2tp][d], v[2tp + 1][d]) for head h and key pairs tp < Lp / 2 (zeros from L on).
template <typename C>
void values_paired(const C* vc, const int64_t* off, int64_t L, int64_t Lp, int64_t h, const AttnShape& sh,
                   int32_t* vp) {
  const C* zero = abf::zero_row<C>(sh.tok_stride);
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const int64_t D = sh.D;
  for (int64_t tp = 0; tp < Lp / 2; ++tp) {
    if (tp % 8 == 0) abf::prefetch_rows(vc, off, 2 * tp + 16, L, h * D, D * int64_t(sizeof(C)), true);
    const C* a = off[2 * tp] < 0 ? zero : vc + off[2 * tp] + h * D;
    const C* b = off[2 * tp + 1] < 0 ? zero : vc + off[2 * tp + 1] + h * D;
    for (int64_t c = 0; c < D; c += 32) {
      const __m512i x = abf::load_row32(a + c), y = abf::load_row32(b + c);
      _mm512_storeu_si512(vp + tp * D + c, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(vp + tp * D + c + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// c[16][ldc] (fp32, columns [0, 16 * nb)) = a[16][32 * steps] x B, where step s's B tile j (16 rows of 16 words,
// `ldb` bytes apart) starts at b + s * b_step + 16j words; a's rows are `lda` bytes apart. nb: 2 or 4.
inline void tile_product(const bf16_t* a, int64_t lda, const int32_t* b, int64_t ldb, int64_t b_step, int64_t steps,
                         int nb, float* c, int64_t ldc) {
  _tile_zero(0); _tile_zero(1);
  if (nb > 2) { _tile_zero(2); _tile_zero(3); }
  for (int64_t s = 0; s < steps; ++s) {
    const int32_t* bs = b + s * b_step;
    _tile_loadd(4, a + s * kStep, lda);
    _tile_loadd(6, bs, ldb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, bs + 16, ldb);
    _tile_dpbf16ps(1, 4, 7);
    if (nb > 2) {
      _tile_loadd(6, bs + 32, ldb);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, bs + 48, ldb);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  const int64_t sc = ldc * int64_t(sizeof(float));
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  if (nb > 2) { _tile_stored(2, c + 32, sc); _tile_stored(3, c + 48, sc); }
}

// 2^x for x <= 0, 16 lanes: 2^round(x) x a degree-5 polynomial of the rest (relative error ~2e-6, against the 4e-3
// of the bf16 the weights are rounded to); vscalefps takes the exponent and underflows to 0 without a clamp. With the
// matmuls on tiles, the softmax's exps are most of a prefill's attention time.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Row i of s (n keys of ldp, scores not yet scaled) as weights: p[i][t] = bf16(exp(scale * (s[t] - max))) for t < n,
// 0 up to ldp. Returns the sum of the fp32 weights.
inline float row_weights(const float* s, int64_t n, int64_t ldp, float scale, bf16_t* p) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 live = n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    mv = _mm512_mask_max_ps(mv, live, mv, _mm512_maskz_loadu_ps(live, s + t));
  }
  const float c = scale * 1.44269504f;  // exp(scale * y) = 2^(c * y)
  const __m512 cv = _mm512_set1_ps(c), top = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * c);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < ldp; t += 16) {
    const __mmask16 live = t >= n ? 0 : n - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), cv, top)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256((__m256i*)(p + t), (__m256i)_mm512_cvtneps_pbh(e));
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

bool attention_amx_usable() { return amx_usable(); }

template <typename C>
void prefill_item_amx(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                      const AttnItem& it, const AttnShape& sh) {
  const int64_t G = sh.G, D = sh.D, h = it.h0, nq = (it.r1 - it.r0) * G;
  const int64_t L = it.ctx0 + it.r1, Lp = (L + kStep - 1) / kStep * kStep;
  thread_local std::vector<int32_t> kt, vp;
  thread_local std::vector<float> S, O;
  thread_local std::vector<bf16_t> P, Q;
  kt.resize(D / 2 * Lp);
  vp.resize(Lp / 2 * D);
  const int64_t* off = abf::token_offsets(table, 0, L, Lp - L, sh);
  keys_transposed(kc, off, L, Lp, h, sh, kt.data());
  values_paired(vc, off, L, Lp, h, sh, vp.data());
  const TileConfig cfg(16);
  _tile_loadconfig(&cfg);
  Q.resize(16 * D);
  O.resize(16 * D);
  // Query vector v is row v / G of the item, group member v % G: its input and output rows.
  auto vector_at = [&](int64_t v, const bf16_t*& src, bf16_t*& dst, int64_t& keys) {
    const int64_t r = it.r0 + v / G, g = v % G;
    src = q + (it.first_token + r) * sh.q_stride + (h * G + g) * D;
    dst = out + (it.first_token + r) * sh.o_stride + (h * G + g) * D;
    keys = it.ctx0 + r + 1;
  };
  const bf16_t* src[16];
  bf16_t* dst[16];
  int64_t keys[16];
  for (int64_t q0 = 0; q0 < nq; q0 += 16) {
    const int64_t nv = std::min<int64_t>(16, nq - q0);
    for (int64_t i = 0; i < 16; ++i) {  // vectors past nv repeat the last
      if (i < nv) vector_at(q0 + i, src[i], dst[i], keys[i]);
      else { src[i] = src[nv - 1]; keys[i] = keys[nv - 1]; }
      for (int64_t d = 0; d < D; d += 32) _mm512_storeu_si512(&Q[i * D + d], _mm512_loadu_si512(src[i] + d));
    }
    for (int64_t v = q0 + 16; v < std::min(nq, q0 + 32); ++v) {  // the next tile's queries into L1
      const bf16_t* next;
      bf16_t* unused;
      int64_t k;
      vector_at(v, next, unused, k);
      for (int64_t b = 0; b < D * int64_t(sizeof(bf16_t)); b += 64) _mm_prefetch((const char*)next + b, _MM_HINT_T0);
    }
    const int64_t Lt = (keys[15] + kStep - 1) / kStep * kStep;
    S.resize(16 * Lt);
    P.resize(16 * Lt);
    for (int64_t t0 = 0; t0 < Lt; t0 += 64)  // S = Q K^T, 64 keys (32 at the end) a pass
      tile_product(Q.data(), D * 2, kt.data() + t0, Lp * 4, 16 * Lp, D / kStep, Lt - t0 >= 64 ? 4 : 2,
                   S.data() + t0, Lt);
    float inv[16];
    for (int64_t i = 0; i < nv; ++i)
      inv[i] = sh.v_scale / row_weights(&S[i * Lt], keys[i], Lt, sh.scale, &P[i * Lt]);
    for (int64_t d0 = 0; d0 < D; d0 += 64)  // O = P V, 64 columns (32 at the end) a pass
      tile_product(P.data(), Lt * 2, vp.data() + d0, D * 4, 16 * D, Lt / kStep, D - d0 >= 64 ? 4 : 2,
                   O.data() + d0, D);
    for (int64_t i = 0; i < nv; ++i) {
      const __m512 w = _mm512_set1_ps(inv[i]);
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(dst[i] + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&O[i * D + d]), w)));
    }
  }
  _tile_release();
}
#else
bool attention_amx_usable() { return false; }
template <typename C>
void prefill_item_amx(const bf16_t*, const C*, const C*, bf16_t*, const int32_t*, const AttnItem&, const AttnShape&) {
  TORCH_CHECK(false, "built without AMX");
}
#endif

template void prefill_item_amx<bf16_t>(const bf16_t*, const bf16_t*, const bf16_t*, bf16_t*, const int32_t*,
                                       const AttnItem&, const AttnShape&);
template void prefill_item_amx<fp8_e4m3_t>(const bf16_t*, const fp8_e4m3_t*, const fp8_e4m3_t*, bf16_t*,
                                           const int32_t*, const AttnItem&, const AttnShape&);
template void prefill_item_amx<fp8_e5m2_t>(const bf16_t*, const fp8_e5m2_t*, const fp8_e5m2_t*, bf16_t*,
                                           const int32_t*, const AttnItem&, const AttnShape&);

}  // namespace ps
