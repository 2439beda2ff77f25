// Fused element-wise CPU kernels in C++: RMSNorm (with the residual add), SiLU-and-mul, rotary, KV-cache writes,
// structured output's token bitmask on the logits, and greedy sampling's argmax.
//
// Each replaces a chain of torch ops (and their temporaries) with one pass over the rows, parallel over rows. Math
// is fp32; bf16 tensors are widened on load and rounded (to nearest even) where Hugging Face's bf16 modules round:
// RMSNorm rounds the normalized row before the weight multiply, as LlamaRMSNorm does.

#include "fused.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <limits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ps {

inline int64_t grain(int64_t work_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, work_per_row)); }

// out = norm(x) * w, or with residual: residual = x + residual; x = norm(residual) * w (both in place). The
// second pass reads the normalized values back from where the first left them (x, or the rounded sum in
// residual) rather than from a per-thread buffer: reaching a thread_local vector in the loop made this 2x slower.
template <typename T>
void rms_rows(T* x, T* residual, const T* w, T* out, int64_t rows, int64_t H, int64_t xs, int64_t rs, int64_t os,
              float eps) {
  parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * xs;
      T* rr = residual != nullptr ? residual + r * rs : xr;
      f32x16 ss = {};
      int64_t d = 0;
      for (; d + 16 <= H; d += 16) {
        f32x16 v = load16(xr + d);
        if (residual != nullptr) {
          store16(rr + d, v + load16(rr + d));
          v = load16(rr + d);  // the rounded sum, as the next layer will read it
        }
        ss += v * v;
      }
      float sum = hsum16(ss);
      if (d + 8 <= H) {
        f32x8 v = load8(xr + d);
        if (residual != nullptr) {
          store8(rr + d, v + load8(rr + d));
          v = load8(rr + d);
        }
        sum += hsum(v * v);
        d += 8;
      }
      for (; d < H; ++d) {  // H % 8 != 0 (a tensor-parallel shard of an odd size)
        float v = load1(xr + d);
        if (residual != nullptr) {
          store1(rr + d, v + load1(rr + d));
          v = load1(rr + d);
        }
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / float(H) + eps);
      T* o = out + r * os;
      for (d = 0; d + 16 <= H; d += 16) {
        T tmp[16];
        store16(tmp, load16(rr + d) * inv);  // Hugging Face rounds here when the model is bf16
        store16(o + d, load16(tmp) * load16(w + d));
      }
      if (d + 8 <= H) {
        T tmp[8];
        store8(tmp, load8(rr + d) * inv);
        store8(o + d, load8(tmp) * load8(w + d));
        d += 8;
      }
      for (; d < H; ++d) {
        T tmp;
        store1(&tmp, load1(rr + d) * inv);
        store1(o + d, load1(&tmp) * load1(w + d));
      }
    }
  });
}

void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out) {
  const int64_t H = x.size(-1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "rows of [T, H]");
  TORCH_CHECK(x.stride(-1) == 1 && out.stride(-1) == 1 && weight.is_contiguous() && weight.numel() == H);
  TORCH_CHECK(out.size(0) == x.size(0) && out.size(1) == H);
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type());
  PS_DISPATCH(x.scalar_type(), [&] {
    rms_rows<scalar>(mut_ptr<scalar>(x), nullptr, ptr<scalar>(weight), mut_ptr<scalar>(out), x.size(0), H,
                     x.stride(0), 0, out.stride(0), float(eps));
  });
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  const int64_t H = x.size(-1);
  TORCH_CHECK(x.dim() == 2 && residual.dim() == 2, "rows of [T, H]");
  TORCH_CHECK(x.stride(-1) == 1 && residual.stride(-1) == 1 && weight.is_contiguous() && weight.numel() == H);
  TORCH_CHECK(residual.size(0) == x.size(0) && residual.size(1) == H);
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type());
  PS_DISPATCH(x.scalar_type(), [&] {
    rms_rows<scalar>(mut_ptr<scalar>(x), mut_ptr<scalar>(residual), ptr<scalar>(weight), mut_ptr<scalar>(x),
                     x.size(0), H, x.stride(0), residual.stride(0), x.stride(0), float(eps));
  });
}

// out[r] = silu(x[r, :I]) * x[r, I:]
void silu_and_mul(torch::Tensor x, torch::Tensor out) {
  const int64_t I = out.size(-1), rows = out.size(0);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "rows of [T, 2I] -> [T, I]");
  TORCH_CHECK(x.size(-1) == 2 * I && x.size(0) == out.size(0) && x.stride(-1) == 1 && out.is_contiguous());
  TORCH_CHECK(x.scalar_type() == out.scalar_type());
  const int64_t xs = x.stride(0);
  PS_DISPATCH(x.scalar_type(), [&] {
    const scalar* in = ptr<scalar>(x);
    scalar* o = mut_ptr<scalar>(out);
    parallel_for(0, rows, grain(I), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        int64_t d = 0;
        for (; d + 16 <= I; d += 16) {
          const f32x16 g = load16(in + r * xs + d), u = load16(in + r * xs + I + d);
          store16(o + r * I + d, g / (1.f + exp16v(-g)) * u);
        }
        if (d + 8 <= I) {
          const f32x8 g = load8(in + r * xs + d), u = load8(in + r * xs + I + d);
          store8(o + r * I + d, g / (1.f + exp8(-g)) * u);
          d += 8;
        }
        for (; d < I; ++d) {  // I % 8 != 0 (a tensor-parallel shard of an odd size)
          const float g = load1(in + r * xs + d), u = load1(in + r * xs + I + d);
          store1(o + r * I + d, g / (1.f + std::exp(-g)) * u);
        }
      }
    });
  });
}

// GPT-NeoX-style rotary (rotate-half) on the first rot dims of each head, in place. cos/sin: [max_pos, rot / 2]
// fp32; for bf16 tensors they are rounded to bf16 first, as the torch path casts them to the model dtype.
template <typename T>
void rope_rows(T* x, int64_t rows, int64_t heads, int64_t row_stride, int64_t head_stride, int64_t rot,
               const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = rot / 2;
  parallel_for(0, rows, grain(heads * rot), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + pos[r] * half;
      const float* s = sin + pos[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + r * row_stride + h * head_stride;
        for (int64_t j = 0; j < half; ++j) {
          T cq, sq;
          store1(&cq, c[j]);
          store1(&sq, s[j]);
          const float cj = load1(&cq), sj = load1(&sq);
          const float x1 = load1(p + j), x2 = load1(p + half + j);
          store1(p + j, x1 * cj - x2 * sj);
          store1(p + half + j, x2 * cj + x1 * sj);
        }
      }
    }
  });
}

void rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
            int64_t rot) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1);
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous());
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && rot % 2 == 0 && rot <= q.size(2) && cos.size(1) == rot / 2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  PS_DISPATCH(q.scalar_type(), [&] {
    rope_rows<scalar>(mut_ptr<scalar>(q), q.size(0), q.size(1), q.stride(0), q.stride(1), rot, pos,
                      cos.data_ptr<float>(), sin.data_ptr<float>());
    rope_rows<scalar>(mut_ptr<scalar>(k), k.size(0), k.size(1), k.stride(0), k.stride(1), rot, pos,
                      cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

// fp8 formats by their mantissa bits and exponent bias, for the vector conversion.
template <typename F> struct Fp8Format;
template <> struct Fp8Format<c10::Float8_e4m3fn> { static constexpr int MANT = 3, BIAS = 7; };
template <> struct Fp8Format<c10::Float8_e5m2> { static constexpr int MANT = 2, BIAS = 15; };

#ifdef __AVX512F__
// 16 finite fp32 values within F's range as F's bytes, rounded to nearest even as c10's conversion does: normals by
// rounding the float's bits to MANT mantissa bits (a carry moves into the exponent) and re-biasing the exponent;
// values below the smallest normal as the nearest multiple of the smallest subnormal (the conversion to int rounds
// to nearest even), which is their code.
template <int MANT, int BIAS>
inline __m128i fp8_codes16(__m512 y) {
  const __m512i u = _mm512_castps_si512(y), a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 23 - MANT), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(_mm512_set1_epi32((1 << (22 - MANT)) - 1), lsb);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(a, half), 23 - MANT),
                                          _mm512_set1_epi32((127 - BIAS) << MANT));
  const __m512 unit = _mm512_set1_ps(std::ldexp(1.f, BIAS - 1 + MANT));  // 1 / the smallest subnormal
  const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), unit));
  const __mmask16 small = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32((128 - BIAS) << 23));
  return _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_mask_mov_epi32(normal, small, sub), sign));
}
#endif

// One row of fp32 or bf16 values as fp8 bytes: x / scale saturated to F's finite range, rounded to nearest even,
// the bytes c10's conversion (torch's own, so torch_ref's) gives. 16 at a time with AVX-512; a group holding a NaN,
// and the tail, through c10.
template <typename F, typename T>
void quantize_row(const T* x, uint8_t* dst, int64_t n, float scale) {
  const float bound = float(std::numeric_limits<F>::max());
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 sv = _mm512_set1_ps(scale), hi = _mm512_set1_ps(bound), lo = _mm512_set1_ps(-bound);
  // x / 2^k and x * 2^-k are one real number, each rounded once: the same float, and the multiply is the cheaper
  // (vdivps takes about a cycle an element). 1.0, vLLM's default scale, is a power of two.
  int exp2;
  const bool pow2 = std::frexp(scale, &exp2) == 0.5f && exp2 > -125 && exp2 < 127;  // 2^-k a normal float
  const __m512 inv = _mm512_set1_ps(pow2 ? std::ldexp(1.f, 1 - exp2) : 0.f);
  for (; i + 16 <= n; i += 16) {
    f32x16 v = load16(x + i);
    __m512 y;
    std::memcpy(&y, &v, sizeof y);
    y = pow2 ? _mm512_mul_ps(y, inv) : _mm512_div_ps(y, sv);
    if (_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q)) {
      for (int64_t j = i; j < i + 16; ++j) dst[j] = F(std::clamp(load1(x + j) / scale, -bound, bound)).x;
      continue;
    }
    y = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
    _mm_storeu_si128((__m128i*)(dst + i), fp8_codes16<Fp8Format<F>::MANT, Fp8Format<F>::BIAS>(y));
  }
#endif
  for (; i < n; ++i) dst[i] = F(std::clamp(load1(x + i) / scale, -bound, bound)).x;
}

// k_cache[slot] = key[t], v_cache[slot] = value[t] for every token with slot >= 0; key/value rows may be strided.
// Caches of the rows' dtype take them as they are; fp8 caches take them quantized (see fused.h).
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2));
  TORCH_CHECK(value.dim() == 3 && value.stride(2) == 1 && value.stride(1) == value.size(2));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.scalar_type() == torch::kLong);
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == torch::kFloat8_e4m3fn || cache_type == torch::kFloat8_e5m2;
  TORCH_CHECK(v_cache.scalar_type() == cache_type && value.scalar_type() == key.scalar_type());
  TORCH_CHECK(key.scalar_type() == cache_type || fp8, "rows of the cache's dtype, or any for an fp8 cache");
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  TORCH_CHECK(k_cache.size(2) * k_cache.size(3) == row);
  auto slots_c = slot_mapping.contiguous();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  const int64_t bytes = row * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  if (fp8 && key.scalar_type() != cache_type) {
    PS_DISPATCH(key.scalar_type(), [&] {
      auto quantize = cache_type == torch::kFloat8_e4m3fn ? quantize_row<c10::Float8_e4m3fn, scalar>
                                                          : quantize_row<c10::Float8_e5m2, scalar>;
      parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          if (slots[t] < 0) continue;
          quantize(reinterpret_cast<const scalar*>(kp + t * ks), reinterpret_cast<uint8_t*>(kc + slots[t] * bytes),
                   row, float(k_scale));
          quantize(reinterpret_cast<const scalar*>(vp + t * vs), reinterpret_cast<uint8_t*>(vc + slots[t] * bytes),
                   row, float(v_scale));
        }
      });
    });
    return;
  }
  // On both threads: each row lands on cache lines not yet in cache.
  parallel_for(0, T, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (slots[t] < 0) continue;
      std::memcpy(kc + slots[t] * bytes, kp + t * ks, bytes);
      std::memcpy(vc + slots[t] * bytes, vp + t * vs, bytes);
    }
  });
}

// Structured output: logits[rows[i], t] = -inf where bit t % 32 of bitmask[i][t / 32] is clear (llguidance's
// layout), and for t past the mask's 32 W bits. Reads the packed words, never unpacked bools.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && bitmask.scalar_type() == torch::kInt && bitmask.dim() == 2);
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == bitmask.size(0));
  auto rows_c = rows.contiguous();
  auto mask_c = bitmask.contiguous();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int64_t R = rows_c.size(0), V = logits.size(1), W = mask_c.size(1), covered = std::min(V, 32 * W);
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "bitmask row out of range");
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(mask_c.data_ptr<int32_t>());
  float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  parallel_for(0, R, grain(V), [=](int64_t begin, int64_t end) {
    // By value: a store through the row may not alias what the loop reads, or the select stays scalar.
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    for (int64_t i = begin; i < end; ++i) {
      float* row = lp + rp[i] * ls;
      const uint32_t* words = mp + i * W;
      for (int64_t t0 = 0; t0 < covered; t0 += 32) {
        const uint32_t bits = words[t0 / 32];
        float* x = row + t0;
        if (bits == 0xffffffffu) continue;
        if (t0 + 32 <= covered) {
          for (int b = 0; b < 32; ++b) x[b] = ((bits >> b) & 1u) ? x[b] : ninf;  // a vector select
        } else {
          for (int64_t b = 0; b < covered - t0; ++b) x[b] = ((bits >> b) & 1u) ? x[b] : ninf;
        }
      }
      for (int64_t t = covered; t < V; ++t) row[t] = ninf;
    }
  });
}

// out[t] = weight[ids[t]] for every t (rows copied as bytes; any dtype): the embedding's lookup, and the rows of the
// hidden states the LM head reads. An id outside [0, V) raises before anything is copied, as F.embedding does. On
// the pool: torch's embedding and indexing are OpenMP regions (pool.cpp says what those cost).
void gather_rows(torch::Tensor ids, torch::Tensor weight, torch::Tensor out) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && weight.dim() == 2 && weight.is_contiguous());
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == ids.size(0) && out.size(1) == weight.size(1) &&
              out.scalar_type() == weight.scalar_type());
  auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t T = ids.size(0), V = weight.size(0), bytes = weight.size(1) * weight.element_size();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(id[t] >= 0 && id[t] < V, "index ", id[t], " is out of range for ", V, " rows");
  const char* w = static_cast<const char*>(weight.data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  parallel_for(0, T, grain(weight.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) std::memcpy(o + t * bytes, w + id[t] * bytes, bytes);
  });
}

// Greedy sampling: each row's index of its largest value, the first on ties, or of its first NaN (as torch.argmax).
// Each of 16 lanes keeps its maximum and where it first saw it, so the row is read once (a second, scalar pass to
// find the maximum's index cost as much as the first).
void argmax_rows(torch::Tensor x, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) > 0);
  TORCH_CHECK(out.scalar_type() == torch::kLong && out.is_contiguous() && out.numel() == x.size(0));
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "argmax_rows: rows of under 2^31 values");
  const int64_t V = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_for(0, x.size(0), grain(V), [=](int64_t begin, int64_t end) {
    i32x16 lane;
    for (int i = 0; i < 16; ++i) lane[i] = i;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      f32x16 mv = f32x16{} - INFINITY;
      i32x16 mi = {}, idx = lane, nan = {};
      int64_t t = 0;
      for (; t + 16 <= V; t += 16, idx += 16) {
        const f32x16 v = load16(row + t);
        nan |= v != v;
        const i32x16 gt = v > mv;
        mv = gt ? v : mv;
        mi = gt ? idx : mi;
      }
      bool any_nan = false;
      float m = -INFINITY;
      int64_t best = 0;
      for (int i = 0; i < 16; ++i) {
        any_nan |= nan[i] != 0;
        if (mv[i] > m || (mv[i] == m && mi[i] < best)) { m = mv[i]; best = mi[i]; }
      }
      for (; t < V; ++t) {
        any_nan |= row[t] != row[t];
        if (row[t] > m) { m = row[t]; best = t; }
      }
      if (any_nan) for (best = 0; row[best] == row[best]; ++best) {}
      op[r] = best;
    }
  });
}

}  // namespace ps
