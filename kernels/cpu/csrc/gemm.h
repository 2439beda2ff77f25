#pragma once
// fp32 GEMM on weights packed into 16-column panels.
#include "common.h"

namespace ps {

// x [M, K] (rows may be strided), packed [P, K, 16], bias [N] or empty, out [M, N] contiguous.
void gemm_packed(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out);

}  // namespace ps
