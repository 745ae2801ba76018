// Fused CPU kernels for the decode step (float32 and bfloat16), registered as torch.ops.hotswap.*
// Built on first use by cpu_kernels.py; every op has a torch-ops twin there that the tests
// compare it with. All arithmetic is float32; bfloat16 is read by widening and written once,
// rounded to nearest even. Each output row depends only on its own inputs, never on how many
// rows share the call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

constexpr int64_t KEY_BLOCK = 32;

// The attention of one (row, kv head) pair: the `group` query heads that share kv head h attend
// over the row's `len` keys, whose pool slots are `slots[0:len]`; `out` gets the group's
// outputs [group, d]. `scores` has room for [group, len]; the portable version also uses qf
// [group, d], rows [KEY_BLOCK, d] and acc [group, d].
template <typename T>
using AttendFn = void (*)(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                          int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t d,
                          float scale, T* out, float* qf, float* rows, float* scores, float* acc);

// A row's keys sit a slot per decode step of its batch apart (kilobytes), which the hardware
// prefetcher does not follow, and each load would otherwise wait on memory: the attention's
// loops ask for the key (or value) KEYS_AHEAD ahead of the one they read, and a task asks for
// its first KEYS_AHEAD keys and values when it starts (prefetch_rows). Against asking for the
// first 256 at the start alone, bf16, 30 layers of interleaved slots, alternating in one
// process: 32 rows x 300 keys 24.6 -> 18.3 ms, 16 x 1,000 44.8 -> 26.9, 4 x 500 3.42 -> 2.57,
// 64 x 74 7.06 -> 6.58; float32 32 x 300 29.9 -> 21.2 (16 or 64 ahead: within noise of 32;
// all of a slot's heads asked for at once: slower).
constexpr int64_t KEYS_AHEAD = 32;

// Asks for kv head h's d values of pool slot `slot` in buf [slots, hkv, d].
template <typename T>
inline void prefetch_head(const T* buf, int64_t slot, int64_t hkv, int64_t h, int64_t d) {
  const char* p = reinterpret_cast<const char*>(buf + (slot * hkv + h) * d);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Portable: keys, then values, widened KEY_BLOCK rows at a time into `rows`, every head run
// over the block.
template <typename T>
void attend_portable(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                     int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t d, float scale,
                     T* out, float* qf, float* rows, float* scores, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    load_row(q + g * d, qf + g * d, d);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] *= scale;
  }
  for (int64_t j0 = 0; j0 < len; j0 += KEY_BLOCK) {
    const int64_t nb = std::min(KEY_BLOCK, len - j0);
    for (int64_t j = j0 + KEYS_AHEAD; j < std::min(j0 + KEYS_AHEAD + nb, len); ++j)
      prefetch_head(k_buf, slots[j], hkv, h, d);
    for (int64_t j = 0; j < nb; ++j)
      load_row(k_buf + (slots[j0 + j] * hkv + h) * d, rows + j * d, d);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < nb; ++j) scores[g * len + j0 + j] = dot(qf + g * d, rows + j * d, d);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    float m = -INFINITY;
    for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; ++j) {
      s[j] = fast_exp(s[j] - m);
      sum += s[j];
    }
    float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) s[j] *= inv;
  }
  std::fill(acc, acc + group * d, 0.f);
  for (int64_t j0 = 0; j0 < len; j0 += KEY_BLOCK) {
    const int64_t nb = std::min(KEY_BLOCK, len - j0);
    for (int64_t j = j0 + KEYS_AHEAD; j < std::min(j0 + KEYS_AHEAD + nb, len); ++j)
      prefetch_head(v_buf, slots[j], hkv, h, d);
    for (int64_t j = 0; j < nb; ++j)
      load_row(v_buf + (slots[j0 + j] * hkv + h) * d, rows + j * d, d);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < nb; ++j) {
        const float p = scores[g * len + j0 + j];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[g * d + i] += p * rows[j * d + i];
      }
  }
  for (int64_t g = 0; g < group; ++g) {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = narrow<T>(acc[g * d + i]);
  }
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

// s[0:len] -> exp(s - max(s)) in place; returns their sum.
inline float exp_weights(float* s, int64_t len) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  const __mmask16 tail = __mmask16((1u << (len - j)) - 1);
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= len; j += 16) {
    const __m512 w = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
    _mm512_storeu_ps(s + j, w);
    sum = _mm512_add_ps(sum, w);
  }
  const __m512 w = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mx));
  _mm512_mask_storeu_ps(s + j, tail, w);
  return _mm512_reduce_add_ps(_mm512_mask_add_ps(sum, tail, sum, w));
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

// The sums of s[r]'s 16 lanes for r < 4, times scale.
inline __m128 sum_lanes4(const __m512* s, float scale) {
  __m256 t[4];
  for (int64_t r = 0; r < 4; ++r)
    t[r] = _mm256_add_ps(_mm512_castps512_ps256(s[r]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[r]), 1)));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
  return _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                    _mm_set1_ps(scale));
}

// scale * (q . k[r]) for four key rows: float32 products and sums; for bf16 AVX512-BF16's
// pairwise products (exact in float32), so neither side is widened.
template <int64_t D>
inline __m128 key_scores4(const float* q, const float* const* k, float scale) {
  __m512 s[4];
  for (int64_t r = 0; r < 4; ++r) {
    s[r] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k[r]));
    for (int64_t c = 16; c < D; c += 16)
      s[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k[r] + c), s[r]);
  }
  return sum_lanes4(s, scale);
}

#if defined(__AVX512BF16__)
inline void store32(at::BFloat16* o, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

template <int64_t D>
inline __m128 key_scores4(const at::BFloat16* q, const at::BFloat16* const* k, float scale) {
  __m512 s[4];
  for (int64_t r = 0; r < 4; ++r) {
    s[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32)
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_loadu_si512(q + c),
                              (__m512bh)_mm512_loadu_si512(k[r] + c));
  }
  return sum_lanes4(s, scale);
}
#endif

// out[g] = (sum_j w[g, j] * v_j) / sums[g] for G query heads (w: their [G, len] scores):
// each value row read and widened once for all G heads, whose G * D / 16 accumulators stay in
// registers.
template <int64_t D, int64_t G, typename T>
inline void weigh_values(const float* w, int64_t len, const T* v_buf, const int64_t* slots,
                         int64_t hkv, int64_t h, const float* sums, T* out) {
  constexpr int64_t C = D / 16;
  __m512 acc[G][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + KEYS_AHEAD < len) prefetch_head(v_buf, slots[j + KEYS_AHEAD], hkv, h, D);
    const T* v = v_buf + (slots[j] * hkv + h) * D;
    __m512 vf[C];
    for (int64_t c = 0; c < C; ++c) vf[c] = load16(v + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(w[g * len + j]);
      for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g]);
    for (int64_t c = 0; c < C; c += 2)
      store32(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], inv),
              _mm512_mul_ps(acc[g][c + 1], inv));
  }
}

// AVX-512 (bf16: AVX512-BF16) for head sizes D of 64 and 128: all `group` heads' scores from
// each key loaded once, four keys per reduction tree; a vectorised softmax; then the values
// weighed for up to 256 / D heads at a time. Measured against the previous kernel (each head's
// own pass over the keys, values widened into a buffer), bf16, 64 rows x 74 keys x 9 heads (3
// kv), 30 layers, 2 threads: 9.2 against 13.8 ms with the keys in DRAM, 5.9 against 10.7 ms in
// cache; float32 12.6 against 17.7 ms.
template <int64_t D, typename T>
void attend_avx512(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                   int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t, float scale,
                   T* out, float*, float*, float* scores, float*) {
  for (int64_t j = 0; j < len; j += 4) {
    for (int64_t r = j + KEYS_AHEAD; r < std::min(j + KEYS_AHEAD + 4, len); ++r)
      prefetch_head(k_buf, slots[r], hkv, h, D);
    const T* k[4];  // the last call of a row repeats its last key where fewer are left
    for (int64_t r = 0; r < 4; ++r) k[r] = k_buf + (slots[std::min(j + r, len - 1)] * hkv + h) * D;
    const __mmask8 keep = __mmask8((1u << std::min<int64_t>(4, len - j)) - 1);
    for (int64_t g = 0; g < group; ++g)
      _mm_mask_storeu_ps(scores + g * len + j, keep, key_scores4<D>(q + g * D, k, scale));
  }
  constexpr int64_t GMAX = 256 / D;
  float sums[GMAX];
  for (int64_t g0 = 0; g0 < group; g0 += GMAX) {
    const int64_t gc = std::min(GMAX, group - g0);
    for (int64_t g = 0; g < gc; ++g) sums[g] = exp_weights(scores + (g0 + g) * len, len);
    const float* w = scores + g0 * len;
    T* o = out + g0 * D;
    if constexpr (GMAX == 4) {
      switch (gc) {
        case 1: weigh_values<D, 1>(w, len, v_buf, slots, hkv, h, sums, o); break;
        case 2: weigh_values<D, 2>(w, len, v_buf, slots, hkv, h, sums, o); break;
        case 3: weigh_values<D, 3>(w, len, v_buf, slots, hkv, h, sums, o); break;
        default: weigh_values<D, 4>(w, len, v_buf, slots, hkv, h, sums, o); break;
      }
    } else if (gc == 1) {
      weigh_values<D, 1>(w, len, v_buf, slots, hkv, h, sums, o);
    } else {
      weigh_values<D, 2>(w, len, v_buf, slots, hkv, h, sums, o);
    }
  }
}
#endif

template <typename T>
AttendFn<T> attend_for(int64_t d) {
#if defined(__AVX512F__)
#if !defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, float>)
#endif
  {
    if (d == 64) return attend_avx512<64, T>;
    if (d == 128) return attend_avx512<128, T>;
  }
#endif
  return attend_portable<T>;
}

// Asks for the K and V rows of heads [h0, h0 + heads) of a row's first KEYS_AHEAD slots, before
// the loops that ask for the rest as they go.
template <typename T>
void prefetch_rows(const T* k_buf, const T* v_buf, const int64_t* slots, int64_t len,
                   int64_t hkv, int64_t d, int64_t h0, int64_t heads) {
  const int64_t bytes = heads * d * int64_t(sizeof(T));
  for (int64_t j = 0; j < std::min(len, KEYS_AHEAD); ++j) {
    const int64_t offset = (slots[j] * hkv + h0) * d;
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k_buf + offset) + b);
      __builtin_prefetch(reinterpret_cast<const char*>(v_buf + offset) + b);
    }
  }
}

// q [n, Hq * D] (any row stride), k_buf / v_buf [slots, Hkv, D], req_to_token [R, W] int64,
// req_idx [n] and seq_lens [n] int64 -> out [n, Hq * D]: row i's query attends to its seq_lens[i]
// tokens at slots req_to_token[req_idx[i], :seq_lens[i]] (its own new token included).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& req_to_token, const at::Tensor& req_idx,
                            const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1, "q must be [n, heads * head_dim], rows dense");
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  v_buf.sizes() == k_buf.sizes(), "k_buf, v_buf must be [slots, kv heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type(),
              "q and the KV pool must share a dtype");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.is_contiguous() &&
                  req_idx.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_idx.is_contiguous() && seq_lens.is_contiguous(),
              "req_to_token, req_idx, seq_lens must be contiguous int64");
  const int64_t n = q.size(0), hkv = k_buf.size(1), d = k_buf.size(2);
  TORCH_CHECK(q.size(1) % (hkv * d) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(req_idx.numel() == n && seq_lens.numel() == n, "one req_idx and seq_len per row");
  const int64_t group = q.size(1) / (hkv * d), width = req_to_token.size(1);
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* rows = req_idx.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= width, "seq_len out of range");
    max_len = std::max(max_len, lens[i]);
  }
  auto out = at::empty({n, q.size(1)}, q.options());
  const float fscale = float(scale);
  dispatch(q.scalar_type(), "decode_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_buf.data_ptr<scalar_t>();
    const scalar_t* vp = v_buf.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t q_stride = q.stride(0);
    // A task is a row's every kv head (whole slots read at once) when there are rows enough
    // for the threads, else a (row, kv head) pair.
    const int64_t splits = n >= 4 * at::get_num_threads() ? 1 : hkv, heads = hkv / splits;
    at::parallel_for(0, n * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(group * d), block(KEY_BLOCK * d), scores(group * max_len),
          acc(group * d);
      const AttendFn<scalar_t> one = attend_for<scalar_t>(d);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t i = t / splits, h0 = t % splits * heads;
        const int64_t* slots = table + rows[i] * width;
        prefetch_rows(kp, vp, slots, lens[i], hkv, d, h0, heads);
        for (int64_t h = h0; h < h0 + heads; ++h)
          one(qp + i * q_stride + h * group * d, kp, vp, slots, lens[i], h, hkv, group, d,
              fscale, op + i * q.size(1) + h * group * d, qf.data(), block.data(),
              scores.data(), acc.data());
      }
    });
  });
  return out;
}

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

// 1 / sqrt(mean(row^2) + eps) in float32: RMSNorm's scale of one row.
template <typename T>
inline float inv_rms(const T* row, int64_t h, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < h; ++j) ss += widen(row[j]) * widen(row[j]);
  return 1.f / std::sqrt(ss / float(h) + float(eps));
}

// RMSNorm of each row of x [T, H] times weight [H] (same dtype): float32 arithmetic, one
// rounding at the end, as F.rms_norm computes it in ~30 ops. With a residual [T, H] (x dense),
// x += residual first, in place and rounded to x's dtype as x.add_(residual) rounds it, and the
// norm is of that sum: the residual add after a matmul costs no pass of its own (oneDNN's add
// post-op cost ~25 us a call more than the matmul without it, at any size).
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
        const float r = inv_rms(row, h, eps);
        scalar_t* o = op + i * h;
#pragma omp simd
        for (int64_t j = 0; j < h; ++j) o[j] = narrow<scalar_t>(widen(row[j]) * r * widen(wp[j]));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, weight, eps, nullptr);
}

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
        const scalar_t* u = g + inter;
        scalar_t* o = op + i * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; ++j) {
          const float a = widen(g[j]);
          o[j] = narrow<scalar_t>(a / (1.f + fast_exp(-a)) * widen(u[j]));
        }
      }
    });
  });
  return out;
}

// out [m, n] = x [m, k] @ w [n, k].T (+ bias) (+ residual) for a few rows m, with w bfloat16 as
// it lies (row-major) and x float32 or bfloat16, out in x's dtype: float32 products (exact: a
// bf16 weight times a float32 or bf16 x) and float32 sums, a bf16 out rounded once. What a
// decode of a few rows multiplies: the float32 lm_head of a bf16 model (half the bytes of its
// float32 copy, the same products) and every projection of a bf16 model. Every output is one
// 16-lane float32 dot product; four weight rows share each load of x (with AVX-512, up to four
// rows of x share each widened weight). The weights stream from DRAM, so the loop asks for them
// ahead: the portable loop for each group of four weight rows the group SMALL_PREFETCH_ROWS rows
// ahead, the AVX-512 one for two cache lines SMALL_PREFETCH_BYTES ahead (into L2) with every
// 128 bytes it reads. Without a prefetch the hardware prefetcher kept SmolLM2's 30 layers and
// head at 9.8 GB/s; the group ahead gave 14.9 GB/s (oneDNN's bf16 matmul of one row: 9.3 GB/s;
// Xeon, 2 threads, one process); the lines ahead, against the group ahead, alternating in one
// process: 16.9 / 15.5 GB/s at 1 row, 13.1 / 11.5 at 4 (4 KB ahead: as the group; 32 and
// 64 KB: 16.3 and 15.8 GB/s; into L1: no better than the group). The 30 layers at 1 / 2 / 4
// rows: 14.5 / 15.8 / 20.4 ms with the weights widened once for all rows, 15.9 / 20.4 / 36.0 ms
// widened for each (the same bits). With AVX512-BF16 a bf16 x takes small_group_bf16 instead
// (any k a multiple of 32), whose bf16 pairwise products need no widening: SmolLM2's 30 layers,
// alternating in one process, 1 row 8.27 -> 7.86 ms, 2 and 4 rows the same, 8 rows 40.8 ->
// 17.4 ms; against oneDNN's packed bf16 matmul 15.3 / 20.4 ms at 4 rows, 5: 17.2 / 21.6,
// 6: 19.0 / 21.0, 8: 20.4 / 20.8 (later, a faster period: 5: 12.5 / 13.5, 6: 13.6 / 13.9,
// 7: 13.8 / 13.6), hence linear.py's SMALL_ROWS = 6.
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

// Weight rows [r0, r1) times the m rows of a bf16 x, 8 rows at a time (k a multiple of 32).
void small_linear_rows_bf16(const at::BFloat16* x, const at::BFloat16* w, float* out, int64_t m,
                            int64_t k, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t i = 0; i < m; i += 8) {
    const at::BFloat16* xi = x + i * k;
    float* oi = out + i * n;
    switch (std::min<int64_t>(8, m - i)) {
      case 1: small_rows_bf16<1>(xi, w, oi, k, r0, r1, n); break;
      case 2: small_rows_bf16<2>(xi, w, oi, k, r0, r1, n); break;
      case 3: small_rows_bf16<3>(xi, w, oi, k, r0, r1, n); break;
      case 4: small_rows_bf16<4>(xi, w, oi, k, r0, r1, n); break;
      case 5: small_rows_bf16<5>(xi, w, oi, k, r0, r1, n); break;
      case 6: small_rows_bf16<6>(xi, w, oi, k, r0, r1, n); break;
      case 7: small_rows_bf16<7>(xi, w, oi, k, r0, r1, n); break;
      default: small_rows_bf16<8>(xi, w, oi, k, r0, r1, n); break;
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
    const bool avx512_group = HAS_AVX512 && k % 16 == 0 && m <= 4;
    if (!avx512_group && r0 + SMALL_PREFETCH_ROWS + R <= n1) {
      const char* ahead = reinterpret_cast<const char*>(w0 + SMALL_PREFETCH_ROWS * k);
      for (int64_t b = 0; b < R * k * int64_t(sizeof(at::BFloat16)); b += 64)
        __builtin_prefetch(ahead + b);
    }
#if defined(__AVX512F__)
    if (avx512_group) {
      float* o = out + r0;
      switch (m) {
        case 1: small_group_avx512<1>(x, w0, o, k, n); continue;
        case 2: small_group_avx512<2>(x, w0, o, k, n); continue;
        case 3: small_group_avx512<3>(x, w0, o, k, n); continue;
        case 4: small_group_avx512<4>(x, w0, o, k, n); continue;
      }
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

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias,
                        const c10::optional<at::Tensor>& residual) {
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
#if defined(__AVX512BF16__)
    const bool bf16_x = std::is_same_v<T, at::BFloat16> && k % 32 == 0;
#else
    constexpr bool bf16_x = false;
#endif
    std::vector<float> xf(bf16_x ? 0 : m * k), acc(m * n);
    for (int64_t i = 0; i < int64_t(xf.size()); ++i) xf[i] = widen(xp[i]);
    at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    at::Tensor rc = residual ? residual->contiguous() : at::Tensor();
    const T* bp = bias ? bc.data_ptr<T>() : nullptr;
    const T* rp = residual ? rc.data_ptr<T>() : nullptr;
    const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
    T* op = out.data_ptr<T>();
    auto rows = [&](int64_t n0, int64_t n1) {
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>)
        if (bf16_x) return small_linear_rows_bf16(xp, wp, acc.data(), m, k, n0, n1, n);
#endif
      small_linear_rows(xf.data(), wp, acc.data(), m, k, n0, n1, n);
    };
    at::parallel_for(0, n, 64, [&](int64_t n0, int64_t n1) {
      rows(n0, n1);
      for (int64_t i = 0; i < m; ++i) {
        const float* a = acc.data() + i * n;
        const T* r = rp ? rp + i * n : nullptr;
        T* o = op + i * n;
        for (int64_t j = n0; j < n1; ++j)
          o[j] = narrow<T>(a[j] + (bp ? widen(bp[j]) : 0.f) + (r ? widen(r[j]) : 0.f));
      }
    });
  });
  return out;
}

// The float32 final norm + lm_head of a bf16 model on AMX, from bf16 matmuls with float32
// accumulation (oneDNN's brgemm through ATen's cpublas; AMX runs them ~4x faster than float32).
// With h the bf16 hidden state, g the bf16 norm weight and s = 1/sqrt(mean(h^2) + eps):
//   logits = (s * h * g) @ W.T = s * ((h * g) @ W.T)
// h * g is a product of two bf16 values, exact in float32 with at most 16 significant bits, so
// it splits exactly into hi + lo, two bf16 values; W is bf16 itself. In hi @ W.T + lo @ W.T
// every product is exact and every sum float32, as in a float32 matmul of the normed state by
// the float32 copy of W; only the scale s comes after the sums instead of before (the float32
// path rounds s * h * g first).
// W is packed once (head_pack) into VNNI blocks of HEAD_BLOCK vocabulary rows. A chunk's hi and
// lo rows are stacked into one brgemm (M = 2 x rows), so each block of W is loaded into tiles
// once for both, and the next block is prefetched while this one is multiplied: with W coming
// from DRAM (as in a decode step) 64 rows took 12.2 ms against 15.3 ms for a brgemm per part
// without the prefetch (medians, variants alternating in one process).
constexpr int64_t HEAD_BLOCK = 64;  // vocabulary rows per packed block (one brgemm N)
constexpr int64_t HEAD_ROWS = 64;   // hidden rows per chunk (one brgemm's M is twice this)
constexpr int64_t HEAD_SPAN = 256;  // rows whose split parts stay in L2 while W streams past

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

// Sampling over the whole vocabulary (executor/sampling.py's two-level inverse CDF, one row per
// task, in three passes over the row instead of torch's ~15 ops and their [n, V] temporaries):
// the max and its first index; exp(x - max) summed per block of SAMPLE_BLOCK tokens (float32,
// the block totals cumulated in float64); then, for a sampled row, the block where u * total
// falls and the token inside it from a float64 cumulative sum of the block's weights. lse =
// max + log(total) gives the logprobs. A row's result depends on its own logits and u only.
constexpr int64_t SAMPLE_BLOCK = 128;  // = sampling.BLOCK

inline double below(double bound) { return std::nextafter(bound, 0.0); }

inline float block_weights(const float* x, int64_t width, float max, float* w) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < width; ++j) {
    const float d = x[j] - max;
    w[j] = d < -87.f ? 0.f : fast_exp(d);  // masked (-inf) tokens get exactly no mass
    sum += w[j];
  }
  return sum;
}

// Lane-wise loops the compiler vectorises (a max reduction over std::max is not).
constexpr int64_t LANES = 16;

inline float row_max(const float* x, int64_t n) {
  float lanes[LANES];
  std::fill(lanes, lanes + LANES, -INFINITY);
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int64_t l = 0; l < LANES; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
  float max = -INFINITY;
  for (int64_t l = 0; l < LANES; ++l) max = lanes[l] > max ? lanes[l] : max;
  for (; j < n; ++j) max = x[j] > max ? x[j] : max;
  return max;
}

inline int64_t first_index(const float* x, int64_t n, float v) {
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    bool hit = false;
    for (int64_t l = 0; l < LANES; ++l) hit |= x[j + l] == v;
    if (hit) break;
  }
  for (; j < n; ++j)
    if (x[j] == v) return j;
  return 0;
}

void sample_row(const float* x, int64_t vocab, double u, bool greedy, float* mass,
                int64_t* token, double* lse) {
  const float max = row_max(x, vocab);
  if (!std::isfinite(max)) {  // no finite logit (or +inf): a token, not a crash
    *token = first_index(x, vocab, max);
    *lse = max;
    return;
  }
  const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  float w[SAMPLE_BLOCK];
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t c0 = b * SAMPLE_BLOCK;
    mass[b] = block_weights(x + c0, std::min(SAMPLE_BLOCK, vocab - c0), max, w);
    total += mass[b];
  }
  *lse = double(max) + std::log(total);
  if (greedy) {
    *token = first_index(x, vocab, max);
    return;
  }
  const double target = std::min(u * total, below(total));
  double cum = 0.0;
  int64_t b = 0;
  for (; b < blocks - 1 && !(cum + mass[b] > target); ++b) cum += mass[b];
  const int64_t c0 = b * SAMPLE_BLOCK, width = std::min(SAMPLE_BLOCK, vocab - c0);
  block_weights(x + c0, width, max, w);
  double inner = 0.0;
  for (int64_t j = 0; j < width; ++j) inner += w[j];
  const double frac = (target - cum) / double(mass[b]);
  const double inner_target = std::min(frac * inner, below(inner));
  double acc = 0.0;
  int64_t pos = 0;
  for (; pos < width - 1; ++pos) {
    acc += w[pos];
    if (acc > inner_target) break;
  }
  *token = c0 + pos;
}

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& x,
                                               const c10::optional<at::Tensor>& u) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "logits [n, vocab] float32 expected");
  const int64_t n = x.size(0), vocab = x.size(1);
  const bool greedy = !u.has_value();
  at::Tensor uc;
  if (!greedy) {
    uc = u->contiguous();
    TORCH_CHECK(uc.scalar_type() == at::kDouble && uc.numel() == n,
                "u must be float64 [n], one uniform per row");
  }
  auto xc = x.contiguous();
  auto tokens = at::empty({n}, x.options().dtype(at::kLong));
  auto lse = at::empty({n}, x.options().dtype(at::kDouble));
  const float* xp = xc.data_ptr<float>();
  const double* up = greedy ? nullptr : uc.data_ptr<double>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  double* lp = lse.data_ptr<double>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> mass((vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK);
    for (int64_t r = r0; r < r1; ++r)
      sample_row(xp + r * vocab, vocab, greedy ? 0.0 : up[r], greedy, mass.data(), tp + r,
                 lp + r);
  });
  return {tokens, lse};
}

// f() inside a profiler scope called `name`: torch.profiler sees the parts of decode_layer,
// whose kernels are called directly rather than through the dispatcher.
template <typename F>
auto scoped(const char* name, F f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

// How linear() multiplies; layers/linear.py's ATEN, ONEDNN and SMALL, which pick it.
constexpr int64_t PATH_ATEN = 0, PATH_ONEDNN = 1, PATH_SMALL = 2;

// x [m, k] @ w.T (+ bias) (+ residual) exactly as layers/linear.py's linear() computes it on
// `path`: the matrix-vector kernel above (w plain bf16, a few rows; the residual joins its
// float32 sums), else oneDNN's matmul (w packed or plain) or at::linear, then the add.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                  const at::Tensor* residual, int64_t path) {
  if (path == PATH_SMALL)
    return scoped("hotswap::small_linear", [&] {
      return small_linear(x, w, b, residual ? c10::optional<at::Tensor>(*residual) : c10::nullopt);
    });
  at::Tensor out;
  if (path == PATH_ONEDNN) {
    static auto plain = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                          c10::string_view, c10::List<c10::optional<at::Scalar>>,
                          c10::optional<c10::string_view>)>();
    out = plain.call(x.contiguous(), w, b, "none", c10::List<c10::optional<at::Scalar>>(),
                     c10::string_view(""));
  } else {
    out = at::linear(x, w, b);
  }
  return residual ? out.add_(*residual) : out;
}

// k_buf[loc[t]] = the k columns of qkv row t (from column q_size), v_buf[loc[t]] the v columns
// after them: index_copy_ of both, without its two dispatches.
void store_kv(const at::Tensor& qkv, int64_t q_size, const at::Tensor& k_buf,
              const at::Tensor& v_buf, const at::Tensor& loc) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous() && loc.numel() == qkv.size(0),
              "out_cache_loc must be contiguous int64, one slot per token");
  TORCH_CHECK(qkv.stride(1) == 1 && qkv.scalar_type() == k_buf.scalar_type() &&
                  k_buf.is_contiguous() && v_buf.is_contiguous(),
              "qkv rows must be dense and share the KV pool's dtype");
  const int64_t slots = k_buf.size(0), row = k_buf.size(1) * k_buf.size(2);
  const int64_t* lp = loc.data_ptr<int64_t>();
  const auto bytes = row * k_buf.element_size();
  const char* src = static_cast<const char*>(qkv.data_ptr());
  char* kp = static_cast<char*>(k_buf.data_ptr());
  char* vp = static_cast<char*>(v_buf.data_ptr());
  const int64_t stride = qkv.stride(0) * qkv.element_size(), offset = q_size * qkv.element_size();
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "out_cache_loc out of range");
    std::memcpy(kp + lp[t] * bytes, src + t * stride + offset, bytes);
    std::memcpy(vp + lp[t] * bytes, src + t * stride + offset + bytes, bytes);
  }
}

// One Llama decoder layer for a decode-only batch (one new token per row), the same ops as
// models/llama.py runs one by one from Python: norm, qkv, rotary, KV store, attention, o_proj
// + residual, norm, gate_up, SiLU-and-multiply, down + residual. Weights are whatever linear()
// multiplies on `path` (the packed copy where there is one, except on PATH_SMALL). The layer's
// input is x + *pending where pending is given (the previous layer's residual, not yet added);
// it returns its output the same way, {out, pending}: each residual add off PATH_SMALL (whose
// kernel adds it to its sums) joins the RMSNorm that reads the sum.
std::pair<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, const at::Tensor* pending, const at::Tensor& ln1, const at::Tensor& qkv_w,
    const c10::optional<at::Tensor>& qkv_b, const at::Tensor& o_w, const at::Tensor& ln2,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, double eps, int64_t path,
    const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_buf,
    const at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& req_to_token,
    const at::Tensor& req_idx, const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  const int64_t hkv = k_buf.size(1), d = k_buf.size(2);
  const int64_t q_size = num_heads * d, kv_size = hkv * d;
  const bool small = path == PATH_SMALL;
  // The parts other than the matmuls (aten ops, seen already) under their ops' names.
  auto norm = [&](const at::Tensor& t, const at::Tensor& w, const at::Tensor* r) {
    return scoped("hotswap::rms_norm", [&] { return rms_norm_impl(t, w, eps, r); });
  };
  auto qkv = linear(norm(x, ln1, pending), qkv_w, qkv_b, nullptr, path);
  scoped("hotswap::rotary_", [&] {
    return rotary_(qkv.slice(1, 0, q_size + kv_size).view({-1, num_heads + hkv, d}), cos, sin);
  });
  scoped("hotswap::store_kv", [&] { store_kv(qkv, q_size, k_buf, v_buf, loc); });
  auto o = scoped("hotswap::decode_attention", [&] {
    return decode_attention(qkv.slice(1, 0, q_size), k_buf, v_buf, req_to_token, req_idx,
                            seq_lens, scale);
  });
  auto h = linear(o, o_w, c10::nullopt, small ? &x : nullptr, path);
  auto gate_up = linear(norm(h, ln2, small ? nullptr : &x), gate_up_w, c10::nullopt, nullptr,
                        path);
  gate_up = scoped("hotswap::silu_and_mul", [&] { return silu_and_mul(gate_up); });
  auto out = linear(gate_up, down_w, c10::nullopt, small ? &h : nullptr, path);
  return {out, small ? at::Tensor() : h};
}

// Every decoder layer of a decode-only batch in one call: decode_layer for each layer in turn
// (weights: ln1, qkv, o, ln2, gate_up, down per layer; a qkv bias or None per layer). One call
// from Python a step instead of one a layer: parsing a layer's 20 arguments cost ~20 us (30
// layers at 1 row: 10.4 against 11.1 ms, alternating in one process). Each layer runs under a
// profiler scope of its own, hotswap::decode_layer.
at::Tensor decode_layers(const at::Tensor& x, at::TensorList weights,
                         const c10::List<c10::optional<at::Tensor>>& qkv_b,
                         at::TensorList k_bufs, at::TensorList v_bufs, double eps, int64_t path,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& loc,
                         const at::Tensor& req_to_token, const at::Tensor& req_idx,
                         const at::Tensor& seq_lens, int64_t num_heads, double scale) {
  const int64_t layers = k_bufs.size();
  TORCH_CHECK(int64_t(weights.size()) == 6 * layers && int64_t(qkv_b.size()) == layers &&
                  int64_t(v_bufs.size()) == layers,
              "six weights, a qkv bias (or None) and a K and V buffer per layer expected");
  std::pair<at::Tensor, at::Tensor> h{x, at::Tensor()};
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + 6 * i;
    const at::Tensor* pending = h.second.defined() ? &h.second : nullptr;
    h = scoped("hotswap::decode_layer", [&] {
      return decode_layer(h.first, pending, w[0], w[1], qkv_b.get(i), w[2], w[3], w[4], w[5],
                          eps, path, cos, sin, k_bufs[i], v_bufs[i], loc, req_to_token, req_idx,
                          seq_lens, num_heads, scale);
    });
  }
  return h.second.defined() ? h.first.add_(h.second) : h.first;
}

}  // namespace

TORCH_LIBRARY(hotswap, m) {
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, "
        "Tensor req_idx, Tensor seq_lens, float scale) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("small_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor? u) -> (Tensor, Tensor)");
  m.def("head_amx() -> bool");
  m.def("head_pack(Tensor weight) -> Tensor");
  m.def("head_logits(Tensor hidden, Tensor norm_weight, float eps, Tensor packed, int vocab) "
        "-> Tensor");
  m.def("decode_layers(Tensor x, Tensor[] weights, Tensor?[] qkv_b, Tensor(a!)[] k_bufs, "
        "Tensor(b!)[] v_bufs, float eps, int path, Tensor cos, Tensor sin, Tensor loc, "
        "Tensor req_to_token, Tensor req_idx, Tensor seq_lens, int num_heads, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(hotswap, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rotary_", &rotary_);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("small_linear", &small_linear);
  m.impl("sample_rows", &sample_rows);
  m.impl("head_pack", &head_pack);
  m.impl("head_logits", &head_logits);
  m.impl("decode_layers", &decode_layers);
}

TORCH_LIBRARY_IMPL(hotswap, CompositeExplicitAutograd, m) { m.impl("head_amx", &head_amx); }

// The packed weights are oneDNN tensors, which dispatch on their own key.
TORCH_LIBRARY_IMPL(hotswap, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
