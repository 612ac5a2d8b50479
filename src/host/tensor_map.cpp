#include "tensor_map.hpp"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <unordered_map>

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

// Everything a descriptor is made from (the swizzle, interleave, promotion and fill are the
// same for every map): equal keys give bytewise equal descriptors.
struct MapKey {
  std::uint64_t base = 0;
  std::uint32_t type = 0, rank = 0;
  cuuint64_t dims[5] = {}, strides[4] = {};
  cuuint32_t box[5] = {};
  std::uint32_t pad = 0;  // (no padding bytes: compared and hashed as bytes)
  bool operator==(const MapKey& o) const { return std::memcmp(this, &o, sizeof(MapKey)) == 0; }
};
static_assert(std::has_unique_object_representations_v<MapKey>);

struct MapKeyHash {
  std::size_t operator()(const MapKey& k) const {  // FNV-1a over the key's bytes
    const auto* p = reinterpret_cast<const unsigned char*>(&k);
    std::uint64_t h = 1469598103934665603ull;
    for (std::size_t i = 0; i < sizeof(MapKey); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<std::size_t>(h);
  }
};

// The descriptors this thread encoded, by key: a layer's calls see the same weights, and
// mostly the same activations and scratch (a caching allocator hands the same blocks back),
// so most maps of a call are found here instead of encoded (a driver call each). Bounded:
// cleared when it holds more than kMaxCachedMaps.
constexpr std::size_t kMaxCachedMaps = 16384;
thread_local std::unordered_map<MapKey, CUtensorMap, MapKeyHash> cached_maps;

// strides: bytes, for dims 1..rank-1 (empty: row-major contiguous). The key is built in
// place and holds the encoder's arrays: a cache hit allocates nothing.
CUtensorMap make_tensor_map(CUtensorMapDataType type, cuuint64_t element_bytes, const void* base,
                            std::initializer_list<std::uint64_t> dims, kernels::Box box, const char* what,
                            std::initializer_list<std::uint64_t> strides = {}) {
  MapKey key;
  key.base = reinterpret_cast<std::uint64_t>(base);
  key.type = static_cast<std::uint32_t>(type);
  key.rank = static_cast<std::uint32_t>(std::min<std::size_t>(dims.size(), 5));
  std::copy_n(dims.begin(), key.rank, key.dims);
  key.box[0] = box.cols, key.box[1] = box.rows;  // (outer dimensions: one element each)
  for (std::uint32_t i = 2; i < key.rank; ++i) key.box[i] = 1;
  if (strides.size() > 0) {
    std::copy_n(strides.begin(), std::min<std::size_t>(strides.size(), 4), key.strides);
  } else {
    cuuint64_t stride = element_bytes;
    for (std::uint32_t i = 0; i + 1 < key.rank; ++i) key.strides[i] = stride *= key.dims[i];
  }
  if (const auto hit = cached_maps.find(key); hit != cached_maps.end()) return hit->second;

  constexpr cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  CUtensorMap map{};
  const CUresult r = encode_function()(&map, type, key.rank, const_cast<void*>(base), key.dims, key.strides, key.box,
                                       element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error(mok::detail::concat("mok: cuTensorMapEncodeTiled failed for ", what, " (CUresult ", static_cast<int>(r), ")"));
  if (cached_maps.size() >= kMaxCachedMaps) cached_maps.clear();
  cached_maps.emplace(key, map);
  return map;
}

}  // namespace

CUtensorMap make_bf16_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims, kernels::Box box,
                                 const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, box, what);
}

CUtensorMap make_u8_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims, kernels::Box box,
                               const char* what) {
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, dims, box, what);
}

CUtensorMap make_bf16_row_regions_map(const void* lo, const void* hi, std::uint64_t cols, std::uint64_t rows,
                                      std::uint64_t split, kernels::Box box, const char* what) {
  if (hi == nullptr)
    return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, lo, {cols, rows, 1}, box, what, {2 * cols, 2 * cols * rows});
  const std::uint64_t stride = static_cast<const char*>(hi) - static_cast<const char*>(lo) - 2 * cols * split;
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, lo, {cols, rows, 2}, box, what, {2 * cols, stride});
}

CUtensorMap make_bf16_weight_map(const TensorView& w, kernels::Box box, const char* what) {
  using U = std::uint64_t;
  return make_tensor_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w.data, {U(w.shape[2]), U(w.shape[1]), U(w.shape[0])},
                         box, what, {2 * U(w.stride[1]), 2 * U(w.stride[0])});
}

}  // namespace mok::detail
