#pragma once
// One call per MoE layer: this rank's experts on the tokens routed to them, fp32 activations, on weights packed into
// panels (fp32, or bf16 widened exactly).
#include "common.h"

namespace ps {

// The (token, choice) pairs routed to this rank's experts, grouped by expert (a CSR table), tokens in order within
// an expert.
struct Routes {
  std::vector<int64_t> start;   // [E + 1]: pairs of expert e are rows start[e] .. start[e + 1]
  std::vector<int64_t> token;   // [pairs]: the token of each row
  std::vector<int64_t> row_of;  // [T * K]: the row of (t, k), or -1 where its expert is on another rank
  std::vector<int64_t> active;  // experts with at least one row
};

// The layer's activations and routing: x [T, H] of dtype, contiguous, out the same, topk_ids [T, K] int64 and
// topk_weights [T, K] fp32, contiguous.
void check_layer_args(const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
                      const torch::Tensor& out, torch::ScalarType dtype);

// For topk_ids [T, K] (global ids) and this rank's experts [expert_start, expert_start + E).
Routes group_by_expert(const int64_t* ids, int64_t T, int64_t K, int64_t expert_start, int64_t E);

// A MoE router's choice (torch_ref.select_experts) for logits [T, E] fp32 or bf16: weights [T, K] fp32 and ids [T, K]
// int64, in order of decreasing weight.
void select_experts(torch::Tensor logits, int64_t top_k, bool renormalize, torch::Tensor weights, torch::Tensor ids);

// x [T, H]; topk_ids [T, K] (global expert ids) and topk_weights [T, K] fp32; this rank holds experts
// [expert_start, expert_start + E). w13 [E, ceil(I/8), H, 16]: panel q holds gate rows 8q.. 8q+7 in columns 0-7 and
// up rows 8q.. 8q+7 in columns 8-15 (rows past I zero). w2 [E, ceil(H/16), I, 16]: the down projection's panels.
// out [T, H] = sum over k (in k order) of topk_weights[t, k] * expert(x[t]) for the k whose expert is local.
void moe_fp32(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
              torch::Tensor w13, torch::Tensor w2, int64_t intermediate_size, torch::Tensor out);

// The same on bf16 activations x [T, H] and bf16 panels, out [T, H] bf16, on AMX tiles where use_amx and the CPU
// has them. With Hp = H rounded up to 32 and Ip = I rounded up to 32: w13 [E, Ip/16, Hp/2, 32, 2], k-pair panels
// (gemm_bf16.h) whose columns 0-15 are gate rows 16q.. 16q+15 and 16-31 the same up rows, zero past I and past H;
// w2 [E, ceil(H/32), Ip/2, 32, 2], the down projection's panels, zero past I. Or weight-only int8 experts: int8
// panels of gemm_int8's layout, w13 [E, Ip/16, Hp, 32] and w2 [E, ceil(H/32), Ip, 32], with fp32 per-column scales
// w13_scale [E, Ip/16, 32] and w2_scale [E, ceil(H/32), 32] (bf16 panels: any, unread). Raises where built without
// AVX512-BF16 (moe_bf16_built).
void moe_bf16(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
              torch::Tensor w13, torch::Tensor w2, torch::Tensor out, bool use_amx, torch::Tensor w13_scale,
              torch::Tensor w2_scale);
bool moe_bf16_built();

}  // namespace ps
