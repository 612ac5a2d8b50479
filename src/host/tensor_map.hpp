// Encoding TMA descriptors through the driver entry point the runtime hands out, so the
// library does not link libcuda (it loads on machines without a GPU driver).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

#include "kernels/common/boxes.hpp"
#include "mok/types.hpp"

namespace mok::detail {

// A row-major bf16 tensor: dims innermost first ({cols, rows[, batch]}), one of the
// kernels' boxes (kernels/common/boxes.hpp; one element of any batch dimension), 128-byte
// swizzle, out-of-bounds elements read as zero.
CUtensorMap make_bf16_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims, kernels::Box box,
                                 const char* what);
// The same for bytes (E4M3 values; a 128-byte row is 128 elements).
CUtensorMap make_u8_tensor_map(const void* base, std::initializer_list<std::uint64_t> dims, kernels::Box box,
                               const char* what);

// bf16 rows [rows, cols] in up to two regions: rows [0, split) at lo, the rest at hi from its
// start (hi at or past row `split` of lo; null: one region), as {cols, rows, regions}: row r of
// either region has coordinate r (region 1's stride is hi - lo less `split` rows).
CUtensorMap make_bf16_row_regions_map(const void* lo, const void* hi, std::uint64_t cols, std::uint64_t rows,
                                      std::uint64_t split, kernels::Box box, const char* what);

// A 3-D bf16 weight [E, rows, cols] as the view says (strided views too: the gate or up half
// of a concatenated [E, 2I, H]), box {cols, rows} of one expert.
CUtensorMap make_bf16_weight_map(const TensorView& w, kernels::Box box, const char* what);

}  // namespace mok::detail
