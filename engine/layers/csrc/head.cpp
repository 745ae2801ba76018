// The float32 final norm and lm_head of a bf16 model as AMX matmuls.

#include <ATen/Parallel.h>
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
// accumulation (oneDNN's brgemm through ATen's cpublas; AMX runs them far faster than float32).
// With h the bf16 hidden state, g the bf16 norm weight and s = 1/sqrt(mean(h^2) + eps):
//   logits = (s * h * g) @ W.T = s * ((h * g) @ W.T)
// h * g is a product of two bf16 values, exact in float32 with at most 16 significant bits, so
// it splits exactly into hi + lo, two bf16 values; W is bf16 itself. In hi @ W.T + lo @ W.T
// every product is exact and every sum float32, as in a float32 matmul of the normed state by
// the float32 copy of W; only the scale s comes after the sums instead of before (the float32
// path rounds s * h * g first).
// W is packed once (head_pack) into VNNI blocks of HEAD_BLOCK vocabulary rows. A chunk's hi and
// lo rows are stacked into one brgemm (M = 2 x rows), so each block of W is loaded into tiles
// once for both, and the next block is prefetched while this one is multiplied, since in a decode
// step W comes from DRAM (docs/performance.md).
constexpr int64_t HEAD_BLOCK = 64;  // vocabulary rows per packed block (one brgemm N)
constexpr int64_t HEAD_ROWS = 64;   // hidden rows per chunk (one brgemm's M is twice this)
constexpr int64_t HEAD_SPAN = 256;  // rows whose split parts stay in L2 while W streams past

// One span of rows: parts holds, chunk by chunk of HEAD_ROWS rows, the chunk's hi rows then its
// lo rows ([2, m, k]); scales [rows]; out rows [rows, n].
void head_span(const at::BFloat16* parts, const float* scales, const at::BFloat16* packed,
               float* out, int64_t rows, int64_t k, int64_t n) {
  const int64_t blocks = (n + HEAD_BLOCK - 1) / HEAD_BLOCK, block_bytes = k * HEAD_BLOCK * 2;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    float tile[2 * HEAD_ROWS * HEAD_BLOCK];
    for (int64_t b = b0; b < b1; ++b) {
      const at::BFloat16* B = packed + b * k * HEAD_BLOCK;
      if (b + 1 < b1)
        for (int64_t off = 0; off < block_bytes; off += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(B + k * HEAD_BLOCK) + off);
      const int64_t c0 = b * HEAD_BLOCK, width = std::min(HEAD_BLOCK, n - c0);
      for (int64_t r0 = 0; r0 < rows; r0 += HEAD_ROWS) {
        const int64_t m = std::min(HEAD_ROWS, rows - r0);
        at::native::cpublas::brgemm(2 * m, HEAD_BLOCK, k, k, HEAD_BLOCK, HEAD_BLOCK, false,
                                    parts + 2 * r0 * k, B, tile, true);
        for (int64_t i = 0; i < m; ++i) {
          const float s = scales[r0 + i];
          const float* hi = tile + i * HEAD_BLOCK;
          const float* lo = tile + (m + i) * HEAD_BLOCK;
          float* o = out + (r0 + i) * n + c0;
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) o[j] = s * (hi[j] + lo[j]);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace

bool head_amx() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor head_pack(const at::Tensor& w) {
  TORCH_CHECK(head_amx(), "head_pack needs AMX (cpublas::could_pack(bfloat16))");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
              "weight [n, k] bfloat16 with an even k expected");
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + HEAD_BLOCK - 1) / HEAD_BLOCK;
  auto padded = at::zeros({blocks * HEAD_BLOCK, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  // [blocks, k, HEAD_BLOCK]: each block as the k x N operand B, then VNNI-interleaved.
  auto b = padded.view({blocks, HEAD_BLOCK, k}).transpose(1, 2).contiguous();
  auto out = at::empty({blocks, k * HEAD_BLOCK}, w.options());
  const at::BFloat16* src = b.data_ptr<at::BFloat16>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i)
      at::native::cpublas::pack(k, HEAD_BLOCK, HEAD_BLOCK, HEAD_BLOCK, at::kBFloat16,
                                at::kBFloat16, src + i * k * HEAD_BLOCK, dst + i * k * HEAD_BLOCK);
  });
  return out;
}

at::Tensor head_logits(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                       const at::Tensor& packed, int64_t vocab) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 &&
                  norm_weight.scalar_type() == at::kBFloat16 &&
                  norm_weight.numel() == hidden.size(1),
              "hidden [m, k] and norm_weight [k], both bfloat16, expected");
  const int64_t m = hidden.size(0), k = hidden.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 &&
                  packed.size(1) == k * HEAD_BLOCK &&
                  packed.size(0) == (vocab + HEAD_BLOCK - 1) / HEAD_BLOCK,
              "packed must be head_pack of a [vocab, k] weight");
  auto h = hidden.contiguous();
  auto g = norm_weight.contiguous();
  auto out = at::empty({m, vocab}, hidden.options().dtype(at::kFloat));
  const at::BFloat16* hp = h.data_ptr<at::BFloat16>();
  const at::BFloat16* gp = g.data_ptr<at::BFloat16>();
  std::vector<at::BFloat16> parts(2 * std::min(m, HEAD_SPAN) * k);
  std::vector<float> scales(std::min(m, HEAD_SPAN));
  for (int64_t s0 = 0; s0 < m; s0 += HEAD_SPAN) {
    const int64_t rows = std::min(HEAD_SPAN, m - s0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r0 = i / HEAD_ROWS * HEAD_ROWS, chunk = std::min(HEAD_ROWS, rows - r0);
      at::BFloat16* hi = parts.data() + (2 * r0 + i - r0) * k;
      at::BFloat16* lo = hi + chunk * k;
      const at::BFloat16* row = hp + (s0 + i) * k;
      scales[i] = inv_rms(row, k, eps);
      for (int64_t j = 0; j < k; ++j) {
        const float p = widen(row[j]) * widen(gp[j]);  // exact: 8 x 8 significant bits
        const at::BFloat16 top = narrow<at::BFloat16>(p);
        hi[j] = top;
        lo[j] = narrow<at::BFloat16>(p - widen(top));  // exact: the other <= 8 bits
      }
    }
    head_span(parts.data(), scales.data(), packed.data_ptr<at::BFloat16>(),
              out.data_ptr<float>() + s0 * vocab, rows, k, vocab);
  }
  return out;
}

}  // namespace hotswap
