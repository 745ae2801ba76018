// The kernels, registered as torch.ops.hotswap.* (bindings.cpp); the fused decoder layer
// (decode_layer.cpp) calls them directly, with no dispatcher between a layer's parts. Every op
// has a torch-ops twin in layers/ that the tests compare it with, and each output row depends
// only on its own inputs, never on how many rows share the call.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace hotswap {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& req_to_token, const at::Tensor& req_idx,
                            const at::Tensor& seq_lens, double scale);
void store_kv(const at::Tensor& qkv, int64_t q_size, const at::Tensor& k_buf,
              const at::Tensor& v_buf, const at::Tensor& loc);
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const at::Tensor* residual);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// One row of rms_norm: out [h] = RMSNorm(x [h]) * weight, on the calling thread.
template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t h, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
// One row of silu_and_mul: o[j] = silu(g[j]) * u[j] for j < n (T, Out: float or at::BFloat16,
// float -> at::BFloat16 for amx_linear's gated sums).
template <typename T, typename Out>
void silu_and_mul_row(const T* g, const T* u, Out* o, int64_t n);
// small_linear's float32 sums of x [m, k] @ w [n, k].T for a bf16 x, on the calling thread,
// before the rounding to x's dtype (moe.cpp runs one expert per thread on it).
void small_linear_sums(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t m,
                       int64_t k, int64_t n);
// Outputs [n0, n1) of small_linear(x, w, bias, residual) for x [m, k] (T: float or bf16), out
// and residual [m, n], on the calling thread: the same sums and rounding whichever rows a
// thread takes. xf: x widened to float32, which small_x_widened(T, k) says the sums read
// instead of x; acc: [m, n] float32 scratch.
template <typename T>
void small_linear_part(const T* x, const float* xf, const at::BFloat16* w, const T* bias,
                       const T* residual, T* out, float* acc, int64_t m, int64_t k, int64_t n,
                       int64_t n0, int64_t n1);
bool small_x_widened(at::ScalarType dtype, int64_t k);
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual);
bool head_amx();
at::Tensor head_pack(const at::Tensor& w, const std::optional<at::Tensor>& out);
at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                       const at::Tensor& packed, int64_t vocab);
// bf16 matmuls on AMX tiles over a weight in amx_pack's layout (amx_linear.cpp); amx_built:
// whether the compiler could build them. gated: W is [gate | up], the result silu(gate) * up.
bool amx_built();
at::Tensor amx_pack(const at::Tensor& w, const std::optional<at::Tensor>& out = std::nullopt);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, bool gated);
// The float32 head's matmul on AMX tiles (head.cpp): out [m, width] = scales[i] * (hi_i + lo_i)
// @ W.T for packed = amx_pack(W) (W's rows padded to whole blocks, width of them real) and
// parts [ceil(m / 16) x 32, kp] bf16, 16 rows' hi parts then their lo parts, zero-padded.
void amx_head(const at::BFloat16* parts, const float* scales, const at::Tensor& packed, float* out,
              int64_t m, int64_t width);
// How a kernel multiplies: layers/linear.py's ATEN, ONEDNN, SMALL, INT8, BLOCKED and AMX.
constexpr int64_t PATH_ATEN = 0, PATH_ONEDNN = 1, PATH_SMALL = 2, PATH_INT8 = 3, PATH_BLOCKED = 4,
                  PATH_AMX = 5;
// x [m, k] @ w.T (+ b) (+ residual) exactly as layers/linear.py's linear() computes it on
// `path` (decode_layer.cpp).
at::Tensor path_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const at::Tensor* residual, int64_t path, at::TensorList quant = {});
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       at::TensorList packed13, at::TensorList packed2, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, int64_t small_rows, int64_t dense_path,
                       const std::optional<at::Tensor>& blocked13,
                       const std::optional<at::Tensor>& blocked2, at::TensorList quant);
// The float32 sums of x [m, k] @ w.T for a weight [n, k] in the blocked layout
// (blocked_linear.cpp), on the calling thread: each a sum over k in order, whatever m.
template <typename T>
void block_linear_sums(const T* x, const T* w, float* out, int64_t m, int64_t k, int64_t n);
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& blocked,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual, bool float_out,
                          int64_t outputs = -1);
// The Hadamard block of an int8 linear with k inputs (layers/quant.py's hadamard_block): the
// largest power of two dividing k, at most 512.
inline int64_t hadamard_block(int64_t k) { return std::min<int64_t>(k & -k, 512); }
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t block);
// A weight w [n, k] quantized as quantize_rows does, into its int8 copy q [n, k] and scale [n];
// with blocked / comp also into the int8 blocked layout and compensation vnni_sums reads.
void quantize_weight_(const at::Tensor& w, int64_t block, const at::Tensor& q,
                      const at::Tensor& scale, const std::optional<at::Tensor>& blocked,
                      const std::optional<at::Tensor>& comp);
// One row of quantize_rows: x [k] -> q [k] int8, its scale returned; `scratch` holds k floats.
template <typename T>
float quantize_row(const T* x, float* scratch, int8_t* q, int64_t k, int64_t block);
// One row of int8_linear's rescaling: out[j] = acc[j] * s * ws[j] (+ bias[j]) (+ res[j]), in T.
template <typename T>
void rescale_row(const int32_t* acc, float s, const float* ws, const float* bias, const T* res,
                 T* out, int64_t n);
// Whether this build has vnni_sums (AVX512-VNNI).
bool has_vnni_kernel();
// out [m, n] = the exact int32 sums of q [m, k] @ w.T (s8 x s8) for a weight [n, k] in the int8
// blocked layout [n / 32, k / 4, 32, 4] with comp[j] = 128 * sum_k w[j, k] (quantize_weight_,
// layers/quant.py): VNNI's u8 x s8 products of q + 128, less the compensation; k a multiple of 4.
void vnni_sums(const int8_t* q, const int8_t* w, const int32_t* comp, int32_t* out, int64_t m,
               int64_t k, int64_t n);
// Rows of x up to this many take vnni_sums where int8_linear is given the blocked layout: it
// streams the weight faster than oneDNN's int8 matmul (docs/performance.md).
constexpr int64_t VNNI_ROWS = 32;
// x [m, k] @ W.T (+ bias) (+ residual) from W's int8 copy [n, k] and its scales (layers/quant.py);
// blocked / comp: the same copy in the int8 blocked layout with its compensation, or none.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, int64_t block,
                       const std::optional<at::Tensor>& blocked = std::nullopt,
                       const std::optional<at::Tensor>& comp = std::nullopt);
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& x,
                                               const std::optional<at::Tensor>& u);

}  // namespace hotswap
