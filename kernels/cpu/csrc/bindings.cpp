// The extension's Python functions: every kernel the Python modules of pagedserve.kernels call.
//
// Each runs without the GIL (its arguments are converted before and its result after): a prefill layer of a 1B
// model runs for most of a second, and a served engine's event loop and Ray's threads share its process. Held,
// they got the GIL only between kernel calls, and a step's outputs reached the gateway a step late. Kernels called
// from several threads at once stay correct: the pool runs one region at a time and the others on their caller.
#include <torch/python.h>

#include "attention.h"
#include "fused.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "gemm_int8.h"
#include "layer.h"
#include "moe.h"
#include "sampling.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_attention", &ps::paged_attention, nogil);
  m.def("rms_norm", &ps::rms_norm, nogil);
  m.def("fused_add_rms_norm", &ps::fused_add_rms_norm, nogil);
  m.def("silu_and_mul", &ps::silu_and_mul, nogil);
  m.def("rotary", &ps::rotary, nogil);
  m.def("reshape_and_cache", &ps::reshape_and_cache, nogil);
  m.def("apply_token_bitmask", &ps::apply_token_bitmask, nogil);
  m.def("argmax_rows", &ps::argmax_rows, nogil);
  m.def("gather_rows", &ps::gather_rows, nogil);
  m.def("stream_read", &ps::stream_read, nogil);
  m.def("sample_rows", &ps::sample_rows, nogil);
  m.def("gemm_packed", &ps::gemm_packed, nogil);
  m.def("gemm_bf16", &ps::gemm_bf16, nogil, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"),
        pybind11::arg("out"), pybind11::arg("use_amx") = true);
  m.def("gemm_bf16_built", &ps::gemm_bf16_built, nogil);
  m.def("gemm_bf16_amx", &ps::gemm_bf16_amx, nogil);
  m.def("llama_layer", &ps::llama_layer, nogil);
  m.def("gemm_int8", &ps::gemm_int8, nogil, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale"),
        pybind11::arg("bias"), pybind11::arg("out"), pybind11::arg("use_amx") = true);
  m.def("gemm_int8_dp_built", &ps::gemm_int8_dp_built, nogil);
  m.def("moe_fp32", &ps::moe_fp32, nogil);
  m.def("select_experts", &ps::select_experts, nogil);
  m.def("moe_bf16", &ps::moe_bf16, nogil, pybind11::arg("x"), pybind11::arg("topk_ids"), pybind11::arg("topk_weights"),
        pybind11::arg("expert_start"), pybind11::arg("w13"), pybind11::arg("w2"), pybind11::arg("out"),
        pybind11::arg("use_amx"), pybind11::arg("w13_scale"), pybind11::arg("w2_scale"));
  m.def("moe_bf16_built", &ps::moe_bf16_built, nogil);
}
