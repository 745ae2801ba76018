// A whole Llama decoder layer for decode-only steps, and the stack of them a model runs.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "decode_layer.h"
#include "ops.h"
#include "vec.h"

namespace hotswap {
namespace {

// f() inside a profiler scope called `name`: torch.profiler sees the parts of decode_layer,
// whose kernels are called directly rather than through the dispatcher.
template <typename F>
auto scoped(const char* name, F f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

}  // namespace

// The blocked kernel (w in the blocked layout, any rows; the residual joins its float32 sums), the
// small-batch kernel (w plain bf16, a few rows; the residual joins its float32 sums), the
// int8 matmul (w int8 with the rest of its copy in `quant`; the residual joins its rescaling),
// else AMX's (w in amx_pack's layout), oneDNN's matmul (w packed or plain) or at::linear, then
// the add.
at::Tensor path_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                       const at::Tensor* residual, int64_t path, at::TensorList quant) {
  if (path == PATH_INT8)
    return scoped("hotswap::int8_linear", [&] {
      auto opt = [&](size_t i) {
        return quant.size() > i ? std::optional<at::Tensor>(quant[i]) : std::nullopt;
      };
      return int8_linear(x, w, quant[0], b,
                         residual ? std::optional<at::Tensor>(*residual) : std::nullopt,
                         hadamard_block(x.size(1)), opt(1), opt(2));
    });
  if (path == PATH_BLOCKED)
    return scoped("hotswap::blocked_linear", [&] {
      return blocked_linear(x, w, b,
                            residual ? std::optional<at::Tensor>(*residual) : std::nullopt,
                            false);
    });
  if (path == PATH_SMALL)
    return scoped("hotswap::small_linear", [&] {
      return small_linear(x, w, b,
                          residual ? std::optional<at::Tensor>(*residual) : std::nullopt);
    });
  at::Tensor out;
  if (path == PATH_AMX) {
    out = scoped("hotswap::amx_linear", [&] { return amx_linear(x, w, b, false); });
  } else if (path == PATH_ONEDNN) {
    static auto plain = c10::Dispatcher::singleton()
        .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                          c10::string_view, c10::List<std::optional<at::Scalar>>,
                          std::optional<c10::string_view>)>();
    out = plain.call(x.contiguous(), w, b, "none", c10::List<std::optional<at::Scalar>>(),
                     c10::string_view(""));
  } else {
    out = at::linear(x, w, b);
  }
  return residual ? out.add_(*residual) : out;
}

namespace {

// What every layer of one step reads besides its weights and its KV buffers.
struct Step {
  const at::Tensor &cos, &sin, &loc, &req_to_token, &req_idx, &seq_lens;
  double scale;
};

// A layer's attention from its qkv output: rotary on q and k in place, k and v stored at the
// step's slots, then decode_attention of q; each part under its profiler scope.
at::Tensor attend(const at::Tensor& qkv, int64_t heads, const Step& step, const at::Tensor& k_buf,
                  const at::Tensor& v_buf) {
  const int64_t hkv = k_buf.size(1), d = k_buf.size(2), q_size = heads * d;
  scoped("hotswap::rotary_", [&] {
    return rotary_(qkv.slice(1, 0, q_size + hkv * d).view({-1, heads + hkv, d}), step.cos,
                   step.sin);
  });
  scoped("hotswap::store_kv", [&] { store_kv(qkv, q_size, k_buf, v_buf, step.loc); });
  return scoped("hotswap::decode_attention", [&] {
    return decode_attention(qkv.slice(1, 0, q_size), k_buf, v_buf, step.req_to_token,
                            step.req_idx, step.seq_lens, step.scale);
  });
}

// One Llama decoder layer for a decode-only batch (one new token per row), the same ops as
// models/llama.py runs one by one from Python: norm, qkv, rotary, KV store, attention, o_proj
// + residual, norm, gate_up, SiLU-and-multiply, down + residual. The layer's input is
// x + *pending where pending is given (the previous layer's residual, not yet added); it
// returns its output the same way, {out, pending}: each residual add off PATH_SMALL (whose
// kernel adds it to its sums) joins the RMSNorm that reads the sum.
std::pair<at::Tensor, at::Tensor> decode_layer(at::Tensor x, const at::Tensor* pending,
                                               const LayerWeights& w, const DecodeLayers& stack,
                                               const Step& step, const at::Tensor& k_buf,
                                               const at::Tensor& v_buf) {
  const int64_t heads = stack.num_heads, path = stack.path;
  // Paths whose kernel adds the residual to its float32 sums (one rounding in bf16).
  const bool small = path == PATH_SMALL || path == PATH_INT8 || path == PATH_BLOCKED;
  // The parts other than the matmuls (aten ops, seen already) under their ops' names.
  auto norm = [&](const at::Tensor& t, const at::Tensor& weight, const at::Tensor* r) {
    return scoped("hotswap::rms_norm", [&] { return rms_norm_impl(t, weight, stack.eps, r); });
  };
  auto qkv = path_linear(norm(x, w.input_norm, pending), w.qkv, w.qkv_bias, nullptr, path,
                    w.qkv_quant);
  const auto o = attend(qkv, heads, step, k_buf, v_buf);
  auto h = path_linear(o, w.o, std::nullopt, small ? &x : nullptr, path, w.o_quant);
  const auto normed = norm(h, w.post_norm, small ? nullptr : &x);
  // On AMX the SiLU-and-multiply is the gate | up matmul's epilogue where each half is whole
  // blocks (as layers/linear.py's Linear.silu_and_mul).
  at::Tensor act;
  if (path == PATH_AMX && w.gate_up.size(0) % 2 == 0) {
    act = scoped("hotswap::amx_linear", [&] {
      return amx_linear(normed, w.gate_up, std::nullopt, true);
    });
  } else {
    const auto gate_up = path_linear(normed, w.gate_up, std::nullopt, nullptr, path,
                                     w.gate_up_quant);
    act = scoped("hotswap::silu_and_mul", [&] { return silu_and_mul(gate_up); });
  }
  auto out = path_linear(act, w.down, std::nullopt, small ? &h : nullptr, path, w.down_quant);
  return {out, small ? at::Tensor() : h};
}

// The threads of one parallel region working as a team: at::parallel_for over [0, size) with
// grain 1 calls f once per thread, and each call join()s with its share. Where the region got
// fewer threads (nested in another, or a smaller pool) a call's share is several indices and
// the team is smaller; members() is final once join() returns. wait() holds every member until
// all have reached it (a spin, then a yield, so an oversubscribed machine still moves on).
class Team {
 public:
  explicit Team(int64_t size) : size_(size) {}

  int64_t join(int64_t begin, int64_t end) {
    const int64_t rank = members_.fetch_add(1);
    covered_.fetch_add(end - begin);
    spin_until([&] { return covered_.load(std::memory_order_acquire) == size_; });
    return rank;
  }
  int64_t members() const { return members_.load(std::memory_order_relaxed); }

  void wait() {
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == members()) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    spin_until([&] { return generation_.load(std::memory_order_acquire) != generation; });
  }

 private:
  template <typename F>
  static void spin_until(F done) {
    for (int64_t spins = 0; !done(); ++spins) {
      if (spins < 4096) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  const int64_t size_;
  std::atomic<int64_t> members_{0}, covered_{0}, arrived_{0}, generation_{0};
};

// f(rank, members) on every thread of one parallel region, as a Team.
template <typename F>
void in_team(F f) {
  const int64_t size = at::get_num_threads();
  Team team(size);
  at::parallel_for(0, size, 1, [&](int64_t begin, int64_t end) {
    const int64_t rank = team.join(begin, end);
    f(rank, team.members(), team);
  });
}

// Member `rank`'s share [n0, n1) of n outputs: whole groups of 4, as small_linear's loops take.
std::pair<int64_t, int64_t> share(int64_t n, int64_t rank, int64_t members) {
  const int64_t per = ((n + members - 1) / members + 3) / 4 * 4;
  const int64_t n0 = std::min(n, rank * per);
  return {n0, std::min(n, n0 + per)};
}

// The decode step on PATH_SMALL with the threads kept in one parallel region from each layer's
// o_proj to the next layer's qkv (the attention between runs as decode_layer runs it): every
// matmul's outputs split between the threads, a wait between the matmuls, and each thread
// norming the rows it reads itself. decode_layer's ops call at::parallel_for ~7 times a layer
// and allocate each output; here a layer is one region and three waits. The same sums and
// roundings as decode_layer, bit for bit: each output is small_linear's, whichever thread
// computes it, and each norm and SiLU row rms_norm's and silu_and_mul's.
at::Tensor forward_small(const DecodeLayers& stack, const at::Tensor& x0,
                         const std::vector<at::Tensor>& k_bufs,
                         const std::vector<at::Tensor>& v_bufs, const Step& step) {
  using T = at::BFloat16;
  const auto& layers = stack.layers;
  const int64_t num_heads = stack.num_heads;
  const double eps = stack.eps;
  const auto& first = layers.front();
  const int64_t m = x0.size(0), hidden = x0.size(1), qkv_n = first.qkv.size(0);
  const int64_t inter = first.gate_up.size(0) / 2, q_size = num_heads * k_bufs[0].size(2);
  // Each thread's x widened to float32 where small_linear's sums read that (k off 32 or no
  // AVX512-BF16): k is hidden, q_size (o_proj) or inter (down).
  const int64_t widest_k = std::max({hidden, inter, q_size});
  const bool widened = small_x_widened(at::kBFloat16, hidden) ||
                       small_x_widened(at::kBFloat16, inter) ||
                       small_x_widened(at::kBFloat16, q_size);
  const int64_t threads = at::get_num_threads();
  auto opts = x0.options();
  // Layer l reads its input from xs[(l + 1) % 2] (the first from x0) and writes xs[l % 2].
  const at::Tensor x0c = x0.contiguous();
  at::Tensor xs[2] = {at::empty({m, hidden}, opts), at::empty({m, hidden}, opts)};
  auto h = at::empty({m, hidden}, opts), qkv = at::empty({m, qkv_n}, opts);
  auto gate_up = at::empty({m, 2 * inter}, opts), act = at::empty({m, inter}, opts);
  auto normed = at::empty({threads, m, hidden}, opts);
  const int64_t widest = std::max({qkv_n, hidden, 2 * inter});
  std::vector<float> acc(m * widest);
  std::vector<float> xf(widened ? threads * m * widest_k : 0);

  // Outputs [n0, n1) of in @ w.T (+ bias) (+ residual) into out, by member `rank`.
  auto matmul = [&](int64_t rank, const T* in, const at::Tensor& w, const T* bias,
                    const T* residual, T* out, int64_t n0, int64_t n1) {
    const int64_t k = w.size(1), n = w.size(0);
    float* wide = nullptr;
    if (small_x_widened(at::kBFloat16, k)) {
      wide = xf.data() + rank * m * widest_k;
      for (int64_t i = 0; i < m * k; ++i) wide[i] = widen(in[i]);
    }
    small_linear_part(in, wide, w.data_ptr<T>(), bias, residual, out, acc.data(), m, k, n, n0,
                      n1);
  };
  // Member `rank`'s norm of the m rows of in, and its share of their qkv.
  auto norm_qkv = [&](int64_t rank, int64_t members, const LayerWeights& w, const T* in) {
    T* own = normed.data_ptr<T>() + rank * m * hidden;
    for (int64_t i = 0; i < m; ++i)
      rms_norm_row(in + i * hidden, w.input_norm.data_ptr<T>(), own + i * hidden, hidden, eps);
    const auto [n0, n1] = share(qkv_n, rank, members);
    matmul(rank, own, w.qkv, w.qkv_bias ? w.qkv_bias->data_ptr<T>() : nullptr, nullptr,
           qkv.data_ptr<T>(), n0, n1);
  };

  scoped("hotswap::small_layers", [&] {
    in_team([&](int64_t rank, int64_t members, Team&) {
      norm_qkv(rank, members, first, x0c.data_ptr<T>());
    });
    return 0;
  });
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& w = layers[l];
    const at::Tensor& x = l == 0 ? x0c : xs[(l + 1) % 2];
    at::Tensor& out = xs[l % 2];
    const auto o = attend(qkv, num_heads, step, k_bufs[l], v_bufs[l]);
    const LayerWeights* next = l + 1 < layers.size() ? &layers[l + 1] : nullptr;
    scoped("hotswap::small_layers", [&] {
      in_team([&](int64_t rank, int64_t members, Team& team) {
        // h = o @ o_proj.T + x
        auto [n0, n1] = share(hidden, rank, members);
        matmul(rank, o.data_ptr<T>(), w.o, nullptr, x.data_ptr<T>(), h.data_ptr<T>(), n0, n1);
        team.wait();
        // act = silu(gate) * up over the member's share of both halves.
        T* own = normed.data_ptr<T>() + rank * m * hidden;
        for (int64_t i = 0; i < m; ++i)
          rms_norm_row(h.data_ptr<T>() + i * hidden, w.post_norm.data_ptr<T>(),
                       own + i * hidden, hidden, eps);
        const auto [g0, g1] = share(inter, rank, members);
        T* gu = gate_up.data_ptr<T>();
        matmul(rank, own, w.gate_up, nullptr, nullptr, gu, g0, g1);
        matmul(rank, own, w.gate_up, nullptr, nullptr, gu, inter + g0, inter + g1);
        for (int64_t i = 0; i < m; ++i)
          silu_and_mul_row(gu + i * 2 * inter + g0, gu + i * 2 * inter + inter + g0,
                           act.data_ptr<T>() + i * inter + g0, g1 - g0);
        team.wait();
        // out = act @ down.T + h
        std::tie(n0, n1) = share(hidden, rank, members);
        matmul(rank, act.data_ptr<T>(), w.down, nullptr, h.data_ptr<T>(), out.data_ptr<T>(),
               n0, n1);
        if (!next) return;
        team.wait();
        norm_qkv(rank, members, *next, out.data_ptr<T>());
      });
      return 0;
    });
  }
  return xs[(layers.size() + 1) % 2];
}

}  // namespace

DecodeLayers::DecodeLayers(double eps, int64_t path, int64_t num_heads)
    : eps(eps), path(path), num_heads(num_heads) {
  TORCH_CHECK(path >= PATH_ATEN && path <= PATH_AMX,
              "path must be linear.py's ATEN, ONEDNN, SMALL, INT8, BLOCKED or AMX, got ", path);
  TORCH_CHECK(num_heads > 0, "num_heads must be positive");
}

void DecodeLayers::add_layer(at::Tensor input_norm, at::Tensor qkv,
                             std::optional<at::Tensor> qkv_bias, at::Tensor o,
                             at::Tensor post_norm, at::Tensor gate_up, at::Tensor down,
                             std::vector<at::Tensor> qkv_quant,
                             std::vector<at::Tensor> o_quant,
                             std::vector<at::Tensor> gate_up_quant,
                             std::vector<at::Tensor> down_quant) {
  for (const auto* quant : {&qkv_quant, &o_quant, &gate_up_quant, &down_quant})
    TORCH_CHECK(path == PATH_INT8 ? (quant->size() == 1 || quant->size() == 3) : quant->empty(),
                "PATH_INT8 needs each weight's scales (and its blocked layout and compensation, "
                "if any); other paths none");
  // forward_small sizes its buffers by the first layer and reads every tensor as dense bf16.
  auto dense_bf16 = [](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 && t.layout() == at::kStrided && t.is_contiguous();
  };
  const LayerWeights* like = layers.empty() ? nullptr : &layers[0];
  small_uniform = (!like || small_uniform) && path == PATH_SMALL &&
                  (!like || (qkv.sizes() == like->qkv.sizes() && o.sizes() == like->o.sizes() &&
                             gate_up.sizes() == like->gate_up.sizes() &&
                             down.sizes() == like->down.sizes())) &&
                  qkv.size(1) == o.size(0) && gate_up.size(1) == o.size(0) &&
                  down.size(0) == o.size(0) && down.size(1) * 2 == gate_up.size(0) &&
                  (!qkv_bias || dense_bf16(*qkv_bias)) && dense_bf16(input_norm) &&
                  dense_bf16(post_norm) && dense_bf16(qkv) && dense_bf16(o) &&
                  dense_bf16(gate_up) && dense_bf16(down);
  layers.push_back({std::move(input_norm), std::move(qkv), std::move(qkv_bias), std::move(o),
                    std::move(post_norm), std::move(gate_up), std::move(down),
                    std::move(qkv_quant), std::move(o_quant), std::move(gate_up_quant),
                    std::move(down_quant)});
}

// Every decoder layer of a decode-only batch in one call: decode_layer for each layer in turn,
// each under a profiler scope of its own. A method rather than an op taking the class: torch.ops
// scans such an op's arguments in Python on every call, which costs more than it saves.
at::Tensor DecodeLayers::forward(at::Tensor x, std::vector<at::Tensor> k_bufs,
                                 std::vector<at::Tensor> v_bufs, at::Tensor cos, at::Tensor sin,
                                 at::Tensor loc, at::Tensor req_to_token, at::Tensor req_idx,
                                 at::Tensor seq_lens, double scale) {
  RECORD_FUNCTION("hotswap::decode_layers", std::vector<c10::IValue>());
  TORCH_CHECK(k_bufs.size() == layers.size() && v_bufs.size() == layers.size(),
              "a K and a V buffer per layer expected: ", layers.size(), " layers, ",
              k_bufs.size(), " K and ", v_bufs.size(), " V buffers");
  const Step step{cos, sin, loc, req_to_token, req_idx, seq_lens, scale};
  if (small_uniform && x.scalar_type() == at::kBFloat16 && x.size(1) == layers[0].o.size(0) &&
      at::get_num_threads() > 1 && !at::in_parallel_region())
    return forward_small(*this, x, k_bufs, v_bufs, step);
  std::pair<at::Tensor, at::Tensor> h{x, at::Tensor()};
  for (size_t i = 0; i < layers.size(); ++i) {
    const at::Tensor* pending = h.second.defined() ? &h.second : nullptr;
    h = scoped("hotswap::decode_layer", [&] {
      return decode_layer(h.first, pending, layers[i], *this, step, k_bufs[i], v_bufs[i]);
    });
  }
  return h.second.defined() ? h.first.add_(h.second) : h.first;
}

}  // namespace hotswap
