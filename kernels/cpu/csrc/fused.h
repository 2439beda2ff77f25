#pragma once
// Fused element-wise kernels: RMSNorm (with the residual add), SiLU-and-mul, rotary, KV-cache writes, the
// token bitmask on logits, greedy argmax, a row gather (embeddings, the LM head's rows).
#include "common.h"

namespace ps {

void rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor out);
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void silu_and_mul(torch::Tensor x, torch::Tensor out);
void rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
            int64_t rot);
// An fp8 cache stores key / k_scale (value / v_scale) saturated to the format's range, rounded to nearest even.
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor slot_mapping, double k_scale = 1.0, double v_scale = 1.0);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
void argmax_rows(torch::Tensor x, torch::Tensor out);
void gather_rows(torch::Tensor ids, torch::Tensor weight, torch::Tensor out);
// Reads every byte of a contiguous buffer (whole 256-byte lines) once on the kernels' threads, as fast as the
// memory gives them; returns their xor, so that no read can be skipped (stream.cpp).
int64_t stream_read(torch::Tensor buffer);

}  // namespace ps
