// The FP8 forward's host steps (mok::forward on a Precision::fp8 workspace): the gather that
// quantizes x's routed rows, then the FP8 kernel's params and launch; the row gather's params
// (the FP8 dgrad's dy rows too; an EP rank's from its peers' tokens).
#include <cuda_runtime_api.h>

#include "cuda_check.hpp"
#include "kernels/fp8/quantize.cuh"
#include "layer_launch.hpp"
#include "tensor_map.hpp"

namespace mok::detail {

kernels::QuantizeRowsParams quantize_rows_params(Workspace& ws, std::span<const void* const> rows, std::uint8_t* values,
                                                 std::uint8_t* exps) {
  const MoeShape& s = ws.shape();
  const DevicePlanView& v = ws.plan().view();
  kernels::QuantizeRowsParams p{};
  for (std::size_t q = 0; q < rows.size(); ++q) p.x[q] = static_cast<const std::uint16_t*>(rows[q]);
  p.pairs_per_rank = ws.tokens() * s.top_k;
  p.values = values;
  p.exps = exps;
  p.row_pair = v.row_pair;
  p.expert_offset = v.expert_offset;
  p.plan_status = v.status;
  p.capacity = ws.plan().capacity_rows();
  p.hidden = static_cast<int>(s.hidden);
  p.top_k = static_cast<int>(s.top_k);
  p.num_local_experts = static_cast<int>(s.num_local_experts);
#if !defined(MOK_DIAG_DISPATCH_GATHER)  // (a diagnostic build: the gather, as before)
  if (rows.size() == 1 && s.num_local_experts == s.num_experts)  // (one GPU: the scatter, x read once)
    p.pair_row = v.pair_row, p.pairs = ws.tokens() * s.top_k;
#endif
  return p;
}

kernels::QuantizeRowsParams quantize_rows_params(Workspace& ws, const void* rows, std::uint8_t* values, std::uint8_t* exps) {
  const void* const sources[1] = {rows};
  return quantize_rows_params(ws, std::span<const void* const>(sources), values, exps);
}

kernels::Fp8ForwardParams fp8_forward_params(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers,
                                             std::uint16_t* saved_gu) {
  const MoeShape& s = ws.shape();
  const std::int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts;
  const std::int64_t capacity = ws.plan().capacity_rows();
  using U = std::uint64_t;
  kernels::Fp8ForwardParams p{};
  set_shared_expert_params(p.base, a, ws, buffers);  // (base's routed maps stay unused)
  set_saved_params(p.base, ws, saved_gu);  // (the same layout as the BF16 forward's)
  const Fp8Weights& w = *a.fp8;
  p.maps.x = make_u8_tensor_map(buffers.x_fp8, {U(H), U(capacity)}, kernels::kBoxFp8, "x rows (fp8)");
  p.maps.gate = make_u8_tensor_map(w.gate.data, {U(H), U(I), U(El)}, kernels::kBoxFp8, "fp8.gate");
  p.maps.up = make_u8_tensor_map(w.up.data, {U(H), U(I), U(El)}, kernels::kBoxFp8, "fp8.up");
  p.maps.down = make_u8_tensor_map(w.down.data, {U(I), U(H), U(El)}, kernels::kBoxFp8, "fp8.down");
  p.maps.h_store = make_u8_tensor_map(buffers.h_fp8, {U(I), U(capacity)}, kernels::kBoxFp8Half, "h (fp8)");
  p.maps.h_load = make_u8_tensor_map(buffers.h_fp8, {U(I), U(capacity)}, kernels::kBoxFp8, "h (fp8)");
  p.capacity = capacity;
  // One GPU: the E4M3 rows in the slots' upper half (forward_buffers()); an EP rank: in its x rows' buffer.
  p.base.x_rows_in_slots = ws.rows_in_slots() ? static_cast<int>(capacity) : 0;
  p.gate_exponents = static_cast<const std::int32_t*>(w.gate_exponents.data);
  p.up_exponents = static_cast<const std::int32_t*>(w.up_exponents.data);
  p.down_exponents = static_cast<const std::int32_t*>(w.down_exponents.data);
  p.x_exps = buffers.x_exps;
  p.h_exps = buffers.h_exps;
  return p;
}

void launch_forward_fp8(const ForwardArgs& a, Workspace& ws, const CallBuffers& buffers, cudaStream_t stream,
                        std::uint16_t* saved_gu, std::string_view where) {
  const int ctas = persistent_ctas(ws, where);
  kernels::QuantizeRowsParams quantize = quantize_rows_params(ws, a.x.data, buffers.x_fp8, buffers.x_exps);
  kernels::launch_quantize_rows(quantize, 4 * ctas, stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 row gather");
  kernels::launch_forward_fp8(fp8_forward_params(a, ws, buffers, saved_gu), ctas, stream);
  cuda_check(cudaGetLastError(), where, "launching the FP8 forward kernel");
}

}  // namespace mok::detail
