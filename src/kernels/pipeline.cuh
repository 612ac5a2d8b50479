// Stage index + phase of a ring of shared-memory stages guarded by full/empty mbarriers.
#pragma once

#include <cstdint>

namespace mok::kernels {

template <int kStages>
struct PipelineState {
  int index = 0;
  std::uint32_t phase = 0;

  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace mok::kernels
