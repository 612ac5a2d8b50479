// The Python extension mok._C: only registers. Tensors arrive through DLPack (any
// framework), the CUDA stream as an integer: nothing here links against PyTorch.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mok/mok.hpp"
#include "mok/testing.hpp"

namespace nb = nanobind;

namespace {

mok::DType dtype_of(const nb::dlpack::dtype& d) {
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

mok::TensorView view_of(const nb::ndarray<>& a) {
  mok::TensorView v;
  if (a.ndim() > static_cast<std::size_t>(mok::TensorView::kMaxDims)) throw nb::value_error("mok: more than 4 dimensions");
  v.data = a.data();
  v.dtype = dtype_of(a.dtype());
  v.device = a.device_type() == nb::device::cuda::value ? mok::Device::cuda(a.device_id()) : mok::Device::cpu();
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) v.shape[i] = a.shape(i), v.stride[i] = a.stride(i);
  return v;
}

std::optional<mok::TensorView> optional_view(const std::optional<nb::ndarray<>>& a) {
  return a ? std::optional<mok::TensorView>(view_of(*a)) : std::nullopt;
}

mok::MoeShape make_shape(std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
                         std::int64_t num_local_experts, std::int64_t top_k, std::int64_t shared_intermediate,
                         std::optional<float> swiglu_limit) {
  mok::MoeShape s;
  s.hidden = hidden, s.intermediate = intermediate, s.num_experts = num_experts;
  s.num_local_experts = num_local_experts, s.top_k = top_k, s.shared_intermediate = shared_intermediate;
  s.swiglu_limit = swiglu_limit;
  mok::validate(s);
  return s;
}

using F64 = nb::ndarray<double, nb::c_contig, nb::device::cpu>;
using I32 = nb::ndarray<std::int32_t, nb::c_contig, nb::device::cpu>;

std::span<const double> span_of(const F64& a) { return {a.data(), a.size()}; }
std::vector<double> vec_of(const std::optional<F64>& a) {
  return a ? std::vector<double>(a->data(), a->data() + a->size()) : std::vector<double>{};
}

nb::ndarray<nb::numpy, double> to_numpy(std::vector<double> values, std::initializer_list<std::size_t> shape) {
  auto* owned = new std::vector<double>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<double>*>(p); });
  return nb::ndarray<nb::numpy, double>(owned->data(), shape.size(), shape.begin(), owner);
}

}  // namespace

mok::ForwardArgs forward_args(const nb::ndarray<>& x, const nb::ndarray<>& ids, const nb::ndarray<>& weights,
                              const nb::ndarray<>& gate, const nb::ndarray<>& up, const nb::ndarray<>& down,
                              const std::optional<nb::ndarray<>>& shared_gate,
                              const std::optional<nb::ndarray<>>& shared_up,
                              const std::optional<nb::ndarray<>>& shared_down, const nb::ndarray<>* y) {
  mok::ForwardArgs a;
  a.x = view_of(x), a.topk_ids = view_of(ids), a.topk_weights = view_of(weights);
  a.w_gate = view_of(gate), a.w_up = view_of(up), a.w_down = view_of(down);
  if (y) a.y = view_of(*y);
  a.shared_gate = optional_view(shared_gate), a.shared_up = optional_view(shared_up);
  a.shared_down = optional_view(shared_down);
  return a;
}

mok::BackwardArgs backward_args(const nb::ndarray<>& dy, const nb::ndarray<>& dx, const nb::ndarray<>& d_weights,
                                const nb::ndarray<>& d_gate, const nb::ndarray<>& d_up, const nb::ndarray<>& d_down,
                                const std::optional<nb::ndarray<>>& d_shared_gate,
                                const std::optional<nb::ndarray<>>& d_shared_up,
                                const std::optional<nb::ndarray<>>& d_shared_down) {
  mok::BackwardArgs b;
  b.dy = view_of(dy), b.dx = view_of(dx), b.d_topk_weights = view_of(d_weights);
  b.d_w_gate = view_of(d_gate), b.d_w_up = view_of(d_up), b.d_w_down = view_of(d_down);
  b.d_shared_gate = optional_view(d_shared_gate), b.d_shared_up = optional_view(d_shared_up);
  b.d_shared_down = optional_view(d_shared_down);
  return b;
}

// This extension has its own CUDA runtime: select the tensors' device explicitly.
void select_device(const mok::ForwardArgs& a, const char* where) {
  if (a.x.device.kind == mok::DeviceKind::cuda && cudaSetDevice(a.x.device.index) != cudaSuccess)
    throw nb::value_error((std::string(where) + ": cannot use CUDA device " + std::to_string(a.x.device.index)).c_str());
}

namespace {

// Binds name(target, x, topk_ids, topk_weights, w_gate, w_up, w_down, shared_*, y, saved,
// stream, scratch=None): the tensors as views on their device, then run(target, args,
// stream, saved, scratch) without the GIL. Target: a Workspace (one GPU) or an EpRank.
template <typename Target, typename Run>
void def_forward(nb::module_& m, const char* name, const char* target, const char* where, Run run) {
  m.def(
      name,
      [where, run](Target& t, nb::ndarray<> x, nb::ndarray<> ids, nb::ndarray<> weights, nb::ndarray<> gate,
                   nb::ndarray<> up, nb::ndarray<> down, std::optional<nb::ndarray<>> shared_gate,
                   std::optional<nb::ndarray<>> shared_up, std::optional<nb::ndarray<>> shared_down, nb::ndarray<> y,
                   std::optional<nb::ndarray<>> saved, std::uintptr_t stream, std::optional<nb::ndarray<>> scratch) {
        const mok::ForwardArgs a = forward_args(x, ids, weights, gate, up, down, shared_gate, shared_up, shared_down, &y);
        select_device(a, where);
        const std::optional<mok::TensorView> saved_view = optional_view(saved), scratch_view = optional_view(scratch);
        nb::gil_scoped_release release;
        run(t, a, reinterpret_cast<cudaStream_t>(stream), saved_view, scratch_view);
      },
      nb::arg(target), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up"),
      nb::arg("w_down"), nb::arg("shared_gate").none(), nb::arg("shared_up").none(), nb::arg("shared_down").none(),
      nb::arg("y"), nb::arg("saved").none(), nb::arg("stream"), nb::arg("scratch").none() = nb::none());
}

// The same for the backward: name(target, forward's inputs, saved, dy, dx, d_topk_weights,
// d_w_gate, d_w_up, d_w_down, d_shared_*, stream, scratch=None).
template <typename Target, typename Run>
void def_backward(nb::module_& m, const char* name, const char* target, const char* where, Run run) {
  m.def(
      name,
      [where, run](Target& t, nb::ndarray<> x, nb::ndarray<> ids, nb::ndarray<> weights, nb::ndarray<> gate,
                   nb::ndarray<> up, nb::ndarray<> down, std::optional<nb::ndarray<>> shared_gate,
                   std::optional<nb::ndarray<>> shared_up, std::optional<nb::ndarray<>> shared_down, nb::ndarray<> saved,
                   nb::ndarray<> dy, nb::ndarray<> dx, nb::ndarray<> d_weights, nb::ndarray<> d_gate,
                   nb::ndarray<> d_up, nb::ndarray<> d_down, std::optional<nb::ndarray<>> d_shared_gate,
                   std::optional<nb::ndarray<>> d_shared_up, std::optional<nb::ndarray<>> d_shared_down,
                   std::uintptr_t stream, std::optional<nb::ndarray<>> scratch) {
        const mok::ForwardArgs a = forward_args(x, ids, weights, gate, up, down, shared_gate, shared_up, shared_down, nullptr);
        select_device(a, where);
        const mok::BackwardArgs b = backward_args(dy, dx, d_weights, d_gate, d_up, d_down, d_shared_gate, d_shared_up,
                                                  d_shared_down);
        const mok::TensorView saved_view = view_of(saved);
        const std::optional<mok::TensorView> scratch_view = optional_view(scratch);
        nb::gil_scoped_release release;
        run(t, a, b, reinterpret_cast<cudaStream_t>(stream), saved_view, scratch_view);
      },
      nb::arg(target), nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up"),
      nb::arg("w_down"), nb::arg("shared_gate").none(), nb::arg("shared_up").none(), nb::arg("shared_down").none(),
      nb::arg("saved"), nb::arg("dy"), nb::arg("dx"), nb::arg("d_topk_weights"), nb::arg("d_w_gate"),
      nb::arg("d_w_up"), nb::arg("d_w_down"), nb::arg("d_shared_gate").none(), nb::arg("d_shared_up").none(),
      nb::arg("d_shared_down").none(), nb::arg("stream"), nb::arg("scratch").none() = nb::none());
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "MoK for Hopper: C++/CUDA core (see the mok package for the PyTorch API)";
  m.attr("__version__") = mok::kVersion;

  // The library's error types as Python's, with the library's message: a wrong dtype is a
  // TypeError, any other wrong argument a ValueError, a failure of the device or the
  // library (CUDA error, timeout) a RuntimeError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const mok::DTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const mok::ArgumentError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const mok::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("cuda_device_count", &mok::cuda_device_count);
  m.def("validate_shape", &make_shape, nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"),
        nb::arg("num_local_experts"), nb::arg("top_k"), nb::arg("shared_intermediate") = 0,
        nb::arg("swiglu_limit") = nb::none());

  // fp64 CPU reference of the whole layer (the test oracle). Weights of all E experts.
  m.def(
      "reference_forward",
      [](F64 x, I32 ids, F64 weights, F64 gate, F64 up, F64 down, std::optional<F64> shared_gate,
         std::optional<F64> shared_up, std::optional<F64> shared_down, std::optional<float> limit) {
        if (x.ndim() != 2 || ids.ndim() != 2) throw nb::value_error("mok.reference_forward: x and topk_ids must be 2-D");
        if (gate.ndim() != 3) throw nb::value_error("mok.reference_forward: w_gate must be [E, I, H]");
        const std::int64_t T = x.shape(0), H = x.shape(1), E = gate.shape(0), I = gate.shape(1), k = ids.shape(1);
        const std::int64_t Is = shared_gate ? shared_gate->shape(0) : 0;
        const mok::MoeShape s = make_shape(H, I, E, E, k, Is, limit);
        mok::reference::Routing r{std::vector<std::int32_t>(ids.data(), ids.data() + ids.size()), vec_of(weights)};
        mok::reference::Weights w{vec_of(gate), vec_of(up), vec_of(down), vec_of(shared_gate), vec_of(shared_up),
                                  vec_of(shared_down)};
        return to_numpy(mok::reference::forward(s, T, span_of(x), r, w), {std::size_t(T), std::size_t(H)});
      },
      nb::arg("x"), nb::arg("topk_ids"), nb::arg("topk_weights"), nb::arg("w_gate"), nb::arg("w_up"),
      nb::arg("w_down"), nb::arg("shared_gate") = nb::none(), nb::arg("shared_up") = nb::none(),
      nb::arg("shared_down") = nb::none(), nb::arg("swiglu_limit") = nb::none());

  // The fused forward's workspace for one shape and token count (one GPU, EP = 1).
  nb::class_<mok::Workspace>(m, "Workspace")
      .def(
          "__init__",
          [](mok::Workspace* self, std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
             std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens,
             int device, int compute_sms, double timeout_seconds, bool training) {
            if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
              throw nb::value_error(("mok.Workspace: cannot use CUDA device " + std::to_string(device) + ": " +
                                     cudaGetErrorString(err)).c_str());
            mok::Config config;
            config.compute_sms = compute_sms;
            config.timeout_seconds = timeout_seconds;
            new (self) mok::Workspace(make_shape(hidden, intermediate, num_experts, num_experts, top_k,
                                                 shared_intermediate, limit),
                                      tokens, config, training ? mok::Training::save : mok::Training::off);
          },
          nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("top_k"),
          nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"), nb::arg("device"),
          nb::arg("compute_sms") = 0, nb::arg("timeout_seconds") = 10.0, nb::arg("training") = false)
      .def_prop_ro("saved_elements", &mok::Workspace::saved_elements)
      .def_prop_ro("forward_scratch_bytes", &mok::Workspace::forward_scratch_bytes)
      .def(
          "backward_scratch_bytes",
          [](const mok::Workspace& ws, bool f32_grads) {
            return ws.backward_scratch_bytes(f32_grads ? mok::DType::f32 : mok::DType::bf16);
          },
          nb::arg("f32_grads") = false)
      .def("check", [](mok::Workspace& ws, std::uintptr_t stream) { ws.check(reinterpret_cast<cudaStream_t>(stream)); })
      .def_prop_ro("bytes", &mok::Workspace::bytes);

  def_forward<mok::Workspace>(m, "forward", "workspace", "mok.forward",
                              [](mok::Workspace& ws, const mok::ForwardArgs& a, cudaStream_t stream,
                                 const std::optional<mok::TensorView>& saved,
                                 const std::optional<mok::TensorView>& scratch) {
                                mok::forward(a, ws, stream, saved, scratch);
                              });

  def_backward<mok::Workspace>(m, "backward", "workspace", "mok.backward",
                               [](mok::Workspace& ws, const mok::ForwardArgs& a, const mok::BackwardArgs& b,
                                  cudaStream_t stream, const mok::TensorView& saved,
                                  const std::optional<mok::TensorView>& scratch) {
                                 mok::backward(a, b, ws, stream, saved, scratch);
                               });

  // Expert parallelism: one rank of a group whose symmetric regions come from the caller
  // (PyTorch symmetric memory: the rendezvous' buffer_ptrs).
  m.def(
      "ep_region_bytes",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t num_local_experts,
         std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens) {
        return mok::EpRank::region_bytes(
            make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit), tokens);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
      nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"));

  m.def(
      "ep_saved_elements",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t num_local_experts,
         std::int64_t top_k, std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens) {
        return mok::saved_elements(
            make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit), tokens);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
      nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
      "bf16 elements of one EP rank's saved tensor (no GPU needed).");

  nb::class_<mok::EpRank>(m, "EpRank")
      .def(
          "__init__",
          [](mok::EpRank* self, std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts,
             std::int64_t num_local_experts, std::int64_t top_k, std::int64_t shared_intermediate,
             std::optional<float> limit, std::int64_t tokens, int rank, std::vector<std::uintptr_t> region_ptrs,
             int device, int compute_sms, double timeout_seconds, bool training, bool peers_on_other_gpus) {
            if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess)
              throw nb::value_error(("mok.EpRank: cannot use CUDA device " + std::to_string(device) + ": " +
                                     cudaGetErrorString(err)).c_str());
            mok::Config config;
            config.compute_sms = compute_sms;
            config.timeout_seconds = timeout_seconds;
            std::vector<void*> bases;
            for (std::uintptr_t p : region_ptrs) bases.push_back(reinterpret_cast<void*>(p));
            new (self) mok::EpRank(
                make_shape(hidden, intermediate, num_experts, num_local_experts, top_k, shared_intermediate, limit),
                tokens, rank, bases, config, training ? mok::Training::save : mok::Training::off, peers_on_other_gpus);
          },
          nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("num_local_experts"),
          nb::arg("top_k"), nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
          nb::arg("rank"), nb::arg("region_ptrs"), nb::arg("device"), nb::arg("compute_sms") = 0,
          nb::arg("timeout_seconds") = 10.0, nb::arg("training") = false, nb::arg("peers_on_other_gpus") = true)
      .def_prop_ro("saved_elements", &mok::EpRank::saved_elements)
      .def("check", [](mok::EpRank& r, std::uintptr_t stream) { r.check(reinterpret_cast<cudaStream_t>(stream)); });

  def_forward<mok::EpRank>(m, "ep_forward", "rank", "mok.ep_forward",
                           [](mok::EpRank& rank, const mok::ForwardArgs& a, cudaStream_t stream,
                              const std::optional<mok::TensorView>& saved,
                              const std::optional<mok::TensorView>& scratch) {
                             if (scratch) throw mok::ArgumentError("mok.ep_forward: scratch: an EP rank owns its buffers; pass None");
                             rank.forward(a, stream, saved);
                           });

  def_backward<mok::EpRank>(m, "ep_backward", "rank", "mok.ep_backward",
                            [](mok::EpRank& rank, const mok::ForwardArgs& a, const mok::BackwardArgs& b,
                               cudaStream_t stream, const mok::TensorView& saved,
                               const std::optional<mok::TensorView>& scratch) {
                              if (scratch) throw mok::ArgumentError("mok.ep_backward: scratch: an EP rank owns its buffers; pass None");
                              rank.backward(a, b, stream, saved);
                            });

  m.def(
      "saved_elements",
      [](std::int64_t hidden, std::int64_t intermediate, std::int64_t num_experts, std::int64_t top_k,
         std::int64_t shared_intermediate, std::optional<float> limit, std::int64_t tokens) {
        return mok::saved_elements(make_shape(hidden, intermediate, num_experts, num_experts, top_k,
                                              shared_intermediate, limit),
                                   tokens);
      },
      nb::arg("hidden"), nb::arg("intermediate"), nb::arg("num_experts"), nb::arg("top_k"),
      nb::arg("shared_intermediate"), nb::arg("swiglu_limit").none(), nb::arg("tokens"),
      "bf16 elements of the tensor a training forward saves for the backward (no GPU needed).");
}
