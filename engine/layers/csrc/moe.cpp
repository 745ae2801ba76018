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
#include <vector>

#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// Expert e's n rows from `lo` on the small-batch path, on raw memory: the ops of the path above
// (small_linear rounded to bf16, silu_and_mul, small_linear, the weight applied and rounded), so
// the same bits, without the dozen tensor allocations and dispatches per expert, which at a
// decode step's few rows per expert cost as much as its matmuls.
void small_expert(const at::Tensor& xs, const at::Tensor& w13, const at::Tensor& w2,
                  const at::Tensor& ws, at::Tensor& out, int64_t e, int64_t lo, int64_t n) {
  using bf16 = at::BFloat16;
  const int64_t hidden = w13.size(2), inter = w2.size(2);
  thread_local std::vector<float> sums;
  thread_local std::vector<bf16> gate_up, h;
  sums.resize(n * std::max(2 * inter, hidden));
  gate_up.resize(n * 2 * inter);
  h.resize(n * inter);
  const bf16* x = xs.data_ptr<bf16>() + lo * hidden;
  small_linear_sums(x, w13.data_ptr<bf16>() + e * 2 * inter * hidden, sums.data(), n, hidden,
                    2 * inter);
  for (int64_t i = 0; i < n * 2 * inter; ++i) gate_up[i] = narrow<bf16>(sums[i]);
  for (int64_t i = 0; i < n; ++i) {
    const bf16* g = gate_up.data() + i * 2 * inter;
    silu_and_mul_row(g, g + inter, h.data() + i * inter, inter);
  }
  small_linear_sums(h.data(), w2.data_ptr<bf16>() + e * hidden * inter, sums.data(), n, inter,
                    hidden);
  bf16* o = out.data_ptr<bf16>() + lo * hidden;
  dispatch(ws.scalar_type(), "moe_experts", [&](auto zero) {
    const auto* w = ws.data_ptr<decltype(zero)>() + lo;
    for (int64_t i = 0; i < n; ++i) {
      const float wi = widen(w[i]);
      for (int64_t j = 0; j < hidden; ++j)
        o[i * hidden + j] = narrow<bf16>(widen(narrow<bf16>(sums[i * hidden + j])) * wi);
    }
  });
}

}  // namespace

// x [T, H]; w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; packed13 / packed2: each
// expert's oneDNN-packed weights, or empty; topk_ids [T, K] int64; topk_weights [T, K]. Returns
// sum over k of weight * down(silu(gate(x)) * up(x)) per token, with every op as grouped_experts
// runs it (so the same bits): each expert's matmuls on expert_linear()'s path for its row count
// (the small-batch kernel for a bf16 expert of at most `small_rows` rows, else oneDNN), the
// weight applied in its dtype and cast to x's, and each token's k outputs summed in ascending
// expert order.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                       at::TensorList packed13, at::TensorList packed2, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, int64_t small_rows) {
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
    if (bf16 && plain && n <= small_rows) return small_expert(xs, w13, w2, ws, out, e, lo, n);
    const auto rows = xs.narrow(0, lo, n);
    const auto& a = packed ? packed13[e] : w13[e];
    const auto& b = packed ? packed2[e] : w2[e];
    const auto h = silu_and_mul(path_linear(rows, a, std::nullopt, nullptr, PATH_ONEDNN));
    const auto y = path_linear(h, b, std::nullopt, nullptr, PATH_ONEDNN);
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
