#pragma once
// A whole LLaMA-style decoder layer in one call, on the kernels of the other files.
#include "common.h"

namespace ps {

std::vector<torch::Tensor> llama_layer(
    torch::Tensor x, torch::Tensor residual, torch::Tensor positions, torch::Tensor ln1, torch::Tensor ln2,
    double eps, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> scales,
    std::vector<torch::Tensor> biases, std::vector<int64_t> dims, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale, double k_scale, double v_scale);

}  // namespace ps
