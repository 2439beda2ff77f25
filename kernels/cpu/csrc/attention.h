#pragma once
// Paged attention's plan (work items over a step's packed rows) and what the fp32 and bf16 kernels share.
#include "common.h"

namespace ps {

struct AttnShape {
  int64_t Hq, Hkv, G, D, bs, tok_stride, blk_stride, q_stride, o_stride, max_blocks;
  float scale;
  int64_t window = 0;   // sliding window: a query at position p sees keys > p - window (0: every key)
  float soft_cap = 0.f;  // scores = soft_cap * tanh(scores / soft_cap) before the softmax (0: none)
  float v_scale = 1.f;   // an fp8 V cache's scale, applied to the output (K's is folded into `scale`)
  bool amx = false;      // the bf16 kernel's prefill items on AMX tiles (attention_amx.cpp)
  // The lowest key position a query at position p attends.
  int64_t first_key(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
};

struct AttnItem {
  int64_t seq, first_token, ctx0;  // ctx0: position of the sequence's first query row this step
  int64_t r0, r1, h0, h1;          // query rows [r0, r1) of the sequence, KV heads [h0, h1)
  double cost;
  int64_t k0 = 0, k1 = 0, part = 0, parts = 1, slot = 0;  // a decode row's part: keys [k0, k1), its scratch slot
};

// Where the parts of split decode rows leave their partial results (scratch: `stride` floats per part, slots
// numbered as plan() gave them) and how many of each sequence's parts are done.
struct DecodeParts {
  float* scratch;
  std::atomic<int32_t>* done;
  int64_t stride;
};

// The partial results of a decode row's n parts (each: Hq maxima, Hq sums, Hq x D outputs not yet divided by the
// sums) combined in part order: acc = the outputs and l = the sums, each part scaled by exp(its max - the top).
inline void combine_parts(const float* parts, int64_t n, const AttnShape& sh, float* acc, float* l) {
  const int64_t Hq = sh.Hq, D = sh.D, stride = Hq * (D + 2);
  thread_local std::vector<float> w;
  w.resize(n);
  for (int64_t hq = 0; hq < Hq; ++hq) {
    float top = -INFINITY;
    for (int64_t p = 0; p < n; ++p) top = std::max(top, parts[p * stride + hq]);
    l[hq] = 0.f;
    for (int64_t p = 0; p < n; ++p) {
      w[p] = std::exp(parts[p * stride + hq] - top);
      l[hq] += w[p] * parts[p * stride + Hq + hq];
    }
    for (int64_t d = 0; d < D; d += 8) {
      f32x8 a = {};
      for (int64_t p = 0; p < n; ++p) a += splat(w[p]) * load8(parts + p * stride + 2 * Hq + hq * D + d);
      store8(acc + hq * D + d, a);
    }
  }
}

// Defined in attention_bf16.cpp (where the compiler targets AVX512-BF16: else the first says no), for bf16 and fp8
// caches.
bool attention_bf16_takes(const AttnShape& sh);
template <typename C>
void attend_item_bf16(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                      const AttnItem& it, const AttnShape& sh, const DecodeParts& split);

// Defined in attention_amx.cpp: whether the CPU (and the OS) let this process use AMX tiles, and one prefill item of
// the bf16 kernel (a sequence's rows [r0, r1) for KV head h0) on them.
bool attention_amx_usable();
template <typename C>
void prefill_item_amx(const bf16_t* q, const C* kc, const C* vc, bf16_t* out, const int32_t* table,
                      const AttnItem& it, const AttnShape& sh);

// query [T, Hq, D], caches [blocks, block_size, Hkv, D] of query's dtype or fp8 (read as byte x k_scale / v_scale),
// int32 tables; writes out [T, Hq, D]. Block-table entries wholly below a row's sliding window are never read.
// use_amx: bf16 prefill rows on AMX tiles where the CPU has them (else, and for decode rows, vdpbf16ps).
void paged_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale, torch::Tensor out,
                     int64_t sliding_window = 0, double logits_soft_cap = 0.0, double k_scale = 1.0,
                     double v_scale = 1.0, bool use_amx = true);

}  // namespace ps
