// SiLU-and-multiply of the MLP's fused gate | up projection.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {

template <typename T>
void silu_and_mul_row(const T* g, const T* u, T* o, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = widen(g[j]);
    o[j] = narrow<T>(a / (1.f + fast_exp(-a)) * widen(u[j]));
  }
}
template void silu_and_mul_row<float>(const float*, const float*, float*, int64_t);
template void silu_and_mul_row<at::BFloat16>(const at::BFloat16*, const at::BFloat16*,
                                             at::BFloat16*, int64_t);

// x [T, 2I] (gate | up) -> silu(gate) * up [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x must be [tokens, 2 * intermediate], rows dense");
  const int64_t t = x.size(0), inter = x.size(1) / 2;
  auto out = at::empty({t, inter}, x.options());
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = xp + i * stride;
        silu_and_mul_row(g, g + inter, op + i * inter, inter);
      }
    });
  });
  return out;
}

}  // namespace hotswap
