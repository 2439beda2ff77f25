#pragma once
// One call per MoE layer: this rank's experts on the tokens routed to them, fp32 activations, on weights packed into
// panels (fp32, or bf16 widened exactly).
#include "common.h"

namespace ps {

// x [T, H]; topk_ids [T, K] (global expert ids) and topk_weights [T, K] fp32; this rank holds experts
// [expert_start, expert_start + E). w13 [E, ceil(I/8), H, 16]: panel q holds gate rows 8q.. 8q+7 in columns 0-7 and
// up rows 8q.. 8q+7 in columns 8-15 (rows past I zero). w2 [E, ceil(H/16), I, 16]: the down projection's panels.
// out [T, H] = sum over k (in k order) of topk_weights[t, k] * expert(x[t]) for the k whose expert is local.
void moe_fp32(torch::Tensor x, torch::Tensor topk_ids, torch::Tensor topk_weights, int64_t expert_start,
              torch::Tensor w13, torch::Tensor w2, int64_t intermediate_size, torch::Tensor out);

}  // namespace ps
