#include "mok/types.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "mok/error.hpp"

namespace mok {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::e4m3: return "e4m3";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::u8:
    case DType::e4m3: return 1;
  }
  return 0;
}

std::string device_name(Device device) {
  return device.kind == DeviceKind::cpu ? std::string("cpu")
                                        : "cuda:" + std::to_string(device.index);
}

TensorView TensorView::contiguous(const void* data, DType dtype, Device device,
                                  std::initializer_list<std::int64_t> dims) {
  if (dims.size() > kMaxDims)
    throw ArgumentError(detail::concat("TensorView::contiguous: at most ", kMaxDims, " dimensions, got ", dims.size()));
  TensorView v;
  v.data = const_cast<void*>(data);
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(dims.size());
  int d = 0;
  for (std::int64_t n : dims) v.shape[d++] = n;
  std::int64_t s = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.stride[i] = s;
    s *= v.shape[i];
  }
  return v;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t s = 1;
  for (int i = ndim - 1; i >= 0; --i) {
    if (shape[i] != 1 && stride[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

bool TensorView::overlaps(const TensorView& other) const {
  // (no data: a default view standing for an absent argument — 0-D, so numel() 1 — shares nothing)
  if (data == nullptr || other.data == nullptr || numel() == 0 || other.numel() == 0) return false;
  auto span = [](const TensorView& v) {  // [lowest, past the highest) byte
    std::int64_t first = 0, last = 0;
    for (int d = 0; d < v.ndim; ++d) (v.stride[d] < 0 ? first : last) += (v.shape[d] - 1) * v.stride[d];
    const auto bytes = static_cast<std::int64_t>(dtype_size(v.dtype));
    const char* base = static_cast<const char*>(v.data);
    return std::pair{base + first * bytes, base + (last + 1) * bytes};
  };
  const auto [a0, a1] = span(*this);
  const auto [b0, b1] = span(other);
  return a0 < b1 && b0 < a1;
}

bool TensorView::rows_apart() const {
  if (ndim != 3) return false;
  if (numel() == 0) return true;
  return stride[2] == 1 && stride[1] >= shape[2] && stride[0] / stride[1] >= shape[1];  // (stride[1] >= shape[2] >= 1)
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

void validate(const MoeShape& s) {
  constexpr const char* where = "mok::MoeShape";
  // (the upper bounds keep every size product of the layer — E * 2I * H elements, their bytes —
  // inside int64: a larger I wrapped E * I * H to 0 and let empty weights pass the reference)
  constexpr std::int64_t kMaxSize = std::int64_t{1} << 20, kMaxExperts = std::int64_t{1} << 16;
  auto check_granular = [&](const char* name, std::int64_t v) {
    if (v <= 0 || v % kHiddenGranularity != 0)
      throw_argument_error(where, name, "must be a positive multiple of ", kHiddenGranularity, ", got ", v);
    if (v > kMaxSize) throw_argument_error(where, name, "must be at most ", kMaxSize, ", got ", v);
  };
  check_granular("hidden", s.hidden);
  check_granular("intermediate", s.intermediate);
  if (s.shared_intermediate != 0) check_granular("shared_intermediate", s.shared_intermediate);
  if (s.num_experts <= 0 || s.num_experts > kMaxExperts)
    throw_argument_error(where, "num_experts", "must be in [1, ", kMaxExperts, "], got ", s.num_experts);
  if (s.num_local_experts <= 0 || s.num_local_experts > s.num_experts ||
      s.num_experts % s.num_local_experts != 0)
    throw_argument_error(where, "num_local_experts", "must divide num_experts = ", s.num_experts,
                         ", got ", s.num_local_experts);
  if (s.top_k <= 0) throw_argument_error(where, "top_k", "must be at least 1, got ", s.top_k);
  if (s.top_k > s.num_experts)
    throw_argument_error(where, "top_k", "must not exceed num_experts = ", s.num_experts, ", got ",
                         s.top_k);
  if (s.swiglu_limit && !(*s.swiglu_limit > 0.0f && std::isfinite(*s.swiglu_limit)))
    throw_argument_error(where, "swiglu_limit", "must be a finite positive number, got ",
                         *s.swiglu_limit);
}

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp8: return "fp8";
  }
  return "unknown";
}

void validate(const Config& c) {
  constexpr const char* where = "mok::Config";
  if (c.precision != Precision::bf16 && c.precision != Precision::fp8)
    throw_argument_error(where, "precision", "must be Precision::bf16 or Precision::fp8, got ", static_cast<int>(c.precision));
  if (c.pull_fp8_rows && c.precision != Precision::fp8)
    throw_argument_error(where, "pull_fp8_rows", "is true, but precision is ", precision_name(c.precision),
                         " (E4M3 rows are pulled by Precision::fp8 EP ranks)");
  if (c.pull_fp8_rows && c.pull_tokens_once)
    throw_argument_error(where, "pull_fp8_rows", "cannot be combined with pull_tokens_once (which pulls each peer "
                                                 "token once in bf16)");
  if (c.fp8_dgrad && c.precision != Precision::fp8)
    throw_argument_error(where, "fp8_dgrad", "is true, but precision is ", precision_name(c.precision),
                         " (the FP8 dgrad's rows serve a Precision::fp8 EP rank)");
  if (c.comm_sms < 0) throw_argument_error(where, "comm_sms", "must be >= 0, got ", c.comm_sms);
  if (c.compute_sms < 0)
    throw_argument_error(where, "compute_sms", "must be >= 0, got ", c.compute_sms);
  if (c.minibatch_rows <= 0 || c.minibatch_rows % 128 != 0)
    throw_argument_error(where, "minibatch_rows", "must be a positive multiple of 128, got ",
                         c.minibatch_rows);
  if (c.minibatch_rows > std::numeric_limits<std::int32_t>::max() || c.ring_rows > std::numeric_limits<std::int32_t>::max())
    throw_argument_error(where, "minibatch_rows", "minibatch_rows and ring_rows must be below 2^31 (the ring's int32 "
                         "row indices), got ", c.minibatch_rows, " and ", c.ring_rows);
  if (c.ring_rows < 0 || (c.ring_rows > 0 && c.ring_rows % c.minibatch_rows != 0))
    throw_argument_error(where, "ring_rows", "must be 0 or a multiple of minibatch_rows = ",
                         c.minibatch_rows, ", got ", c.ring_rows);
  if (c.interleave_rows < 0 || c.interleave_rows % 128 != 0)
    throw_argument_error(where, "interleave_rows", "must be 0 or a positive multiple of 128, got ", c.interleave_rows);
  if (c.interleave_rows > 0 && (c.comm_sms > 0 || c.ring_rows > 0))
    throw_argument_error(where, "interleave_rows", "cannot be combined with the ring (comm_sms = ", c.comm_sms,
                         ", ring_rows = ", c.ring_rows, "), which orders GEMM1 by its minibatches");
  if (c.pingpong && (c.comm_sms > 0 || c.ring_rows > 0))
    throw_argument_error(where, "pingpong", "is a one-GPU forward without the ring (comm_sms = ", c.comm_sms,
                         ", ring_rows = ", c.ring_rows, ")");
  if (c.pull_tokens_once && (c.comm_sms > 0 || c.ring_rows > 0))
    throw_argument_error(where, "pull_tokens_once", "applies to rows pulled before the kernel; the ring (comm_sms = ",
                         c.comm_sms, ", ring_rows = ", c.ring_rows, ") pulls its own");
  if (c.backward_column_blocks < 0 || c.backward_column_blocks > 1024)
    throw_argument_error(where, "backward_column_blocks",
                         "must be 0 (the default: 2, 1 for Precision::fp8 where H <= 2048; Training::recompute 2 where I > H, else 1) or 1 .. 1024, got ",
                         c.backward_column_blocks);
  if (!(c.capacity_factor >= 0.0) || !std::isfinite(c.capacity_factor))
    throw_argument_error(where, "capacity_factor", "must be a finite number >= 0, got ",
                         c.capacity_factor);
  if (!(c.timeout_seconds > 0.0) || !(c.timeout_seconds <= 3600.0))  // (the kernels' wait clock wraps after 73 min)
    throw_argument_error(where, "timeout_seconds", "must be a positive number of at most 3600 (one hour), got ",
                         c.timeout_seconds);
}

std::int64_t plan_capacity_rows(const MoeShape& shape, const Config& config, std::int64_t tokens,
                                std::int64_t block_m) {
  const std::int64_t pairs = tokens * shape.top_k;
  const std::int64_t worst = shape.ep_size() * pairs;
  std::int64_t rows = worst;
  if (config.capacity_factor > 0.0)  // (min in double: a factor of 1e17 overflowed the int64 cast)
    rows = static_cast<std::int64_t>(std::min(static_cast<double>(worst), std::ceil(config.capacity_factor * pairs)));
  return rows + shape.num_local_experts * (block_m - 1);
}

double forward_flops(const MoeShape& shape, std::int64_t routed_pairs, std::int64_t tokens) {
  return 6.0 * static_cast<double>(shape.hidden) *
         (static_cast<double>(routed_pairs) * static_cast<double>(shape.intermediate) +
          static_cast<double>(tokens) * static_cast<double>(shape.shared_intermediate));
}

}  // namespace mok
