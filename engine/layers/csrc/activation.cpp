// SiLU-and-multiply of the MLP's fused gate | up projection.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {

// The vector loops compute as the scalar one, bit for bit (fast_exp's steps, a division), where
// the compiler vectorised the scalar loop poorly: 64 rows of SmolLM2's MLP on the Xeon, 2
// threads, bf16 43-49 -> 36-37 us (AVX2 switch: 49-58 -> 41-45), AVX2 float32 40-42 -> 31-32.
template <typename T, typename Out>
void silu_and_mul_row(const T* g, const T* u, Out* o, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 a = load16(g + j);
    const __m512 silu = _mm512_div_ps(a, _mm512_add_ps(one, fast_exp16(_mm512_sub_ps(
                                                               _mm512_setzero_ps(), a))));
    store16(o + j, _mm512_mul_ps(silu, load16(u + j)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; j + 8 <= n; j += 8) {
    const __m256 a = load8(g + j);
    const __m256 silu = _mm256_div_ps(a, _mm256_add_ps(one, fast_exp8(_mm256_sub_ps(
                                                               _mm256_setzero_ps(), a))));
    store8(o + j, _mm256_mul_ps(silu, load8(u + j)));
  }
#endif
#pragma omp simd
  for (int64_t i = j; i < n; ++i) {
    const float a = widen(g[i]);
    o[i] = narrow<Out>(a / (1.f + fast_exp(-a)) * widen(u[i]));
  }
}
template void silu_and_mul_row(const float*, const float*, float*, int64_t);
template void silu_and_mul_row(const at::BFloat16*, const at::BFloat16*, at::BFloat16*, int64_t);
template void silu_and_mul_row(const float*, const float*, at::BFloat16*, int64_t);

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
