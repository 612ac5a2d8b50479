#include "tensor_map.hpp"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <vector>

#include "mok/error.hpp"

namespace mok::detail {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult result{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &result) !=
            cudaSuccess ||
        result != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw Error("mok: cuTensorMapEncodeTiled is not available from the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

}  // namespace

namespace {

// strides: bytes, for dims 1..rank-1 (empty: row-major contiguous).
CUtensorMap make_tensor_map(CUtensorMapDataType type, cuuint64_t element_bytes, const void* base,
                            std::initializer_list<std::uint64_t> dims_list,
                            std::initializer_list<std::uint32_t> box_list, const char* what,
                            std::vector<cuuint64_t> strides = {}) {
  const std::vector<cuuint64_t> dims(dims_list.begin(), dims_list.end());
  const std::vector<cuuint32_t> box(box_list.begin(), box_list.end());
  if (strides.empty()) {
    cuuint64_t stride = element_bytes;
    for (std::size_t i = 0; i + 1 < dims.size(); ++i) strides.push_back(stride *= dims[i]);
  }
  const std::vector<cuuint32_t> element_strides(dims.size(), 1);
  CUtensorMap map{};
  const CUresult r = encode_function()(&map, type, static_cast<cuuint32_t>(dims.size()),
                                       const_cast<void*>(base), dims.data(), strides.data(), box.data(),
                                       element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                                       CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(mok::detail::concat("mok: cuTensorMapEncodeTiled failed for ", what, " (CUresult ", static_cast<int>(r), ")"));
  return map;
}

}  // namespace

CUtensorMap make_bf16_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims,
                                 std::initializer_list<std::uint32_t> box, const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, box, what);
}

CUtensorMap make_f32_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims,
                                std::initializer_list<std::uint32_t> box, const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, dims, box, what);
}

CUtensorMap make_bf16_weight_map(const TensorView& w, std::uint32_t box_cols, std::uint32_t box_rows, const char* what) {
  using U = std::uint64_t;
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w.data, {U(w.shape[2]), U(w.shape[1]), U(w.shape[0])},
                         {box_cols, box_rows, 1}, what, {2 * U(w.stride[1]), 2 * U(w.stride[0])});
}

}  // namespace mok::detail
