// The float32 final norm and lm_head of a bf16 model as AMX matmuls.

#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// The float32 final norm + lm_head of a bf16 model on AMX, from bf16 matmuls with float32
// accumulation (AMX runs them far faster than float32).
// With h the bf16 hidden state, g the bf16 norm weight and s = 1/sqrt(mean(h^2) + eps):
//   logits = (s * h * g) @ W.T = s * ((h * g) @ W.T)
// h * g is a product of two bf16 values, exact in float32 with at most 16 significant bits, so
// it splits exactly into hi + lo, two bf16 values; W is bf16 itself. In hi @ W.T + lo @ W.T
// every product is exact and every sum float32, as in a float32 matmul of the normed state by
// the float32 copy of W; only the scale s comes after the sums instead of before (the float32
// path rounds s * h * g first).
// W is packed once (head_pack) in amx_linear's layout, blocks of 32 vocabulary rows, and the
// matmul is amx_linear's loop (amx_head): each block of W comes from memory once a step, the
// next one asked for into L2 while this one is multiplied, and 16 rows' hi parts and their lo
// parts fill a pass's two A tiles, so s * (hi + lo) is taken from the tiles' sums.
constexpr int64_t HEAD_BLOCK = 32;  // vocabulary rows per packed block (amx_linear's)
constexpr int64_t HEAD_PASS = 16;   // rows per pass: their hi parts, then their lo parts
constexpr int64_t HEAD_SPAN = 256;  // rows whose split parts stay in L2 while W streams past

}  // namespace

// Whether this CPU and build run the head (and amx_linear) on AMX tiles.
bool head_amx() { return amx_built() && at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor head_pack(const at::Tensor& w, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(head_amx(), "head_pack needs AMX (cpublas::could_pack(bfloat16)) and amx_linear");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "weight [n, k] bfloat16 expected");
  const int64_t n = w.size(0), blocks = (n + HEAD_BLOCK - 1) / HEAD_BLOCK;
  if (n == blocks * HEAD_BLOCK) return amx_pack(w, out);
  auto padded = at::zeros({blocks * HEAD_BLOCK, w.size(1)}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return amx_pack(padded, out);
}

at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                       const at::Tensor& packed, int64_t vocab) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 &&
                  norm_weight.scalar_type() == at::kBFloat16 &&
                  norm_weight.numel() == hidden.size(1),
              "hidden [m, k] and norm_weight [k], both bfloat16, expected");
  const int64_t m = hidden.size(0), k = hidden.size(1), kp = (k + 31) / 32 * 32;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) == kp * HEAD_BLOCK &&
                  packed.size(0) == (vocab + HEAD_BLOCK - 1) / HEAD_BLOCK,
              "packed must be head_pack of a [vocab, k] weight");
  auto h = hidden.contiguous();
  auto g = norm_weight.contiguous();
  auto out = at::empty({m, vocab}, hidden.options().dtype(at::kFloat));
  const at::BFloat16* hp = h.data_ptr<at::BFloat16>();
  const at::BFloat16* gp = g.data_ptr<at::BFloat16>();
  const int64_t span_passes = (std::min(m, HEAD_SPAN) + HEAD_PASS - 1) / HEAD_PASS;
  std::vector<at::BFloat16> parts(span_passes * 2 * HEAD_PASS * kp);
  std::vector<float> scales(std::min(m, HEAD_SPAN));
  for (int64_t s0 = 0; s0 < m; s0 += HEAD_SPAN) {
    const int64_t rows = std::min(HEAD_SPAN, m - s0);
    std::fill(parts.begin(), parts.end(), at::BFloat16(0.0f));
    for (int64_t i = 0; i < rows; ++i) {
      at::BFloat16* hi = parts.data() + (i / HEAD_PASS * 2 * HEAD_PASS + i % HEAD_PASS) * kp;
      at::BFloat16* lo = hi + HEAD_PASS * kp;
      const at::BFloat16* row = hp + (s0 + i) * k;
      scales[i] = inv_rms(row, k, eps);
      for (int64_t j = 0; j < k; ++j) {
        const float p = widen(row[j]) * widen(gp[j]);  // exact: 8 x 8 significant bits
        const at::BFloat16 top = narrow<at::BFloat16>(p);
        hi[j] = top;
        lo[j] = narrow<at::BFloat16>(p - widen(top));  // exact: the other <= 8 bits
      }
    }
    amx_head(parts.data(), scales.data(), packed, out.data_ptr<float>() + s0 * vocab, rows,
             vocab);
  }
  return out;
}

}  // namespace hotswap
