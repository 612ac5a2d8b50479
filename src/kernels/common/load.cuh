// Loading kernels before the first call of an EP rank.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

// Loads `kernel`'s module now. With lazy loading (the default since CUDA 12.2) a kernel's
// first launch loads its module, which can wait for the kernels already running on the
// device: behind a kernel that spins on a peer rank served by a later launch of the same
// process (separate ranks on one GPU), that wait never ends. Ranks load every kernel they
// launch before their first call.
template <typename Kernel>
void load_kernel(Kernel* kernel) {
  cudaFuncAttributes attributes;
  (void)cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel));  // errors surface at launch
}

// Every kernel an EpRank launches (ep_sync.cu).
void load_ep_kernels();

// Per translation unit.
void load_forward_kernels();
void load_forward_fp8_kernels();
void load_quantize_kernels();
void load_backward_kernels();
void load_wgrad_fp8_kernels();
void load_plan_kernels();
void load_dispatch_kernels();
void load_exchange_kernels();

}  // namespace mok::kernels
