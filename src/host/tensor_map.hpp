// Encoding TMA descriptors through the driver entry point the runtime hands out, so the
// library does not link libcuda (it loads on machines without a GPU driver).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

namespace mok::detail {

// A row-major bf16 tensor: dims innermost first ({cols, rows[, batch]}), box likewise,
// 128-byte swizzle, out-of-bounds elements read as zero.
CUtensorMap make_bf16_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims,
                                 std::initializer_list<std::uint32_t> box, const char* what);
// The same for fp32 (a 128-byte row is 32 elements).
CUtensorMap make_f32_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims,
                                std::initializer_list<std::uint32_t> box, const char* what);

}  // namespace mok::detail
