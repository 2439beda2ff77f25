// Paged attention for CPUs in C++: decodes and prefill chunks of one step in one call, fp32 or bf16 (on AVX512-BF16
// CPUs bf16 items go to attention_bf16.cpp).
//
// The torch reference gathers each sequence's blocks into a contiguous copy and runs one SDPA per prefill chunk
// from Python; this kernel reads K and V rows in place through the block table and takes the whole packed batch at
// once (an fp8 cache is widened to fp32 as it is read). Work items are a decode row (all heads; a row of more than
// 512 keys in near-equal parts, merged by the thread that finishes its last part) or a tile of up to 32 prefill
// rows for one KV head (its GQA group scored against each K row while it is in cache); the pool's threads (pool.h)
// take the items costliest first (rows x keys), each the next one as it finishes. Queries, scores, softmax and the
// output accumulator are fp32 whatever the storage dtype (bf16 is widened on load, the output rounded to nearest
// even once).

#include "attention.h"

namespace ps {

// Decode rows of more keys go in near-equal parts of at most this many, so a long row runs on every thread
// (smaller parts cost more setup than they save).
constexpr int64_t kDecodePartKeys = 512;

// Keys go in chunks of 8: eight dot products share each query load and end in one transposing reduction; the
// value pass adds eight weighted rows per load and store of the accumulator.
constexpr int kChunk = 8;

// out[j] = sum_d q[d] * k[j][d] for the 8 rows k[0..7].
template <typename T>
inline void dot8(const float* q, const T* const* k, int64_t D, float* out) {
  f32x8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  for (int64_t d = 0; d < D; d += 8) {
    const f32x8 qv = load8(q + d);
    a0 += qv * load8(k[0] + d); a1 += qv * load8(k[1] + d); a2 += qv * load8(k[2] + d); a3 += qv * load8(k[3] + d);
    a4 += qv * load8(k[4] + d); a5 += qv * load8(k[5] + d); a6 += qv * load8(k[6] + d); a7 += qv * load8(k[7] + d);
  }
  store8(out, transpose_sum(a0, a1, a2, a3, a4, a5, a6, a7));
}

// acc[d] += sum_j p[j] * v[j][d] for the 8 rows v[0..7].
template <typename T>
inline void axpy8(float* acc, const float* p, const T* const* v, int64_t D) {
  const f32x8 p0 = splat(p[0]), p1 = splat(p[1]), p2 = splat(p[2]), p3 = splat(p[3]);
  const f32x8 p4 = splat(p[4]), p5 = splat(p[5]), p6 = splat(p[6]), p7 = splat(p[7]);
  for (int64_t d = 0; d < D; d += 8) {
    f32x8 a = load8(acc + d);
    a += p0 * load8(v[0] + d); a += p1 * load8(v[1] + d); a += p2 * load8(v[2] + d); a += p3 * load8(v[3] + d);
    a += p4 * load8(v[4] + d); a += p5 * load8(v[5] + d); a += p6 * load8(v[6] + d); a += p7 * load8(v[7] + d);
    store8(acc + d, a);
  }
}

#if defined(__AVX512F__) && defined(__AVX2__)
// dot8 and axpy8 on 16 lanes, for head sizes that are a multiple of 16: an fp8 row widens 16 bytes per conversion
// (fewer instructions per element than 8), and a decode row over an fp8 cache is bound by its widening.
template <typename T>
inline void dot16(const float* q, const T* const* k, int64_t D, float* out) {
  f32x16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  for (int64_t d = 0; d < D; d += 16) {
    const f32x16 qv = load16(q + d);
    a0 += qv * load16(k[0] + d); a1 += qv * load16(k[1] + d); a2 += qv * load16(k[2] + d);
    a3 += qv * load16(k[3] + d); a4 += qv * load16(k[4] + d); a5 += qv * load16(k[5] + d);
    a6 += qv * load16(k[6] + d); a7 += qv * load16(k[7] + d);
  }
  const auto fold = [](f32x16 v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  };
  store8(out, transpose_sum(fold(a0), fold(a1), fold(a2), fold(a3), fold(a4), fold(a5), fold(a6), fold(a7)));
}

template <typename T>
inline void axpy16(float* acc, const float* p, const T* const* v, int64_t D) {
  const f32x16 p0 = (f32x16)_mm512_set1_ps(p[0]), p1 = (f32x16)_mm512_set1_ps(p[1]);
  const f32x16 p2 = (f32x16)_mm512_set1_ps(p[2]), p3 = (f32x16)_mm512_set1_ps(p[3]);
  const f32x16 p4 = (f32x16)_mm512_set1_ps(p[4]), p5 = (f32x16)_mm512_set1_ps(p[5]);
  const f32x16 p6 = (f32x16)_mm512_set1_ps(p[6]), p7 = (f32x16)_mm512_set1_ps(p[7]);
  for (int64_t d = 0; d < D; d += 16) {
    f32x16 a = load16(acc + d);
    a += p0 * load16(v[0] + d); a += p1 * load16(v[1] + d); a += p2 * load16(v[2] + d); a += p3 * load16(v[3] + d);
    a += p4 * load16(v[4] + d); a += p5 * load16(v[5] + d); a += p6 * load16(v[6] + d); a += p7 * load16(v[7] + d);
    store16(acc + d, a);
  }
}
#define PS_ATTN16 1
#else
#define PS_ATTN16 0
#endif

template <typename T>
inline void dot_chunk(const float* q, const T* const* k, int64_t D, float* out) {
#if PS_ATTN16
  if (D % 16 == 0) return dot16(q, k, D, out);
#endif
  dot8(q, k, D, out);
}
template <typename T>
inline void axpy_chunk(float* acc, const float* p, const T* const* v, int64_t D) {
#if PS_ATTN16
  if (D % 16 == 0) return axpy16(acc, p, v, D);
#endif
  axpy8(acc, p, v, D);
}

// exp(s - max) in place over s[0:n]; returns their sum (the normalization is applied to the output), and the max
// in *max_out.
inline float softmax_unnormalized(float* s, int64_t n, float* max_out) {
  f32x8 mv = splat(-INFINITY);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) { f32x8 x = load8(s + t); mv = x > mv ? x : mv; }
  float m = hmax(mv);
  for (; t < n; ++t) m = std::max(m, s[t]);
  *max_out = m;
  f32x8 sv = {};
  t = 0;
  for (; t + 8 <= n; t += 8) { f32x8 e = exp8(load8(s + t) - m); store8(s + t, e); sv += e; }
  float sum = hsum(sv);
  if (t < n) {  // tail: through a padded lane buffer
    float buf[8];
    for (int i = 0; i < 8; ++i) buf[i] = t + i < n ? s[t + i] - m : -87.f;
    f32x8 e = exp8(load8(buf));
    for (int64_t i = 0; t + i < n; ++i) { s[t + i] = e[i]; sum += e[i]; }
  }
  return sum;
}

// Pointers to the cache rows (token start, head 0) of keys t0 .. t0 + 7; keys past L point at a zero row.
template <typename T>
inline void chunk_rows(const T* cache, const int32_t* table, int64_t t0, int64_t L, const AttnShape& sh,
                       const T* zero, const T** rows) {
  // One division per chunk, not per key: a 64-bit division cost as much as widening a key's fp8 row.
  int64_t blk = t0 / sh.bs, off = t0 % sh.bs;
  const T* base = cache + table[blk] * sh.blk_stride;
  for (int j = 0; j < kChunk; ++j) {
    rows[j] = t0 + j < L ? base + off * sh.tok_stride : zero;
    if (++off == sh.bs && t0 + j + 1 < L) { off = 0; base = cache + table[++blk] * sh.blk_stride; }
  }
}

// A work item of plan(); a decode row's part leaves its partial results in split's scratch, and the thread that
// finishes the row's last part combines them and writes the row. T: query and output storage; C: the cache's.
template <typename T, typename C>
void attend_item(const T* q, const C* kc, const C* vc, T* out, const int32_t* table, const AttnItem& it,
                 const AttnShape& sh, const DecodeParts& split) {
  thread_local std::vector<float> qf, S, acc, sums, top, wide;
  thread_local std::vector<C> zero;
  const int64_t nr = it.r1 - it.r0, nh = it.h1 - it.h0, G = sh.G, D = sh.D;
  const int64_t nq = nr * nh * G;               // query vectors, ordered (row, KV head, group member)
  const bool part = it.parts > 1;               // keys [k0, k1) of a decode row (one row, every head)
  // Row i (position lag + i) sees keys [max(first_key(lag + i), k0), min(lag + i + 1, L)).
  const int64_t lag = it.ctx0 + it.r0;
  const int64_t k0 = part ? it.k0 : sh.first_key(lag);
  const int64_t L = part ? it.k1 : it.ctx0 + it.r1;  // keys the tile's last row attends to
  const int64_t Lp = (L - k0 + kChunk - 1) / kChunk * kChunk;
  qf.resize(nq * D);
  S.resize(nq * Lp);
  acc.assign(nq * D, 0.f);
  sums.resize(nq);
  top.resize(nq);
  if (int64_t(zero.size()) < sh.tok_stride) zero.assign(sh.tok_stride, C{});  // +0.0 in every format
  const int64_t row0 = it.first_token + it.r0;
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + (row0 + i) * sh.q_stride + ((it.h0 + hh) * G + g) * D;
        float* dst = qf.data() + ((i * nh + hh) * G + g) * D;
        for (int64_t d = 0; d < D; d += 8) store8(dst + d, load8(src + d) * sh.scale);
      }
  // A chunk of keys [t0, t0 + 8) matters to rows i >= t0 - lag and, under a window, i < t0 + 8 + window - 1 - lag.
  auto rows_end = [&](int64_t t0) {
    return sh.window > 0 ? std::min<int64_t>(nr, t0 + kChunk + sh.window - 1 - lag) : nr;
  };
  // body(r, h): the chunk's rows r[j], head h + hh at r[j] + (h + hh) * D. A tile of several query rows reads
  // each row once per query row: an fp8 or bf16 chunk is widened once into `wide` for them.
  const C* rows[kChunk];
  auto for_chunk = [&](const C* cache, int64_t t0, auto&& body) {
    chunk_rows(cache, table, t0, L, sh, zero.data(), rows);
    if constexpr (!std::is_same_v<C, float>) {
      if (nr > 1) {
        wide.resize(kChunk * nh * D);
        const float* wr[kChunk];
        for (int j = 0; j < kChunk; ++j) {
          float* w = wide.data() + j * nh * D;
          int64_t e = 0;
#if PS_ATTN16
          for (; e + 16 <= nh * D; e += 16) store16(w + e, load16(rows[j] + it.h0 * D + e));
#endif
          for (; e < nh * D; e += 8) store8(w + e, load8(rows[j] + it.h0 * D + e));
          wr[j] = w;
        }
        return body(wr, int64_t(0));
      }
    }
    body(rows, it.h0);
  };
  // op(qi, t, hr): query vector qi against the chunk's rows hr[0..7] of its head, keys from k0 + t.
  auto over_keys = [&](const C* cache, auto&& op) {
    for (int64_t t0 = k0; t0 < L; t0 += kChunk)
      for_chunk(cache, t0, [&](const auto* const* r, int64_t h) {
        std::remove_cv_t<std::remove_reference_t<decltype(r[0])>> hr[kChunk];
        for (int64_t i = std::max<int64_t>(0, t0 - lag), ie = rows_end(t0); i < ie; ++i)
          for (int64_t hh = 0; hh < nh; ++hh) {
            for (int j = 0; j < kChunk; ++j) hr[j] = r[j] + (h + hh) * D;
            for (int64_t g = 0; g < G; ++g) op((i * nh + hh) * G + g, t0 - k0, hr);
          }
      });
  };
  over_keys(kc, [&](int64_t qi, int64_t t, const auto* hr) {
    dot_chunk(qf.data() + qi * D, hr, D, S.data() + qi * Lp + t);
  });
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t lo = std::max(sh.first_key(lag + i), k0) - k0, hi = std::min(lag + i + 1, L) - k0;
    for (int64_t j = 0; j < nh * G; ++j) {
      float* s = S.data() + (i * nh * G + j) * Lp;
      if (sh.soft_cap > 0.f)
        for (int64_t t = lo; t < hi; ++t) s[t] = sh.soft_cap * std::tanh(s[t] / sh.soft_cap);
      sums[i * nh * G + j] = softmax_unnormalized(s + lo, hi - lo, &top[i * nh * G + j]);
      std::fill(s, s + lo, 0.f);  // keys below the row's window
      std::fill(s + hi, s + Lp, 0.f);  // keys past the row's position
    }
  }
  over_keys(vc, [&](int64_t qi, int64_t t, const auto* hr) {
    axpy_chunk(acc.data() + qi * D, S.data() + qi * Lp + t, hr, D);
  });
  if (part) {  // query vector qi is head qi here
    float* p = split.scratch + it.slot * split.stride;
    std::copy(top.begin(), top.begin() + nq, p);
    std::copy(sums.begin(), sums.begin() + nq, p + nq);
    std::copy(acc.begin(), acc.begin() + nq * D, p + 2 * nq);
    if (split.done[it.seq].fetch_add(1, std::memory_order_acq_rel) + 1 < it.parts) return;
    combine_parts(split.scratch + (it.slot - it.part) * split.stride, it.parts, sh, acc.data(), sums.data());
  }
  for (int64_t i = 0; i < nr; ++i)
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t qi = (i * nh + hh) * G + g;
        T* dst = out + (row0 + i) * sh.o_stride + ((it.h0 + hh) * G + g) * D;
        const float* a = acc.data() + qi * D;
        const f32x8 w = splat(sh.v_scale / sums[qi]);
        for (int64_t d = 0; d < D; d += 8) store8(dst + d, load8(a + d) * w);
      }
}

template <typename T, typename C>
inline bool attend_bf16_if(const T*, const C*, const C*, T*, const int32_t*, const AttnItem&, const AttnShape&,
                           const DecodeParts&) { return false; }
template <typename C>
inline bool attend_bf16_if(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                           const AttnItem& it, const AttnShape& sh, const DecodeParts& split) {
  attend_item_bf16(q, kc, vc, out, table, it, sh, split);
  return true;
}

// Work items: a decode row (all heads), or up to tile_rows prefill rows of one KV head. With part_keys > 0, a
// decode row of more keys goes in near-equal parts of at most part_keys keys (by its own length only, so that its
// result does not depend on the batch); *slots counts the parts.
std::vector<AttnItem> plan(const int32_t* qsl, const int32_t* sl, int64_t B, const AttnShape& sh, int64_t tile_rows,
                           int64_t part_keys, int64_t* slots) {
  std::vector<AttnItem> items;
  items.reserve(B);
  *slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = qsl[b], n = qsl[b + 1] - qsl[b], ctx0 = sl[b] - n;
    if (n <= 0) continue;
    const int64_t lo = sh.first_key(ctx0), nk = sl[b] - lo;  // a decode row's keys: [lo, sl[b])
    if (n == 1 && part_keys > 0 && nk > part_keys) {
      // Near-equal parts of whole 16-key groups (600 keys: 304 + 296, not 512 + 88).
      const int64_t parts = (nk + part_keys - 1) / part_keys, keys = (nk + 16 * parts - 1) / (16 * parts) * 16;
      for (int64_t p = 0; p < parts; ++p) {
        AttnItem it{b, first, ctx0, 0, 1, 0, sh.Hkv, 0.0};
        it.k0 = lo + p * keys; it.k1 = std::min<int64_t>(sl[b], it.k0 + keys);
        it.cost = double(it.k1 - it.k0) * sh.Hq;
        it.part = p; it.parts = parts; it.slot = *slots + p;
        items.push_back(it);
      }
      *slots += parts;
      continue;
    }
    if (n == 1) {
      items.push_back({b, first, ctx0, 0, 1, 0, sh.Hkv, double(nk) * sh.Hq});
      continue;
    }
    for (int64_t r0 = 0; r0 < n; r0 += tile_rows) {
      const int64_t r1 = std::min(n, r0 + tile_rows);
      double keys = ctx0 + (r0 + r1 + 1) / 2.0;
      if (sh.window > 0) keys = std::min<double>(keys, sh.window);
      keys *= r1 - r0;
      for (int64_t h = 0; h < sh.Hkv; ++h) items.push_back({b, first, ctx0, r0, r1, h, h + 1, keys * sh.G});
    }
  }
  return items;
}

void paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale, torch::Tensor out,
                     int64_t sliding_window, double logits_soft_cap, double k_scale, double v_scale, bool use_amx) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && out.dim() == 3);
  const auto cache_type = k_cache.scalar_type();
  const bool fp8 = cache_type == torch::kFloat8_e4m3fn || cache_type == torch::kFloat8_e5m2;
  TORCH_CHECK((fp8 || query.scalar_type() == cache_type) && cache_type == v_cache.scalar_type() &&
              out.scalar_type() == query.scalar_type(), "query and out share one dtype; the caches it or fp8");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be [heads, head_size]");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be [heads, head_size]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous());
  TORCH_CHECK(query_start_loc.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt);
  AttnShape sh;
  sh.Hq = query.size(1); sh.D = query.size(2); sh.bs = k_cache.size(1); sh.Hkv = k_cache.size(2);
  TORCH_CHECK(sh.D % 8 == 0 && k_cache.size(3) == sh.D && sh.Hq % sh.Hkv == 0);
  sh.G = sh.Hq / sh.Hkv;
  sh.tok_stride = sh.Hkv * sh.D; sh.blk_stride = sh.bs * sh.tok_stride;
  sh.q_stride = query.stride(0); sh.o_stride = out.stride(0);
  sh.max_blocks = block_tables.size(1);
  sh.scale = float(scale * (fp8 ? k_scale : 1.0));
  sh.v_scale = float(fp8 ? v_scale : 1.0);
  sh.window = sliding_window;
  sh.soft_cap = float(logits_soft_cap);
  const int64_t B = seq_lens.size(0);
  auto qsl_c = query_start_loc.contiguous();
  auto sl_c = seq_lens.contiguous();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* sl = sl_c.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  // The bf16 kernel (bf16 queries over a bf16 or fp8 cache) packs each item's V rows once: larger items (128 query
  // vectors) share that. It takes windows on decode rows only and no soft-cap; the generic kernel takes the rest.
  const bool bf16_kernel = query.scalar_type() == torch::kBFloat16 && (cache_type == torch::kBFloat16 || fp8) &&
                           attention_bf16_takes(sh) && sh.soft_cap == 0.f;
  sh.amx = bf16_kernel && use_amx && attention_amx_usable();
  int64_t slots = 0;
  const std::vector<AttnItem> items = plan(qsl, sl, B, sh, bf16_kernel ? std::max<int64_t>(1, 128 / sh.G) : 32,
                                           kDecodePartKeys, &slots);
  if (items.empty()) return;
  std::vector<float> scratch(slots * sh.Hq * (sh.D + 2));
  std::vector<std::atomic<int32_t>> done(slots > 0 ? B : 0);
  for (auto& d : done) d.store(0, std::memory_order_relaxed);
  const DecodeParts split{scratch.data(), done.data(), sh.Hq * (sh.D + 2)};
  // Costliest items first, each thread taking the next one as it finishes (longest-processing-time order).
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) order[i] = int32_t(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return items[a].cost > items[b].cost; });
  const int64_t n = int64_t(items.size()), parts = std::min<int64_t>(kernel_threads(), n);
  std::atomic<int64_t> next{0};
  auto run = [&](auto* q, auto* kc, auto* vc, auto* o) {
    AttnShape loaded = sh;  // attend_item's load8 reads an fp8 cache's values divided by fp8_unit
    const float unit = fp8_unit<std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>>();
    loaded.scale *= unit;
    loaded.v_scale *= unit;
    run_parallel(parts, [&] {
      for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
        const AttnItem& it = items[order[k]];
        const bool bf16_item = bf16_kernel && (sh.window == 0 || (it.r0 == 0 && it.r1 == 1 && it.h1 - it.h0 == sh.Hkv));
        if (!(bf16_item && attend_bf16_if(q, kc, vc, o, bt + it.seq * sh.max_blocks, it, sh, split)))
          attend_item(q, kc, vc, o, bt + it.seq * sh.max_blocks, it, loaded, split);
      }
    });
  };
  PS_DISPATCH(query.scalar_type(), [&] {
    const scalar* q = ptr<scalar>(query);
    scalar* o = mut_ptr<scalar>(out);
    if (cache_type == torch::kFloat8_e4m3fn)
      run(q, ptr<fp8_e4m3_t>(k_cache), ptr<fp8_e4m3_t>(v_cache), o);
    else if (cache_type == torch::kFloat8_e5m2)
      run(q, ptr<fp8_e5m2_t>(k_cache), ptr<fp8_e5m2_t>(v_cache), o);
    else
      run(q, ptr<scalar>(k_cache), ptr<scalar>(v_cache), o);
  });
}

}  // namespace ps
