// Shared helpers of the PTX wrappers: shared-memory addresses.
#pragma once

#include <cstdint>

namespace mok::ptx {

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace mok::ptx
