// The extension's conversions: DLPack tensors (any framework) to mok::TensorView, the
// layer's argument structs, NumPy results of the reference, and the two binding templates
// that every forward and backward entry point (one GPU, EP rank) is made of.
#pragma once

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <tuple>
#include <vector>

#include "mok/mok.hpp"
#include "mok/testing.hpp"

namespace mok_python {

namespace nb = nanobind;

inline mok::DType dtype_of(const nb::dlpack::dtype& d) {
  using code = nb::dlpack::dtype_code;
  const auto c = static_cast<code>(d.code);
  if (d.lanes == 1) {
    if (c == code::Bfloat && d.bits == 16) return mok::DType::bf16;
    if (c == code::Float && d.bits == 16) return mok::DType::f16;
    if (c == code::Float && d.bits == 32) return mok::DType::f32;
    if (c == code::Float && d.bits == 64) return mok::DType::f64;
    if (c == code::Int && d.bits == 32) return mok::DType::i32;
    if (c == code::Int && d.bits == 64) return mok::DType::i64;
    if (c == code::UInt && d.bits == 8) return mok::DType::u8;
  }
  throw nb::type_error("mok: unsupported tensor dtype");
}

inline mok::TensorView view_of(const nb::ndarray<>& a) {
  mok::TensorView v;
  if (a.ndim() > static_cast<std::size_t>(mok::TensorView::kMaxDims)) throw nb::value_error("mok: more than 4 dimensions");
  v.data = a.data();
  v.dtype = dtype_of(a.dtype());
  v.device = a.device_type() == nb::device::cuda::value ? mok::Device::cuda(a.device_id()) : mok::Device::cpu();
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = a.shape(i), v.stride[i] = a.stride(i);
  // A dimension of size 1 is never stepped along, so its stride says nothing, and exporters differ:
  // PyTorch 1.13 to 2.9 hands DLPack a stride of 1 for every such dimension (an E = 1 expert stack
  // [1, I, H] arrives with strides (1, H, 1); the 128 x 128 blocks' exponents of I = 128, [E, 1, n],
  // with (n, 1, 1)), which the row checks and TMA descriptors would read as overlapping rows. Such a
  // stride is made the extent of the dimensions after it (for a row-major tensor the stride later
  // PyTorch exports).
  for (int i = v.ndim - 1; i >= 0; --i) {
    if (v.shape[i] != 1) continue;
    std::int64_t extent = 1;
    for (int j = i + 1; j < v.ndim; ++j) extent = std::max(extent, v.shape[j] * std::abs(v.stride[j]));
    v.stride[i] = extent;
  }
  return v;
}

inline std::optional<mok::TensorView> optional_view(const std::optional<nb::ndarray<>>& a) {
  return a ? std::optional<mok::TensorView>(view_of(*a)) : std::nullopt;
}

inline mok::MoeShape make_shape(std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
                         std::int64_t num_local_experts, std::int64_t top_k, std::int64_t shared_intermediate,
                         std::optional<float> swiglu_limit) {
  mok::MoeShape s;
  s.hidden = hidden, s.intermediate = intermediate, s.num_experts = num_experts;
  s.num_local_experts = num_local_experts, s.top_k = top_k, s.shared_intermediate = shared_intermediate;
  s.swiglu_limit = swiglu_limit;
  mok::validate(s);
  return s;
}

// The Training mode of a Workspace or EpRank from the bindings' two flags (`where` names the class
// in the error: recompute without training is refused).
inline mok::Training training_mode(const char* where, bool training, bool recompute) {
  if (recompute && !training)
    throw nb::value_error((std::string(where) + ": recompute=True needs training=True (recomputing trains)").c_str());
  return !training ? mok::Training::off : recompute ? mok::Training::recompute : mok::Training::save;
}

// The Precision named by the bindings' string (`where` names the function or class in the error).
inline mok::Precision parse_precision(const char* where, const std::string& precision) {
  if (precision != "bf16" && precision != "fp8")
    throw nb::value_error((std::string(where) + ": precision must be 'bf16' or 'fp8', got '" + precision + "'").c_str());
  return precision == "fp8" ? mok::Precision::fp8 : mok::Precision::bf16;
}

using F64 = nb::ndarray<double, nb::c_contig, nb::device::cpu>;
using I32 = nb::ndarray<std::int32_t, nb::c_contig, nb::device::cpu>;

inline std::span<const double> span_of(const F64& a) { return {a.data(), a.size()}; }
inline std::vector<double> vec_of(const std::optional<F64>& a) {
  return a ? std::vector<double>(a->data(), a->data() + a->size()) : std::vector<double>{};
}

inline nb::ndarray<nb::numpy, double> to_numpy(std::vector<double> values, std::initializer_list<std::size_t> shape) {
  auto* owned = new std::vector<double>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  return nb::ndarray<nb::numpy, double>(owned->data(), shape.size(), shape.begin(), owner);
}

// The gate and up weights (or their gradients) as two views. With `up` absent, `gate` holds
// both concatenated along its rows, [E, 2I, H] (gate rows, then up rows, as Hugging Face,
// torchtitan and Megatron keep them): its two halves, views of the same memory (no copy).
inline std::pair<mok::TensorView, mok::TensorView> gate_and_up(const nb::ndarray<>& gate,
                                                               const std::optional<nb::ndarray<>>& up,
                                                               const char* where, const char* name) {
  mok::TensorView g = view_of(gate);
  if (up) return {g, view_of(*up)};
  if (g.ndim != 3 || g.shape[1] % 2 != 0)
    throw nb::value_error((std::string(where) + ": '" + name + "' must be [E, 2I, H] (gate and up concatenated, " +
                           "its up absent), got shape " + g.shape_string()).c_str());
  g.shape[1] /= 2;
  mok::TensorView u = g;
  u.data = static_cast<char*>(g.data) + g.shape[1] * g.stride[1] * static_cast<std::int64_t>(mok::dtype_size(g.dtype));
  return {g, u};
}

inline mok::ForwardArgs forward_args(const nb::ndarray<>& x, const nb::ndarray<>& ids, const nb::ndarray<>& weights,
                                     const nb::ndarray<>& gate, const std::optional<nb::ndarray<>>& up,
                                     const nb::ndarray<>& down, const std::optional<nb::ndarray<>>& shared_gate,
                                     const std::optional<nb::ndarray<>>& shared_up,
                                     const std::optional<nb::ndarray<>>& shared_down, const nb::ndarray<>* y,
                                     const char* where) {
  mok::ForwardArgs a;
  a.x = view_of(x), a.topk_ids = view_of(ids), a.topk_weights = view_of(weights);
  std::tie(a.w_gate, a.w_up) = gate_and_up(gate, up, where, "w_gate");
  a.w_down = view_of(down);
  if (y) a.y = view_of(*y);
  a.shared_gate = optional_view(shared_gate), a.shared_up = optional_view(shared_up);
  a.shared_down = optional_view(shared_down);
  return a;
}

inline mok::BackwardArgs backward_args(const nb::ndarray<>& dy, const nb::ndarray<>& dx, const nb::ndarray<>& d_weights,
                                       const nb::ndarray<>& d_gate, const std::optional<nb::ndarray<>>& d_up,
                                       const nb::ndarray<>& d_down, const std::optional<nb::ndarray<>>& d_shared_gate,
                                       const std::optional<nb::ndarray<>>& d_shared_up,
                                       const std::optional<nb::ndarray<>>& d_shared_down, const char* where) {
  mok::BackwardArgs b;
  b.dy = view_of(dy), b.dx = view_of(dx), b.d_topk_weights = view_of(d_weights);
  std::tie(b.d_w_gate, b.d_w_up) = gate_and_up(d_gate, d_up, where, "d_w_gate");
  b.d_w_down = view_of(d_down);
  b.d_shared_gate = optional_view(d_shared_gate), b.d_shared_up = optional_view(d_shared_up);
  b.d_shared_down = optional_view(d_shared_down);
  return b;
}

// This extension has its own CUDA runtime: select the tensors' device explicitly.
inline void select_device(const mok::TensorView& t, const char* where) {
  if (t.device.kind == mok::DeviceKind::cuda && cudaSetDevice(t.device.index) != cudaSuccess)
    throw nb::value_error((std::string(where) + ": cannot use CUDA device " + std::to_string(t.device.index)).c_str());
}

// Binds name(target, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_*, y, saved,
// stream, scratch=None, rows_enqueued=False) (w_up None: w_gate concatenated, see gate_and_up):
// the tensors as views on their device, then run(target, args, stream, saved, scratch,
// rows_enqueued) without the GIL. Target: a Workspace (one GPU) or an EpRank.
template <typename Target, typename Run>
void def_forward(nb::module_& m, const char* name, const char* target, const char* where, Run run) {
  m.def(
      name,
      [where, run](Target& t, nb::ndarray<> x, nb::ndarray<> ids, nb::ndarray<> weights, nb::ndarray<> gate,
                   std::optional<nb::ndarray<>> up, nb::ndarray<> down, std::optional<nb::ndarray<>> shared_gate,
                   std::optional<nb::ndarray<>> shared_up, std::optional<nb::ndarray<>> shared_down, nb::ndarray<> y,
                   std::optional<nb::ndarray<>> saved, std::uintptr_t stream, std::optional<nb::ndarray<>> scratch,
                   bool rows_enqueued) {
        const mok::ForwardArgs a = forward_args(x, ids, weights, gate, up, down, shared_gate, shared_up, shared_down, &y, where);
        select_device(a.x, where);
        const std::optional<mok::TensorView> saved_view = optional_view(saved), scratch_view = optional_view(scratch);
        nb::gil_scoped_release release;
        run(t, a, reinterpret_cast<cudaStream_t>(stream), saved_view, scratch_view, rows_enqueued);
      },
      nb::arg(target), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up").none(),
      nb::arg("w_down"), nb::arg("shared_gate").none(), nb::arg("shared_up").none(), nb::arg("shared_down").none(),
      nb::arg("y"), nb::arg("saved").none(), nb::arg("stream"), nb::arg("scratch").none() = nb::none(),
      nb::arg("rows_enqueued") = false);
}

// The FP8 forward (a target of precision "fp8"): name(target, the forward's inputs, y, then the
// routed weights as mok.fp8.quantize_weights gives them — E4M3 values (u8) and block exponents
// (i32) of gate, up and down — stream, scratch=None, saved=None); saved (training): the
// pre-activations to fill, which the (bf16) backward reads.
template <typename Target, typename Run>
void def_forward_fp8(nb::module_& m, const char* name, const char* target, const char* where, Run run) {
  m.def(
      name,
      [where, run](Target& t, nb::ndarray<> x, nb::ndarray<> ids, nb::ndarray<> weights, nb::ndarray<> gate,
                   std::optional<nb::ndarray<>> up, nb::ndarray<> down, std::optional<nb::ndarray<>> shared_gate,
                   std::optional<nb::ndarray<>> shared_up, std::optional<nb::ndarray<>> shared_down, nb::ndarray<> y,
                   nb::ndarray<> gate_values, nb::ndarray<> gate_exponents, nb::ndarray<> up_values,
                   nb::ndarray<> up_exponents, nb::ndarray<> down_values, nb::ndarray<> down_exponents,
                   std::uintptr_t stream, std::optional<nb::ndarray<>> scratch, std::optional<nb::ndarray<>> saved) {
        mok::ForwardArgs a = forward_args(x, ids, weights, gate, up, down, shared_gate, shared_up, shared_down, &y, where);
        a.fp8 = mok::Fp8Weights{view_of(gate_values), view_of(up_values), view_of(down_values),
                                view_of(gate_exponents), view_of(up_exponents), view_of(down_exponents)};
        select_device(a.x, where);
        const std::optional<mok::TensorView> scratch_view = optional_view(scratch), saved_view = optional_view(saved);
        nb::gil_scoped_release release;
        run(t, a, reinterpret_cast<cudaStream_t>(stream), saved_view, scratch_view);
      },
      nb::arg(target), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"),
      nb::arg("w_up").none(), nb::arg("w_down"), nb::arg("shared_gate").none(), nb::arg("shared_up").none(),
      nb::arg("shared_down").none(), nb::arg("y"), nb::arg("gate_values"), nb::arg("gate_exponents"),
      nb::arg("up_values"), nb::arg("up_exponents"), nb::arg("down_values"), nb::arg("down_exponents"),
      nb::arg("stream"), nb::arg("scratch").none() = nb::none(), nb::arg("saved").none() = nb::none());
}

// The same for the backward: name(target, forward's inputs, saved, dy, dx, d_topk_weights,
// d_w_gate, d_w_up, d_w_down, d_shared_*, stream, scratch=None, fp8_dgrad=None, fp8_wgrad=False)
// (w_up, d_w_up None: concatenated; saved None: the target recomputes the pre-activations
// (Training::recompute); fp8_dgrad: BackwardArgs::fp8 as (down_t, down_t_exponents,
// gate_up_t, gate_up_t_exponents), mok.fp8.quantize_dgrad_experts' tensors; fp8_wgrad:
// BackwardArgs::fp8_weight_gradients).
template <typename Target, typename Run>
void def_backward(nb::module_& m, const char* name, const char* target, const char* where, Run run) {
  m.def(
      name,
      [where, run](Target& t, nb::ndarray<> x, nb::ndarray<> ids, nb::ndarray<> weights, nb::ndarray<> gate,
                   std::optional<nb::ndarray<>> up, nb::ndarray<> down, std::optional<nb::ndarray<>> shared_gate,
                   std::optional<nb::ndarray<>> shared_up, std::optional<nb::ndarray<>> shared_down,
                   std::optional<nb::ndarray<>> saved, nb::ndarray<> dy, nb::ndarray<> dx, nb::ndarray<> d_weights, nb::ndarray<> d_gate,
                   std::optional<nb::ndarray<>> d_up, nb::ndarray<> d_down, std::optional<nb::ndarray<>> d_shared_gate,
                   std::optional<nb::ndarray<>> d_shared_up, std::optional<nb::ndarray<>> d_shared_down,
                   std::uintptr_t stream, std::optional<nb::ndarray<>> scratch,
                   std::optional<std::tuple<nb::ndarray<>, nb::ndarray<>, nb::ndarray<>, nb::ndarray<>>> fp8_dgrad,
                   bool fp8_wgrad) {
        const mok::ForwardArgs a = forward_args(x, ids, weights, gate, up, down, shared_gate, shared_up, shared_down, nullptr, where);
        select_device(a.x, where);
        mok::BackwardArgs b = backward_args(dy, dx, d_weights, d_gate, d_up, d_down, d_shared_gate, d_shared_up,
                                            d_shared_down, where);
        if (fp8_dgrad) {
          const auto& [down_t, down_t_exponents, gate_up_t, gate_up_t_exponents] = *fp8_dgrad;
          b.fp8 = mok::Fp8DgradWeights{view_of(down_t), view_of(gate_up_t), view_of(down_t_exponents),
                                       view_of(gate_up_t_exponents)};
        }
        b.fp8_weight_gradients = fp8_wgrad;
        const std::optional<mok::TensorView> saved_view = optional_view(saved);
        const std::optional<mok::TensorView> scratch_view = optional_view(scratch);
        nb::gil_scoped_release release;
        run(t, a, b, reinterpret_cast<cudaStream_t>(stream), saved_view, scratch_view);
      },
      nb::arg(target), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up").none(),
      nb::arg("w_down"), nb::arg("shared_gate").none(), nb::arg("shared_up").none(), nb::arg("shared_down").none(),
      nb::arg("saved").none(), nb::arg("dy"), nb::arg("dx"), nb::arg("d_topk_weights"), nb::arg("d_w_gate"),
      nb::arg("d_w_up").none(), nb::arg("d_w_down"), nb::arg("d_shared_gate").none(), nb::arg("d_shared_up").none(),
      nb::arg("d_shared_down").none(), nb::arg("stream"), nb::arg("scratch").none() = nb::none(),
      nb::arg("fp8_dgrad").none() = nb::none(), nb::arg("fp8_wgrad") = false);
}

}  // namespace mok_python
