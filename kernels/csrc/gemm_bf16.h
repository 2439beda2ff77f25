#pragma once
// bf16 GEMM on AVX512-BF16, on weights packed into k-pair panels of 32 columns.
#include "common.h"

namespace ps {

// x [M, K] bf16 (rows may be strided), packed [P, K/2, 32, 2] bf16, bias [N] bf16 or empty, out [M, N] bf16 or
// fp32, contiguous. Raises where built without AVX512-BF16.
void gemm_bf16(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out);
// Whether this build has the AVX512-BF16 kernel.
bool gemm_bf16_built();

}  // namespace ps
