// RMSNorm, with the residual add of the matmul before it folded in.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {

template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t h, double eps) {
  const float r = inv_rms(x, h, eps);
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) out[j] = narrow<T>(widen(x[j]) * r * widen(weight[j]));
}
template void rms_norm_row(const float*, const float*, float*, int64_t, double);
template void rms_norm_row(const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t,
                           double);

// RMSNorm of each row of x [T, H] times weight [H] (same dtype): float32 arithmetic, one
// rounding at the end, as F.rms_norm computes it in ~30 ops. With a residual [T, H] (x dense),
// x += residual first, in place and rounded to x's dtype as x.add_(residual) rounds it, and the
// norm is of that sum: the residual add after a matmul costs no pass of its own (oneDNN's add
// post-op costs more than the pass it saves, docs/performance.md).
at::Tensor rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps,
                         const at::Tensor* residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "x [tokens, hidden] and weight [hidden] of one dtype expected");
  TORCH_CHECK(!residual || (x.is_contiguous() && residual->sizes() == x.sizes() &&
                            residual->scalar_type() == x.scalar_type()),
              "a residual must match x, and x be dense");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto rc = residual ? residual->contiguous() : at::Tensor();
  const int64_t t = x.size(0), h = x.size(1);
  auto out = at::empty({t, h}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    const scalar_t* rp = residual ? rc.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, std::max<int64_t>(1, 32768 / h), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* row = xp + i * h;
        if (rp) {
          const scalar_t* r = rp + i * h;
#pragma omp simd
          for (int64_t j = 0; j < h; ++j) row[j] = narrow<scalar_t>(widen(row[j]) + widen(r[j]));
        }
        rms_norm_row(row, wp, op + i * h, h, eps);
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, weight, eps, nullptr);
}

}  // namespace hotswap
