// The extension's Python functions: every kernel the Python modules of pagedserve.kernels call.
#include <torch/python.h>

#include "attention.h"
#include "fused.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"
#include "layer.h"
#include "sampling.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &ps::paged_attention);
  m.def("rms_norm", &ps::rms_norm);
  m.def("fused_add_rms_norm", &ps::fused_add_rms_norm);
  m.def("silu_and_mul", &ps::silu_and_mul);
  m.def("rotary", &ps::rotary);
  m.def("reshape_and_cache", &ps::reshape_and_cache);
  m.def("apply_token_bitmask", &ps::apply_token_bitmask);
  m.def("argmax_rows", &ps::argmax_rows);
  m.def("gather_rows", &ps::gather_rows);
  m.def("sample_rows", &ps::sample_rows);
  m.def("gemm_packed", &ps::gemm_packed);
  m.def("gemm_bf16", &ps::gemm_bf16, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"),
        pybind11::arg("out"), pybind11::arg("use_amx") = true);
  m.def("gemm_bf16_built", &ps::gemm_bf16_built);
  m.def("gemm_bf16_amx", &ps::gemm_bf16_amx);
  m.def("llama_layer", &ps::llama_layer);
  m.def("gemm_int8", &ps::gemm_int8, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale"),
        pybind11::arg("bias"), pybind11::arg("out"), pybind11::arg("use_amx") = true);
  m.def("gemm_int8_dp_built", &ps::gemm_int8_dp_built);
}
