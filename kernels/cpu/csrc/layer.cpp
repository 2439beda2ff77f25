// One LLaMA-style decoder layer in one call (cpu_layer.py says why): the kernels of the other files in the
// module path's order, on the same buffers.

#include "layer.h"

#include <array>

#include "attention.h"
#include "fused.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"

namespace ps {

// The calling thread's buffer for intermediate `slot` of a layer, as [rows, cols] of x's dtype: kept and grown, never
// shrunk, so a step's layers reuse the pages of the first. A fresh multi-MB tensor each time is mmap'd by glibc and
// unmapped on free, and every layer then paid the kernel's page faults and zeroing again.
inline torch::Tensor workspace(int slot, int64_t rows, int64_t cols, const torch::Tensor& like) {
  thread_local std::array<torch::Tensor, 6> buffers;
  torch::Tensor& b = buffers[slot];
  const int64_t n = rows * cols;
  if (!b.defined() || b.numel() < n || b.scalar_type() != like.scalar_type())
    b = torch::empty({std::max<int64_t>(n, b.defined() ? b.numel() : 0)}, like.options());
  return b.narrow(0, 0, n).view({rows, cols});
}

// y = x @ W.T (+ bias inside the GEMM, as a column-parallel layer adds it; or after it, as a row-parallel one), into
// y. int8 panels come with their per-channel scales.
inline torch::Tensor linear_panels(const torch::Tensor& x, const torch::Tensor& panels, const torch::Tensor& scale,
                                   const torch::Tensor& bias, bool bias_after, torch::Tensor y) {
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
    h = workspace(0, T, x.size(1), x);
    rms_norm(x, ln1, eps, h);
  } else {
    fused_add_rms_norm(x, residual, ln1, eps);
    h = x;
  }
  auto qkv = linear_panels(h, weights[0], scales[0], biases[0], false, workspace(1, T, dims[4], x));
  auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rotary(positions, q, k, cos, sin, dims[3]);
  reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale);
  auto attn = workspace(2, T, Hq * D, x).view({T, Hq, D});
  paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, attn, 0, 0.0, k_scale, v_scale);
  auto o = linear_panels(attn.view({T, Hq * D}), weights[1], scales[1], biases[1], true, workspace(3, T, dims[5], x));
  fused_add_rms_norm(o, residual, ln2, eps);
  auto gate_up = linear_panels(o, weights[2], scales[2], biases[2], false, workspace(4, T, dims[6], x));
  auto act = workspace(5, T, dims[6] / 2, x);
  silu_and_mul(gate_up, act);
  // The output is the next layer's input (and may become its residual): a tensor of its own.
  return {linear_panels(act, weights[3], scales[3], biases[3], true, torch::empty({T, dims[7]}, x.options())),
          residual};
}

}  // namespace ps
