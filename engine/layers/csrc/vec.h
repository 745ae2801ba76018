// Scalar and vector helpers the kernels share: bf16 <-> float32, a vectorisable exp, dtype
// dispatch. All arithmetic is float32; bfloat16 is read by widening and written once, rounded to
// nearest even.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hotswap {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return bits_to_float(uint32_t(x.x) << 16); }

template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline at::BFloat16 narrow<at::BFloat16>(float x) {
  uint32_t u = float_to_bits(x);
  uint16_t out = (x != x) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return at::BFloat16(out, at::BFloat16::from_bits());
}

// exp: Cody-Waite reduction to r in [-ln2/2, ln2/2], a degree-6 polynomial, then the exponent
// bits. Relative error ~2e-7 (a few ulp); inlined so the loops that call it vectorise, which
// std::exp does not.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float(uint32_t(int32_t(n) + 127) << 23);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = widen(src[i]);
}

// Calls f(float{}) or f(at::BFloat16{}) by dtype (not AT_DISPATCH: a pragma cannot sit inside a
// macro argument).
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", dtype);
  }
}

// Calls f(std::integral_constant<int, M>{}) with M = rows, for 1 <= rows <= MAX (a register
// tile's row count as a template argument; rows above MAX take MAX).
template <int MAX, int M = 1, typename F>
void dispatch_rows(int64_t rows, F&& f) {
  if constexpr (M < MAX) {
    if (rows > M) return dispatch_rows<MAX, M + 1>(rows, f);
  }
  f(std::integral_constant<int, M>{});
}

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}
#if defined(__AVX512F__)
// exp of 16 lanes by fast_exp's steps.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                       _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline void store32(float* o, __m512 lo, __m512 hi) {
  _mm512_storeu_ps(o, lo);
  _mm512_storeu_ps(o + 16, hi);
}

inline void store16(float* o, __m512 v) { _mm512_storeu_ps(o, v); }
// Rounded to nearest even, as narrow<at::BFloat16> (NaN aside).
inline void store16(at::BFloat16* o, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
}

#if defined(__AVX512BF16__)
inline void store32(at::BFloat16* o, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp of 8 lanes by fast_exp's steps (the AVX2 twin of fast_exp16).
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }
inline void store8(at::BFloat16* o, __m256 v) {  // rounded as narrow<at::BFloat16> (NaN aside)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

// 1 / sqrt(mean(row^2) + eps) in float32: RMSNorm's scale of one row.
template <typename T>
inline float inv_rms(const T* row, int64_t h, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < h; ++j) ss += widen(row[j]) * widen(row[j]);
  return 1.f / std::sqrt(ss / float(h) + float(eps));
}

}  // namespace hotswap
