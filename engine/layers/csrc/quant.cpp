// int8 linear layers (layers/quant.py): weights int8 per output channel, activations int8 per
// token (dynamic), both symmetric and both rotated by a block Hadamard transform along the input
// dimension first, which spreads a channel's outlier over its block so that one large value no
// longer sets the scale of the whole row. int32 products and sums (at::_int_mm: oneDNN's VNNI or
// AMX kernels; int8_sums on an ISA without them), rescaled to float32 and written in x's dtype.

#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// In place: each block of `block` floats (a power of two) times the Hadamard matrix of that
// order, unnormalised (the Walsh-Hadamard butterflies; quantize_row folds in 1/sqrt(block)).
void hadamard_blocks(float* v, int64_t k, int64_t block, int64_t first_h = 1) {
  for (int64_t b = 0; b < k; b += block) {
    float* x = v + b;
    for (int64_t h = first_h; h < block; h *= 2)
      for (int64_t i = 0; i < block; i += 2 * h) {
#pragma omp simd
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], c = x[j + h];
          x[j] = a + c;
          x[j + h] = a - c;
        }
      }
  }
}

#if defined(__AVX512F__)
// The four butterfly stages inside 16 lanes: each lane meets lane ^ h; the upper one of the pair
// (mask bit set) takes partner - self, the lower one self + partner.
inline __m512 hadamard16(__m512 v) {
  const __m512i i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  constexpr __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  for (int s = 0; s < 4; ++s) {
    const __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(i, _mm512_set1_epi32(1 << s)), v);
    v = _mm512_mask_blend_ps(upper[s], _mm512_add_ps(v, p), _mm512_sub_ps(p, v));
  }
  return v;
}
#endif

}  // namespace

// One row x [k] -> q [k] int8: rotated, then q = round(v * 127 / max|v|); returns the scale
// max|v| / 127 of the normalised rotation (0 for a row of zeros, whose q are all 0). `v` is
// scratch of k floats.
template <typename T>
float quantize_row(const T* x, float* v, int8_t* q, int64_t k, int64_t block) {
  float amax = 0.0f;
#if defined(__AVX512F__)
  if (k % 16 == 0 && block >= 16) {
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) _mm512_storeu_ps(v + j, hadamard16(load16(x + j)));
    hadamard_blocks(v, k, block, 16);
    for (int64_t j = 0; j < k; j += 16)
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
    amax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int64_t j = 0; j < k; j += 16) {
      // Round to nearest even (the default rounding mode), then saturate to int8 (|q| <= 127).
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + j), inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(r));
    }
    return amax / (127.0f * std::sqrt(float(block)));
  }
#endif
  load_row(x, v, k);
  hadamard_blocks(v, k, block);
#pragma omp simd reduction(max : amax)
  for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < k; ++j)
    q[j] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(v[j] * inv))));
  return amax / (127.0f * std::sqrt(float(block)));
}

// out[j] = acc[j] * s * ws[j] (+ bias[j]) (+ residual[j]) for one row of n, in T.
template <typename T>
void rescale_row(const int32_t* acc, float s, const float* ws, const float* bias, const T* res,
                 T* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + j)),
        _mm512_mul_ps(sv, _mm512_loadu_ps(ws + j)));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    if (res) v = _mm512_add_ps(v, load16(res + j));
    store16(out + j, v);
  }
#endif
  for (; j < n; ++j) {
    float v = float(acc[j]) * (s * ws[j]);
    if (bias) v += bias[j];
    if (res) v += widen(res[j]);
    out[j] = narrow<T>(v);
  }
}

namespace {

#if defined(__AVX512VNNI__)
// Bytes ahead of its weight stream a VNNI tile asks for (into L2).
constexpr int64_t VNNI_PREFETCH_BYTES = 8192;

// M rows of x (as u8: q + 128, packed [k / 4][M] 32-bit groups) times one block of 32 outputs of
// a weight in the int8 blocked layout [k / 4][32][4]: for each group of 4 inputs the block's
// weights are two 64-byte loads and each row's group one broadcast; VNNI's u8 x s8 products of
// 4 inputs summed into int32 lanes, exactly.
template <int M>
void vnni_tile(const int32_t* xg, const int8_t* w, int32_t* out, int64_t k, int64_t n) {
  __m512i lo[M], hi[M];
  for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm512_setzero_si512();
  const char* ahead = reinterpret_cast<const char*>(w) + VNNI_PREFETCH_BYTES;
  for (int64_t p = 0; p < k / 4; ++p, ahead += 128) {
    _mm_prefetch(ahead, _MM_HINT_T1);
    _mm_prefetch(ahead + 64, _MM_HINT_T1);
    const __m512i w0 = _mm512_loadu_si512(w + p * 128);
    const __m512i w1 = _mm512_loadu_si512(w + p * 128 + 64);
    for (int i = 0; i < M; ++i) {
      const __m512i xv = _mm512_set1_epi32(xg[p * M + i]);
      lo[i] = _mm512_dpbusd_epi32(lo[i], xv, w0);
      hi[i] = _mm512_dpbusd_epi32(hi[i], xv, w1);
    }
  }
  for (int i = 0; i < M; ++i) {
    _mm512_storeu_si512(out + i * n, lo[i]);
    _mm512_storeu_si512(out + i * n + 16, hi[i]);
  }
}
#endif

}  // namespace

template float quantize_row<float>(const float*, float*, int8_t*, int64_t, int64_t);
template float quantize_row<at::BFloat16>(const at::BFloat16*, float*, int8_t*, int64_t, int64_t);
template void rescale_row<float>(const int32_t*, float, const float*, const float*, const float*,
                                 float*, int64_t);
template void rescale_row<at::BFloat16>(const int32_t*, float, const float*, const float*,
                                        const at::BFloat16*, at::BFloat16*, int64_t);

namespace {

// Whether the ISA this build targets has int8 dot products (layers/quant.py's INT8_FLAGS). Without
// them oneDNN's int8 kernels add pairs of u8 x s8 products in int16 (vpmaddubsw), which
// saturates: under ONEDNN_MAX_CPU_ISA=AVX2, at::_int_mm of int8 values beyond +-64 is off by up
// to 8e4.
constexpr bool HAS_INT8_DOT =
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__) || defined(__AMX_INT8__)
    true;
#else
    false;
#endif

// The exact int32 sums of one row of q [., k] and each weight row, the compiler's vectorisation.
inline int32_t int8_dot(const int8_t* a, const int8_t* b, int64_t k) {
  int32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t p = 0; p < k; ++p) s += int32_t(a[p]) * int32_t(b[p]);
  return s;
}

#if defined(__AVX2__)
// R rows of q against one weight row: 16 int8 at a time sign-extended to int16 and multiplied
// pairwise into int32 (vpmaddwd: exact, no saturation), the weight's 16 widened once for R rows.
template <int R>
void int8_dot_rows(const int8_t* q, const int8_t* w, int32_t* out, int64_t k, int64_t n) {
  auto widen = [](const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  int64_t p = 0;
  for (; p + 16 <= k; p += 16) {
    const __m256i wv = widen(w + p);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(widen(q + r * k + p), wv));
  }
  for (int r = 0; r < R; ++r) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    out[r * n] = _mm_cvtsi128_si32(s) + int8_dot(q + r * k + p, w + p, k - p);
  }
}
#endif

// The exact int32 sums of q [m, k] @ w [n, k].T on any ISA; a weight row meets every row of q
// while it is in L1, so the weights stream once. With AVX2, 4 rows of q at a time share each
// widened weight (4-5x the compiler's loop at 64 rows, as fast as oneDNN's float32 matmul).
void int8_sums(const int8_t* q, const int8_t* w, int32_t* out, int64_t m, int64_t k, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      const int8_t* wj = w + j * k;
      int64_t i = 0;
#if defined(__AVX2__)
      for (; i + 4 <= m; i += 4) int8_dot_rows<4>(q + i * k, wj, out + i * n + j, k, n);
#endif
      for (; i < m; ++i) out[i * n + j] = int8_dot(q + i * k, wj, k);
    }
  });
}

}  // namespace

bool has_vnni_kernel() {
#if defined(__AVX512VNNI__)
  return true;
#else
  return false;
#endif
}

void vnni_sums(const int8_t* q, const int8_t* w, const int32_t* comp, int32_t* out, int64_t m,
               int64_t k, int64_t n) {
#if defined(__AVX512VNNI__)
  constexpr int64_t ROWS = 12;
  // x's rows as u8 (q + 128: the sign bit flipped), each chunk of ROWS rows packed group-major
  // so that a tile's broadcasts read consecutive words (one address register, not one per row).
  thread_local std::vector<int32_t> packed;
  packed.resize(((m + ROWS - 1) / ROWS) * ROWS * (k / 4));
  const auto* q32 = reinterpret_cast<const int32_t*>(q);
  for (int64_t c = 0; c * ROWS < m; ++c) {
    const int64_t rows = std::min(ROWS, m - c * ROWS);
    int32_t* dst = packed.data() + c * ROWS * (k / 4);
    for (int64_t p = 0; p < k / 4; ++p)
      for (int64_t i = 0; i < rows; ++i)
        dst[p * rows + i] = q32[(c * ROWS + i) * (k / 4) + p] ^ int32_t(0x80808080u);
  }
  // Blocks of 32 outputs over the threads (inline inside moe.cpp's parallel region), where the
  // weight is worth a second thread (a dense layer at batch 1 streams it from memory).
  const int64_t blocks = n / 32;
  const int32_t* xp = packed.data();  // (a worker thread's `packed` is its own)
  at::parallel_for(0, blocks, k * n >= 262144 ? 1 : blocks, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo * 32; b < hi * 32; b += 32) {
      const int8_t* wb = w + b * k;
      for (int64_t i = 0; i < m; i += ROWS) {
        const int32_t* xg = xp + (i / ROWS) * ROWS * (k / 4);
        int32_t* o = out + i * n + b;
        dispatch_rows<ROWS>(m - i, [&](auto rows) {
          vnni_tile<decltype(rows)::value>(xg, wb, o, k, n);
        });
      }
      // sum (q + 128) w = sum q w + 128 sum w: the compensation makes them the s8 x s8 sums.
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = b; j < b + 32; ++j) out[i * n + j] -= comp[j];
    }
  });
#else
  TORCH_CHECK(false, "vnni_sums: built without AVX512-VNNI");
#endif
}

namespace {

void check_block(int64_t k, int64_t block) {
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && k % block == 0,
              "block must be a power of two dividing ", k, ", got ", block);
}

bool is(const at::Tensor& t, at::ScalarType dtype, int64_t numel) {
  return t.scalar_type() == dtype && t.is_contiguous() && t.numel() == numel;
}

// `blocked` and `comp` (given together or not at all) fit a weight [n, k]: contiguous int8
// [n / 32, k / 4, 32, 4] and int32 [n], n a multiple of 32 and k of 4.
void check_blocked(const std::optional<at::Tensor>& blocked,
                   const std::optional<at::Tensor>& comp, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK(blocked.has_value() == comp.has_value(), op, ": blocked and comp go together");
  TORCH_CHECK(!blocked || (is(*blocked, at::kChar, n * k) && is(*comp, at::kInt, n) &&
                           n % 32 == 0 && k % 4 == 0),
              op, ": blocked must be the weight's int8 blocked layout [n / 32, k / 4, 32, 4] "
              "(contiguous) and comp int32 [n], n a multiple of 32 and k of 4");
}

// Rows of x [m, k] quantized into q [m, k] and scale [m]; with `blocked`, each row also into the
// int8 blocked layout [m / 32, k / 4, 32, 4] (its 4-byte groups 32 apart) and 128 times its sum
// into `comp`, while the row is in L1. Threads take blocks of 32 rows (one of the layout's).
template <typename T>
void quantize_into(const T* x, int64_t m, int64_t k, int64_t block, int8_t* q, float* scale,
                   int8_t* blocked, int32_t* comp) {
  const int64_t chunks = (m + 31) / 32;
  // Few rows are not worth a second thread's start-up.
  at::parallel_for(0, chunks, m * k < 65536 ? chunks : 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scratch(k);
    for (int64_t i = lo * 32; i < std::min(m, hi * 32); ++i) {
      int8_t* row = q + i * k;
      scale[i] = quantize_row(x + i * k, scratch.data(), row, k, block);
      if (!blocked) continue;
      const auto* groups = reinterpret_cast<const int32_t*>(row);
      auto* out = reinterpret_cast<int32_t*>(blocked) + (i / 32) * 32 * (k / 4) + i % 32;
      int32_t sum = 0;
      for (int64_t p = 0; p < k / 4; ++p) out[p * 32] = groups[p];
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < k; ++j) sum += row[j];
      comp[i] = 128 * sum;
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows: x must be 2-D");
  check_block(x.size(1), block);
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  auto q = at::empty({m, k}, xc.options().dtype(at::kChar));
  auto scale = at::empty({m}, xc.options().dtype(at::kFloat));
  dispatch(xc.scalar_type(), "quantize_rows", [&](auto tag) {
    using T = decltype(tag);
    quantize_into(xc.data_ptr<T>(), m, k, block, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                  nullptr, nullptr);
  });
  return {q, scale};
}

void quantize_weight_(const at::Tensor& w, int64_t block, const at::Tensor& q,
                      const at::Tensor& scale, const std::optional<at::Tensor>& blocked,
                      const std::optional<at::Tensor>& comp) {
  TORCH_CHECK(w.dim() == 2, "quantize_weight_: w must be 2-D");
  check_block(w.size(1), block);
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(is(q, at::kChar, n * k) && is(scale, at::kFloat, n),
              "quantize_weight_: q must be contiguous int8 [n, k], scale float32 [n]");
  check_blocked(blocked, comp, n, k, "quantize_weight_");
  const auto wc = w.contiguous();
  dispatch(wc.scalar_type(), "quantize_weight_", [&](auto tag) {
    using T = decltype(tag);
    quantize_into(wc.data_ptr<T>(), n, k, block, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                  blocked ? blocked->data_ptr<int8_t>() : nullptr,
                  comp ? comp->data_ptr<int32_t>() : nullptr);
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual, int64_t block,
                       const std::optional<at::Tensor>& blocked,
                       const std::optional<at::Tensor>& comp) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "int8_linear: x [m, k] and weight [n, k] expected");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear: weight must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == weight.size(0),
              "int8_linear: scale must be float32 [n]");
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  check_blocked(blocked, comp, n, k, "int8_linear");
  auto [q, xs] = quantize_rows(x, block);
  at::Tensor acc;
  if (blocked && m <= VNNI_ROWS) {
    TORCH_CHECK(has_vnni_kernel(), "int8_linear: the blocked layout needs AVX512-VNNI");
    acc = at::empty({m, n}, x.options().dtype(at::kInt));
    vnni_sums(q.data_ptr<int8_t>(), blocked->data_ptr<int8_t>(), comp->data_ptr<int32_t>(),
              acc.data_ptr<int32_t>(), m, k, n);
  } else if (HAS_INT8_DOT) {
    // [n, k] contiguous, passed transposed: oneDNN reads it as a column-major [k, n].
    acc = at::_int_mm(q, weight.t());
  } else {
    acc = at::empty({m, n}, x.options().dtype(at::kInt));
    int8_sums(q.data_ptr<int8_t>(), weight.data_ptr<int8_t>(), acc.data_ptr<int32_t>(), m, k, n);
  }
  auto out = at::empty({m, n}, x.options());
  std::optional<at::Tensor> b, r;
  if (bias) b = bias->to(at::kFloat).contiguous();
  if (residual) {
    TORCH_CHECK(residual->sizes() == out.sizes() && residual->scalar_type() == x.scalar_type(),
                "int8_linear: residual must be [m, n] in x's dtype");
    r = residual->contiguous();
  }
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xsp = xs.data_ptr<float>();
  const float* wsp = scale.data_ptr<float>();
  const float* bp = b ? b->data_ptr<float>() : nullptr;
  dispatch(x.scalar_type(), "int8_linear", [&](auto tag) {
    using T = decltype(tag);
    T* op = out.data_ptr<T>();
    const T* rp = r ? r->data_ptr<T>() : nullptr;
    at::parallel_for(0, m, m * n < 65536 ? m : 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rescale_row(ap + i * n, xsp[i], wsp, bp, rp ? rp + i * n : nullptr, op + i * n, n);
    });
  });
  return out;
}

}  // namespace hotswap
