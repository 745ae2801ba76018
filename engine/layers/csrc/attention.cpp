// Paged decode attention over the KV pool, and the KV store of a step's new tokens.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

constexpr int64_t KEY_BLOCK = 32;

// A row's keys are attended CHUNK at a time (the last chunk takes the rest), each chunk a task of
// its own whose float32 result joins the others' by their softmax sums, so that the keys of a
// few long rows spread over the threads. The chunks follow from the row's own length alone: a
// row's result does not depend on its batch-mates (deterministic mode).
constexpr int64_t CHUNK = 1024;

// The attention of one (chunk, kv head) pair: the `group` query heads that share kv head h attend
// over `len` keys, whose pool slots are `slots[0:len]`; `out` gets the group's outputs [group,
// d] (the row's own, in T, where the chunk is its only one; else float32 for the join) and
// `stats` each one's [max score, sum of exp(score - max)]. `scores` has room for [group, len];
// the portable version also uses qf [group, d], rows [KEY_BLOCK, d] and acc [group, d].
template <typename T, typename O>
using AttendFn = void (*)(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                          int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t d,
                          float scale, O* out, float* stats, float* qf, float* rows,
                          float* scores, float* acc);

// A row's keys sit a slot per decode step of its batch apart (kilobytes), which the hardware
// prefetcher does not follow, and each load would otherwise wait on memory: the attention's
// loops ask for the key (or value) KEYS_AHEAD ahead of the one they read, and a task asks for
// its first KEYS_AHEAD keys and values when it starts (prefetch_rows). 16 or 64 ahead did no
// better, and asking for all of a slot's heads at once did worse (docs/performance.md).
constexpr int64_t KEYS_AHEAD = 32;

// Asks for kv head h's d values of pool slot `slot` in buf [slots, hkv, d].
template <typename T>
inline void prefetch_head(const T* buf, int64_t slot, int64_t hkv, int64_t h, int64_t d) {
  const char* p = reinterpret_cast<const char*>(buf + (slot * hkv + h) * d);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Portable: keys, then values, widened KEY_BLOCK rows at a time into `rows`, every head run
// over the block.
template <typename T, typename O>
void attend_portable(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                     int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t d, float scale,
                     O* out, float* stats, float* qf, float* rows, float* scores, float* acc) {
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
    stats[2 * g] = m;
    stats[2 * g + 1] = sum;
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
  for (int64_t i = 0; i < group * d; ++i) out[i] = narrow<O>(acc[i]);
}

#if defined(__AVX512F__)
// s[0:len] -> exp(s - max(s)) in place; stats <- [max(s), the sum of the exps].
inline void exp_weights(float* s, int64_t len, float* stats) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= len; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  const __mmask16 tail = __mmask16((1u << (len - j)) - 1);
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
  stats[0] = _mm512_reduce_max_ps(m);
  const __m512 mx = _mm512_set1_ps(stats[0]);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= len; j += 16) {
    const __m512 w = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mx));
    _mm512_storeu_ps(s + j, w);
    sum = _mm512_add_ps(sum, w);
  }
  const __m512 w = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), mx));
  _mm512_mask_storeu_ps(s + j, tail, w);
  stats[1] = _mm512_reduce_add_ps(_mm512_mask_add_ps(sum, tail, sum, w));
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


// out[g] = (sum_j w[g, j] * v_j) / sum_g for G query heads (w: their [G, len] scores; stats:
// their [max, sum] pairs): each value row read and widened once for all G heads, whose G * D /
// 16 accumulators stay in registers.
template <int64_t D, int64_t G, typename T, typename O>
inline void weigh_values(const float* w, int64_t len, const T* v_buf, const int64_t* slots,
                         int64_t hkv, int64_t h, const float* stats, O* out) {
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
    const __m512 inv = _mm512_set1_ps(1.f / stats[2 * g + 1]);
    for (int64_t c = 0; c < C; ++c) store16(out + g * D + 16 * c, _mm512_mul_ps(acc[g][c], inv));
  }
}

// AVX-512 (bf16: AVX512-BF16) for head sizes D of 64 and 128: all `group` heads' scores from
// each key loaded once, four keys per reduction tree; a vectorised softmax; then the values
// weighed for up to 256 / D heads at a time, so no head makes its own pass over the keys and no
// value row is widened into a buffer (docs/performance.md).
template <int64_t D, typename T, typename O>
void attend_avx512(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots,
                   int64_t len, int64_t h, int64_t hkv, int64_t group, int64_t, float scale,
                   O* out, float* stats, float*, float*, float* scores, float*) {
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
  for (int64_t g0 = 0; g0 < group; g0 += GMAX) {
    const int64_t gc = std::min(GMAX, group - g0);
    for (int64_t g = g0; g < g0 + gc; ++g) exp_weights(scores + g * len, len, stats + 2 * g);
    const float* w = scores + g0 * len;
    const float* sums = stats + 2 * g0;
    O* o = out + g0 * D;
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

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// s[0:len] -> exp(s - max(s)) in place; stats <- [max(s), the sum of the exps].
inline void exp_weights8(float* s, int64_t len, float* stats) {
  const int64_t full = len / 8 * 8;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  float mx = reduce_max8(m);
  for (int64_t j = full; j < len; ++j) mx = std::max(mx, s[j]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < full; j += 8) {
    const __m256 w = fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, w);
    sum = _mm256_add_ps(sum, w);
  }
  float total = reduce_add8(sum);
  for (int64_t j = full; j < len; ++j) total += s[j] = fast_exp(s[j] - mx);
  stats[0] = mx;
  stats[1] = total;
}

// scale * (q . k[r]) for four key rows, q widened to float32.
template <int64_t D, typename T>
inline __m128 key_scores4(const float* q, const T* const* k, float scale) {
  __m256 s[4];
  for (int64_t r = 0; r < 4; ++r) {
    s[r] = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k[r]));
    for (int64_t c = 8; c < D; c += 8)
      s[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k[r] + c), s[r]);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  return _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)),
                    _mm_set1_ps(scale));
}

// out[g] = (sum_j w[g, j] * v_j) / sum_g for G query heads, each value row read once for all
// of them (weigh_values with 8 lanes).
template <int64_t D, int64_t G, typename T, typename O>
inline void weigh_values8(const float* w, int64_t len, const T* v_buf, const int64_t* slots,
                          int64_t hkv, int64_t h, const float* stats, O* out) {
  constexpr int64_t C = D / 8;
  __m256 acc[G][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    if (j + KEYS_AHEAD < len) prefetch_head(v_buf, slots[j + KEYS_AHEAD], hkv, h, D);
    const T* v = v_buf + (slots[j] * hkv + h) * D;
    for (int64_t c = 0; c < C; ++c) {
      const __m256 vf = load8(v + 8 * c);
      for (int64_t g = 0; g < G; ++g)
        acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[g * len + j]), vf, acc[g][c]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / stats[2 * g + 1]);
    for (int64_t c = 0; c < C; ++c) store8(out + g * D + 8 * c, _mm256_mul_ps(acc[g][c], inv));
  }
}

// AVX2 with FMA (AVX-512's attend_avx512 with 8 lanes) for head sizes 64 and 128: every head's
// scores from each key loaded once, a vectorised softmax, the values weighed for up to two
// heads (D 64) or one (D 128) at a time, so the accumulators stay in the 16 registers.
template <int64_t D, typename T, typename O>
void attend_avx2(const T* q, const T* k_buf, const T* v_buf, const int64_t* slots, int64_t len,
                 int64_t h, int64_t hkv, int64_t group, int64_t, float scale, O* out,
                 float* stats, float* qf, float*, float* scores, float*) {
  for (int64_t g = 0; g < group; ++g) load_row(q + g * D, qf + g * D, D);
  for (int64_t j = 0; j < len; j += 4) {
    for (int64_t r = j + KEYS_AHEAD; r < std::min(j + KEYS_AHEAD + 4, len); ++r)
      prefetch_head(k_buf, slots[r], hkv, h, D);
    const T* k[4];  // the last call of a row repeats its last key where fewer are left
    for (int64_t r = 0; r < 4; ++r) k[r] = k_buf + (slots[std::min(j + r, len - 1)] * hkv + h) * D;
    const int64_t keep = std::min<int64_t>(4, len - j);
    for (int64_t g = 0; g < group; ++g) {
      alignas(16) float four[4];
      _mm_store_ps(four, key_scores4<D>(qf + g * D, k, scale));
      std::copy(four, four + keep, scores + g * len + j);
    }
  }
  constexpr int64_t GMAX = 128 / D;
  for (int64_t g0 = 0; g0 < group; g0 += GMAX) {
    const int64_t gc = std::min(GMAX, group - g0);
    for (int64_t g = g0; g < g0 + gc; ++g) exp_weights8(scores + g * len, len, stats + 2 * g);
    const float* w = scores + g0 * len;
    if constexpr (GMAX == 2) {
      if (gc == 2) {
        weigh_values8<D, 2>(w, len, v_buf, slots, hkv, h, stats + 2 * g0, out + g0 * D);
        continue;
      }
    }
    weigh_values8<D, 1>(w, len, v_buf, slots, hkv, h, stats + 2 * g0, out + g0 * D);
  }
}
#endif

template <typename T, typename O>
AttendFn<T, O> attend_for(int64_t d) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (d == 64) return attend_avx2<64, T, O>;
  if (d == 128) return attend_avx2<128, T, O>;
#endif
#if defined(__AVX512F__)
#if !defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, float>)
#endif
  {
    if (d == 64) return attend_avx512<64, T, O>;
    if (d == 128) return attend_avx512<128, T, O>;
  }
#endif
  return attend_portable<T, O>;
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

}  // namespace

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
  // Row i's chunks are tasks first[i] .. first[i + 1] - 1. A row of one chunk gets its outputs
  // directly; the chunks of a longer one write theirs in float32 into part[chunk] and their
  // softmax stats into stats[chunk], which a second pass joins.
  std::vector<int64_t> first(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + (lens[i] + CHUNK - 1) / CHUNK;
  const int64_t chunks = first[n], hq = q.size(1) / d;
  std::vector<int64_t> row_of(chunks);
  for (int64_t i = 0; i < n; ++i) std::fill(&row_of[first[i]], &row_of[first[i + 1]], i);
  const bool joins = chunks > n;
  const auto part = at::empty({joins ? chunks * hq * (d + 2) : 0}, q.options().dtype(at::kFloat));
  float* pp = part.data_ptr<float>();  // [chunks, hq, d] outputs,
  float* sp = pp + (joins ? chunks * hq * d : 0);  // then [chunks, hq, 2] stats
  auto out = at::empty({n, q.size(1)}, q.options());
  const float fscale = float(scale);
  dispatch(q.scalar_type(), "decode_attention", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_buf.data_ptr<scalar_t>();
    const scalar_t* vp = v_buf.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t q_stride = q.stride(0);
    // A task is a chunk's every kv head (whole slots read at once) when there are chunks enough
    // for the threads, else a (chunk, kv head) pair.
    const int64_t splits = chunks >= 4 * at::get_num_threads() ? 1 : hkv, heads = hkv / splits;
    at::parallel_for(0, chunks * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(group * d), block(KEY_BLOCK * d),
          scores(group * std::min(CHUNK, max_len)), acc(group * d), own(group * 2);
      const AttendFn<scalar_t, scalar_t> whole = attend_for<scalar_t, scalar_t>(d);
      const AttendFn<scalar_t, float> partial = attend_for<scalar_t, float>(d);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t c = t / splits, i = row_of[c], h0 = t % splits * heads;
        const int64_t j0 = (c - first[i]) * CHUNK, len = std::min(CHUNK, lens[i] - j0);
        const int64_t* slots = table + rows[i] * width + j0;
        prefetch_rows(kp, vp, slots, len, hkv, d, h0, heads);
        for (int64_t h = h0; h < h0 + heads; ++h) {
          const scalar_t* qh = qp + i * q_stride + h * group * d;
          if (first[i + 1] - first[i] == 1)
            whole(qh, kp, vp, slots, len, h, hkv, group, d, fscale,
                  op + i * q.size(1) + h * group * d, own.data(), qf.data(), block.data(),
                  scores.data(), acc.data());
          else
            partial(qh, kp, vp, slots, len, h, hkv, group, d, fscale,
                    pp + (c * hq + h * group) * d, sp + (c * hq + h * group) * 2, qf.data(),
                    block.data(), scores.data(), acc.data());
        }
      }
    });
    if (!joins) return;
    // Each chunk's outputs weighed by its softmax sum relative to the row's largest score.
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> weight;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t c0 = first[i], nc = first[i + 1] - c0;
        if (nc == 1) continue;
        weight.resize(nc);
        for (int64_t g = 0; g < hq; ++g) {
          const float* o = pp + (c0 * hq + g) * d;  // chunk c0 + c's at o + c * hq * d
          const float* st = sp + (c0 * hq + g) * 2;  // its max and sum at st + c * hq * 2
          float m = -INFINITY, total = 0.f;
          for (int64_t c = 0; c < nc; ++c) m = std::max(m, st[c * hq * 2]);
          for (int64_t c = 0; c < nc; ++c)
            total += weight[c] = st[c * hq * 2 + 1] * std::exp(st[c * hq * 2] - m);
          scalar_t* dst = op + i * q.size(1) + g * d;
          for (int64_t e = 0; e < d; ++e) {
            float sum = 0.f;
            for (int64_t c = 0; c < nc; ++c) sum += weight[c] * o[c * hq * d + e];
            dst[e] = narrow<scalar_t>(sum / total);
          }
        }
      }
    });
  });
  return out;
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

}  // namespace hotswap
