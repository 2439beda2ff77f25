"""A whole LLaMA-style decoder layer in one C++ call, for CPU fp32 or bf16 with panel-packed weights and one rank.

It runs the same kernels as the Python modules, in the same order, on the same buffers (so its results are
bitwise those of the module path), without the ~12 module calls, shape checks and allocations around them that
Python paid per layer: measured on the 2-core EPYC with ``bench-llama-58m``, the module path spent ~2 ms of a
12 ms decode step (7 sequences) outside its kernels, this path 0.3 ms (steps of 101 sequences: 94.7 -> 90.1 ms).
End to end, alternating with the module path (3 pairs each, same greedy tokens): sharegpt-like +3.4-4.8%,
alpaca-like +3.2-7.5%. The model uses it where every layer qualifies (``LlamaModel.cpu_layers``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_extension, cpu_ops

SOURCE = r"""
namespace ps {

// y = x @ W.T (+ bias inside the GEMM, as a column-parallel layer adds it; or after it, as a row-parallel one).
inline torch::Tensor linear_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t n,
                                   const torch::Tensor& bias, bool bias_after) {
  auto y = torch::empty({x.size(0), n}, x.options());
  const auto b = bias_after ? torch::empty({0}, x.options()) : bias;
  if (panels.scalar_type() == torch::kBFloat16) gemm_bf16(x, panels, b, y);
  else gemm_packed(x, panels, b, y);
  if (bias_after && bias.numel() != 0) y.add_(bias);
  return y;
}

// Input norm (first layer: residual = x; else residual += x, in place), attention, post-attention norm with the
// residual add, MLP. dims: heads, KV heads, head size, rotary dims, then the output features of qkv, o_proj,
// gate_up and down. Returns (the MLP's output, the residual).
std::vector<torch::Tensor> llama_layer(
    torch::Tensor x, torch::Tensor residual, torch::Tensor positions, torch::Tensor ln1, torch::Tensor ln2,
    double eps, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> biases, std::vector<int64_t> dims,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && dims.size() == 8);
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
  auto qkv = linear_panels(h, weights[0], dims[4], biases[0], false);
  auto q = qkv.narrow(1, 0, Hq * D).view({T, Hq, D});
  auto k = qkv.narrow(1, Hq * D, Hkv * D).view({T, Hkv, D});
  auto v = qkv.narrow(1, (Hq + Hkv) * D, Hkv * D).view({T, Hkv, D});
  rotary(positions, q, k, cos, sin, dims[3]);
  reshape_and_cache(k, v, k_cache, v_cache, slot_mapping);
  auto attn = torch::empty({T, Hq, D}, x.options());
  paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, attn);
  auto o = linear_panels(attn.view({T, Hq * D}), weights[1], dims[5], biases[1], true);
  fused_add_rms_norm(o, residual, ln2, eps);
  auto gate_up = linear_panels(o, weights[2], dims[6], biases[2], false);
  auto act = torch::empty({T, dims[6] / 2}, x.options());
  silu_and_mul(gate_up, act);
  return {linear_panels(act, weights[3], dims[7], biases[3], true), residual};
}

}  // namespace ps
"""

FUNCTIONS = {"llama_layer": "ps::llama_layer"}
_NONE = torch.empty(0)


def supported(md, k_cache: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether this step can take the one-call layers: the C++ attention backend, fp32 or bf16 activations and
    cache of one dtype."""
    return md.backend is cpu_ops and x.dtype in (torch.float32, torch.bfloat16) and k_cache.dtype == x.dtype \
        and x.device.type == "cpu"


@dataclass(frozen=True)
class LayerWeights:
    """What :func:`llama_layer` reads of one decoder layer, gathered once (the KV cache is bound later)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    weights: list[torch.Tensor]  # panels of qkv, o_proj, gate_up, down (cpu_gemm's fp32 or cpu_gemm_bf16's bf16)
    biases: list[torch.Tensor]  # each empty where the layer has none
    dims: list[int]  # heads, KV heads, head size, rotary dims, out features of qkv, o_proj, gate_up, down
    cos: torch.Tensor
    sin: torch.Tensor
    scale: float


def llama_layer(lw: LayerWeights, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, md) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` int64 contiguous; ``md`` the step's attention metadata (int32 tables, int64 slots)."""
    out, residual = cpu_extension.load().llama_layer(
        x, _NONE if residual is None else residual, positions, lw.ln1, lw.ln2, lw.eps, lw.weights, lw.biases,
        lw.dims, lw.cos, lw.sin, k_cache, v_cache, md.slot_mapping, md.block_tables, md.query_start_loc,
        md.seq_lens, lw.scale)
    return out, residual
