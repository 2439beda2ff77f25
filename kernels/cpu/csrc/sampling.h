#pragma once
// Random sampling of one token per row (temperature, min-p, top-k, top-p, an inverse-CDF draw); sampling.cpp.
#include "common.h"

namespace ps {

// out[r] = the token drawn for row r with uniform[r] in (0, 1), or greedy[r] where temperature[r] <= 0. logits
// [B, V] fp32; temperature, top_p, min_p [B] fp32; top_k [B] int64 (<= 0 or >= V: no limit); top_k, top_p and
// min_p may be empty (unused); uniform [B] fp64; greedy, out [B] int64.
void sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k, torch::Tensor top_p,
                 torch::Tensor min_p, torch::Tensor uniform, torch::Tensor greedy, torch::Tensor out);

}  // namespace ps
