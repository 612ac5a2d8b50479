// What the library needs to know about a GPU, and whether it can run the fused kernels.
#pragma once

#include <optional>
#include <string>

namespace mok {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0, minor = 0;  // compute capability
  int sm_count = 0;
  std::size_t shared_memory_per_block_optin = 0;
  std::size_t global_memory_bytes = 0;

  // The fused kernels are built for sm_90a only (wgmma, setmaxnreg).
  bool is_hopper() const { return major == 9 && minor == 0; }
};

// Number of visible CUDA devices; 0 where there is no GPU or no driver (never throws).
int cuda_device_count();

// Properties of device `index`; throws mok::Error if it does not exist.
DeviceInfo query_device(int index);

}  // namespace mok
