// The blocked matmul: x [m, k] @ w.T for a weight in the blocked layout, each output a sum over
// k in order whatever m, whatever the row's place among the m and whatever the thread count.
// The experts' kernel (moe.cpp) and the batch-invariant linear of deterministic=True
// (layers/linear.py's BLOCKED path).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// The blocked layout of a weight [n, k] (layers/cpu_kernels.py's block_pack): [n / 32, k / G,
// 32, G] with G = 2 in bf16 and 1 in float32 (the inputs one 32-bit lane holds; quant.cpp's int8
// kernel takes G = 4): for each block of 32 outputs and each group of G inputs, the 32 outputs'
// weights side by side.
constexpr int64_t BLOCK = 32;

// Bytes ahead of its weight stream a tile asks for (into L2).
constexpr int64_t BLOCK_PREFETCH_BYTES = 8192;

#if defined(__AVX512F__)
// The 16 products of a lane group: AVX512-BF16's pairwise products of bf16 (exact in float32,
// summed in float32) or a float32 FMA.
#if defined(__AVX512BF16__)
inline __m512 lane_fma(__m512 acc, const at::BFloat16* w, int32_t x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w),
                          (__m512bh)_mm512_set1_epi32(x));
}
#endif
inline __m512 lane_fma(__m512 acc, const float* w, float x) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_set1_ps(x), acc);
}
#endif

// Whether this build has the vector tile for T (else the portable one runs).
template <typename T>
constexpr bool has_vector_tile() {
#if defined(__AVX512BF16__)
  return true;
#elif defined(__AVX512F__)
  return std::is_same_v<T, float>;
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool HAS_AVX2_TILE = true;
#else
constexpr bool HAS_AVX2_TILE = false;
#endif

// Rows of x per register tile: 12 rows x 2 vectors of the AVX-512 tile; of the AVX2 one 6 rows
// x 2 vectors in float32, 4 in bf16 (whose widened weights take 4 registers); 4 rows x 32
// floats of the portable one.
template <typename T>
constexpr int tile_rows() {
  if (has_vector_tile<T>()) return 12;
  if (HAS_AVX2_TILE) return std::is_same_v<T, float> ? 6 : 4;
  return 4;
}

#if defined(__AVX2__) && defined(__FMA__)
// The AVX2 tile (no AVX-512, or bf16 without AVX512-BF16): the block's 32 outputs as two halves
// of 16, each 2 vectors x M rows of accumulators, float32 FMAs over k in order (a bf16 pair's
// first product, then its second: the portable loop's arithmetic, so the same bits).
template <int M, typename T>
void block_tile_avx2(const T* x, const T* w, float* out, int64_t k, int64_t n) {
  constexpr int64_t G = 4 / sizeof(T);
  for (int64_t half = 0; half < 2; ++half) {
    __m256 acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    // the first half asks for the stream ahead (128 bytes a group), the second finds it cached
    const char* ahead = reinterpret_cast<const char*>(w) + BLOCK_PREFETCH_BYTES;
    for (int64_t p = 0; p < k / G; ++p, ahead += 128) {
      if (half == 0) {
        _mm_prefetch(ahead, _MM_HINT_T1);
        _mm_prefetch(ahead + 64, _MM_HINT_T1);
      }
      const T* wp = w + (p * BLOCK + half * 16) * G;
      if constexpr (std::is_same_v<T, float>) {
        const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
        for (int i = 0; i < M; ++i) {
          const __m256 xv = _mm256_set1_ps(x[i * k + p]);
          acc[i][0] = _mm256_fmadd_ps(w0, xv, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(w1, xv, acc[i][1]);
        }
      } else {
        // 8 outputs' pairs per load: the first of a pair in a lane's low 16 bits
        const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16));
        const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16));
        const __m256 b0 = _mm256_castsi256_ps(_mm256_and_si256(r0, high));
        const __m256 a1 = _mm256_castsi256_ps(_mm256_slli_epi32(r1, 16));
        const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(r1, high));
        for (int i = 0; i < M; ++i) {
          const __m256 x0 = _mm256_set1_ps(widen(x[i * k + 2 * p]));
          const __m256 x1 = _mm256_set1_ps(widen(x[i * k + 2 * p + 1]));
          acc[i][0] = _mm256_fmadd_ps(b0, x1, _mm256_fmadd_ps(a0, x0, acc[i][0]));
          acc[i][1] = _mm256_fmadd_ps(b1, x1, _mm256_fmadd_ps(a1, x0, acc[i][1]));
        }
      }
    }
    for (int i = 0; i < M; ++i) {
      _mm256_storeu_ps(out + i * n + half * 16, acc[i][0]);
      _mm256_storeu_ps(out + i * n + half * 16 + 8, acc[i][1]);
    }
  }
}
#endif

// M rows of x [m, k] times one block of 32 outputs in the blocked layout: for each group of
// inputs the block's weights are two 64-byte loads and each row's group one broadcast, so an
// output is a sum over k in order, with no horizontal sum and no widening; 2 * M accumulators
// stay in registers. The block is one contiguous stream of k * 32 weights.
template <int M, typename T>
void block_tile(const T* x, const T* w, float* out, int64_t k, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (has_vector_tile<T>()) {
    using Lane = std::conditional_t<std::is_same_v<T, float>, float, int32_t>;
    constexpr int64_t G = sizeof(Lane) / sizeof(T);
    __m512 lo[M], hi[M];
    for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
    const auto* xl = reinterpret_cast<const Lane*>(x);
    const char* ahead = reinterpret_cast<const char*>(w) + BLOCK_PREFETCH_BYTES;
    for (int64_t p = 0; p < k / G; ++p, ahead += 128) {
      _mm_prefetch(ahead, _MM_HINT_T1);
      _mm_prefetch(ahead + 64, _MM_HINT_T1);
      const T* wp = w + p * BLOCK * G;
      for (int i = 0; i < M; ++i) {
        const Lane xv = xl[i * k / G + p];
        lo[i] = lane_fma(lo[i], wp, xv);
        hi[i] = lane_fma(hi[i], wp + 16 * G, xv);
      }
    }
    for (int i = 0; i < M; ++i) {
      _mm512_storeu_ps(out + i * n, lo[i]);
      _mm512_storeu_ps(out + i * n + 16, hi[i]);
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  block_tile_avx2<M>(x, w, out, k, n);
#else
  // Portable: float32 FMAs over k in order, a bf16 pair's first product then its second;
  // vectorised over the block's 32 outputs.
  constexpr int64_t G = 4 / sizeof(T);
  float acc[M][BLOCK] = {};
  for (int64_t p = 0; p < k / G; ++p) {
    const T* wp = w + p * BLOCK * G;
    for (int i = 0; i < M; ++i)
      for (int64_t g = 0; g < G; ++g) {
        const float xv = widen(x[i * k + p * G + g]);
#pragma omp simd
        for (int64_t j = 0; j < BLOCK; ++j)
          acc[i][j] = std::fma(widen(wp[j * G + g]), xv, acc[i][j]);
      }
  }
  for (int i = 0; i < M; ++i)
    for (int64_t j = 0; j < BLOCK; ++j) out[i * n + j] = acc[i][j];
#endif
}

}  // namespace

// The float32 sums of x [m, k] @ w.T for a weight [n, k] in the blocked layout, a block at a
// time: a tile of rows in registers, more rows meeting the block again while it is in cache,
// so the weights stream from memory once.
template <typename T>
void block_linear_sums(const T* x, const T* w, float* out, int64_t m, int64_t k, int64_t n) {
  constexpr int R = tile_rows<T>();
  for (int64_t b = 0; b < n; b += BLOCK) {
    const T* wb = w + b * k;
    for (int64_t i = 0; i < m; i += R) {
      const T* xi = x + i * k;
      float* oi = out + i * n + b;
      dispatch_rows<R>(m - i, [&](auto rows) {
        block_tile<decltype(rows)::value>(xi, wb, oi, k, n);
      });
    }
  }
}

template void block_linear_sums<float>(const float*, const float*, float*, int64_t, int64_t,
                                       int64_t);
template void block_linear_sums<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, float*,
                                              int64_t, int64_t, int64_t);

// x [m, k] @ w.T (+ bias) (+ residual) for a weight [n, k] given in the blocked layout
// [n' / 32, k / G, 32, G] (n' >= n: block_pack pads the outputs to whole blocks; n < 0: n'):
// the blocks of 32 outputs spread over the threads, each output's float32 sum as
// block_linear_sums makes it, plus bias, plus residual, rounded once to x's dtype (or kept in
// float32 with float_out).
at::Tensor blocked_linear(const at::Tensor& x, const at::Tensor& blocked,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& residual, bool float_out,
                          int64_t outputs) {
  TORCH_CHECK(x.dim() == 2 && blocked.dim() == 4 && blocked.size(2) == BLOCK &&
                  x.size(1) == blocked.size(1) * blocked.size(3) &&
                  blocked.size(3) * blocked.element_size() == 4,
              "blocked_linear: x [m, k] and the blocked layout [n / 32, k / G, 32, G] expected");
  TORCH_CHECK(x.scalar_type() == blocked.scalar_type() && blocked.is_contiguous(),
              "blocked_linear: x and a contiguous blocked weight of one dtype expected");
  const auto xc = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), padded = blocked.size(0) * BLOCK;
  const int64_t n = outputs < 0 ? padded : outputs;
  TORCH_CHECK(n <= padded && n > padded - BLOCK, "blocked_linear: ", n,
              " outputs do not match the blocked layout's ", padded);
  TORCH_CHECK(!bias || (bias->numel() == n && bias->scalar_type() == x.scalar_type()),
              "blocked_linear: bias must be [n] of x's dtype");
  TORCH_CHECK(!residual || (residual->dim() == 2 && residual->size(0) == m &&
                            residual->size(1) == n && residual->scalar_type() == x.scalar_type()),
              "blocked_linear: residual must be [m, n] of x's dtype");
  auto out = at::empty({m, n}, float_out ? x.options().dtype(at::kFloat) : x.options());
  dispatch(x.scalar_type(), "blocked_linear", [&](auto zero) {
    using T = decltype(zero);
    const T* xp = xc.data_ptr<T>();
    const T* wp = blocked.data_ptr<T>();
    const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    const at::Tensor rc = residual ? residual->contiguous() : at::Tensor();
    const T* bp = bias ? bc.data_ptr<T>() : nullptr;
    const T* rp = residual ? rc.data_ptr<T>() : nullptr;
    at::parallel_for(0, padded / BLOCK, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> sums(m * BLOCK);
      for (int64_t b = b0; b < b1; ++b) {
        block_linear_sums(xp, wp + b * BLOCK * k, sums.data(), m, k, BLOCK);
        auto store = [&](auto* op) {
          using O = std::remove_pointer_t<decltype(op)>;
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < std::min(BLOCK, n - b * BLOCK); ++j) {
              const int64_t c = b * BLOCK + j;
              float s = sums[i * BLOCK + j];
              if (bp) s += widen(bp[c]);
              if (rp) s += widen(rp[i * n + c]);
              op[i * n + c] = narrow<O>(s);
            }
        };
        if (float_out)
          store(out.data_ptr<float>());
        else
          store(out.data_ptr<T>());
      }
    });
  });
  return out;
}

}  // namespace hotswap
