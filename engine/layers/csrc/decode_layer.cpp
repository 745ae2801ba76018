// A whole Llama decoder layer for decode-only steps, and the stack of them a model runs.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "decode_layer.h"
#include "ops.h"

namespace hotswap {
namespace {

// f() inside a profiler scope called `name`: torch.profiler sees the parts of decode_layer,
// whose kernels are called directly rather than through the dispatcher.
template <typename F>
auto scoped(const char* name, F f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

}  // namespace

// The blocked kernel (w in the blocked layout, any rows; the residual joins its float32 sums), the
// small-batch kernel (w plain bf16, a few rows; the residual joins its float32 sums), the
// int8 matmul (w int8 with the rest of its copy in `quant`; the residual joins its rescaling),
// else AMX's (w in amx_pack's layout), oneDNN's matmul (w packed or plain) or at::linear, then
// the add.
at::Tensor path_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const at::Tensor* residual, int64_t path, at::TensorList quant) {
  if (path == PATH_INT8)
    return scoped("hotswap::int8_linear", [&] {
      auto opt = [&](size_t i) {
        return quant.size() > i ? std::optional<at::Tensor>(quant[i]) : std::nullopt;
      };
      return int8_linear(x, w, quant[0], b,
                         residual ? std::optional<at::Tensor>(*residual) : std::nullopt,
                         hadamard_block(x.size(1)), opt(1), opt(2));
    });
  if (path == PATH_BLOCKED)
    return scoped("hotswap::blocked_linear", [&] {
      return blocked_linear(x, w, b,
                            residual ? std::optional<at::Tensor>(*residual) : std::nullopt,
                            false);
    });
  if (path == PATH_SMALL)
    return scoped("hotswap::small_linear", [&] {
      return small_linear(x, w, b,
                          residual ? std::optional<at::Tensor>(*residual) : std::nullopt);
    });
  at::Tensor out;
  if (path == PATH_AMX) {
    out = scoped("hotswap::amx_linear", [&] { return amx_linear(x, w, b, false); });
  } else if (path == PATH_ONEDNN) {
    static auto plain = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          c10::string_view, c10::List<std::optional<at::Scalar>>,
                          std::optional<c10::string_view>)>();
    out = plain.call(x.contiguous(), w, b, "none", c10::List<std::optional<at::Scalar>>(),
                     c10::string_view(""));
  } else {
    out = at::linear(x, w, b);
  }
  return residual ? out.add_(*residual) : out;
}

namespace {

// What every layer of one step reads besides its weights and its KV buffers.
struct Step {
  const at::Tensor &cos, &sin, &loc, &req_to_token, &req_idx, &seq_lens;
  double scale;
};

// One Llama decoder layer for a decode-only batch (one new token per row), the same ops as
// models/llama.py runs one by one from Python: norm, qkv, rotary, KV store, attention, o_proj
// + residual, norm, gate_up, SiLU-and-multiply, down + residual. The layer's input is
// x + *pending where pending is given (the previous layer's residual, not yet added); it
// returns its output the same way, {out, pending}: each residual add off PATH_SMALL (whose
// kernel adds it to its sums) joins the RMSNorm that reads the sum.
std::pair<at::Tensor, at::Tensor> decode_layer(at::Tensor x, const at::Tensor* pending,
                                               const LayerWeights& w, const DecodeLayers& stack,
                                               const Step& step, const at::Tensor& k_buf,
                                               const at::Tensor& v_buf) {
  const int64_t hkv = k_buf.size(1), d = k_buf.size(2), heads = stack.num_heads;
  const int64_t q_size = heads * d, kv_size = hkv * d, path = stack.path;
  // Paths whose kernel adds the residual to its float32 sums (one rounding in bf16).
  const bool small = path == PATH_SMALL || path == PATH_INT8 || path == PATH_BLOCKED;
  // The parts other than the matmuls (aten ops, seen already) under their ops' names.
  auto norm = [&](const at::Tensor& t, const at::Tensor& weight, const at::Tensor* r) {
    return scoped("hotswap::rms_norm", [&] { return rms_norm_impl(t, weight, stack.eps, r); });
  };
  auto qkv = path_linear(norm(x, w.input_norm, pending), w.qkv, w.qkv_bias, nullptr, path,
                    w.qkv_quant);
  scoped("hotswap::rotary_", [&] {
    return rotary_(qkv.slice(1, 0, q_size + kv_size).view({-1, heads + hkv, d}), step.cos,
                   step.sin);
  });
  scoped("hotswap::store_kv", [&] { store_kv(qkv, q_size, k_buf, v_buf, step.loc); });
  auto o = scoped("hotswap::decode_attention", [&] {
    return decode_attention(qkv.slice(1, 0, q_size), k_buf, v_buf, step.req_to_token,
                            step.req_idx, step.seq_lens, step.scale);
  });
  auto h = path_linear(o, w.o, std::nullopt, small ? &x : nullptr, path, w.o_quant);
  const auto normed = norm(h, w.post_norm, small ? nullptr : &x);
  // On AMX the SiLU-and-multiply is the gate | up matmul's epilogue where each half is whole
  // blocks (as layers/linear.py's Linear.silu_and_mul).
  at::Tensor act;
  if (path == PATH_AMX && w.gate_up.size(0) % 2 == 0) {
    act = scoped("hotswap::amx_linear", [&] {
      return amx_linear(normed, w.gate_up, std::nullopt, true);
    });
  } else {
    const auto gate_up = path_linear(normed, w.gate_up, std::nullopt, nullptr, path,
                                     w.gate_up_quant);
    act = scoped("hotswap::silu_and_mul", [&] { return silu_and_mul(gate_up); });
  }
  auto out = path_linear(act, w.down, std::nullopt, small ? &h : nullptr, path, w.down_quant);
  return {out, small ? at::Tensor() : h};
}

}  // namespace

DecodeLayers::DecodeLayers(double eps, int64_t path, int64_t num_heads)
    : eps(eps), path(path), num_heads(num_heads) {
  TORCH_CHECK(path >= PATH_ATEN && path <= PATH_AMX,
              "path must be linear.py's ATEN, ONEDNN, SMALL, INT8, BLOCKED or AMX, got ", path);
  TORCH_CHECK(num_heads > 0, "num_heads must be positive");
}

void DecodeLayers::add_layer(at::Tensor input_norm, at::Tensor qkv,
                             std::optional<at::Tensor> qkv_bias, at::Tensor o,
                             at::Tensor post_norm, at::Tensor gate_up, at::Tensor down,
                             std::vector<at::Tensor> qkv_quant,
                             std::vector<at::Tensor> o_quant,
                             std::vector<at::Tensor> gate_up_quant,
                             std::vector<at::Tensor> down_quant) {
  for (const auto* quant : {&qkv_quant, &o_quant, &gate_up_quant, &down_quant})
    TORCH_CHECK(path == PATH_INT8 ? (quant->size() == 1 || quant->size() == 3) : quant->empty(),
                "PATH_INT8 needs each weight's scales (and its blocked layout and compensation, "
                "if any); other paths none");
  layers.push_back({std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o),
                    std::move(post_norm), std::move(gate_up), std::move(down),
                    std::move(qkv_quant), std::move(o_quant), std::move(gate_up_quant),
                    std::move(down_quant)});
}

// Every decoder layer of a decode-only batch in one call: decode_layer for each layer in turn,
// each under a profiler scope of its own. A method rather than an op taking the class: torch.ops
// scans such an op's arguments in Python on every call, which costs more than it saves.
at::Tensor DecodeLayers::forward(at::Tensor x, std::vector<at::Tensor> k_bufs,
                                 std::vector<at::Tensor> v_bufs, at::Tensor cos, at::Tensor sin,
                                 at::Tensor loc, at::Tensor req_to_token, at::Tensor req_idx,
                                 at::Tensor seq_lens, double scale) {
  RECORD_FUNCTION("hotswap::decode_layers", std::vector<c10::IValue>());
  TORCH_CHECK(k_bufs.size() == layers.size() && v_bufs.size() == layers.size(),
              "a K and a V buffer per layer expected: ", layers.size(), " layers, ",
              k_bufs.size(), " K and ", v_bufs.size(), " V buffers");
  const Step step{cos, sin, loc, req_to_token, req_idx, seq_lens, scale};
  std::pair<at::Tensor, at::Tensor> h{x, at::Tensor()};
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor* pending = h.second.defined() ? &h.second : nullptr;
    h = scoped("hotswap::decode_layer", [&] {
      return decode_layer(h.first, pending, layers[i], *this, step, k_bufs[i], v_bufs[i]);
    });
  }
  return h.second.defined() ? h.first.add_(h.second) : h.first;
}

}  // namespace hotswap
