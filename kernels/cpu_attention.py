"""A C++ paged decode-attention kernel for CPUs, built on first use with torch's extension loader.

Decode rows (one query token per sequence) dominate serving; the torch reference has to gather each
sequence's blocks into a contiguous copy before attending, tripling memory traffic. This kernel reads
K and V rows in place through the block table: one task per (sequence, KV head) on torch's intra-op
thread pool, all query heads of a GQA group scored against each K row while it is in cache.
"""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

void paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                            torch::Tensor out) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(query.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt);
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t tok_stride = Hkv * D, blk_stride = bs * Hkv * D;
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.contiguous().data_ptr<int32_t>();
  const int32_t* sl = seq_lens.contiguous().data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // One task per sequence, walking whole token rows (all heads, contiguous) so reads stream.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = sl[b];
      const int32_t* table = bt + b * max_blocks;
      const float* qb = q + b * Hq * D;
      scores.resize(Hq * L);  // [Hq, L]
      for (int64_t t = 0; t < L; ++t) {
        const float* row = kc + table[t / bs] * blk_stride + (t % bs) * tok_stride;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* kp = row + (hq / G) * D;
          const float* qh = qb + hq * D;
          float s = 0.f;
          #pragma omp simd reduction(+:s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kp[d];
          scores[hq * L + t] = s * fscale;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sh = scores.data() + hq * L;
        const float m = *std::max_element(sh, sh + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sh[t] = std::exp(sh[t] - m); sum += sh[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const float* row = vc + table[t / bs] * blk_stride + (t % bs) * tok_stride;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float p = scores[hq * L + t];
          const float* vp = row + (hq / G) * D;
          float* ah = acc.data() + hq * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) ah[d] += p * vp[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o + b * Hq * D);
    }
  });
}
"""

_module = None
_failed = False


def load():
    """The compiled extension, or None where no compiler is available (callers fall back to torch)."""
    global _module, _failed
    if _module is None and not _failed:
        try:
            from torch.utils.cpp_extension import load_inline

            _module = load_inline(
                name="pagedserve_cpu_attention", cpp_sources=[_SOURCE], functions=["paged_decode_attention"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=bool(os.environ.get("PAGEDSERVE_VERBOSE_BUILD")))
        except Exception as e:  # a missing compiler or ninja: the torch path still works
            _failed = True
            logger.warning("CPU attention kernel unavailable (%s); using the torch reference", e)
    return _module


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    load().paged_decode_attention(query.contiguous(), k_cache, v_cache, block_tables.to(torch.int32),
                                  seq_lens.to(torch.int32), scale, out)
    return out
