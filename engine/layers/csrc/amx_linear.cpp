// bf16 matmuls of decode-sized batches on AMX tiles, the weight streamed from memory once.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "ops.h"

#ifdef HOTSWAP_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hotswap {

#ifdef HOTSWAP_AMX
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
#endif

namespace {

// W [n, k] is packed once (amx_pack) into blocks of AMX_BLOCK outputs, each the VNNI layout of
// AMX's B operand, [kp / 2, AMX_BLOCK, 2], k padded with zeros to kp, whole tiles of 32.
// x is multiplied 32 rows at a time: eight tiles, the two 16-row A tiles against the block's
// two 16-column B tiles into four float32 accumulators, k in steps of 32. A thread takes units
// (a block; gated, a gate block and its up block) in turn, every 32 rows of x for each, so a
// block is read from memory once; it asks for the next unit's lines into L2 a few per step,
// spread over the unit's tile products (oneDNN's
// matmul, with a call per weight, streams the weight at about half the rate: 30 layers of
// SmolLM2 at 64 rows from DRAM, 21.6 against 27.5 ms on the Xeon, docs/performance.md).
constexpr int64_t AMX_BLOCK = 32;
constexpr int64_t TILE_K = 32;  // bf16 per tile row (64 bytes)
constexpr int64_t TILE_ROWS = 16;
constexpr int64_t ROWS = 2 * TILE_ROWS;  // rows of x per pass over a block

inline int64_t padded(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#ifdef HOTSWAP_AMX
// Lines a thread asks for into L2 while it multiplies a unit: the next unit's blocks, one or two
// (not adjacent when gated), spread evenly over the unit's tile products.
struct NextLines {
  const char* blocks[2];
  int64_t block_lines, lines, per_step, asked;
  void step() {
    for (const int64_t e = std::min(asked + per_step, lines); asked < e; ++asked)
      _mm_prefetch(asked < block_lines ? blocks[0] + asked * 64
                                       : blocks[1] + (asked - block_lines) * 64,
                   _MM_HINT_T1);
  }
};

// The float32 sums of 32 rows of x (a0: the first, rows kp apart) against one block w, into
// acc [32 rows][32 outputs]; the tiles hold no state between calls.
AMX_TARGET inline void block_pass(const at::BFloat16* a0, const at::BFloat16* w, int64_t kp,
                                  float* acc, NextLines& next) {
  const at::BFloat16* a1 = a0 + TILE_ROWS * kp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < kp / TILE_K; ++s) {
    next.step();
    const at::BFloat16* ws = w + s * (TILE_K / 2) * AMX_BLOCK * 2;
    _tile_loadd(4, a0 + s * TILE_K, kp * 2);
    _tile_loadd(5, a1 + s * TILE_K, kp * 2);
    _tile_loadd(6, ws, AMX_BLOCK * 4);
    _tile_loadd(7, ws + 2 * TILE_ROWS, AMX_BLOCK * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, AMX_BLOCK * 4);
  _tile_stored(1, acc + TILE_ROWS, AMX_BLOCK * 4);
  _tile_stored(2, acc + TILE_ROWS * AMX_BLOCK, AMX_BLOCK * 4);
  _tile_stored(3, acc + TILE_ROWS * AMX_BLOCK + TILE_ROWS, AMX_BLOCK * 4);
}

// What a unit writes from its float32 sums: the bias added and rounded to bf16 (kRound);
// silu(gate) * up rounded to bf16 (kGated); or the float32 head's s * (hi + lo) (kHead).
enum class Epilogue { kRound, kGated, kHead };

// One call's units: x [passes x 32, kp] zero-padded to whole passes and tiles; for kHead each
// pass holds 16 rows' hi parts, then the same rows' lo parts (head.cpp), and covers those 16
// rows of out. A unit is one block: kRound out [m, n] bf16 = x @ W.T + bias; kHead out
// [m, width] float32 (width <= n, the rest padding) = scales[i] * (hi_i + lo_i) @ W.T. Gated, a
// unit is block u of the gate half and block u of the up half: out [m, n / 2] bf16 =
// silu(x @ Wg.T) * (x @ Wu.T).
struct Units {
  const at::BFloat16* x;
  const at::BFloat16* packed;
  int64_t m, n, kp;
  Epilogue epilogue;
  const at::BFloat16* bias;  // kRound: [n], or none
  const float* scales;       // kHead: [m]
  void* out;
  int64_t width;  // out's columns
};

AMX_TARGET inline __m512 bias_half(const at::BFloat16* bias) {
  const __m512i raw =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
}

// The mask of a row's first `count` lanes of 16 (the head's last block may end inside one).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? 0xFFFF : count <= 0 ? 0 : __mmask16((1u << count) - 1);
}

// Units [u0, u1) of `job` on the calling thread (a function of its own: a lambda would not take
// the target).
AMX_TARGET void amx_units(const Units& job, int64_t u0, int64_t u1) {
  const bool gated = job.epilogue == Epilogue::kGated, head = job.epilogue == Epilogue::kHead;
  const int64_t kp = job.kp, pass_rows = head ? TILE_ROWS : ROWS, parts = gated ? 2 : 1;
  const int64_t passes = padded(job.m, pass_rows) / pass_rows, half = job.n / AMX_BLOCK / 2;
  const int64_t block_elems = kp * AMX_BLOCK, block_lines = block_elems * 2 / 64;
  const int64_t lines = parts * block_lines, steps = passes * parts * (kp / TILE_K);
  const int64_t per_step = (lines + steps - 1) / steps;
  auto block = [&](int64_t u, int64_t part) {
    return job.packed + (u + part * half) * block_elems;
  };
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = TILE_ROWS;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float acc[2][ROWS * AMX_BLOCK];
  for (int64_t u = u0; u < u1; ++u) {
    const bool last = u + 1 == u1;
    NextLines next{{last ? nullptr : reinterpret_cast<const char*>(block(u + 1, 0)),
                    last || !gated ? nullptr : reinterpret_cast<const char*>(block(u + 1, 1))},
                   block_lines, lines, per_step, last ? lines : 0};
    const bool biased = job.epilogue == Epilogue::kRound && job.bias != nullptr;
    const __m512 bias0 = biased ? bias_half(job.bias + u * AMX_BLOCK) : _mm512_setzero_ps();
    const __m512 bias1 = biased ? bias_half(job.bias + u * AMX_BLOCK + 16) : _mm512_setzero_ps();
    const int64_t c0 = u * AMX_BLOCK;
    const __mmask16 mask0 = first_lanes(job.width - c0), mask1 = first_lanes(job.width - c0 - 16);
    for (int64_t p = 0; p < passes; ++p) {
      for (int64_t part = 0; part < parts; ++part)
        block_pass(job.x + p * ROWS * kp, block(u, part), kp, acc[part], next);
      const int64_t r0 = p * pass_rows;
      for (int64_t i = 0; i < std::min(pass_rows, job.m - r0); ++i) {
        const float* sums = acc[0] + i * AMX_BLOCK;
        if (head) {
          const float* lo = acc[0] + (TILE_ROWS + i) * AMX_BLOCK;
          const __m512 s = _mm512_set1_ps(job.scales[r0 + i]);
          float* o = static_cast<float*>(job.out) + (r0 + i) * job.width + c0;
          _mm512_mask_storeu_ps(o, mask0, _mm512_mul_ps(s, _mm512_add_ps(_mm512_load_ps(sums),
                                                                          _mm512_load_ps(lo))));
          _mm512_mask_storeu_ps(o + 16, mask1,
                                _mm512_mul_ps(s, _mm512_add_ps(_mm512_load_ps(sums + 16),
                                                               _mm512_load_ps(lo + 16))));
          continue;
        }
        at::BFloat16* o = static_cast<at::BFloat16*>(job.out) + (r0 + i) * job.width + c0;
        if (gated) {
          silu_and_mul_row(sums, acc[1] + i * AMX_BLOCK, o, AMX_BLOCK);
          continue;
        }
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(sums), bias0);
        const __m512 hi = _mm512_add_ps(_mm512_load_ps(sums + 16), bias1);
        _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

bool amx_built() {
#ifdef HOTSWAP_AMX
  return true;
#else
  return false;
#endif
}

at::Tensor amx_pack(const at::Tensor& w, const std::optional<at::Tensor>& into) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % AMX_BLOCK == 0,
              "weight [n, k] bfloat16 with n a multiple of 32 expected");
  const int64_t n = w.size(0), k = w.size(1), kp = padded(k, TILE_K);
  at::Tensor out;
  if (into.has_value()) {
    out = *into;
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.dim() == 2 && out.is_contiguous() &&
                    out.size(0) == n / AMX_BLOCK && out.size(1) == kp * AMX_BLOCK,
                "out: a contiguous bfloat16 [n / 32, 32 x k rounded up to 32] expected");
    if (kp != k) out.zero_();  // the padding of k; every other element is written below
  } else {
    out = at::zeros({n / AMX_BLOCK, kp * AMX_BLOCK}, w.options());
  }
  const auto wc = w.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // dst[b][j / 2][c][j % 2] = W[b * AMX_BLOCK + c][j]: a block is the transpose of its rows'
  // pairs, moved 32 bits at a time (an odd k's last value pairs with a zero).
  at::parallel_for(0, n / AMX_BLOCK, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < AMX_BLOCK; ++c) {
        const uint16_t* row = src + (b * AMX_BLOCK + c) * k;
        uint16_t* col = dst + b * kp * AMX_BLOCK + 2 * c;
        int64_t j = 0;
        for (; j + 1 < k; j += 2) {
          uint32_t pair;
          std::memcpy(&pair, row + j, 4);
          std::memcpy(col + j * AMX_BLOCK, &pair, 4);
        }
        if (j < k) col[j * AMX_BLOCK] = row[j];
      }
  });
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const std::optional<at::Tensor>& bias, bool gated) {
  TORCH_CHECK(amx_built(), "amx_linear: built without AMX support (GCC >= 11 or clang >= 12)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) == padded(x.size(1), TILE_K) * AMX_BLOCK,
              "x [m, k] bfloat16 and amx_pack of a [n, k] weight expected");
  TORCH_CHECK(!gated || (packed.size(0) % 2 == 0 && !bias.has_value()),
              "gated: a [gate | up] weight of 2 x a multiple of 32 rows, and no bias, expected");
  const int64_t m = x.size(0), k = x.size(1), kp = padded(k, TILE_K);
  const int64_t n = packed.size(0) * AMX_BLOCK;
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "bias [n] bfloat16 expected");
  }
  auto out = at::empty({m, gated ? n / 2 : n}, x.options());
  if (m == 0) return out;
#ifdef HOTSWAP_AMX
  TORCH_CHECK(amx_permitted(), "amx_linear: the kernel did not grant this process AMX");
  // x zero-padded to whole passes of 32 rows and whole tiles of k, unless it already is.
  at::Tensor a = x;
  if (m % ROWS != 0 || kp != k || !x.is_contiguous()) {
    a = at::zeros({padded(m, ROWS), kp}, x.options());
    a.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  const Units job{a.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), m, n, kp,
                  gated ? Epilogue::kGated : Epilogue::kRound,
                  b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, nullptr, out.data_ptr(),
                  out.size(1)};
  at::parallel_for(0, packed.size(0) / (gated ? 2 : 1), 1,
                   [&](int64_t u0, int64_t u1) { amx_units(job, u0, u1); });
#endif
  return out;
}

void amx_head(const at::BFloat16* parts, const float* scales, const at::Tensor& packed, float* out,
              int64_t m, int64_t width) {
#ifdef HOTSWAP_AMX
  TORCH_CHECK(amx_permitted(), "head_logits: the kernel did not grant this process AMX");
  const Units job{parts, packed.data_ptr<at::BFloat16>(), m, packed.size(0) * AMX_BLOCK,
                  packed.size(1) / AMX_BLOCK, Epilogue::kHead, nullptr, scales, out, width};
  at::parallel_for(0, packed.size(0), 1, [&](int64_t u0, int64_t u1) { amx_units(job, u0, u1); });
#else
  TORCH_CHECK(false, "head_logits: built without AMX support (GCC >= 11 or clang >= 12)");
#endif
}

}  // namespace hotswap
