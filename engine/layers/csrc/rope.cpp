// Rotary position embedding, in place (half-rotation layout).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {

// x [T, H, D] (any token stride; heads and dim dense) rotated in place, half-rotation layout:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with cos/sin [T, D/2] float32.
at::Tensor rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [tokens, heads, dim] with heads and dim dense");
  const int64_t t = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == t &&
                  cos.size(1) == half && sin.sizes() == cos.sizes(),
              "cos, sin must be contiguous float32 [tokens, dim / 2]");
  dispatch(x.scalar_type(), "rotary_", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* xp = x.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float* c = cp + i * half;
        const float* s = sp + i * half;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* a = xp + i * stride + h * 2 * half;
          scalar_t* b = a + half;
#pragma omp simd
          for (int64_t j = 0; j < half; ++j) {
            const float x1 = widen(a[j]), x2 = widen(b[j]);
            a[j] = narrow<scalar_t>(x1 * c[j] - x2 * s[j]);
            b[j] = narrow<scalar_t>(x2 * c[j] + x1 * s[j]);
          }
        }
      }
    });
  });
  return x;
}

}  // namespace hotswap
