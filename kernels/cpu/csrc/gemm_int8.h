#pragma once
// Weight-only int8 GEMM on int8 weights packed into 32-column panels, per-output-channel fp32 scales.
#include "common.h"

namespace ps {

// x [M, K] fp32 or bf16 (rows may be strided), packed [P, K, 32] int8, scale [N] fp32, bias [N] of x's dtype or
// empty, out [M, N] of x's dtype or fp32, contiguous: out = (x @ q.T) * scale + bias. bf16 rows on AMX tiles where
// the CPU has them and use_amx.
void gemm_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor bias, torch::Tensor out,
               bool use_amx = true);
// Whether this build has the AVX512-BF16 path for many bf16 rows (else every shape takes the FMA path).
bool gemm_int8_dp_built();

}  // namespace ps
