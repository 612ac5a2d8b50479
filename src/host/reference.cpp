#include "mok/reference.hpp"

#include <cmath>
#include <algorithm>
#include <limits>
#include <tuple>

#include "mok/error.hpp"
#include "mok/fp8.hpp"
#include "parallel.hpp"

namespace mok::reference {
namespace {

constexpr const char* kWhere = "mok::reference";

double dot(const double* a, const double* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(double alpha, const double* x, double* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// v rounded to bf16 (what the kernels store), back in fp64.
double round_bf16(double v) { return bf16::from_float(static_cast<float>(v)).to_float(); }

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// One expert (routed or shared) as seen by one token: pointers into the weights.
struct Expert {
  const double* gate;  // [I, H]
  const double* up;    // [I, H]
  const double* down;  // [H, I]
  std::int64_t inter;  // I
};

// The SwiGLU of one token through one expert, with what backward needs.
struct Activation {
  std::vector<double> gate, up;   // clamped pre-activations
  std::vector<bool> gate_pass, up_pass;  // false where the clamp was active
  std::vector<double> hidden;     // silu(gate) * up
};

void activate(const Expert& ex, const double* x, std::int64_t H, const MoeShape& s, Activation& a) {
  const std::int64_t I = ex.inter;
  a.gate.resize(I), a.up.resize(I), a.hidden.resize(I);
  a.gate_pass.assign(I, true), a.up_pass.assign(I, true);
  for (std::int64_t i = 0; i < I; ++i) {
    double g = dot(ex.gate + i * H, x, H);
    double u = dot(ex.up + i * H, x, H);
    if (s.swiglu_limit) {
      const double lim = *s.swiglu_limit;
      if (g > lim) g = lim, a.gate_pass[i] = false;
      if (u > lim) u = lim, a.up_pass[i] = false;
      if (u < -lim) u = -lim, a.up_pass[i] = false;
    }
    a.gate[i] = g, a.up[i] = u;
    a.hidden[i] = g * sigmoid(g) * u;
  }
}

std::int64_t checked_size(const char* name, std::size_t got, std::int64_t expected) {
  if (static_cast<std::int64_t>(got) != expected)
    throw_argument_error(kWhere, name, "must hold ", expected, " values, got ", got);
  return expected;
}

void check_inputs(const MoeShape& s, std::int64_t T, std::span<const double> x,
                  const Routing& r, const Weights& w) {
  validate(s);
  if (T < 0) throw_argument_error(kWhere, "tokens", "must be >= 0, got ", T);
  const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_experts, k = s.top_k;
  const std::int64_t Is = s.shared_intermediate;
  checked_size("x", x.size(), T * H);
  checked_size("topk_ids", r.ids.size(), T * k);
  checked_size("topk_weights", r.weights.size(), T * k);
  checked_size("w_gate", w.gate.size(), E * I * H);
  checked_size("w_up", w.up.size(), E * I * H);
  checked_size("w_down", w.down.size(), E * H * I);
  checked_size("shared_gate", w.shared_gate.size(), Is * H);
  checked_size("shared_up", w.shared_up.size(), Is * H);
  checked_size("shared_down", w.shared_down.size(), H * Is);
  for (std::int64_t i = 0; i < T * k; ++i)
    if (r.ids[i] < -1 || r.ids[i] >= E)
      throw_argument_error(kWhere, "topk_ids", "expert id must be in [-1, ", E, "), got ", r.ids[i],
                           " at token ", i / k, ", slot ", i % k);
}

Expert routed_expert(const MoeShape& s, const Weights& w, std::int64_t e) {
  const std::int64_t H = s.hidden, I = s.intermediate;
  return {w.gate.data() + e * I * H, w.up.data() + e * I * H, w.down.data() + e * H * I, I};
}

Expert shared_expert(const MoeShape& s, const Weights& w) {
  return {w.shared_gate.data(), w.shared_up.data(), w.shared_down.data(), s.shared_intermediate};
}

}  // namespace

std::vector<double> forward(const MoeShape& s, std::int64_t T, std::span<const double> x,
                            const Routing& r, const Weights& w) {
  check_inputs(s, T, x, r, w);
  const std::int64_t H = s.hidden, k = s.top_k;
  std::vector<double> y(T * H, 0.0);
  detail::parallel_for(T, [&](std::int64_t t) {
    const double* xt = x.data() + t * H;
    double* yt = y.data() + t * H;
    Activation a;
    auto add_expert = [&](const Expert& ex, double weight) {
      activate(ex, xt, H, s, a);
      for (std::int64_t h = 0; h < H; ++h) yt[h] += weight * dot(ex.down + h * ex.inter, a.hidden.data(), ex.inter);
    };
    if (s.has_shared()) add_expert(shared_expert(s, w), 1.0);
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = r.ids[t * k + j];
      if (e >= 0) add_expert(routed_expert(s, w, e), r.weights[t * k + j]);
    }
  });
  return y;
}

namespace {

// `values` ([rows, cols]) through E4M3 with power-of-two scales per block, back in fp64.
std::vector<double> through_fp8(const double* values, std::int64_t rows, std::int64_t cols, int block_rows, int block_cols) {
  std::vector<float> f(values, values + rows * cols);
  const auto q = fp8::quantize(f.data(), static_cast<int>(rows), static_cast<int>(cols), block_rows, block_cols);
  const auto d = fp8::dequantize(q);
  return std::vector<double>(d.begin(), d.end());
}

// The routed experts' weights through FP8, 128 x 128 blocks per expert matrix (a transposed
// copy for the backward's GEMMs has the same blocks, so the same values).
Weights quantized_experts(const MoeShape& s, const Weights& w) {
  const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_experts;
  Weights q;
  q.gate.resize(E * I * H), q.up.resize(E * I * H), q.down.resize(E * H * I);
  detail::parallel_for(E, [&](std::int64_t e) {
    for (auto [from, to, rows, cols] : {std::tuple{&w.gate, &q.gate, I, H}, {&w.up, &q.up, I, H}, {&w.down, &q.down, H, I}}) {
      const auto m = through_fp8(from->data() + e * rows * cols, rows, cols, 128, 128);
      std::copy(m.begin(), m.end(), to->begin() + e * rows * cols);
    }
  });
  return q;
}

}  // namespace

std::vector<double> forward_fp8(const MoeShape& s, std::int64_t T, std::span<const double> x, const Routing& r,
                                const Weights& w) {
  check_inputs(s, T, x, r, w);
  const std::int64_t H = s.hidden, I = s.intermediate, k = s.top_k;
  const Weights q = quantized_experts(s, w);
  const std::vector<double> xq = through_fp8(x.data(), T, H, 1, 128);
  std::vector<double> y(T * H, 0.0);
  detail::parallel_for(T, [&](std::int64_t t) {
    double* yt = y.data() + t * H;
    Activation a;
    if (s.has_shared()) {  // BF16 (unquantized)
      const Expert ex = shared_expert(s, w);
      activate(ex, x.data() + t * H, H, s, a);
      for (std::int64_t h = 0; h < H; ++h) yt[h] += dot(ex.down + h * ex.inter, a.hidden.data(), ex.inter);
    }
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = r.ids[t * k + j];
      if (e < 0) continue;
      const Expert ex = routed_expert(s, q, e);
      activate(ex, xq.data() + t * H, H, s, a);
      const std::vector<double> hq = through_fp8(a.hidden.data(), 1, I, 1, 128);
      for (std::int64_t h = 0; h < H; ++h) yt[h] += r.weights[t * k + j] * dot(ex.down + h * I, hq.data(), I);
    }
  });
  return y;
}

namespace {

// The FP8 recipe's operands of the backward (backward_fp8): the routed experts' quantized
// weights, x and dy per 1 x 128 of a token, and whether the dgrad GEMMs read them.
struct Fp8Operands {
  Weights w;
  std::vector<double> x, dy;
  bool dgrad = true;
  bool wgrad = false;  // the routed weight gradients of E4M3 operands (routed_weight_grads_fp8)
};

Gradients backward(const MoeShape& s, std::int64_t T, std::span<const double> x, const Routing& r, const Weights& w,
                   std::span<const double> dy, const Fp8Operands* fp8);

}  // namespace

Gradients backward(const MoeShape& s, std::int64_t T, std::span<const double> x,
                   const Routing& r, const Weights& w, std::span<const double> dy) {
  return backward(s, T, x, r, w, dy, nullptr);
}

Gradients backward_fp8(const MoeShape& s, std::int64_t T, std::span<const double> x, const Routing& r,
                       const Weights& w, std::span<const double> dy, bool fp8_dgrad, bool fp8_wgrad) {
  check_inputs(s, T, x, r, w);
  checked_size("dy", dy.size(), T * s.hidden);
  const Fp8Operands q{quantized_experts(s, w), through_fp8(x.data(), T, s.hidden, 1, 128),
                      through_fp8(dy.data(), T, s.hidden, 1, 128), fp8_dgrad, fp8_wgrad};
  return backward(s, T, x, r, w, dy, &q);
}

namespace {

Gradients backward(const MoeShape& s, std::int64_t T, std::span<const double> x, const Routing& r, const Weights& w,
                   std::span<const double> dy, const Fp8Operands* fp8) {
  check_inputs(s, T, x, r, w);
  const std::int64_t H = s.hidden, I = s.intermediate, E = s.num_experts, k = s.top_k;
  const std::int64_t Is = s.shared_intermediate;
  checked_size("dy", dy.size(), T * H);

  // Phase 1, per token: SwiGLU and its gradient for every (token, slot) pair and for the
  // shared expert, kept per pair for the weight gradients; dx and d_topk_weights.
  // Slot k of a token stands for the shared expert.
  const std::int64_t slots = k + 1;
  std::vector<double> pair_hidden(T * slots * std::max(I, Is));
  std::vector<double> pair_dgate(pair_hidden.size()), pair_dup(pair_hidden.size());
  const std::int64_t stride = std::max(I, Is);
  Gradients g;
  g.x.assign(T * H, 0.0);
  g.topk_weights.assign(T * k, 0.0);

  detail::parallel_for(T, [&](std::int64_t t) {
    const double* xt = x.data() + t * H;
    const double* dyt = dy.data() + t * H;
    Activation a;
    std::vector<double> out(H), dh;
    // fp8 (a routed expert): the forward's pre-activations are FP8 GEMM1's (act: the quantized
    // expert, and x per 1 x 128); with fp8 dgrad the dgrad GEMMs read quantized operands (ex:
    // the quantized expert): dy (per 1 x 128) with W_down, and dgate, dup (per 1 x 128 of the
    // pair's row) with W_gate, W_up. The weight gradients (below) read x, dy, h and dgate/dup
    // unquantized, as BF16 GEMMs would.
    auto backprop = [&](const Expert& ex, const Expert& act, double weight, std::int64_t slot, bool fp8_expert) -> double {
      const std::int64_t n = ex.inter;
      const bool dgrad = fp8_expert && fp8->dgrad;
      activate(act, fp8_expert ? fp8->x.data() + t * H : xt, H, s, a);
      if (fp8_expert && fp8->wgrad) {
        // The backward reads the pre-activations as the forward saved them: bf16, the clamp's
        // decision kept (a cut value at the limit, a passing one rounded, then clamped as the
        // kernel's SwiGLU clamps it). (Left unrounded, w h and dgate|dup differ from the
        // kernel's by ~0.15 % RMS, and the E4M3 roundings of ~2 % of them with it: ~1.2 % of
        // a weight gradient.)
        const double lim = s.swiglu_limit ? static_cast<double>(*s.swiglu_limit) : INFINITY;
        for (std::int64_t i = 0; i < ex.inter; ++i) {
          if (a.gate_pass[i]) a.gate[i] = std::min(round_bf16(a.gate[i]), lim);
          if (a.up_pass[i]) a.up[i] = std::clamp(round_bf16(a.up[i]), -lim, lim);
          a.hidden[i] = a.gate[i] * sigmoid(a.gate[i]) * a.up[i];
        }
      }
      const double* dy_in = dgrad ? fp8->dy.data() + t * H : dyt;
      // d(weight) = <dy, down h> = <down^T dy, h>;  dh = weight * down^T dy.
      dh.assign(n, 0.0);
      for (std::int64_t h = 0; h < H; ++h) axpy(dy_in[h], ex.down + h * n, dh.data(), n);
      const double d_weight = dot(dh.data(), a.hidden.data(), n);
      for (std::int64_t i = 0; i < n; ++i) dh[i] *= weight;
      double* hid = pair_hidden.data() + (t * slots + slot) * stride;
      double* dg = pair_dgate.data() + (t * slots + slot) * stride;
      double* du = pair_dup.data() + (t * slots + slot) * stride;
      for (std::int64_t i = 0; i < n; ++i) {
        const double gv = a.gate[i], uv = a.up[i], sg = sigmoid(gv);
        hid[i] = a.hidden[i];
        dg[i] = a.gate_pass[i] ? dh[i] * uv * sg * (1.0 + gv * (1.0 - sg)) : 0.0;
        du[i] = a.up_pass[i] ? dh[i] * gv * sg : 0.0;
      }
      double* dxt = g.x.data() + t * H;
      // (quantized from their bf16 values, which the weight gradients read: E4M3 of bf16, as the kernel)
      auto through_bf16 = [n](const double* v) {
        std::vector<double> r(n);
        for (std::int64_t i = 0; i < n; ++i) r[i] = round_bf16(v[i]);
        return r;
      };
      const std::vector<double> dgq = dgrad ? through_fp8(through_bf16(dg).data(), 1, n, 1, 128) : std::vector<double>(dg, dg + n);
      const std::vector<double> duq = dgrad ? through_fp8(through_bf16(du).data(), 1, n, 1, 128) : std::vector<double>(du, du + n);
      for (std::int64_t i = 0; i < n; ++i) {
        axpy(dgq[i], ex.gate + i * H, dxt, H);
        axpy(duq[i], ex.up + i * H, dxt, H);
      }
      return d_weight;
    };
    if (s.has_shared()) backprop(shared_expert(s, w), shared_expert(s, w), 1.0, k, false);
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = r.ids[t * k + j];
      if (e < 0) continue;
      const Expert act = routed_expert(s, fp8 ? fp8->w : w, e);
      const Expert ex = routed_expert(s, fp8 && fp8->dgrad ? fp8->w : w, e);
      g.topk_weights[t * k + j] = backprop(ex, act, r.weights[t * k + j], j, fp8 != nullptr);
    }
  });

  // Phase 2, per output row of each weight gradient: sums over the expert's pairs in
  // token order. pairs_of[e] lists (token, slot) of expert e; the shared expert is e = E.
  std::vector<std::vector<std::int64_t>> pairs_of(E + 1);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < k; ++j)
      if (r.ids[t * k + j] >= 0) pairs_of[r.ids[t * k + j]].push_back(t * slots + j);
    if (s.has_shared()) pairs_of[E].push_back(t * slots + k);
  }
  auto weight_of = [&](std::int64_t pair) {
    const std::int64_t t = pair / slots, j = pair % slots;
    return j == k ? 1.0 : r.weights[t * k + j];
  };
  g.w.gate.assign(w.gate.size(), 0.0), g.w.up.assign(w.up.size(), 0.0), g.w.down.assign(w.down.size(), 0.0);
  g.w.shared_gate.assign(w.shared_gate.size(), 0.0), g.w.shared_up.assign(w.shared_up.size(), 0.0);
  g.w.shared_down.assign(w.shared_down.size(), 0.0);

  // Rows: E*I rows of d_gate/d_up, E*H rows of d_down, then I_s and H rows for the shared expert.
  const std::int64_t rows_gu = E * I, rows_d = E * H, rows_sgu = Is, rows_sd = Is > 0 ? H : 0;
  const bool wgrad8 = fp8 != nullptr && fp8->wgrad;
  detail::parallel_for(rows_gu + rows_d + rows_sgu + rows_sd, [&](std::int64_t row) {
    if (wgrad8 && row < rows_gu + rows_d) return;  // (routed_weight_grads_fp8 below)
    if (row < rows_gu || (row >= rows_gu + rows_d && row < rows_gu + rows_d + rows_sgu)) {
      const bool shared = row >= rows_gu;
      const std::int64_t e = shared ? E : row / I, i = shared ? row - rows_gu - rows_d : row % I;
      double* dgate = shared ? g.w.shared_gate.data() + i * H : g.w.gate.data() + row * H;
      double* dup = shared ? g.w.shared_up.data() + i * H : g.w.up.data() + row * H;
      for (std::int64_t pair : pairs_of[e]) {
        const double* xt = x.data() + (pair / slots) * H;
        axpy(pair_dgate[pair * stride + i], xt, dgate, H);
        axpy(pair_dup[pair * stride + i], xt, dup, H);
      }
    } else {
      const bool shared = row >= rows_gu + rows_d;
      const std::int64_t base = shared ? rows_gu + rows_d + rows_sgu : rows_gu;
      const std::int64_t e = shared ? E : (row - base) / H, h = (row - base) % H;
      const std::int64_t n = shared ? Is : I;
      double* ddown = shared ? g.w.shared_down.data() + h * Is : g.w.down.data() + (row - base) * I;
      for (std::int64_t pair : pairs_of[e]) {
        const double scale = weight_of(pair) * dy[(pair / slots) * H + h];
        axpy(scale, pair_hidden.data() + pair * stride, ddown, n);
      }
    }
  });
  if (wgrad8) {
    // The routed weight gradients of the FP8 recipe's operands: per expert, its rows in plan
    // order (the pairs by token) in blocks of 128 from its first (padding rows: zeros), dy and
    // dgate | dup (bf16, as the kernel stores them) per column and block, x and w h (bf16) per
    // 128 x 128; exact sums of the quantized values.
    detail::parallel_for(E, [&](std::int64_t e) {
      const std::vector<std::int64_t>& pairs = pairs_of[e];
      const std::int64_t n = static_cast<std::int64_t>(pairs.size()), rows = (n + 127) / 128 * 128;
      if (n == 0) return;
      std::vector<double> dy_rows(rows * H, 0.0), x_rows(rows * H, 0.0), hw(rows * I, 0.0), dgu(rows * 2 * I, 0.0);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t pair = pairs[i], t = pair / slots;
        std::copy(dy.begin() + t * H, dy.begin() + (t + 1) * H, dy_rows.begin() + i * H);
        std::copy(x.begin() + t * H, x.begin() + (t + 1) * H, x_rows.begin() + i * H);
        for (std::int64_t c = 0; c < I; ++c) {
          hw[i * I + c] = round_bf16(weight_of(pair) * pair_hidden[pair * stride + c]);
          dgu[i * 2 * I + c] = round_bf16(pair_dgate[pair * stride + c]);
          dgu[i * 2 * I + I + c] = round_bf16(pair_dup[pair * stride + c]);
        }
      }
      const auto dy_q = through_fp8(dy_rows.data(), rows, H, 128, 1), x_q = through_fp8(x_rows.data(), rows, H, 128, 128);
      const auto hw_q = through_fp8(hw.data(), rows, I, 128, 128), dgu_q = through_fp8(dgu.data(), rows, 2 * I, 128, 1);
      double* down = g.w.down.data() + e * H * I;
      double* gate = g.w.gate.data() + e * I * H;
      double* up = g.w.up.data() + e * I * H;
      for (std::int64_t i = 0; i < n; ++i) {
        for (std::int64_t h = 0; h < H; ++h) axpy(dy_q[i * H + h], hw_q.data() + i * I, down + h * I, I);
        for (std::int64_t c = 0; c < I; ++c) {
          axpy(dgu_q[i * 2 * I + c], x_q.data() + i * H, gate + c * H, H);
          axpy(dgu_q[i * 2 * I + I + c], x_q.data() + i * H, up + c * H, H);
        }
      }
    });
  }
  return g;
}

}  // namespace

std::vector<double> to_double(std::span<const bf16> values) {
  std::vector<double> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = values[i].to_float();
  return out;
}

std::vector<double> to_double(std::span<const float> values) {
  return std::vector<double>(values.begin(), values.end());
}

double relative_error(std::span<const double> a, std::span<const double> b) {
  if (a.size() != b.size())
    throw ArgumentError(detail::concat("mok::reference::relative_error: sizes differ, ", a.size(), " and ", b.size()));
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = a[i] - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  if (!std::isfinite(num) || !std::isfinite(den)) return std::numeric_limits<double>::infinity();
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

}  // namespace mok::reference
