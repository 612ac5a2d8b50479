// The checks of one call against its workspace: where each tensor lives, the saved tensor and
// the caller's scratch.
#include <cuda_runtime_api.h>

#include "cuda_check.hpp"
#include "layer_launch.hpp"
#include "mok/error.hpp"

namespace mok::detail {

void check_locations(std::string_view where, const ForwardArgs& a, const MoeShape& s, bool check_output) {
  for (auto [name, view] : {std::pair{"x", &a.x}, {"topk_ids", &a.topk_ids}, {"topk_weights", &a.topk_weights},
                            {"w_gate", &a.w_gate}, {"w_up", &a.w_up}, {"w_down", &a.w_down}})
    if (view->numel() > 0) check_pointer_location(where, name, *view);
  if (check_output && a.y.numel() > 0) check_pointer_location(where, "y", a.y);
  if (s.has_shared())
    for (auto [name, view] : {std::pair{"shared_gate", &*a.shared_gate}, {"shared_up", &*a.shared_up},
                              {"shared_down", &*a.shared_down}})
      check_pointer_location(where, name, *view);
  if (a.fp8)
    for (auto [name, view] : {std::pair{"fp8.gate", &a.fp8->gate}, {"fp8.up", &a.fp8->up}, {"fp8.down", &a.fp8->down},
                              {"fp8.gate_exponents", &a.fp8->gate_exponents}, {"fp8.up_exponents", &a.fp8->up_exponents},
                              {"fp8.down_exponents", &a.fp8->down_exponents}})
      if (view->numel() > 0) check_pointer_location(where, name, *view);
}

namespace {

// A flat buffer argument (saved, scratch): dtype, 1-D with `elements` (at least, or exactly)
// as `from` says, device, then contiguous, non-null and where it says it lives.
void check_flat(std::string_view where, std::string_view arg, const TensorView& v, DType dtype, std::int64_t elements,
                bool at_least, std::string_view from, Device device) {
  if (v.dtype != dtype) throw_dtype_error(where, arg, "dtype must be ", dtype_name(dtype), ", got ", dtype_name(v.dtype));
  if (v.ndim != 1 || (at_least ? v.shape[0] < elements : v.shape[0] != elements))
    throw_argument_error(where, arg, "shape must be [", at_least ? ">= " : "", elements, "] (", from, "), got ",
                         v.shape_string());
  if (v.device != device) throw_argument_error(where, arg, "must be on ", device_name(device), ", got ", device_name(v.device));
  if (v.numel() > 0 && (v.data == nullptr || !v.is_contiguous()))
    throw_argument_error(where, arg, "must be a contiguous non-null tensor");
  if (v.numel() > 0) check_pointer_location(where, arg, v);
}

}  // namespace

void check_saved(std::string_view where, const TensorView& saved, const Workspace& ws, Device device) {
  check_flat(where, "saved", saved, DType::bf16, ws.saved_elements(ws.tokens()), false, "Workspace::saved_elements(T)",
             device);
  // (the backward reads it through tensor maps, and may place the FP8 weight gradients' operands there)
  if (reinterpret_cast<std::uintptr_t>(saved.data) % kPointerAlignment != 0)
    throw_argument_error(where, "saved", "data pointer must be ", kPointerAlignment, "-byte aligned, got address 0x",
                         std::hex, reinterpret_cast<std::uintptr_t>(saved.data));
}

void* call_scratch(Workspace& ws, const std::optional<TensorView>& given, std::int64_t bytes,
                   std::string_view bytes_from, std::string_view where, cudaStream_t stream) {
  if (!given) return ws.own_scratch(bytes, where, stream);
  int device = 0;
  cuda_check(cudaGetDevice(&device), where, "cudaGetDevice");
  check_flat(where, "scratch", *given, DType::u8, bytes, true, bytes_from, Device::cuda(device));
  if (reinterpret_cast<std::uintptr_t>(given->data) % kPointerAlignment != 0)
    throw_argument_error(where, "scratch", "must be aligned to ", kPointerAlignment, " bytes");
  return given->data;
}

unsigned long long* saved_marker(std::uint16_t* saved, const Workspace& ws) {
  return reinterpret_cast<unsigned long long*>(saved + ws.saved_elements(ws.tokens()) - kSavedTrailer);
}

}  // namespace mok::detail
