// Turns a failed CUDA runtime call into mok::Error("<where>: <what>: <CUDA's message>").
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include "mok/error.hpp"

namespace mok::detail {

inline void cuda_check(cudaError_t err, std::string_view where, std::string_view what) {
  if (err != cudaSuccess) throw Error(concat(where, ": ", what, ": ", cudaGetErrorString(err)));
}

}  // namespace mok::detail
