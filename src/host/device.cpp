#include "mok/device.hpp"

#include <cuda_runtime_api.h>

#include "mok/error.hpp"

namespace mok {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

DeviceInfo query_device(int index) {
  const int n = cuda_device_count();
  if (index < 0 || index >= n)
    throw_argument_error("mok::query_device", "index", "must be in [0, ", n, "), got ", index);
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, index); err != cudaSuccess)
    throw Error(detail::concat("mok::query_device: cudaGetDeviceProperties(", index,
                               ") failed: ", cudaGetErrorString(err)));
  DeviceInfo info;
  info.index = index;
  info.name = prop.name;
  info.major = prop.major, info.minor = prop.minor;
  info.sm_count = prop.multiProcessorCount;
  info.shared_memory_per_block_optin = prop.sharedMemPerBlockOptin;
  info.global_memory_bytes = prop.totalGlobalMem;
  return info;
}

}  // namespace mok
