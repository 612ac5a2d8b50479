// What the standalone microbenchmarks (ring_copy_bench, combine_rate: no mok_bench support, no
// exceptions) share: a CUDA call checked, exiting with the call and its error, and GPU 0 required to
// be a Hopper GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    const cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                             \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

// GPU 0's properties into `prop`; false, with a message naming `tool`, where there is no CUDA GPU or
// GPU 0 is not sm_90 (the tools' kernels are Hopper's).
inline bool hopper_gpu(const char* tool, cudaDeviceProp& prop) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "%s: no CUDA GPU found; it needs a Hopper GPU (sm_90)\n", tool);
    return false;
  }
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "%s: GPU 0 is not Hopper (sm_%d%d); it needs sm_90\n", tool, prop.major, prop.minor);
    return false;
  }
  return true;
}
