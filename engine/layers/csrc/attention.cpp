// Paged decode attention over the KV pool, and the KV store of a step's new tokens.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "amx.h"
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


// out[g] = (sum_j w[g, j] * v_j) / sum_g for G query heads (w[g, j] at w[g * wg + j * wj]: their
// weights; stats: their [max, sum] pairs): each value row read and widened once for all G
// heads, whose G * D / 16 accumulators stay in registers. A bf16 row is read 32 values a load
// and widened without a shuffle: its even values by a shift, its odd ones by a mask, so
// acc[g][2c] holds dims 32c, 32c + 2, ... and acc[g][2c + 1] dims 32c + 1, 32c + 3, ...,
// interleaved back at the end (the same sums; 3-7% less time a task than widening 16 values a
// load, docs/performance.md).
template <int64_t D, int64_t G, typename T, typename O>
inline void weigh_values(const float* w, int64_t len, const T* v_buf, const int64_t* slots,
                         int64_t hkv, int64_t h, const float* stats, O* out, int64_t wg,
                         int64_t wj) {
  constexpr int64_t C = D / 16;
  constexpr bool pairs = std::is_same_v<T, at::BFloat16>;
  __m512 acc[G][C];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  const __m512i odd = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t j = 0; j < len; ++j) {
    if (j + KEYS_AHEAD < len) prefetch_head(v_buf, slots[j + KEYS_AHEAD], hkv, h, D);
    const T* v = v_buf + (slots[j] * hkv + h) * D;
    __m512 vf[C];
    if constexpr (pairs) {
      for (int64_t c = 0; c < C; c += 2) {
        const __m512i raw = _mm512_loadu_si512(v + 16 * c);
        vf[c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        vf[c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, odd));
      }
    } else {
      for (int64_t c = 0; c < C; ++c) vf[c] = load16(v + 16 * c);
    }
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(w[g * wg + j * wj]);
      for (int64_t c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
    }
  }
  // Lanes 0-15 of (even, odd) interleaved, then lanes 16-31.
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                        24, 8);
  for (int64_t g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / stats[2 * g + 1]);
    for (int64_t c = 0; c < C; c += pairs ? 2 : 1) {
      const __m512 a = _mm512_mul_ps(acc[g][c], inv);
      if constexpr (pairs) {
        const __m512 b = _mm512_mul_ps(acc[g][c + 1], inv);
        store16(out + g * D + 16 * c, _mm512_permutex2var_ps(a, low, b));
        store16(out + g * D + 16 * c + 16, _mm512_permutex2var_ps(a, high, b));
      } else {
        store16(out + g * D + 16 * c, a);
      }
    }
  }
}

// weigh_values for every query head of the group, 256 / D heads a pass (their accumulators in
// registers); w[g, j] at w[g * len + j] (wj = 1) or w[j * wj + g] (key-major, wj = gp).
template <int64_t D, typename T, typename O>
inline void weigh_groups(const float* w, int64_t len, int64_t wj, const T* v_buf,
                         const int64_t* slots, int64_t hkv, int64_t h, int64_t group,
                         const float* stats, O* out) {
  constexpr int64_t GMAX = 256 / D;
  const int64_t wg = wj == 1 ? len : 1;
  for (int64_t g0 = 0; g0 < group; g0 += GMAX) {
    const int64_t gc = std::min(GMAX, group - g0);
    const float* wp = w + g0 * wg;
    const float* sums = stats + 2 * g0;
    O* o = out + g0 * D;
    if constexpr (GMAX == 4) {
      switch (gc) {
        case 1: weigh_values<D, 1>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj); break;
        case 2: weigh_values<D, 2>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj); break;
        case 3: weigh_values<D, 3>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj); break;
        default: weigh_values<D, 4>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj); break;
      }
    } else if (gc == 1) {
      weigh_values<D, 1>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj);
    } else {
      weigh_values<D, 2>(wp, len, v_buf, slots, hkv, h, sums, o, wg, wj);
    }
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
  for (int64_t g = 0; g < group; ++g) exp_weights(scores + g * len, len, stats + 2 * g);
  weigh_groups<D>(scores, len, 1, v_buf, slots, hkv, h, group, stats, out);
}
#endif

#if defined(HOTSWAP_AMX) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define ATTEND_AMX 1
// The attention of one (chunk, kv head) pair for a bf16 pool on a CPU with AMX (tiles as
// attention_tiles configures them): the scores of 16 keys at a time as one tile product per 32
// dims, C [16 keys, gp] = K [16 keys, 32] @ Q.T (B: the group's query pairs, loaded once a
// task), no sum across lanes; then exp_weights_amx, and weigh_values as attend_avx512. The
// keys' rows are the A tile, read where they lie when the 16 slots are consecutive (a prompt's)
// and copied side by side first otherwise; a task whose keys mostly are not (a decode's) runs
// attend_avx512 instead. `scores` holds the weights key-major, [len rounded up to 16, gp] for gp the group
// rounded up to a power of two (<= 16). The same exact bf16 products as attend_avx512's, summed
// in AMX's order; the scores took 22 -> 9-11 cycles a key and kv head (docs/performance.md).
constexpr int64_t AMX_KEYS = 16, AMX_MIN_KEYS = 64;

inline int64_t group_lanes(int64_t group) {
  int64_t gp = 1;
  while (gp < group) gp *= 2;
  return gp;
}

// s [len, gp] (key-major) * scale -> exp(s - max) per query head, in place; stats[2g, 2g + 1] <-
// head g's [max, sum of the exps]. Lane l of every 16 holds head l % gp.
inline void exp_weights_amx(float* s, int64_t len, int64_t gp, int64_t group, float scale,
                            float* stats) {
  const int64_t total = len * gp, full = total / 16 * 16;
  const __mmask16 tail = __mmask16((1u << (total - full)) - 1);
  // max(s * scale) = max(s) * scale, both rounded once: the scaled scores are not stored.
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + full));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  for (int64_t l = gp; l < 16; ++l) lanes[l % gp] = std::max(lanes[l % gp], lanes[l]);
  for (int64_t l = 0; l < gp; ++l) lanes[l] *= scale;
  for (int64_t l = gp; l < 16; ++l) lanes[l] = lanes[l % gp];
  const __m512 mx = _mm512_load_ps(lanes);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < full; j += 16) {
    const __m512 w = fast_exp16(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), sc), mx));
    _mm512_storeu_ps(s + j, w);
    sum = _mm512_add_ps(sum, w);
  }
  const __m512 w = fast_exp16(
      _mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), sc), mx));
  _mm512_mask_storeu_ps(s + full, tail, w);
  sum = _mm512_mask_add_ps(sum, tail, sum, w);
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum);
  for (int64_t l = gp; l < 16; ++l) sums[l % gp] += sums[l];
  for (int64_t g = 0; g < group; ++g) stats[2 * g] = lanes[g], stats[2 * g + 1] = sums[g];
}

// Whether slots s[0:16] run consecutively (s[i] == s[0] + i), as a prompt's do.
inline bool consecutive16(const int64_t* s) {
  const __m512i lo = _mm512_add_epi64(_mm512_set1_epi64(s[0]),
                                      _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
  const __m512i hi = _mm512_add_epi64(lo, _mm512_set1_epi64(8));
  return (_mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s), lo) &
          _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(s + 8), hi)) == 0xFF;
}

// Whether a call's tasks take attend_amx: a bf16 pool, head size 64 or 128, at most 16 query
// heads a kv head, and AMX granted.
inline bool amx_attends(bool bf16, int64_t d, int64_t group) {
  return bf16 && (d == 64 || d == 128) && group <= 16 && amx_permitted();
}

// The tiles attend_amx uses, configured once for all of a thread's tasks in a call (per task it
// cost ~250 cycles): C 0 [16 keys, gp] float32, A 1 [16 keys, 32 dims], B 2 to 2 + d / 32 - 1
// [16 pairs, gp].
AMX_TARGET inline void attention_tiles(int64_t group, int64_t d) {
  const uint16_t cols = uint16_t(group_lanes(group) * 4);
  TileConfig cfg;
  cfg.rows[0] = AMX_KEYS, cfg.colsb[0] = cols;
  cfg.rows[1] = AMX_KEYS, cfg.colsb[1] = 64;
  for (int64_t t = 2; t < 2 + d / 32; ++t) cfg.rows[t] = 16, cfg.colsb[t] = cols;
  _tile_loadconfig(&cfg);
}

template <int64_t D, typename O>
AMX_TARGET void attend_amx(const at::BFloat16* q, const at::BFloat16* k_buf,
                           const at::BFloat16* v_buf, const int64_t* slots, int64_t len,
                           int64_t h, int64_t hkv, int64_t group, int64_t, float scale, O* out,
                           float* stats, float*, float* rows, float* scores, float*) {
  // Mostly scattered keys (a decode's) take attend_avx512, where the copies cost what the tiles
  // save, and so do fewer than AMX_MIN_KEYS, where the task's fixed costs do
  // (docs/performance.md).
  int64_t runs = 0;
  for (int64_t j0 = 0; j0 + AMX_KEYS <= len; j0 += AMX_KEYS) runs += consecutive16(slots + j0);
  if (2 * runs * AMX_KEYS < len || len < AMX_MIN_KEYS)
    return attend_avx512<D, at::BFloat16, O>(q, k_buf, v_buf, slots, len, h, hkv, group, 0,
                                             scale, out, stats, nullptr, rows, scores, nullptr);
  constexpr int64_t S = D / 32;  // tile products a block of keys (32 dims each)
  const int64_t gp = group_lanes(group);
  // B_t [16 pairs, gp]: query head g's dims 32t + 2p, 32t + 2p + 1 (zero past the group).
  alignas(64) uint32_t b[S][16][16] = {};
  for (int64_t t = 0; t < S; ++t)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t g = 0; g < group; ++g)
        std::memcpy(&b[t][p][g], q + g * D + 32 * t + 2 * p, 4);
  _tile_loadd(2, b[0], 64);  // tile numbers are immediates
  _tile_loadd(3, b[1], 64);
  if constexpr (S > 2) {
    _tile_loadd(4, b[2], 64);
    _tile_loadd(5, b[3], 64);
  }
  at::BFloat16* side = reinterpret_cast<at::BFloat16*>(rows);  // [16, D]: copied keys
  for (int64_t j0 = 0; j0 < len; j0 += AMX_KEYS) {
    for (int64_t r = j0 + KEYS_AHEAD; r < std::min(j0 + KEYS_AHEAD + AMX_KEYS, len); ++r)
      prefetch_head(k_buf, slots[r], hkv, h, D);
    const int64_t n = std::min(AMX_KEYS, len - j0);
    const bool runs = n == AMX_KEYS && consecutive16(slots + j0);
    const at::BFloat16* a = k_buf + (slots[j0] * hkv + h) * D;
    int64_t a_stride = hkv * D * 2;
    if (!runs) {  // copied; past the row's end its last key again, whose scores are not read
      for (int64_t i = 0; i < AMX_KEYS; ++i) {
        const at::BFloat16* key = k_buf + (slots[j0 + std::min(i, n - 1)] * hkv + h) * D;
        for (int64_t c = 0; c < D; c += 32)
          _mm512_storeu_si512(side + i * D + c, _mm512_loadu_si512(key + c));
      }
      a = side;
      a_stride = D * 2;
    }
    _tile_zero(0);
    _tile_loadd(1, a, a_stride);
    _tile_dpbf16ps(0, 1, 2);
    _tile_loadd(1, a + 32, a_stride);
    _tile_dpbf16ps(0, 1, 3);
    if constexpr (S > 2) {
      _tile_loadd(1, a + 64, a_stride);
      _tile_dpbf16ps(0, 1, 4);
      _tile_loadd(1, a + 96, a_stride);
      _tile_dpbf16ps(0, 1, 5);
    }
    _tile_stored(0, scores + j0 * gp, gp * 4);
  }
  exp_weights_amx(scores, len, gp, group, scale, stats);
  weigh_groups<D>(scores, len, gp, v_buf, slots, hkv, h, group, stats, out);
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
AttendFn<T, O> attend_for(int64_t d, int64_t group) {
#ifdef ATTEND_AMX
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx_attends(true, d, group)) return d == 64 ? attend_amx<64, O> : attend_amx<128, O>;
  }
#endif
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
      std::vector<float> qf(group * d), block(KEY_BLOCK * d), acc(group * d), own(group * 2);
      // [group, len], or key-major [len rounded up to 16, group rounded up to a power of two]
      // (attend_amx); not zeroed: every score is written before it is read.
      const std::unique_ptr<float[]> scores(
          new float[2 * group * (std::min(CHUNK, max_len) + 32)]);
      const AttendFn<scalar_t, scalar_t> whole = attend_for<scalar_t, scalar_t>(d, group);
      const AttendFn<scalar_t, float> partial = attend_for<scalar_t, float>(d, group);
#ifdef ATTEND_AMX
      const bool tiles = amx_attends(std::is_same_v<scalar_t, at::BFloat16>, d, group);
      if (tiles) attention_tiles(group, d);
#endif
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
                  scores.get(), acc.data());
          else
            partial(qh, kp, vp, slots, len, h, hkv, group, d, fscale,
                    pp + (c * hq + h * group) * d, sp + (c * hq + h * group) * 2, qf.data(),
                    block.data(), scores.get(), acc.data());
        }
      }
#ifdef ATTEND_AMX
      if (tiles) _tile_release();
#endif
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
