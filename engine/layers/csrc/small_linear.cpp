// Small-batch matmul over plain bf16 weights: a few rows of x, the weights streamed once.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// out [m, n] = x [m, k] @ w [n, k].T (+ bias) (+ residual) for a few rows m, with w bfloat16 as
// it lies (row-major) and x float32 or bfloat16, out in x's dtype: float32 products (exact: a
// bf16 weight times a float32 or bf16 x) and float32 sums, a bf16 out rounded once. What a
// decode of a few rows multiplies: the float32 lm_head of a bf16 model (half the bytes of its
// float32 copy, the same products) and every projection of a bf16 model. Every output is one
// 16-lane float32 dot product; four weight rows share each load of x (with AVX-512, up to four
// rows of x share each widened weight). The weights stream from DRAM, so the loop asks for them
// ahead: the portable loop for each group of four weight rows the group SMALL_PREFETCH_ROWS rows
// ahead, the AVX-512 one for two cache lines SMALL_PREFETCH_BYTES ahead (into L2) with every
// 128 bytes it reads; the hardware prefetcher alone streams them far slower, and nearer, farther
// or into L1 did no better (docs/performance.md). The AVX-512 loop widens each weight once for
// all rows of x (the same bits as widening it per row, fewer instructions). With AVX512-BF16 a
// bf16 x takes small_group_bf16 instead (any k a multiple of 32), whose bf16 pairwise products
// need no widening; it beats oneDNN's packed bf16 matmul up to 6 rows, hence linear.py's
// SMALL_ROWS.
constexpr int64_t SMALL_PREFETCH_ROWS = 8;
constexpr int64_t SMALL_PREFETCH_BYTES = 16384;

#if defined(__AVX512F__)
constexpr bool HAS_AVX512 = true;
// One 4-row group of small_linear_rows for M rows of x at once (k a multiple of 16): each 16
// weights are widened once for all M rows, which the portable loop does again for every row.
template <int M>
void small_group_avx512(const float* x, const at::BFloat16* w0, float* out, int64_t k,
                        int64_t n) {
  __m512 acc[M][4];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
  // The four rows lie one after the other: 16 weights of each are 128 bytes of the stream.
  const char* ahead = reinterpret_cast<const char*>(w0) + SMALL_PREFETCH_BYTES;
  for (int64_t j = 0; j < k; j += 16, ahead += 128) {
    _mm_prefetch(ahead, _MM_HINT_T1);
    _mm_prefetch(ahead + 64, _MM_HINT_T1);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load16(w0 + r * k + j);
    for (int i = 0; i < M; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * k + j);
      for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_fmadd_ps(wv[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < 4; ++r) out[i * n + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#else
constexpr bool HAS_AVX512 = false;
#endif

#if defined(__AVX512BF16__)
// M rows of a bf16 x times R weight rows (R = 4 up to 4 rows of x, 2 up to 8: 16 sums in
// registers), 32 weights at a time: AVX512-BF16's pairwise products (exact in float32) summed
// in float32, the weights neither widened nor x, half the instructions of the float32 loop.
// The weight rows lie one after the other, R * 64 bytes of the stream a step; asked for as
// in small_group_avx512.
template <int M, int R>
void small_group_bf16(const at::BFloat16* x, const at::BFloat16* w0, float* out, int64_t k,
                      int64_t n) {
  __m512 acc[M][R];
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w0) + SMALL_PREFETCH_BYTES;
  for (int64_t j = 0; j < k; j += 32, ahead += 64 * R) {
    for (int r = 0; r < R; ++r) _mm_prefetch(ahead + 64 * r, _MM_HINT_T1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w0 + r * k + j);
    for (int i = 0; i < M; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * k + j);
      for (int r = 0; r < R; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[r], xv);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) out[i * n + r] = _mm512_reduce_add_ps(acc[i][r]);
}

template <int M>
void small_rows_bf16(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t k,
                     int64_t r0, int64_t r1, int64_t n) {
  constexpr int R = M <= 4 ? 4 : 2;
  for (; r0 + R <= r1; r0 += R) small_group_bf16<M, R>(x, w + r0 * k, out + r0, k, n);
  for (; r0 < r1; ++r0) small_group_bf16<M, 1>(x, w + r0 * k, out + r0, k, n);
}

// Weight rows [r0, r1) times the m rows of a bf16 x, 8 rows at a time (k a multiple of 32). A
// tile of SMALL_TILE_ROWS weight rows meets every row of x before the next tile is read, so
// past 8 rows of x (an MoE expert's rows) the weights still stream from memory once.
constexpr int64_t SMALL_TILE_ROWS = 8;

void small_linear_rows_bf16(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t m,
                            int64_t k, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t t0 = r0; t0 < r1; t0 += SMALL_TILE_ROWS) {
    const int64_t t1 = std::min(r1, t0 + SMALL_TILE_ROWS);
    for (int64_t i = 0; i < m; i += 8) {
      const at::BFloat16* xi = x + i * k;
      float* oi = out + i * n;
      dispatch_rows<8>(m - i, [&](auto rows) {
        small_rows_bf16<decltype(rows)::value>(xi, w, oi, k, t0, t1, n);
      });
    }
  }
}
#endif

void small_linear_rows(const float* x, const at::BFloat16* w, float* out, int64_t m, int64_t k,
                       int64_t n0, int64_t n1, int64_t n) {
  constexpr int64_t R = 4;
  int64_t r0 = n0;
  for (; r0 + R <= n1; r0 += R) {
    const at::BFloat16* w0 = w + r0 * k;
    const at::BFloat16* w1 = w0 + k;
    const at::BFloat16* w2 = w1 + k;
    const at::BFloat16* w3 = w2 + k;
    // Every row count takes the same loop (4 rows of x at a time past 4), so a row's sums do not
    // depend on how many rows share the call.
    const bool avx512_group = HAS_AVX512 && k % 16 == 0;
    if (!avx512_group && r0 + SMALL_PREFETCH_ROWS + R <= n1) {
      const char* ahead = reinterpret_cast<const char*>(w0 + SMALL_PREFETCH_ROWS * k);
      for (int64_t b = 0; b < R * k * int64_t(sizeof(at::BFloat16)); b += 64)
        __builtin_prefetch(ahead + b);
    }
#if defined(__AVX512F__)
    if (avx512_group) {
      for (int64_t i = 0; i < m; i += 4)
        dispatch_rows<4>(m - i, [&](auto rows) {
          small_group_avx512<decltype(rows)::value>(x + i * k, w0, out + i * n + r0, k, n);
        });
      continue;
    }
#endif
    for (int64_t i = 0; i < m; ++i) {
      const float* xv = x + i * k;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t j = 0; j < k; ++j) {
        const float v = xv[j];
        s0 += widen(w0[j]) * v;
        s1 += widen(w1[j]) * v;
        s2 += widen(w2[j]) * v;
        s3 += widen(w3[j]) * v;
      }
      float* o = out + i * n + r0;
      o[0] = s0, o[1] = s1, o[2] = s2, o[3] = s3;
    }
  }
  for (; r0 < n1; ++r0) {
    const at::BFloat16* w0 = w + r0 * k;
    for (int64_t i = 0; i < m; ++i) {
      const float* xv = x + i * k;
      float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
      for (int64_t j = 0; j < k; ++j) s0 += widen(w0[j]) * xv[j];
      out[i * n + r0] = s0;
    }
  }
}

}  // namespace

void small_linear_sums(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t m,
                       int64_t k, int64_t n) {
#if defined(__AVX512BF16__)
  if (k % 32 == 0) return small_linear_rows_bf16(x, w, out, m, k, 0, n, n);
#endif
  thread_local std::vector<float> xf;
  xf.resize(m * k);
  for (int64_t i = 0; i < m * k; ++i) xf[i] = widen(x[i]);
  small_linear_rows(xf.data(), w, out, m, k, 0, n, n);
}

bool small_x_widened(at::ScalarType dtype, int64_t k) {
#if defined(__AVX512BF16__)
  return !(dtype == at::kBFloat16 && k % 32 == 0);
#else
  return true;
#endif
}

template <typename T>
void small_linear_part(const T* x, const float* xf, const at::BFloat16* w, const T* bias,
                       const T* residual, T* out, float* acc, int64_t m, int64_t k, int64_t n,
                       int64_t n0, int64_t n1) {
  if (xf) {
    small_linear_rows(xf, w, acc, m, k, n0, n1, n);
  } else {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>)
      small_linear_rows_bf16(x, w, acc, m, k, n0, n1, n);
#endif
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* a = acc + i * n;
    const T* r = residual ? residual + i * n : nullptr;
    T* o = out + i * n;
    for (int64_t j = n0; j < n1; ++j)
      o[j] = narrow<T>(a[j] + (bias ? widen(bias[j]) : 0.f) + (r ? widen(r[j]) : 0.f));
  }
}
template void small_linear_part(const float*, const float*, const at::BFloat16*, const float*,
                                const float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                                int64_t);
template void small_linear_part(const at::BFloat16*, const float*, const at::BFloat16*,
                                const at::BFloat16*, const at::BFloat16*, at::BFloat16*, float*,
                                int64_t, int64_t, int64_t, int64_t, int64_t);

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x [m, k] and weight [n, k] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.layout() == at::kStrided &&
                  weight.is_contiguous(), "weight must be a dense, contiguous bfloat16 tensor");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(!bias || (bias->numel() == n && bias->scalar_type() == dtype),
              "bias must be [n] of x's dtype");
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == m &&
                            residual->size(1) == n && residual->scalar_type() == dtype),
              "residual must be [m, n] of x's dtype");
  auto out = at::empty({m, n}, x.options());
  dispatch(dtype, "small_linear", [&](auto zero) {
    using T = decltype(zero);
    auto xc = x.contiguous();
    const T* xp = xc.data_ptr<T>();
    std::vector<float> xf(small_x_widened(dtype, k) ? m * k : 0), acc(m * n);
    for (int64_t i = 0; i < int64_t(xf.size()); ++i) xf[i] = widen(xp[i]);
    at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    at::Tensor rc = residual ? residual->contiguous() : at::Tensor();
    const T* bp = bias ? bc.data_ptr<T>() : nullptr;
    const T* rp = residual ? rc.data_ptr<T>() : nullptr;
    at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
      small_linear_part(xp, xf.empty() ? nullptr : xf.data(), weight.data_ptr<at::BFloat16>(),
                        bp, rp, out.data_ptr<T>(), acc.data(), m, k, n, n0, n1);
    });
  });
  return out;
}

}  // namespace hotswap
