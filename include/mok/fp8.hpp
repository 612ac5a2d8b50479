// FP8 on the host: E4M3 values (OCP FP8: 1 sign, 4 exponent bits of bias 7, 3 mantissa bits,
// no infinities, largest finite 448) and the blockwise scaling the FP8 path will use
// (DeepSeek-V3's recipe: activations per 1 x 128 block of a row, weights per 128 x 128 block),
// with power-of-two scales, so that a quantized tensor converts to MXFP8 (an E8M0 exponent per
// 32 elements of a row) without changing a value. The reference and the tests of the FP8
// kernels are built on these; the kernels will produce the same bytes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "mok/types.hpp"
#include "mok/validate.hpp"

namespace mok::fp8 {

inline constexpr float kE4m3Max = 448.0f;
// The smallest scale exponent: E8M0's (MXFP8's scale format, 2^-127 .. 2^127), so that every
// scale of the recipe is an E8M0 byte (e + 127) and every quantized tensor converts to MXFP8.
inline constexpr int kMinScaleExponent = -127;

// Round to nearest, ties to even; magnitudes above 448 saturate to +-448 (training's
// "satfinite"); NaN becomes 0x7f. -0.0 keeps its sign.
std::uint8_t encode_e4m3(float value);
float decode_e4m3(std::uint8_t bits);

// The exponent e of a block's power-of-two scale 2^e: the smallest e >= kMinScaleExponent with
// amax / 2^e <= 448, so that the block's largest magnitude fits (0 for an all-zero block). Only a
// block whose largest magnitude is below 1.75 2^-119 takes the floor (its values then use fewer of
// E4M3's exponents; those of magnitude 2^-133 and above keep all three mantissa bits). A block is stored
// as values v_i = encode(x_i / 2^e) and dequantizes to decode(v_i) * 2^e.
int scale_exponent(float amax);

// A row-major [rows, cols] tensor quantized per block_rows x block_cols block (cols and rows
// need not be multiples: edge blocks are smaller).
struct Blockwise {
  int rows = 0, cols = 0, block_rows = 1, block_cols = 128;
  std::vector<std::uint8_t> values;  // [rows, cols] E4M3
  std::vector<int> exponents;        // [ceil(rows / block_rows), ceil(cols / block_cols)]
  int exponent_of(int row, int col) const;
};

Blockwise quantize(const float* x, int rows, int cols, int block_rows, int block_cols);
std::vector<float> dequantize(const Blockwise& q);

// MXFP8 (OCP microscaling): the same E4M3 values, one E8M0 scale (exponent + 127) per 32
// consecutive elements of a row. Exact for a Blockwise whose block_cols is a multiple of 32.
struct Mxfp8 {
  int rows = 0, cols = 0;
  std::vector<std::uint8_t> values;  // [rows, cols] E4M3
  std::vector<std::uint8_t> e8m0;    // [rows, ceil(cols / 32)]
};
Mxfp8 to_mxfp8(const Blockwise& q);
std::vector<float> dequantize(const Mxfp8& m);

// Weights quantized on the GPU, stream-ordered: w bf16 [E, rows, cols] (contiguous rows;
// the expert and row strides as the view says, e.g. one half of a concatenated gate|up),
// values u8 [E, rows, cols] (E4M3) and exponents i32 [E, ceil(rows / 128), ceil(cols / 128)]
// (block (i, j) of expert e dequantizes as decode(value) * 2^exponent), both contiguous, all
// on one CUDA device. Each expert's bytes equal quantize(w[e] as float, rows, cols, 128, 128).
// Deterministic: a block's scale is its largest magnitude, whatever the order it is found in.
// transpose: the quantization of w^T instead (values [E, cols, rows], exponents [E, ceil(cols /
// 128), ceil(rows / 128)]): the transposed bytes of the untransposed one (the same 128 x 128
// blocks), for GEMMs that multiply by w^T (E4M3 tensor cores read K-major operands only).
// values and exponents may be views with contiguous rows of larger tensors (their own strides).
void quantize_weights(const TensorView& w, const TensorView& values, const TensorView& exponents,
                      cudaStream_t stream, bool transpose = false);
// Both from one read of w (one kernel, w's bytes read once): values and exponents as above, and
// values_t [E, cols, rows] and exponents_t [E, ceil(cols / 128), ceil(rows / 128)] those of w^T
// (transpose = true's bytes).
void quantize_weights(const TensorView& w, const TensorView& values, const TensorView& exponents,
                      const TensorView& values_t, const TensorView& exponents_t, cudaStream_t stream);

// The routed weights as the FP8 backward's dgrad GEMMs read them (Fp8DgradWeights, with its
// shapes): W_down^T, and W_gate^T then W_up^T along K in one [E, H, 2I] (quantize_weights with
// transpose: the same blocks as the forward's, so the same values). I a multiple of 128.
void quantize_dgrad_weights(const TensorView& w_gate, const TensorView& w_up, const TensorView& w_down,
                            const Fp8DgradWeights& out, cudaStream_t stream);

// A weight version's quantization for Precision::fp8: the forward's operands (Fp8Weights), and
// with dgrad the backward's (quantize_dgrad_weights' bytes) from the same reads: three kernels,
// each matrix read once (the two quantizations separately read every weight twice). w_gate and
// w_up [E, I, H], w_down [E, H, I] on one device; every argument is checked (and named as here,
// e.g. 'w_down', 'gate_up_t') before the first kernel, so a bad one leaves the outputs untouched.
void quantize_experts(const TensorView& w_gate, const TensorView& w_up, const TensorView& w_down, const Fp8Weights& out,
                      const Fp8DgradWeights* dgrad, cudaStream_t stream);

}  // namespace mok::fp8
