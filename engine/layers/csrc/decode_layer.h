// The fused decoder layers, holding their weights once per model
// (torch.classes.hotswap.DecodeLayers); apart from ops.h, as torch/custom_class.h is slow to
// compile.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops.h"

namespace hotswap {

// One decoder layer's weights as linear() multiplies them on the stack's path (the packed copy
// where there is one, except on PATH_SMALL; on PATH_INT8 the int8 weights, each with the rest of
// its int8 copy: the scales, then the blocked layout and its compensation where there are).
struct LayerWeights {
  at::Tensor input_norm, qkv;
  std::optional<at::Tensor> qkv_bias;
  at::Tensor o, post_norm, gate_up, down;
  std::vector<at::Tensor> qkv_quant, o_quant, gate_up_quant, down_quant;
};

// A model's decoder layers for the fused decode step, built once per set of weights (and path)
// by models/llama.py, so that a step passes only what changes from step to step (forward).
struct DecodeLayers : torch::CustomClassHolder {
  DecodeLayers(double eps, int64_t path, int64_t num_heads);
  void add_layer(at::Tensor input_norm, at::Tensor qkv, std::optional<at::Tensor> qkv_bias,
                 at::Tensor o, at::Tensor post_norm, at::Tensor gate_up, at::Tensor down,
                 std::vector<at::Tensor> qkv_quant, std::vector<at::Tensor> o_quant,
                 std::vector<at::Tensor> gate_up_quant, std::vector<at::Tensor> down_quant);
  int64_t size() const { return int64_t(layers.size()); }
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs,
                     at::Tensor cos, at::Tensor sin, at::Tensor loc, at::Tensor req_to_token,
                     at::Tensor req_idx, at::Tensor seq_lens, double scale);

  std::vector<LayerWeights> layers;
  double eps;
  int64_t path, num_heads;
  // Every layer on PATH_SMALL, of one shape, its tensors dense bf16: the step may run with the
  // threads kept together (decode_layer.cpp's forward_small).
  bool small_uniform = false;
};

}  // namespace hotswap
