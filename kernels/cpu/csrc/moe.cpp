// The fused MoE layer (fp32): the (token, choice) pairs routed to this rank's experts grouped by expert (a CSR
// table, tokens in order within an expert), then two parallel passes, each over every active expert's weights once:
//  1. gate+up: one work item per (expert, panel of 8 gate and 8 up rows); the 6 x 16 panel tile gives both halves
//     of SiLU(gate) * up for a row tile at once, written to the intermediate activations [pairs, I].
//  2. down: one work item per 16 output features; it runs that panel of every active expert, then sums each token's
//     weighted choices in k order straight into out, so no [tokens * k, hidden] buffer is kept and no two threads
//     write the same output.
// Threads take items as they come, so a skewed routing (every token to one expert) still splits that expert's rows.
// Each value is summed in k order as the panel GEMM sums it: the same gate, up and down values as the per-expert
// linears on the same panels.

#include "moe.h"

#include <vector>

#include "gemm_tile.h"

namespace ps {

namespace {

constexpr int64_t kHalf = kNR / 2;  // gate (or up) rows per w13 panel

// y [rows, 16] = x [rows, K] (row stride ldx) times one panel [K, 16]: k blocks of kKC, each run by every row tile
// while its slice of the panel sits in L1; the sums in k order, as the panel GEMM's.
template <typename W>
void panel_gemm(const float* x, int64_t ldx, int64_t rows, const W* panel, int64_t K, float* y) {
  for (int64_t k0 = 0; k0 < K; k0 += kKC) {
    const int64_t kc = std::min(kKC, K - k0);
    for (int64_t m = 0; m < rows; m += kMR) {
      const int64_t mr = std::min(kMR, rows - m);
      kTilesOf<W>[mr](x + m * ldx + k0, ldx, panel + k0 * kNR, kc, y + m * kNR, kNR, kNR, k0 > 0, nullptr, nullptr);
    }
  }
}

template <typename W>
void moe(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
         torch::Tensor w13, torch::Tensor w2, int64_t intermediate_size, torch::Tensor out) {
  check_layer_args(x, topk_ids, topk_weights, out, torch::kFloat);
  const int64_t T = x.size(0), H = x.size(1), K = topk_ids.size(1), I = intermediate_size;
  TORCH_CHECK(w13.dim() == 4 && w13.is_contiguous() && w13.size(2) == H &&
              w13.size(3) == kNR && w13.size(1) == (I + kHalf - 1) / kHalf, "w13: [E, ceil(I/8), H, 16]");
  const int64_t E = w13.size(0), P13 = w13.size(1), P2 = (H + kNR - 1) / kNR, Ipad = P13 * kHalf;
  TORCH_CHECK(w2.dim() == 4 && w2.is_contiguous() && w2.scalar_type() == w13.scalar_type() && w2.size(0) == E &&
              w2.size(1) == P2 && w2.size(2) == I && w2.size(3) == kNR, "w2: [E, ceil(H/16), I, 16]");

  const Routes routes = group_by_expert(topk_ids.data_ptr<int64_t>(), T, K, expert_start, E);
  const int64_t rows = routes.start[E];
  float* y = out.data_ptr<float>();
  if (rows == 0) {
    std::fill(y, y + T * H, 0.f);
    return;
  }
  const float* xp = x.data_ptr<float>();
  const W* wp13 = reinterpret_cast<const W*>(w13.data_ptr());
  const W* wp2 = reinterpret_cast<const W*>(w2.data_ptr());
  const float* weights = topk_weights.data_ptr<float>();
  std::vector<float> xs(rows * H), act(rows * Ipad);
  parallel_for(0, rows, std::max<int64_t>(1, 4096 / H), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) std::memcpy(xs.data() + r * H, xp + routes.token[r] * H, H * sizeof(float));
  });

  // 1. act = SiLU(x W_gate^T) * (x W_up^T), per active expert and panel.
  std::vector<int64_t> first_item(routes.active.size() + 1, 0);
  for (size_t i = 0; i < routes.active.size(); ++i) first_item[i + 1] = first_item[i] + P13;
  parallel_for(0, first_item.back(), 1, [&](int64_t b, int64_t e_) {
    std::vector<float> gate_up;
    for (int64_t item = b; item < e_; ++item) {
      const int64_t e = routes.active[item / P13], q = item % P13, m0 = routes.start[e], m1 = routes.start[e + 1];
      gate_up.resize((m1 - m0) * kNR);
      panel_gemm<W>(xs.data() + m0 * H, H, m1 - m0, wp13 + (e * P13 + q) * H * kNR, H, gate_up.data());
      for (int64_t r = 0; r < m1 - m0; ++r) {
        const f32x8 g = load8(gate_up.data() + r * kNR), u = load8(gate_up.data() + r * kNR + kHalf);
        store8(act.data() + (m0 + r) * Ipad + q * kHalf, g / (1.f + exp8(-g)) * u);
      }
    }
  });

  // 2. out[t] = sum_k weight[t, k] * (act[row(t, k)] W_down^T), per panel of 16 output features.
  parallel_for(0, P2, 1, [&](int64_t b, int64_t e_) {
    std::vector<float> down(rows * kNR);
    for (int64_t p = b; p < e_; ++p) {
      const int64_t n0 = p * kNR, ncols = std::min(kNR, H - n0);
      for (const int64_t e : routes.active) {
        const int64_t m0 = routes.start[e], m1 = routes.start[e + 1];
        panel_gemm<W>(act.data() + m0 * Ipad, Ipad, m1 - m0, wp2 + (e * P2 + p) * I * kNR, I, down.data() + m0 * kNR);
      }
      for (int64_t t = 0; t < T; ++t) {
        f32x8 s0 = {}, s1 = {};
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = routes.row_of[t * K + k];
          if (r < 0) continue;
          const float w = weights[t * K + k];
          const f32x8 t0 = load8(down.data() + r * kNR) * w, t1 = load8(down.data() + r * kNR + kHalf) * w;
          s0 += t0;
          s1 += t1;
        }
        float sum[kNR];
        store8(sum, s0);
        store8(sum + kHalf, s1);
        std::memcpy(y + t * H + n0, sum, ncols * sizeof(float));
      }
    }
  });
}

}  // namespace

void check_layer_args(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                      const torch::Tensor& out, torch::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype, "x: contiguous [T, H] of ", dtype);
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && out.scalar_type() == dtype);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.is_contiguous() && topk_ids.scalar_type() == torch::kLong &&
              topk_ids.size(0) == x.size(0));
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.is_contiguous() &&
              topk_weights.scalar_type() == torch::kFloat);
}

Routes group_by_expert(const int64_t* ids, int64_t T, int64_t K, int64_t expert_start, int64_t E) {
  Routes r;
  r.start.assign(E + 1, 0);
  r.row_of.assign(T * K, -1);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = ids[i] - expert_start;
    if (e >= 0 && e < E) ++r.start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (r.start[e + 1] > 0) r.active.push_back(e);
    r.start[e + 1] += r.start[e];
  }
  r.token.resize(r.start[E]);
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = ids[i] - expert_start;
    if (e < 0 || e >= E) continue;
    r.row_of[i] = fill[e];
    r.token[fill[e]++] = i / K;
  }
  return r;
}

namespace {

// Rows [b, e) of the router: softmax in fp32 over the E logits, the top k (the softmax is monotonic, so the logits
// order them as the probabilities do; of equal logits the lower expert id first, where torch.topk's order depends on
// its algorithm), renormalized where asked.
template <typename S>
void route_rows(const S* logits, int64_t ld, int64_t b, int64_t e, int64_t E, int64_t K, bool renormalize, float* w,
                int64_t* ids) {
  std::vector<float> v(E);
  std::vector<char> taken(E);
  for (int64_t t = b; t < e; ++t) {
    float m = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < E; ++j) m = std::max(m, v[j] = load1(logits + t * ld + j));
    for (int64_t j = 0; j < E; ++j) sum += std::exp(v[j] - m);
    std::fill(taken.begin(), taken.end(), 0);
    float chosen = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t j = 0; j < E; ++j)
        if (!taken[j] && (best < 0 || v[j] > v[best])) best = j;
      taken[best] = 1;
      ids[t * K + k] = best;
      chosen += w[t * K + k] = std::exp(v[best] - m) / sum;
    }
    for (int64_t k = 0; renormalize && k < K; ++k) w[t * K + k] /= chosen;
  }
}

}  // namespace

void select_experts(torch::Tensor logits, int64_t top_k, bool renormalize, torch::Tensor weights, torch::Tensor ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits: [T, E], unit stride along E");
  const int64_t T = logits.size(0), E = logits.size(1), K = top_k;
  TORCH_CHECK(K >= 1 && K <= E, "top_k in [1, number of experts]");
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == torch::kFloat && weights.size(0) == T &&
              weights.size(1) == K && ids.is_contiguous() && ids.scalar_type() == torch::kLong &&
              ids.sizes() == weights.sizes());
  float* w = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  PS_DISPATCH(logits.scalar_type(), [&] {
    const scalar* l = ptr<scalar>(logits);
    parallel_for(0, T, std::max<int64_t>(1, 8192 / E), [&](int64_t b, int64_t e) {
      route_rows(l, logits.stride(0), b, e, E, K, renormalize, w, id);
    });
  });
}

void moe_fp32(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
              torch::Tensor w13, torch::Tensor w2, int64_t intermediate_size, torch::Tensor out) {
  if (w13.scalar_type() == torch::kBFloat16) {
    moe<bf16_t>(x, topk_ids, topk_weights, expert_start, w13, w2, intermediate_size, out);
    return;
  }
  TORCH_CHECK(w13.scalar_type() == torch::kFloat, "expert panels: float32 or bfloat16");
  moe<float>(x, topk_ids, topk_weights, expert_start, w13, w2, intermediate_size, out);
}

}  // namespace ps
