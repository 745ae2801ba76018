// Registers the kernels as torch.ops.hotswap.* and the fused decoder layers as
// torch.classes.hotswap.DecodeLayers; layers/cpu_kernels.py wraps both.

#include <torch/custom_class.h>
#include <torch/library.h>

#include "decode_layer.h"
#include "ops.h"

TORCH_LIBRARY(hotswap, m) {
  m.class_<hotswap::DecodeLayers>("DecodeLayers")
      .def(torch::init<double, int64_t, int64_t>())
      .def("add_layer", &hotswap::DecodeLayers::add_layer)
      .def("__len__", &hotswap::DecodeLayers::size)
      .def("forward", &hotswap::DecodeLayers::forward);
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
        "Tensor req_idx, Tensor seq_lens, float scale) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor? u) -> (Tensor, Tensor)");
  m.def("quantize_rows(Tensor x, int block) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? bias, Tensor? residual, "
        "int block, Tensor? blocked=None, Tensor? comp=None) -> Tensor");
  m.def("quantize_weight_(Tensor w, int block, Tensor(a!) q, Tensor(b!) scale, "
        "Tensor(c!)? blocked, Tensor(d!)? comp) -> ()");
  m.def("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor[] packed13, Tensor[] packed2, "
        "Tensor topk_ids, Tensor topk_weights, int small_rows, int dense_path, Tensor? blocked13, "
        "Tensor? blocked2, Tensor[] quant) -> Tensor");
  m.def("blocked_linear(Tensor x, Tensor blocked, Tensor? bias=None, Tensor? residual=None, "
        "bool float_out=False, int outputs=-1) -> Tensor");
  m.def("head_amx() -> bool");
  m.def("amx_built() -> bool");
  m.def("amx_pack(Tensor weight, Tensor? out=None) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias=None, bool gated=False) -> Tensor");
  m.def("head_pack(Tensor weight, Tensor? out=None) -> Tensor");
  m.def("head_logits(Tensor hidden, Tensor norm_weight, float eps, Tensor packed, int vocab) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("decode_attention", &hotswap::decode_attention);
  m.impl("rotary_", &hotswap::rotary_);
  m.impl("rms_norm", &hotswap::rms_norm);
  m.impl("silu_and_mul", &hotswap::silu_and_mul);
  m.impl("small_linear", &hotswap::small_linear);
  m.impl("sample_rows", &hotswap::sample_rows);
  m.impl("quantize_rows", &hotswap::quantize_rows);
  m.impl("int8_linear", &hotswap::int8_linear);
  m.impl("quantize_weight_", &hotswap::quantize_weight_);
  m.impl("moe_experts", &hotswap::moe_experts);
  m.impl("blocked_linear", &hotswap::blocked_linear);
  m.impl("head_pack", &hotswap::head_pack);
  m.impl("head_logits", &hotswap::head_logits);
  m.impl("amx_pack", &hotswap::amx_pack);
  m.impl("amx_linear", &hotswap::amx_linear);
}

// The experts' packed weights are oneDNN tensors: their key picks the kernel as well.
TORCH_LIBRARY_IMPL(hotswap, MkldnnCPU, m) {
  m.impl("moe_experts", &hotswap::moe_experts);
}

TORCH_LIBRARY_IMPL(hotswap, CompositeExplicitAutograd, m) {
  m.impl("head_amx", &hotswap::head_amx);
  m.impl("amx_built", &hotswap::amx_built);
}
