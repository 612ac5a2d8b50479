// The TMA boxes of the kernels' loads and stores, innermost dimension first ({columns, rows}
// in elements), in one place: the host encodes every tensor map with these (src/host), and
// the kernels count the bytes a stage expects from them (forward/tasks.cuh and
// backward/tasks.cuh static_assert that they match the tile constants). Plain C++: the host
// compiler includes it too.
#pragma once

#include <cstdint>

namespace mok::kernels {

struct Box {
  std::uint32_t cols, rows;
  constexpr std::uint32_t bytes(std::uint32_t element_bytes) const { return cols * rows * element_bytes; }
};

// A K-major bf16 operand tile: one 128-byte swizzle atom of K (64) by an M-tile's 128 rows
// (x and routed x rows, GEMM1's gate and up rows, GEMM2's h rows; the backward's K-major A).
inline constexpr Box kBoxK{64, 128};
// GEMM2's weight tile (w_down, the shared expert's down): 64 of K by a 256-column N-tile.
inline constexpr Box kBoxDown{64, 256};
// 64 x 64 bf16: the forward's h and slot-row stores, the backward's MN-major loads and its row stores.
inline constexpr Box kBoxMN{64, 64};

// The FP8 kernels' E4M3 tiles (1 byte an element, so one 128-byte swizzle atom is 128 of K):
// 128 rows (x rows, h rows, w_down's 128-column N-tile) and the 64-row halves (w_gate's and
// w_up's rows of one GEMM1 pass; a consumer warpgroup's h store; the backward's dy rows, dgate|dup
// rows and transposed weights).
inline constexpr Box kBoxFp8{128, 128};
// K of an FP8 stage: one 128-byte swizzle atom of E4M3, which is one scale block of every operand.
inline constexpr int kFp8BlockK = 128;
inline constexpr Box kBoxFp8Half{128, 64};

}  // namespace mok::kernels
