// E4M3 encoding and blockwise power-of-two scaling on the host (mok/fp8.hpp).
#include "mok/fp8.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <utility>

#include "cuda_check.hpp"
#include "kernels/fp8/quantize.cuh"
#include "mok/error.hpp"

namespace mok::fp8 {

std::uint8_t encode_e4m3(float value) {
  if (std::isnan(value)) return 0x7f;
  const std::uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  float a = std::fabs(value);
  if (a >= kE4m3Max) return sign | 0x7e;  // 1.75 * 2^8, saturated
  // Quantum of |value|'s binade (subnormals share the smallest normal binade's 2^-9).
  const int e = a >= std::ldexp(1.0f, -6) ? std::ilogb(a) : -6;
  const float quantum = std::ldexp(1.0f, e - 3);
  // Ties to even, whatever the floating-point environment's rounding mode (nearbyint follows it):
  // a / quantum is exact (a power of two), so are its floor and the fraction.
  const float scaled = a / quantum, whole = std::floor(scaled), fraction = scaled - whole;
  const bool up = fraction > 0.5f || (fraction == 0.5f && std::fmod(whole, 2.0f) != 0.0f);
  a = (whole + (up ? 1.0f : 0.0f)) * quantum;
  if (a >= kE4m3Max) return sign | 0x7e;
  if (a < std::ldexp(1.0f, -6)) return sign | static_cast<std::uint8_t>(a / std::ldexp(1.0f, -9));  // subnormal
  const int e2 = std::ilogb(a);
  const int mantissa = static_cast<int>(std::ldexp(a, -e2) * 8.0f) - 8;
  return sign | static_cast<std::uint8_t>(((e2 + 7) << 3) | mantissa);
}

float decode_e4m3(std::uint8_t bits) {
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);
  return sign * std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
}

// amax = m 2^x with m in [0.5, 1) (frexp is exact, subnormals too) and 448 = 0.875 2^9: the
// smallest e with amax / 2^e <= 448 is x - 9, or x - 8 where m > 0.875. (A log2 of amax / 448
// underflowed to -inf for amax below ~2^-141 and its correcting loop never ended.)
int scale_exponent(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 0;
  int x = 0;
  const float m = std::frexp(amax, &x);
  return std::max(x - 9 + (m > 0.875f ? 1 : 0), kMinScaleExponent);
}

int Blockwise::exponent_of(int row, int col) const {
  const std::int64_t blocks_per_row = (std::int64_t{cols} + block_cols - 1) / block_cols;
  return exponents[static_cast<std::size_t>(row / block_rows * blocks_per_row + col / block_cols)];
}

namespace {
// A Blockwise made by hand must be one quantize() could have made: its blocks positive, one
// exponent a block, one value an element (else exponent_of reads out of range).
void check_blockwise(const char* where, const Blockwise& q) {
  if (q.rows < 0 || q.cols < 0 || q.block_rows < 1 || q.block_cols < 1)
    throw_argument_error(where, "q", "needs rows, cols >= 0 and blocks >= 1, got ", q.rows, " x ", q.cols, " in blocks ",
                         q.block_rows, " x ", q.block_cols);
  const std::int64_t br = (std::int64_t{q.rows} + q.block_rows - 1) / q.block_rows,
                     bc = (std::int64_t{q.cols} + q.block_cols - 1) / q.block_cols;
  if (static_cast<std::int64_t>(q.exponents.size()) != br * bc ||
      static_cast<std::int64_t>(q.values.size()) != std::int64_t{q.rows} * q.cols)
    throw_argument_error(where, "q", "must hold ", br * bc, " exponents and ", std::int64_t{q.rows} * q.cols,
                         " values, got ", q.exponents.size(), " and ", q.values.size());
}
}  // namespace

Blockwise quantize(const float* x, int rows, int cols, int block_rows, int block_cols) {
  if (rows < 0 || cols < 0) throw_argument_error("mok::fp8::quantize", "rows", "rows and cols must be >= 0");
  if (block_rows < 1 || block_cols < 1)
    throw_argument_error("mok::fp8::quantize", "block_rows", "block sizes must be >= 1, got ", block_rows, " x ",
                         block_cols);
  Blockwise q;
  q.rows = rows, q.cols = cols, q.block_rows = block_rows, q.block_cols = block_cols;
  if (rows > 0 && cols > 0 && x == nullptr) throw_argument_error("mok::fp8::quantize", "x", "is null");
  // (in int64: a block of INT_MAX rows — one scale for the whole tensor — overflowed rows + block_rows - 1)
  const std::int64_t br = (std::int64_t{rows} + block_rows - 1) / block_rows,
                     bc = (std::int64_t{cols} + block_cols - 1) / block_cols;
  q.exponents.assign(static_cast<std::size_t>(br) * bc, 0);
  q.values.resize(static_cast<std::size_t>(rows) * cols);
  for (std::int64_t i = 0; i < br; ++i)
    for (std::int64_t j = 0; j < bc; ++j) {
      const int r1 = static_cast<int>(std::min<std::int64_t>(rows, (i + 1) * block_rows)),
                c1 = static_cast<int>(std::min<std::int64_t>(cols, (j + 1) * block_cols));
      float amax = 0.0f;
      const int r0 = static_cast<int>(i * block_rows), c0 = static_cast<int>(j * block_cols);
      for (int r = r0; r < r1; ++r)
        for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[static_cast<std::size_t>(r) * cols + c]));
      const int e = scale_exponent(amax);
      q.exponents[static_cast<std::size_t>(i) * bc + j] = e;
      for (int r = r0; r < r1; ++r)
        for (int c = c0; c < c1; ++c) {
          const std::size_t at = static_cast<std::size_t>(r) * cols + c;
          q.values[at] = encode_e4m3(std::ldexp(x[at], -e));
        }
    }
  return q;
}

std::vector<float> dequantize(const Blockwise& q) {
  check_blockwise("mok::fp8::dequantize", q);
  std::vector<float> out(q.values.size());
  for (int r = 0; r < q.rows; ++r)
    for (int c = 0; c < q.cols; ++c) {
      const std::size_t at = static_cast<std::size_t>(r) * q.cols + c;
      out[at] = std::ldexp(decode_e4m3(q.values[at]), q.exponent_of(r, c));
    }
  return out;
}

Mxfp8 to_mxfp8(const Blockwise& q) {
  check_blockwise("mok::fp8::to_mxfp8", q);
  if (q.block_cols % 32 != 0)
    throw_argument_error("mok::fp8::to_mxfp8", "block_cols", "must be a multiple of 32 (MXFP8 scales 32 elements), got ",
                         q.block_cols);
  Mxfp8 m;
  m.rows = q.rows, m.cols = q.cols, m.values = q.values;
  const int groups = (q.cols + 31) / 32;
  m.e8m0.resize(static_cast<std::size_t>(q.rows) * groups);
  for (int r = 0; r < q.rows; ++r)
    for (int g = 0; g < groups; ++g) {
      const int e = q.exponent_of(r, g * 32);
      if (e < -127 || e > 127)
        throw_argument_error("mok::fp8::to_mxfp8", "exponents", "a scale 2^", e, " is outside E8M0's range");
      m.e8m0[static_cast<std::size_t>(r) * groups + g] = static_cast<std::uint8_t>(e + 127);
    }
  return m;
}

std::vector<float> dequantize(const Mxfp8& m) {
  const std::int64_t groups = (std::int64_t{m.cols} + 31) / 32;
  if (m.rows < 0 || m.cols < 0 || static_cast<std::int64_t>(m.values.size()) != std::int64_t{m.rows} * m.cols ||
      static_cast<std::int64_t>(m.e8m0.size()) != std::int64_t{m.rows} * groups)
    throw_argument_error("mok::fp8::dequantize", "m", "must hold rows * cols values and rows * ceil(cols / 32) E8M0 "
                         "scales, got ", m.rows, " x ", m.cols, " with ", m.values.size(), " and ", m.e8m0.size());
  std::vector<float> out(m.values.size());
  for (int r = 0; r < m.rows; ++r)
    for (int c = 0; c < m.cols; ++c) {
      const std::size_t at = static_cast<std::size_t>(r) * m.cols + c;
      const std::uint8_t scale = m.e8m0[static_cast<std::size_t>(r * groups + c / 32)];
      // (E8M0's 0xFF is NaN in the OCP MX format, not 2^128)
      out[at] = scale == 0xFF ? std::nanf("") : std::ldexp(decode_e4m3(m.values[at]), static_cast<int>(scale) - 127);
    }
  return out;
}

namespace {

// int columns, and the grid's column blocks computed as (cols + 127) / 128 in int.
constexpr std::int64_t kMaxColumns = INT32_MAX - kernels::kFp8Block;

// Each output shares no byte with another or with an input (inputs may share: they are read).
void check_apart(const char* where, std::initializer_list<std::pair<const char*, const TensorView*>> inputs,
                 std::initializer_list<std::pair<const char*, const TensorView*>> outputs) {
  for (auto a = outputs.begin(); a != outputs.end(); ++a) {
    for (auto b = std::next(a); b != outputs.end(); ++b)
      if (a->second->overlaps(*b->second))
        throw_argument_error(where, a->first, "must not overlap '", b->first, "' (each output its own memory)");
    for (const auto& [name, in] : inputs)
      if (a->second->overlaps(*in)) throw_argument_error(where, a->first, "must not overlap '", name, "' (an input)");
  }
}

// A quantization's 3-D argument must have contiguous rows that overlap neither each other nor
// another expert's (TensorView::rows_apart); `rows` names them in the error.
void require_rows_apart(const char* where, const char* name, const TensorView& t, const char* rows = "rows") {
  if (!t.rows_apart())
    throw_argument_error(where, name, "must have contiguous, non-overlapping ", rows, ", got strides (", t.stride[0],
                         ", ", t.stride[1], ", ", t.stride[2], ") for shape ", t.shape_string());
}

// quantize_weights' checks of (w, values, exponents) and its kernel's parameters; values and
// exponents named as the caller's arguments.
kernels::QuantizeParams weight_params(const char* where, const TensorView& w, const TensorView& values,
                                      const TensorView& exponents, bool transpose, const char* w_name,
                                      const char* values_name, const char* exponents_name) {
  if (w.dtype != DType::bf16) throw_dtype_error(where, w_name, "dtype must be bf16, got ", dtype_name(w.dtype));
  if (values.dtype != DType::u8)
    throw_dtype_error(where, values_name, "dtype must be u8 (E4M3 bytes), got ", dtype_name(values.dtype));
  if (exponents.dtype != DType::i32)
    throw_dtype_error(where, exponents_name, "dtype must be i32, got ", dtype_name(exponents.dtype));
  if (w.ndim != 3) throw_argument_error(where, w_name, "must be 3-D [E, rows, cols], got shape ", w.shape_string());
  const std::int64_t E = w.shape[0], R = w.shape[1], C = w.shape[2];
  const std::int64_t rb = (R + kernels::kFp8Block - 1) / kernels::kFp8Block;
  const std::int64_t cb = (C + kernels::kFp8Block - 1) / kernels::kFp8Block;
  require_rows_apart(where, w_name, w);
  const std::int64_t VR = transpose ? C : R, VC = transpose ? R : C, XR = transpose ? cb : rb, XC = transpose ? rb : cb;
  if (values.ndim != 3 || values.shape[0] != E || values.shape[1] != VR || values.shape[2] != VC)
    throw_argument_error(where, values_name, "shape must be [", E, ", ", VR, ", ", VC, "] (", transpose ? "w^T" : "w",
                         "'s), got ", values.shape_string());
  if (exponents.ndim != 3 || exponents.shape[0] != E || exponents.shape[1] != XR || exponents.shape[2] != XC)
    throw_argument_error(where, exponents_name, "shape must be [", E, ", ", XR, ", ", XC, "] (128 x 128 blocks of ",
                         transpose ? "w^T" : "w", "), got ", exponents.shape_string());
  require_rows_apart(where, values_name, values);
  require_rows_apart(where, exponents_name, exponents);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{w_name, &w}, {values_name, &values},
                                {exponents_name, &exponents}}) {
    if (t->device.kind != DeviceKind::cuda)
      throw_argument_error(where, name, "must be on a CUDA device, got ", device_name(t->device));
    if (t->device.index != w.device.index)
      throw_argument_error(where, name, "is on ", device_name(t->device), ", but ", w_name, " is on ", device_name(w.device));
    if (t->numel() > 0 && t->data == nullptr) throw_argument_error(where, name, "data pointer is null");
    // (the kernels' element-wise path loads and stores whole elements: 2 bytes of w, 4 of an exponent)
    const auto address = reinterpret_cast<std::uintptr_t>(t->data);
    if (t->numel() > 0 && address % dtype_size(t->dtype) != 0)
      throw_argument_error(where, name, "data pointer must be aligned to its ", dtype_size(t->dtype),
                           "-byte elements, got address 0x", std::hex, address);
  }
  if (E > 65535 || rb > 65535 || C > kMaxColumns)  // (the grid's y and z limits; int columns, rounded up to blocks)
    throw_argument_error(where, w_name, "at most 65535 experts, 65535 * 128 rows and ", kMaxColumns,
                         " columns, got shape ", w.shape_string());
  kernels::QuantizeParams p{};
  p.w = static_cast<const std::uint16_t*>(w.data);
  p.expert_stride = w.stride[0], p.row_stride = w.stride[1];
  p.values = static_cast<std::uint8_t*>(values.data);
  p.exponents = static_cast<std::int32_t*>(exponents.data);
  p.values_expert_stride = values.stride[0], p.values_row_stride = values.stride[1];
  p.exponents_expert_stride = exponents.stride[0], p.exponents_row_stride = exponents.stride[1];
  p.experts = static_cast<int>(E), p.rows = static_cast<int>(R), p.cols = static_cast<int>(C);
  p.transpose = transpose;
  return p;
}

// p writing w^T's values and exponents too, where t (w's transposed quantization) writes them.
void with_transpose(kernels::QuantizeParams& p, const kernels::QuantizeParams& t) {
  p.values_t = t.values, p.exponents_t = t.exponents;
  p.values_t_expert_stride = t.values_expert_stride, p.values_t_row_stride = t.values_row_stride;
  p.exponents_t_expert_stride = t.exponents_expert_stride, p.exponents_t_row_stride = t.exponents_row_stride;
}

void launch(const kernels::QuantizeParams& p, cudaStream_t stream, const char* where) {
  kernels::launch_quantize_blocks(p, stream);
  detail::cuda_check(cudaGetLastError(), where, "launching the quantization");
}

}  // namespace

void quantize_weights(const TensorView& w, const TensorView& values, const TensorView& exponents,
                      cudaStream_t stream, bool transpose) {
  constexpr const char* where = "mok::fp8::quantize_weights";
  const kernels::QuantizeParams p = weight_params(where, w, values, exponents, transpose, "w", "values", "exponents");
  check_apart(where, {{"w", &w}}, {{"values", &values}, {"exponents", &exponents}});
  launch(p, stream, where);
}

void quantize_weights(const TensorView& w, const TensorView& values, const TensorView& exponents,
                      const TensorView& values_t, const TensorView& exponents_t, cudaStream_t stream) {
  constexpr const char* where = "mok::fp8::quantize_weights";
  kernels::QuantizeParams p = weight_params(where, w, values, exponents, false, "w", "values", "exponents");
  with_transpose(p, weight_params(where, w, values_t, exponents_t, true, "w", "values_t", "exponents_t"));
  check_apart(where, {{"w", &w}}, {{"values", &values}, {"exponents", &exponents}, {"values_t", &values_t},
                                   {"exponents_t", &exponents_t}});
  launch(p, stream, where);
}

}  // namespace mok::fp8

namespace mok::fp8 {

namespace {

// Columns [col0, col0 + cols) of a 3-D view.
TensorView columns(const TensorView& v, std::int64_t col0, std::int64_t cols) {
  TensorView c = v;
  c.data = static_cast<char*>(v.data) + col0 * v.stride[2] * static_cast<std::int64_t>(dtype_size(v.dtype));
  c.shape[2] = cols;
  return c;
}

// Fp8DgradWeights' gate_up_t and its exponents for I = w_gate's rows (a multiple of 128): the
// two halves' views (W_gate^T's columns, then W_up^T's).
struct GateUpHalves {
  TensorView gate_t, up_t, gate_t_exponents, up_t_exponents;
};

GateUpHalves gate_up_halves(const char* where, const TensorView& w_gate, const TensorView& w_down,
                            const Fp8DgradWeights& out) {
  if (w_gate.ndim != 3 || w_down.ndim != 3)
    throw_argument_error(where, w_gate.ndim != 3 ? "w_gate" : "w_down", "must be 3-D [E, rows, cols], got shape ",
                         (w_gate.ndim != 3 ? w_gate : w_down).shape_string());
  const std::int64_t I = w_gate.shape[1], ib = (I + kernels::kFp8Block - 1) / kernels::kFp8Block;
  if (I % kernels::kFp8Block != 0)
    throw_argument_error(where, "w_gate", "rows (I) must be a multiple of ", kernels::kFp8Block, " (W_gate^T and W_up^T "
                         "share [E, H, 2I] at a block boundary), got ", I);
  const std::int64_t E = w_gate.shape[0], H = w_gate.shape[2], hb = (H + kernels::kFp8Block - 1) / kernels::kFp8Block;
  if (out.gate_up_t.ndim != 3 || out.gate_up_t.shape[0] != E || out.gate_up_t.shape[1] != H || out.gate_up_t.shape[2] != 2 * I)
    throw_argument_error(where, "gate_up_t", "shape must be [E, H, 2I] = [", E, ", ", H, ", ", 2 * I,
                         "] (w_gate's E, H and I), got ", out.gate_up_t.shape_string());
  if (out.gate_up_t_exponents.ndim != 3 || out.gate_up_t_exponents.shape[0] != E ||
      out.gate_up_t_exponents.shape[1] != hb || out.gate_up_t_exponents.shape[2] != 2 * ib)
    throw_argument_error(where, "gate_up_t_exponents", "shape must be [E, H / 128, 2I / 128] = [", E, ", ", hb, ", ",
                         2 * ib, "], got ", out.gate_up_t_exponents.shape_string());
  // (whole rows of 2I: each half checked alone would let W_up^T's row h share W_gate^T's row h + 1)
  require_rows_apart(where, "gate_up_t", out.gate_up_t, "rows of 2I");
  require_rows_apart(where, "gate_up_t_exponents", out.gate_up_t_exponents, "rows of 2I");
  return {columns(out.gate_up_t, 0, I), columns(out.gate_up_t, I, I), columns(out.gate_up_t_exponents, 0, ib),
          columns(out.gate_up_t_exponents, ib, ib)};
}

}  // namespace

void quantize_dgrad_weights(const TensorView& w_gate, const TensorView& w_up, const TensorView& w_down,
                            const Fp8DgradWeights& out, cudaStream_t stream) {
  constexpr const char* where = "mok::fp8::quantize_dgrad_weights";
  const GateUpHalves h = gate_up_halves(where, w_gate, w_down, out);
  // Every argument is checked before the first kernel: a bad one leaves every output untouched.
  const kernels::QuantizeParams p[3] = {
      weight_params(where, w_down, out.down_t, out.down_t_exponents, true, "w_down", "down_t", "down_t_exponents"),
      weight_params(where, w_gate, h.gate_t, h.gate_t_exponents, true, "w_gate", "gate_up_t", "gate_up_t_exponents"),
      weight_params(where, w_up, h.up_t, h.up_t_exponents, true, "w_up", "gate_up_t", "gate_up_t_exponents")};
  check_apart(where, {{"w_gate", &w_gate}, {"w_up", &w_up}, {"w_down", &w_down}},
              {{"down_t", &out.down_t}, {"down_t_exponents", &out.down_t_exponents}, {"gate_up_t", &out.gate_up_t},
               {"gate_up_t_exponents", &out.gate_up_t_exponents}});
  for (const kernels::QuantizeParams& q : p) launch(q, stream, where);
}

void quantize_experts(const TensorView& w_gate, const TensorView& w_up, const TensorView& w_down, const Fp8Weights& out,
                      const Fp8DgradWeights* dgrad, cudaStream_t stream) {
  constexpr const char* where = "mok::fp8::quantize_experts";
  for (const auto& [name, w] :
       {std::pair<const char*, const TensorView*>{"w_gate", &w_gate}, {"w_up", &w_up}, {"w_down", &w_down}})
    if (w->ndim != 3) throw_argument_error(where, name, "must be 3-D [E, rows, cols], got shape ", w->shape_string());
  const std::int64_t E = w_gate.shape[0], I = w_gate.shape[1], H = w_gate.shape[2];
  if (w_up.shape[0] != E || w_up.shape[1] != I || w_up.shape[2] != H)
    throw_argument_error(where, "w_up", "shape must be w_gate's, ", w_gate.shape_string(), ", got ", w_up.shape_string());
  if (w_down.shape[0] != E || w_down.shape[1] != H || w_down.shape[2] != I)
    throw_argument_error(where, "w_down", "shape must be [E, H, I] = [", E, ", ", H, ", ", I, "] (w_gate's), got ",
                         w_down.shape_string());
  for (const auto& [name, w] : {std::pair<const char*, const TensorView*>{"w_up", &w_up}, {"w_down", &w_down}})
    if (w->device.kind != w_gate.device.kind || w->device.index != w_gate.device.index)
      throw_argument_error(where, name, "is on ", device_name(w->device), ", but w_gate is on ", device_name(w_gate.device));
  // Every argument is checked before the first kernel: a bad one leaves every output untouched.
  kernels::QuantizeParams p[3] = {
      weight_params(where, w_gate, out.gate, out.gate_exponents, false, "w_gate", "gate", "gate_exponents"),
      weight_params(where, w_up, out.up, out.up_exponents, false, "w_up", "up", "up_exponents"),
      weight_params(where, w_down, out.down, out.down_exponents, false, "w_down", "down", "down_exponents")};
  if (dgrad != nullptr) {
    const GateUpHalves h = gate_up_halves(where, w_gate, w_down, *dgrad);
    with_transpose(p[0], weight_params(where, w_gate, h.gate_t, h.gate_t_exponents, true, "w_gate", "gate_up_t",
                                       "gate_up_t_exponents"));
    with_transpose(p[1], weight_params(where, w_up, h.up_t, h.up_t_exponents, true, "w_up", "gate_up_t",
                                       "gate_up_t_exponents"));
    with_transpose(p[2], weight_params(where, w_down, dgrad->down_t, dgrad->down_t_exponents, true, "w_down", "down_t",
                                       "down_t_exponents"));
  }
  const TensorView none{};  // (empty: overlaps nothing)
  const Fp8DgradWeights* d = dgrad;
  check_apart(where, {{"w_gate", &w_gate}, {"w_up", &w_up}, {"w_down", &w_down}},
              {{"gate", &out.gate}, {"gate_exponents", &out.gate_exponents}, {"up", &out.up},
               {"up_exponents", &out.up_exponents}, {"down", &out.down}, {"down_exponents", &out.down_exponents},
               {"down_t", d ? &d->down_t : &none}, {"down_t_exponents", d ? &d->down_t_exponents : &none},
               {"gate_up_t", d ? &d->gate_up_t : &none}, {"gate_up_t_exponents", d ? &d->gate_up_t_exponents : &none}});
  for (const kernels::QuantizeParams& q : p) launch(q, stream, where);
}

}  // namespace mok::fp8
