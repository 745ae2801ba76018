// The experts of a mixture-of-experts layer in one call (layers/moe.py's grouped_experts):
// the (token, slot) pairs grouped by expert, each expert that got tokens running its gate/up
// matmul, SiLU-and-multiply and down matmul over its rows, the experts spread over the threads.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// One expert's n rows on raw memory, its matmuls given: gate_up = matmul13(x) and y =
// matmul2(silu_and_mul(gate_up)), each written in T, then out's rows = y * the rows' weights,
// rounded to T (the weight in its dtype, as grouped_experts applies it). No tensor allocation or
// dispatch per expert: at a decode step's few rows per expert they cost as much as its matmuls.
template <typename T, typename Matmul13, typename Matmul2>
void expert_rows(const T* x, int64_t n, int64_t hidden, int64_t inter, Matmul13 matmul13,
                 Matmul2 matmul2, const at::Tensor& ws, at::Tensor& out, int64_t lo) {
  thread_local std::vector<T> gate_up, h, y;
  gate_up.resize(n * 2 * inter);
  h.resize(n * inter);
  y.resize(n * hidden);
  matmul13(x, gate_up.data());
  for (int64_t i = 0; i < n; ++i) {
    const T* g = gate_up.data() + i * 2 * inter;
    silu_and_mul_row(g, g + inter, h.data() + i * inter, inter);
  }
  matmul2(h.data(), y.data());
  T* o = out.data_ptr<T>() + lo * hidden;
  dispatch(ws.scalar_type(), "moe_experts", [&](auto zero) {
    const auto* w = ws.data_ptr<decltype(zero)>() + lo;
    for (int64_t i = 0; i < n; ++i) {
      const float wi = widen(w[i]);
      for (int64_t j = 0; j < hidden; ++j)
        o[i * hidden + j] = narrow<T>(widen(y[i * hidden + j]) * wi);
    }
  });
}

// Expert e's n rows from `lo` on raw memory, with expert_linear's matmuls (the blocked kernel
// where the blocked layout is given, else bf16's small_linear; float32 sums rounded to T once),
// so grouped_experts' bits.
template <typename T>
void raw_expert(const at::Tensor& xs, const at::Tensor& w13, const at::Tensor& w2,
                const std::optional<at::Tensor>& blocked13,
                const std::optional<at::Tensor>& blocked2, const at::Tensor& ws, at::Tensor& out,
                int64_t e, int64_t lo, int64_t n) {
  const int64_t hidden = w13.size(2), inter = w2.size(2);
  // dst [n, outs] = a [n, k] @ expert e's weight w [outs, k] (or its blocked copy).T, in T.
  auto matmul = [&](const at::Tensor& w, const std::optional<at::Tensor>& blocked, int64_t k,
                    int64_t outs) {
    return [&, k, outs](const T* a, T* dst) {
      thread_local std::vector<float> sums;
      sums.resize(n * outs);
      if (blocked) {
        block_linear_sums(a, blocked->data_ptr<T>() + e * outs * k, sums.data(), n, k, outs);
      } else if constexpr (std::is_same_v<T, at::BFloat16>) {
        small_linear_sums(a, w.data_ptr<T>() + e * outs * k, sums.data(), n, k, outs);
      } else {
        TORCH_CHECK(false, "moe_experts: a float32 expert on raw memory needs the blocked "
                           "layout");
      }
      for (int64_t i = 0; i < n * outs; ++i) dst[i] = narrow<T>(sums[i]);
    };
  };
  expert_rows(xs.data_ptr<T>() + lo * hidden, n, hidden, inter,
              matmul(w13, blocked13, hidden, 2 * inter), matmul(w2, blocked2, inter, hidden), ws,
              out, lo);
}

// Expert e's n rows from `lo` over its int8 copies on raw memory (AVX512-VNNI), with
// int8_linear's matmuls (each row quantized as quantize_rows does, the exact int32 sums, the
// same rescaling), so grouped_experts' bits. quant: w13, scale13, w2, scale2, then w13 and w2 in
// the int8 blocked layout with their compensations (layers/moe.py's ExpertQuant).
template <typename T>
void raw_int8_expert(const at::Tensor& xs, at::TensorList quant, const at::Tensor& ws,
                     at::Tensor& out, int64_t e, int64_t lo, int64_t n) {
  const int64_t hidden = quant[0].size(2), inter = quant[2].size(2);
  // dst [n, outs] = a [n, k] @ W.T from W's int8 copy: blocked, its compensation, its scales.
  auto matmul = [&](const at::Tensor& blocked, const at::Tensor& comp, const at::Tensor& scale,
                    int64_t k, int64_t outs) {
    return [&, k, outs](const T* a, T* dst) {
      thread_local std::vector<float> scratch, row_scale;
      thread_local std::vector<int8_t> q;
      thread_local std::vector<int32_t> acc;
      scratch.resize(k);
      q.resize(n * k);
      row_scale.resize(n);
      acc.resize(n * outs);
      const int64_t block = hadamard_block(k);
      for (int64_t i = 0; i < n; ++i)
        row_scale[i] = quantize_row(a + i * k, scratch.data(), q.data() + i * k, k, block);
      vnni_sums(q.data(), blocked.data_ptr<int8_t>() + e * outs * k,
                comp.data_ptr<int32_t>() + e * outs, acc.data(), n, k, outs);
      const float* sw = scale.data_ptr<float>() + e * outs;
      for (int64_t i = 0; i < n; ++i)
        rescale_row<T>(acc.data() + i * outs, row_scale[i], sw, nullptr, nullptr,
                       dst + i * outs, outs);
    };
  };
  expert_rows(xs.data_ptr<T>() + lo * hidden, n, hidden, inter,
              matmul(quant[4], quant[5], quant[1], hidden, 2 * inter),
              matmul(quant[6], quant[7], quant[3], inter, hidden), ws, out, lo);
}

}  // namespace

// x [T, H]; w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; packed13 / packed2: each
// expert's oneDNN-packed weights, or empty; topk_ids [T, K] int64; topk_weights [T, K];
// blocked13 / blocked2: w13 and w2 in the blocked layout, or none; quant: the experts' int8
// copies (w13 int8 [E, 2I, H], its scales [E, 2I], w2 int8 [E, H, I], its scales [E, H], then
// where the VNNI kernel applies w13 and w2 in the int8 blocked layout and their compensations)
// or empty. Returns sum over k of weight * down(silu(gate(x)) * up(x)) per token, with every op
// as grouped_experts runs it (so the same bits): each expert's matmuls on its path (int8_linear
// over the int8 copies where given, its int32 sums exact whichever kernel makes them, else
// expert_linear()'s: the blocked kernel where the blocked layout is given, else the small-batch
// kernel for a bf16 expert of at most `small_rows` rows, else `dense_path`: PATH_ONEDNN (over the
// packed weights where given) or PATH_ATEN where oneDNN does not run x's dtype, as linear.py's
// matmul_path picks), the weight applied in its dtype and cast to x's, and each token's k outputs
// summed in ascending expert order.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       at::TensorList packed13, at::TensorList packed2, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, int64_t small_rows, int64_t dense_path,
                       const std::optional<at::Tensor>& blocked13,
                       const std::optional<at::Tensor>& blocked2, at::TensorList quant) {
  TORCH_CHECK(x.dim() == 2 && w13.dim() == 3 && w2.dim() == 3 && topk_ids.dim() == 2,
              "moe_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_ids [T, K]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.size(0) == x.size(0),
              "moe_experts: topk_ids must be int64 [T, K]");
  const int64_t num_experts = w13.size(0), top_k = topk_ids.size(1);
  const int64_t slots = x.size(0) * top_k;
  const bool packed = !packed13.empty();
  TORCH_CHECK(!packed || (static_cast<int64_t>(packed13.size()) == num_experts &&
                          static_cast<int64_t>(packed2.size()) == num_experts),
              "moe_experts: one packed weight per expert");
  TORCH_CHECK(blocked13.has_value() == blocked2.has_value() &&
                  (!blocked13 ||
                   (blocked13->numel() == w13.numel() && blocked2->numel() == w2.numel() &&
                    blocked13->is_contiguous() && blocked2->is_contiguous() &&
                    blocked13->scalar_type() == x.scalar_type() &&
                    blocked2->scalar_type() == x.scalar_type())),
              "moe_experts: blocked13 and blocked2 are both given (w13 and w2 in the blocked "
              "layout, of x's dtype) or neither");
  TORCH_CHECK(quant.empty() || ((quant.size() == 4 || quant.size() == 8) &&
                                quant[0].sizes() == w13.sizes() && quant[2].sizes() == w2.sizes()),
              "moe_experts: quant is empty or the experts' int8 w13, its scales, int8 w2, its "
              "scales (and both blocked, with their compensations)");
  TORCH_CHECK(quant.size() != 8 || has_vnni_kernel(), "moe_experts: built without AVX512-VNNI");
  TORCH_CHECK(dense_path == PATH_ONEDNN || (dense_path == PATH_ATEN && !packed),
              "moe_experts: dense_path is PATH_ONEDNN, or PATH_ATEN without packed weights");
  // A stable counting sort of the slots by expert: torch.argsort(stable=True)'s order.
  const auto ids = topk_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < num_experts, "moe_experts: expert id ", id[s],
                " outside [0, ", num_experts, ")");
    ++start[id[s] + 1];
  }
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  auto order_t = at::empty({slots}, topk_ids.options());
  auto token_t = at::empty({slots}, topk_ids.options());
  int64_t* order = order_t.data_ptr<int64_t>();
  int64_t* token = token_t.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) order[fill[id[s]]++] = s;
  for (int64_t i = 0; i < slots; ++i) token[i] = order[i] / top_k;
  const auto xs = x.index_select(0, token_t);
  const auto ws = topk_weights.reshape({-1}).index_select(0, order_t);
  auto out = at::empty({slots, x.size(1)}, x.options());
  // The experts that got tokens, most rows first: the threads take them one at a time.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  std::stable_sort(active.begin(), active.end(), [&](int64_t a, int64_t b) {
    return start[a + 1] - start[a] > start[b + 1] - start[b];
  });
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool plain = w13.is_contiguous() && w2.is_contiguous();
  auto run = [&](int64_t e) {
    const int64_t lo = start[e], n = start[e + 1] - lo;
    if (quant.size() == 8) {
      if (bf16) return raw_int8_expert<at::BFloat16>(xs, quant, ws, out, e, lo, n);
      return raw_int8_expert<float>(xs, quant, ws, out, e, lo, n);
    }
    if (!quant.empty()) {
      const auto rows = xs.narrow(0, lo, n);
      const auto h = silu_and_mul(int8_linear(rows, quant[0][e], quant[1][e], std::nullopt,
                                              std::nullopt, hadamard_block(rows.size(1))));
      const auto y = int8_linear(h, quant[2][e], quant[3][e], std::nullopt, std::nullopt,
                                 hadamard_block(h.size(1)));
      out.narrow(0, lo, n).copy_(y.mul(ws.narrow(0, lo, n).unsqueeze(1)));
      return;
    }
    if (plain && blocked13 && !bf16)
      return raw_expert<float>(xs, w13, w2, blocked13, blocked2, ws, out, e, lo, n);
    if (plain && bf16 && (blocked13 || n <= small_rows))
      return raw_expert<at::BFloat16>(xs, w13, w2, blocked13, blocked2, ws, out, e, lo, n);
    const auto rows = xs.narrow(0, lo, n);
    const auto& a = packed ? packed13[e] : w13[e];
    const auto& b = packed ? packed2[e] : w2[e];
    const auto h = silu_and_mul(path_linear(rows, a, std::nullopt, nullptr, dense_path));
    const auto y = path_linear(h, b, std::nullopt, nullptr, dense_path);
    out.narrow(0, lo, n).copy_(y.mul(ws.narrow(0, lo, n).unsqueeze(1)));
  };
  const int64_t count = static_cast<int64_t>(active.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), count));
  if (threads <= 1) {
    for (int64_t e : active) run(e);  // one expert: its ops keep every thread
  } else {
    std::exception_ptr error;
    const at::ThreadLocalState state;  // inference mode and the like, for the other threads
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      try {
        at::ThreadLocalStateGuard guard(state);
        run(active[i]);
      } catch (...) {
#pragma omp critical
        error = std::current_exception();
      }
    }
    if (error) std::rethrow_exception(error);
  }
  return at::zeros_like(x).index_add_(0, token_t, out);
}

}  // namespace hotswap
