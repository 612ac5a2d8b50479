#include "mok/validate.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <unordered_set>
#include <vector>

#include "mok/error.hpp"

namespace mok {
namespace {

struct Checker {
  std::string_view where;
  Device device;

  // strided: a 3-D expert weight (or its bf16 gradient) may be a strided view, e.g. the gate
  // or up half of a concatenated [E, 2I, H] tensor: rows contiguous, row and expert strides
  // multiples of 8 elements (16 bytes, for TMA), experts and rows not overlapping.
  void tensor(std::string_view arg, const TensorView& v, std::initializer_list<DType> dtypes,
              std::initializer_list<std::int64_t> dims, bool strided = false) const {
    bool dtype_ok = false;
    for (DType d : dtypes) dtype_ok |= (v.dtype == d);
    if (!dtype_ok) {
      std::string allowed;
      for (DType d : dtypes) allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(d));
      throw_dtype_error(where, arg, "dtype must be ", allowed, ", got ", dtype_name(v.dtype));
    }
    bool shape_ok = v.ndim == static_cast<int>(dims.size());
    int i = 0;
    for (std::int64_t n : dims) shape_ok = shape_ok && v.shape[i++] == n;
    if (!shape_ok) {
      TensorView expected = TensorView::contiguous(nullptr, v.dtype, v.device, dims);
      throw_argument_error(where, arg, "shape must be ", expected.shape_string(), ", got ",
                           v.shape_string());
    }
    if (v.device != device)
      throw_argument_error(where, arg, "must be on ", device_name(device), ", got ",
                           device_name(v.device));
    if (v.numel() == 0) return;  // an empty tensor may have a null pointer
    if (v.data == nullptr) throw_argument_error(where, arg, "data pointer is null");
    if (strided && !v.is_contiguous()) {
      // (rows_apart compares by division: the product wrapped for strides near 2^57 and let
      // overlapping experts through)
      const bool ok = v.rows_apart() && v.stride[1] % 8 == 0 && v.stride[0] % 8 == 0;
      if (!ok)
        throw_argument_error(where, arg, "must be contiguous or a view with contiguous rows, row and expert "
                             "strides multiples of 8 and no overlap (like one half of [E, 2I, H]), got strides ",
                             stride_string(v), " for shape ", v.shape_string());
    } else if (!v.is_contiguous()) {
      throw_argument_error(where, arg, "must be contiguous (row-major), got strides ",
                           stride_string(v), " for shape ", v.shape_string());
    }
    const auto address = reinterpret_cast<std::uintptr_t>(v.data);
    if (address % kPointerAlignment != 0)
      throw_argument_error(where, arg, "data pointer must be ", kPointerAlignment,
                           "-byte aligned, got address 0x", std::hex, address);
  }

  static std::string stride_string(const TensorView& v) {
    std::string s = "[";
    for (int i = 0; i < v.ndim; ++i) s += (i ? ", " : "") + std::to_string(v.stride[i]);
    return s + "]";
  }
};

void check_rows(std::string_view where, std::string_view arg, const TensorView& v,
                std::int64_t tokens, std::string_view ref) {
  if (v.ndim >= 1 && v.shape[0] != tokens)
    throw_argument_error(where, arg, "must have ", tokens, " rows like '", ref, "', got ",
                         v.shape[0]);
}

}  // namespace

std::int64_t validate_rows_args(std::string_view where, const MoeShape& shape, const TensorView& x,
                                const TensorView& topk_ids, Device device) {
  validate(shape);
  if (x.ndim != 2) throw_argument_error(where, "x", "must be 2-D [T, H], got shape ", x.shape_string());
  const std::int64_t T = x.shape[0];
  if (T < 0) throw_argument_error(where, "x", "must have T >= 0 rows, got shape ", x.shape_string());
  const Checker c{where, device};
  c.tensor("x", x, {DType::bf16}, {T, shape.hidden});
  check_rows(where, "topk_ids", topk_ids, T, "x");
  c.tensor("topk_ids", topk_ids, {DType::i32, DType::i64}, {T, shape.top_k});
  return T;
}

std::int64_t validate_forward_args(std::string_view where, const MoeShape& shape,
                                   const ForwardArgs& a, Device device, bool require_output) {
  const std::int64_t T = validate_rows_args(where, shape, a.x, a.topk_ids, device);
  const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts;
  const std::int64_t k = shape.top_k, Is = shape.shared_intermediate;
  const Checker c{where, device};

  check_rows(where, "topk_weights", a.topk_weights, T, "x");
  c.tensor("topk_weights", a.topk_weights, {DType::f32}, {T, k});
  c.tensor("w_gate", a.w_gate, {DType::bf16}, {El, I, H}, true);
  c.tensor("w_up", a.w_up, {DType::bf16}, {El, I, H}, true);
  c.tensor("w_down", a.w_down, {DType::bf16}, {El, H, I}, true);
  const bool any_shared = a.shared_gate || a.shared_up || a.shared_down;
  if (shape.has_shared()) {
    if (!a.shared_gate) throw_argument_error(where, "shared_gate", "is required: shape.shared_intermediate = ", Is);
    if (!a.shared_up) throw_argument_error(where, "shared_up", "is required: shape.shared_intermediate = ", Is);
    if (!a.shared_down) throw_argument_error(where, "shared_down", "is required: shape.shared_intermediate = ", Is);
    c.tensor("shared_gate", *a.shared_gate, {DType::bf16}, {Is, H});
    c.tensor("shared_up", *a.shared_up, {DType::bf16}, {Is, H});
    c.tensor("shared_down", *a.shared_down, {DType::bf16}, {H, Is});
  } else if (any_shared) {
    throw_argument_error(where, "shared_gate", "shared-expert weights were given but shape.shared_intermediate = 0");
  }
  if (require_output || a.y.ndim != 0) c.tensor("y", a.y, {DType::bf16}, {T, H});
  if (a.fp8) {  // (whether the call takes them is the workspace's precision: checked by the call)
    const std::int64_t Hb = (H + 127) / 128, Ib = (I + 127) / 128;
    c.tensor("fp8.gate", a.fp8->gate, {DType::u8}, {El, I, H});
    c.tensor("fp8.up", a.fp8->up, {DType::u8}, {El, I, H});
    c.tensor("fp8.down", a.fp8->down, {DType::u8}, {El, H, I});
    c.tensor("fp8.gate_exponents", a.fp8->gate_exponents, {DType::i32}, {El, Ib, Hb});
    c.tensor("fp8.up_exponents", a.fp8->up_exponents, {DType::i32}, {El, Ib, Hb});
    c.tensor("fp8.down_exponents", a.fp8->down_exponents, {DType::i32}, {El, Hb, Ib});
  }
  return T;
}

void validate_backward_args(std::string_view where, const MoeShape& shape, const ForwardArgs& f,
                            const BackwardArgs& b, Device device) {
  const std::int64_t T = validate_forward_args(where, shape, f, device, false);
  const std::int64_t H = shape.hidden, I = shape.intermediate, El = shape.num_local_experts;
  const std::int64_t k = shape.top_k, Is = shape.shared_intermediate;
  const Checker c{where, device};
  c.tensor("dy", b.dy, {DType::bf16}, {T, H});
  c.tensor("dx", b.dx, {DType::bf16}, {T, H});
  c.tensor("d_topk_weights", b.d_topk_weights, {DType::f32}, {T, k});
  const DType gdt = b.d_w_gate.dtype;
  if (gdt != DType::bf16 && gdt != DType::f32)
    throw_dtype_error(where, "d_w_gate", "dtype must be bf16 (written) or f32 (accumulated), got ", dtype_name(gdt));
  // bf16 gradients are written through tensor maps (strided views too); f32 ones are
  // accumulated with plain loads and stores of contiguous rows.
  const bool strided = gdt == DType::bf16;
  c.tensor("d_w_gate", b.d_w_gate, {gdt}, {El, I, H}, strided);
  c.tensor("d_w_up", b.d_w_up, {gdt}, {El, I, H}, strided);
  c.tensor("d_w_down", b.d_w_down, {gdt}, {El, H, I}, strided);
  if (shape.has_shared()) {
    if (!b.d_shared_gate || !b.d_shared_up || !b.d_shared_down)
      throw_argument_error(where, "d_shared_gate", "shared-expert gradients are required: shape.shared_intermediate = ", Is);
    c.tensor("d_shared_gate", *b.d_shared_gate, {gdt}, {Is, H});
    c.tensor("d_shared_up", *b.d_shared_up, {gdt}, {Is, H});
    c.tensor("d_shared_down", *b.d_shared_down, {gdt}, {H, Is});
  } else if (b.d_shared_gate || b.d_shared_up || b.d_shared_down) {  // (never written: refused, as the forward's)
    throw_argument_error(where, "d_shared_gate", "shared-expert gradients were given but shape.shared_intermediate = 0");
  }
  if (b.fp8) {  // (whether the call takes them is the workspace's precision: checked by the call)
    const std::int64_t Hb = (H + 127) / 128, Ib = (I + 127) / 128;
    c.tensor("fp8.down_t", b.fp8->down_t, {DType::u8}, {El, I, H});
    c.tensor("fp8.gate_up_t", b.fp8->gate_up_t, {DType::u8}, {El, H, 2 * I});
    c.tensor("fp8.down_t_exponents", b.fp8->down_t_exponents, {DType::i32}, {El, Ib, Hb});
    c.tensor("fp8.gate_up_t_exponents", b.fp8->gate_up_t_exponents, {DType::i32}, {El, Hb, 2 * Ib});
  }
}

void validate_routing_values(std::string_view where, const MoeShape& shape,
                             const TensorView& ids) {
  validate(shape);
  if (ids.device.kind != DeviceKind::cpu)
    throw_argument_error(where, "topk_ids", "value check needs host memory, got ", device_name(ids.device));
  if (ids.dtype != DType::i32 && ids.dtype != DType::i64)
    throw_dtype_error(where, "topk_ids", "dtype must be i32 or i64, got ", dtype_name(ids.dtype));
  if (ids.ndim != 2 || ids.shape[1] != shape.top_k || ids.shape[0] < 0)
    throw_argument_error(where, "topk_ids", "must be [T, top_k = ", shape.top_k, "], got shape ", ids.shape_string());
  if (!ids.is_contiguous())  // (the values are read as one flat array)
    throw_argument_error(where, "topk_ids", "must be contiguous for the value check");
  const std::int64_t n = ids.numel();
  if (n > 0 && ids.data == nullptr) throw_argument_error(where, "topk_ids", "data pointer is null");
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t id = ids.dtype == DType::i64 ? static_cast<const std::int64_t*>(ids.data)[i]
                                                    : static_cast<const std::int32_t*>(ids.data)[i];
    if (id < -1 || id >= shape.num_experts)
      throw_argument_error(where, "topk_ids", "expert id must be in [-1, ", shape.num_experts,
                           "), got ", id, " at token ", i / shape.top_k, ", slot ", i % shape.top_k);
  }
}

namespace {

// The (pointer, device) pairs this thread found to be memory of that CUDA device: a layer's
// calls see the same weights, activations and scratch blocks again and again (a caching
// allocator hands the same blocks back), and each cudaPointerGetAttributes is a driver call
// of ~1 µs before the first launch. Only passes are kept; bounded, cleared when full.
constexpr std::size_t kMaxCheckedPointers = 4096;
thread_local std::unordered_set<std::uint64_t> checked_pointers;

std::uint64_t pointer_key(const void* p, int device) {  // (user-space addresses are below 2^57)
  return (reinterpret_cast<std::uint64_t>(p) << 6) | static_cast<std::uint64_t>(device & 63);
}

}  // namespace

void check_pointer_location(std::string_view where, std::string_view arg, const TensorView& v) {
  if (v.data == nullptr) return;
  const bool cacheable = v.device.kind == DeviceKind::cuda && v.device.index >= 0 && v.device.index < 64;
  if (cacheable && checked_pointers.count(pointer_key(v.data, v.device.index))) return;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, v.data);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
    throw_argument_error(where, arg, "cannot query its pointer: ", cudaGetErrorString(err));
  }
  const bool on_gpu = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (v.device.kind == DeviceKind::cuda) {
    if (!on_gpu)
      throw_argument_error(where, arg, "is declared on ", device_name(v.device),
                           " but its pointer is host memory");
    if (attr.device != v.device.index)
      throw_argument_error(where, arg, "is declared on ", device_name(v.device),
                           " but its pointer lives on cuda:", attr.device);
  } else if (attr.type == cudaMemoryTypeDevice) {
    throw_argument_error(where, arg, "is declared on cpu but its pointer is memory of cuda:", attr.device);
  }
  if (cacheable) {
    if (checked_pointers.size() >= kMaxCheckedPointers) checked_pointers.clear();
    checked_pointers.insert(pointer_key(v.data, v.device.index));
  }
}

}  // namespace mok
