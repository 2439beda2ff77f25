// One LLaMA-style decoder layer in one call (cpu_layer.py says why): the kernels of the other files in the
// module path's order, on the same buffers.

#include "layer.h"

#include "attention.h"
#include "fused.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"

namespace ps {

// y = x @ W.T (+ bias inside the GEMM, as a column-parallel layer adds it; or after it, as a row-parallel one).
// int8 panels come with their per-channel scales.
inline torch::Tensor linear_panels(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                   int64_t n, const torch::Tensor& bias, bool bias_after) {
  auto y = torch::empty({x.size(0), n}, x.options());
  const auto b = bias_after ? torch::empty({0}, x.options()) : bias;
  if (panels.scalar_type() == torch::kChar) gemm_int8(x, panels, scale, b, y);
  else if (panels.scalar_type() == torch::kBFloat16) gemm_bf16(x, panels, b, y);
  else gemm_packed(x, panels, b, y);
  if (bias_after && bias.numel() != 0) y.add_(bias);
  return y;
}

// Input norm (first layer: residual = x; else residual += x, in place), attention, post-attention norm with the
// residual add, MLP. dims: heads, KV heads, head size, rotary dims, then the output features of qkv, o_proj,
// gate_up and down; scales: each int8 weight's per-channel scales (empty for the others); k_scale, v_scale: an fp8
// cache's. Returns (the MLP's output, the residual).
std::vector<torch::Tensor> llama_layer(
    torch::Tensor x, torch::Tensor residual, torch::Tensor positions, torch::Tensor ln1, torch::Tensor ln2,
    double eps, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> scales,
    std::vector<torch::Tensor> biases, std::vector<int64_t> dims, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && biases.size() == 4 && dims.size() == 8);
  const int64_t T = x.size(0), Hq = dims[0], Hkv = dims[1], D = dims[2];
  torch::Tensor h;
  if (residual.numel() == 0) {
    residual = x;
    h = torch::empty_like(x);
    rms_norm(x, ln1, eps, h);
  } else {
    fused_add_rms_norm(x, residual, ln1, eps);
    h = x;
  }
  auto qkv = linear_panels(h, weights[0], scales[0], dims[4], biases[0], false);
  auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rotary(positions, q, k, cos, sin, dims[3]);
  reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  auto attn = torch::empty({T, Hq, D}, x.options());
  paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, attn, 0, 0.0, k_scale, v_scale);
  auto o = linear_panels(attn.view({T, Hq * D}), weights[1], scales[1], dims[5], biases[1], true);
  fused_add_rms_norm(o, residual, ln2, eps);
  auto gate_up = linear_panels(o, weights[2], scales[2], dims[6], biases[2], false);
  auto act = torch::empty({T, dims[6] / 2}, x.options());
  silu_and_mul(gate_up, act);
  return {linear_panels(act, weights[3], scales[3], dims[7], biases[3], true), residual};
}

}  // namespace ps
