// Every invalid input is rejected with its own message naming the argument and value.
#include <gtest/gtest.h>

#include <functional>
#include <typeinfo>

#include "mok/ep.hpp"
#include "mok/error.hpp"
#include "mok/forward.hpp"
#include "mok/validate.hpp"
#include "validate_fixture.hpp"

namespace mok {
namespace {

using testing::expect_error;
using testing::Fixture;
using testing::good_shape;

// The error's type says what is wrong (the Python extension maps it: DTypeError ->
// TypeError, ArgumentError -> ValueError, Error -> RuntimeError), and a prefix keeps it.
TEST(Validate, ErrorTypesSayWhatIsWrong) {
  Fixture f;
  f.args.x.dtype = DType::f32;
  EXPECT_THROW(f.forward(), DTypeError);
  Fixture g;
  g.args.x.shape[1] = 96;
  try {
    g.forward();
    ADD_FAILURE() << "no error for a wrong shape";
  } catch (const DTypeError&) {
    ADD_FAILURE() << "a wrong shape is not a dtype error";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'x': shape must be"), std::string::npos) << e.what();
  }
  for (const std::function<void()>& original :
       {std::function<void()>([] { throw DTypeError("d"); }), std::function<void()>([] { throw ArgumentError("a"); }),
        std::function<void()>([] { throw Error("e"); })}) {
    try {
      try {
        original();
      } catch (const Error& e) {
        e.rethrow_with_prefix("rank 3: ");
      }
    } catch (const Error& prefixed) {
      try {
        original();
      } catch (const Error& e) {
        EXPECT_EQ(typeid(prefixed), typeid(e));
        EXPECT_EQ(std::string(prefixed.what()), "rank 3: " + std::string(e.what()));
      }
    }
  }
}

TEST(Validate, GoodArgumentsPass) {
  Fixture f;
  EXPECT_EQ(validate_forward_args("mok::forward", f.shape, f.args, Device::cpu()), Fixture::T);
  EXPECT_NO_THROW(f.backward());
  f.grads.d_w_gate.dtype = f.grads.d_w_up.dtype = f.grads.d_w_down.dtype = DType::f32;  // main_grad mode
  EXPECT_NO_THROW(f.backward());
}

TEST(Validate, WrongDtypeOfX) {
  Fixture f;
  f.args.x.dtype = DType::f32;
  expect_error([&] { f.forward(); }, "mok::forward: argument 'x': dtype must be bf16, got f32");
}

TEST(Validate, WrongDtypeOfTopkIds) {
  Fixture f;
  f.args.topk_ids.dtype = DType::f32;
  expect_error([&] { f.forward(); }, "argument 'topk_ids': dtype must be i32 or i64, got f32");
  f.args.topk_ids.dtype = DType::i64;  // int64 is accepted
  EXPECT_NO_THROW(f.forward());
}

TEST(Validate, WrongDtypeOfTopkWeights) {
  Fixture f;
  f.args.topk_weights.dtype = DType::bf16;
  expect_error([&] { f.forward(); }, "argument 'topk_weights': dtype must be f32, got bf16");
}

TEST(Validate, WrongShapeOfWeights) {
  Fixture f;
  f.args.w_gate = TensorView::contiguous(Fixture::memory, DType::bf16, Device::cpu(), {4, 128, 64});
  expect_error([&] { f.forward(); }, "argument 'w_gate': shape must be [4, 64, 128], got [4, 128, 64]");
  Fixture g;
  g.args.w_down = TensorView::contiguous(Fixture::memory, DType::bf16, Device::cpu(), {8, 128, 64});
  expect_error([&] { g.forward(); }, "argument 'w_down': shape must be [4, 128, 64], got [8, 128, 64]");
}

TEST(Validate, TokenCountMismatch) {
  Fixture f;
  f.args.topk_ids = TensorView::contiguous(Fixture::memory, DType::i32, Device::cpu(), {6, 2});
  expect_error([&] { f.forward(); }, "argument 'topk_ids': must have 5 rows like 'x', got 6");
}

TEST(Validate, TopkColumnsMismatch) {
  Fixture f;
  f.args.topk_weights = TensorView::contiguous(Fixture::memory, DType::f32, Device::cpu(), {5, 3});
  expect_error([&] { f.forward(); }, "argument 'topk_weights': shape must be [5, 2], got [5, 3]");
}

TEST(Validate, NullPointer) {
  Fixture f;
  f.args.w_up.data = nullptr;
  expect_error([&] { f.forward(); }, "argument 'w_up': data pointer is null");
}

TEST(Validate, NonContiguous) {
  Fixture f;
  f.args.x.stride = {256, 1};
  expect_error([&] { f.forward(); }, "argument 'x': must be contiguous (row-major), got strides [256, 1] for shape [5, 128]");
}

// Expert weights may be strided views (the gate and up halves of one [E, 2I, H] tensor, rows
// with a pitch); bf16 weight gradients too, f32 ones (accumulated) may not.
TEST(Validate, StridedExpertWeights) {
  Fixture f;
  const std::int64_t H = 128, I = 64;
  f.args.w_gate.stride = {2 * I * H, H, 1};
  f.args.w_up.stride = {2 * I * H, H, 1};
  f.args.w_down.stride = {H * (I + 64), I + 64, 1};
  f.grads.d_w_gate.stride = f.args.w_gate.stride;
  f.grads.d_w_up.stride = f.args.w_up.stride;
  EXPECT_NO_THROW(f.backward());
  f.args.w_up.stride = {2 * I * H, H + 4, 1};
  expect_error([&] { f.forward(); }, "argument 'w_up': must be contiguous or a view with contiguous rows, row and "
                                     "expert strides multiples of 8 and no overlap (like one half of [E, 2I, H]), got "
                                     "strides [16384, 132, 1] for shape [4, 64, 128]");
  f.args.w_up.stride = {I * H / 2, H, 1};  // experts overlap
  expect_error([&] { f.forward(); }, "argument 'w_up': must be contiguous or a view");
  f.args.w_up.stride = {2 * I * H, 1, H};  // column-major rows
  expect_error([&] { f.forward(); }, "argument 'w_up': must be contiguous or a view");
  f.args.w_up.stride = {2 * I * H, H, 1};
  for (TensorView* g : {&f.grads.d_w_gate, &f.grads.d_w_up, &f.grads.d_w_down}) g->dtype = DType::f32;
  expect_error([&] { f.backward(); }, "argument 'd_w_gate': must be contiguous (row-major), got strides [16384, 128, 1]");
}

TEST(Validate, MisalignedPointer) {
  Fixture f;
  f.args.y.data = Fixture::memory + 2;
  expect_error([&] { f.forward(); }, "argument 'y': data pointer must be 16-byte aligned");
}

TEST(Validate, WrongDevice) {
  Fixture f;
  f.args.w_down.device = Device::cuda(1);
  expect_error([&] { f.forward(); }, "argument 'w_down': must be on cpu, got cuda:1");
  expect_error([&] { validate_forward_args("mok::forward", f.shape, Fixture().args, Device::cuda(0)); },
               "argument 'x': must be on cuda:0, got cpu");
}

TEST(Validate, ExpertIdOutOfRange) {
  const MoeShape s = good_shape();
  std::int32_t ids[6] = {0, 1, 2, 8, -1, 3};
  const auto view = TensorView::contiguous(ids, DType::i32, Device::cpu(), {3, 2});
  expect_error([&] { validate_routing_values("mok::forward", s, view); },
               "argument 'topk_ids': expert id must be in [-1, 8), got 8 at token 1, slot 1");
  ids[3] = -3;
  expect_error([&] { validate_routing_values("mok::forward", s, view); }, "got -3 at token 1, slot 1");
  std::int64_t ids64[2] = {7, 1ll << 40};
  expect_error([&] { validate_routing_values("mok::forward", s, TensorView::contiguous(ids64, DType::i64, Device::cpu(), {1, 2})); },
               "got 1099511627776 at token 0, slot 1");
}

TEST(Validate, TopKLargerThanExperts) {
  MoeShape s = good_shape();
  s.top_k = 9;
  expect_error([&] { validate(s); }, "mok::MoeShape: argument 'top_k': must not exceed num_experts = 8, got 9");
}

TEST(Validate, TopKZero) {
  MoeShape s = good_shape();
  s.top_k = 0;
  expect_error([&] { validate(s); }, "argument 'top_k': must be at least 1, got 0");
}

TEST(Validate, HiddenNotGranular) {
  MoeShape s = good_shape();
  s.hidden = 100;
  expect_error([&] { validate(s); }, "argument 'hidden': must be a positive multiple of 64, got 100");
  s = good_shape();
  s.intermediate = 96;
  expect_error([&] { validate(s); }, "argument 'intermediate': must be a positive multiple of 64, got 96");
  s = good_shape();
  s.shared_intermediate = 32;
  expect_error([&] { validate(s); }, "argument 'shared_intermediate': must be a positive multiple of 64, got 32");
}

// Sizes, strides and gradients a review found passing: a negative T, expert strides whose product
// wraps, shared-expert gradients for a layer without one (never written), an intermediate size
// whose E * I * H wraps, the sizing functions at any T, and the host id check on another dtype.
TEST(Validate, WrapsAndUnwrittenOutputsAreRefused) {
  Fixture f;
  f.args.x.shape[0] = -1;
  f.args.topk_ids.shape[0] = f.args.topk_weights.shape[0] = -1;
  expect_error([&] { validate_forward_args("t", f.shape, f.args, Device::cpu()); }, "argument 'x': must have T >= 0 rows");
  Fixture g;
  g.args.w_gate.stride[1] = std::int64_t{1} << 57;
  g.args.w_gate.stride[0] = 8;
  expect_error([&] { validate_forward_args("t", g.shape, g.args, Device::cpu()); }, "argument 'w_gate': must be contiguous or a view");
  Fixture h;
  TensorView extra = h.grads.d_w_down;
  h.grads.d_shared_gate = extra;
  expect_error([&] { validate_backward_args("t", h.shape, h.args, h.grads, Device::cpu()); },
               "argument 'd_shared_gate': shared-expert gradients were given but shape.shared_intermediate = 0");
  MoeShape huge = good_shape();
  huge.intermediate = std::int64_t{1} << 57;
  expect_error([&] { validate(huge); }, "argument 'intermediate': must be at most 1048576");
  expect_error([&] { saved_elements(good_shape(), -1000); }, "argument 'tokens'");
  expect_error([&] { saved_elements(good_shape(), std::int64_t{1} << 61); }, "argument 'tokens'");
  float not_ids[2 * 5] = {};
  const TensorView as_f32 = TensorView::contiguous(not_ids, DType::f32, Device::cpu(), {5, 2});
  EXPECT_THROW(validate_routing_values("t", good_shape(), as_f32), DTypeError);
}

TEST(Validate, LocalExpertsMustDivide) {
  MoeShape s = good_shape();
  s.num_local_experts = 3;
  expect_error([&] { validate(s); }, "argument 'num_local_experts': must divide num_experts = 8, got 3");
}

TEST(Validate, BadSwigluLimit) {
  MoeShape s = good_shape();
  s.swiglu_limit = -1.0f;
  expect_error([&] { validate(s); }, "argument 'swiglu_limit': must be a finite positive number, got -1");
}

TEST(Validate, SharedExpertRequiredOrForbidden) {
  Fixture f;
  f.shape.shared_intermediate = 64;
  expect_error([&] { f.forward(); }, "argument 'shared_gate': is required: shape.shared_intermediate = 64");
  Fixture g;
  g.args.shared_gate = g.args.w_gate;
  expect_error([&] { g.forward(); }, "shared-expert weights were given but shape.shared_intermediate = 0");
}

TEST(Validate, GradientDtypes) {
  Fixture f;
  f.grads.d_w_gate.dtype = DType::f16;
  expect_error([&] { f.backward(); }, "argument 'd_w_gate': dtype must be bf16 (written) or f32 (accumulated), got f16");
  Fixture g;
  g.grads.d_w_up.dtype = DType::f32;  // mixed gradient dtypes
  expect_error([&] { g.backward(); }, "argument 'd_w_up': dtype must be bf16, got f32");
}

TEST(Validate, BackwardNeedsNoOutputButChecksItsOwnTensors) {
  Fixture f;
  f.args.y = TensorView{};  // the backward does not read y
  EXPECT_NO_THROW(f.backward());
  expect_error([&] { f.forward(); }, "argument 'y': shape must be [5, 128], got []");
  Fixture g;
  g.grads.dy = TensorView::contiguous(Fixture::memory, DType::bf16, Device::cpu(), {Fixture::T, 64});
  expect_error([&] { g.backward(); }, "argument 'dy': shape must be [5, 128], got [5, 64]");
  Fixture h;
  h.grads.d_topk_weights.dtype = DType::bf16;
  expect_error([&] { h.backward(); }, "argument 'd_topk_weights': dtype must be f32, got bf16");
}

// The saved tensor of a training forward: 2 bf16 per routed row and intermediate unit for
// gate and up, over the plan's worst-case rows, plus the shared expert's padded tokens,
// plus an 8-element trailer. Computed without a GPU.
TEST(Validate, SavedElementsFollowThePlanCapacity) {
  MoeShape s = good_shape();
  s.num_local_experts = s.num_experts;  // EP = 1
  const std::int64_t T = 1000, k = s.top_k, I = s.intermediate, El = s.num_local_experts;
  const std::int64_t capacity = (T * k + El * 127) / 128 * 128;
  EXPECT_EQ(saved_elements(s, T), 2 * capacity * I + 8);
  s.shared_intermediate = 192;
  EXPECT_EQ(saved_elements(s, T), 2 * (capacity * I + 1024 * 192) + 8);  // T padded to 8 tiles of 128
  EXPECT_EQ(saved_elements(s, 0), 2 * (El * 127 / 128 * 128) * I + 8);  // padding rows only, no shared tokens
}

TEST(Validate, ConfigFields) {
  Config c;
  c.minibatch_rows = 100;
  expect_error([&] { validate(c); }, "mok::Config: argument 'minibatch_rows': must be a positive multiple of 128, got 100");
  c = Config{};
  c.ring_rows = 5000;
  expect_error([&] { validate(c); }, "argument 'ring_rows': must be 0 or a multiple of minibatch_rows = 4096, got 5000");
  c = Config{};
  c.timeout_seconds = 0;
  expect_error([&] { validate(c); }, "argument 'timeout_seconds': must be a positive number of at most 3600 (one hour), got 0");
  c.timeout_seconds = 7200;
  expect_error([&] { validate(c); }, "argument 'timeout_seconds': must be a positive number of at most 3600 (one hour), got 7200");
  c.timeout_seconds = 3600;
  validate(c);
  c = Config{};
  c.comm_sms = -2;
  expect_error([&] { validate(c); }, "argument 'comm_sms': must be >= 0, got -2");
  c = Config{};
  c.capacity_factor = -1;
  expect_error([&] { validate(c); }, "argument 'capacity_factor': must be a finite number >= 0, got -1");
  c = Config{};
  c.interleave_rows = 100;
  expect_error([&] { validate(c); }, "argument 'interleave_rows': must be 0 or a positive multiple of 128, got 100");
  c.interleave_rows = 4096, c.ring_rows = 8192;
  expect_error([&] { validate(c); }, "argument 'interleave_rows': cannot be combined with the ring (comm_sms = 0, "
                                     "ring_rows = 8192), which orders GEMM1 by its minibatches");
  c = Config{};
  c.backward_column_blocks = -1;
  expect_error([&] { validate(c); },
               "argument 'backward_column_blocks': must be 0 (the default: 2, 1 for Precision::fp8 where H <= 2048; Training::recompute 2 where I > H, else 1) or 1 .. 1024, got -1");
  c.backward_column_blocks = 1025;
  expect_error([&] { validate(c); },
               "argument 'backward_column_blocks': must be 0 (the default: 2, 1 for Precision::fp8 where H <= 2048; Training::recompute 2 where I > H, else 1) or 1 .. 1024, got 1025");
  c.backward_column_blocks = 1024;
  validate(c);
  c = Config{};
  c.pull_tokens_once = true, c.comm_sms = 8;
  expect_error([&] { validate(c); },
               "argument 'pull_tokens_once': applies to rows pulled before the kernel; the ring (comm_sms = 8, "
               "ring_rows = 0) pulls its own");
}

TEST(Validate, EmptyBatchIsAllowed) {
  Fixture f;
  f.args.x = TensorView::contiguous(nullptr, DType::bf16, Device::cpu(), {0, 128});
  f.args.topk_ids = TensorView::contiguous(nullptr, DType::i32, Device::cpu(), {0, 2});
  f.args.topk_weights = TensorView::contiguous(nullptr, DType::f32, Device::cpu(), {0, 2});
  f.args.y = TensorView::contiguous(nullptr, DType::bf16, Device::cpu(), {0, 128});
  EXPECT_EQ(validate_forward_args("mok::forward", f.shape, f.args, Device::cpu()), 0);
}

// Expert parallelism: the rank's arguments are checked before anything touches a GPU.
TEST(ValidateEp, EpRankArguments) {
  MoeShape s;
  s.hidden = 256, s.intermediate = 128, s.num_experts = 8, s.num_local_experts = 2, s.top_k = 2;  // 4 ranks
  alignas(256) static char regions[4][256];
  std::vector<void*> bases{regions[0], regions[1], regions[2], regions[3]};
  expect_error([&] { EpRank(s, 64, 0, std::span<void* const>(bases.data(), 3)); },
               "mok::EpRank: argument 'region_bases': must hold one region per rank (4), got 3");
  expect_error([&] { EpRank(s, 64, 4, bases); }, "mok::EpRank: argument 'rank': must be in [0, 4), got 4");
  expect_error([&] { EpRank(s, 0, 0, bases); }, "argument 'tokens_per_rank': must be >= 1, got 0");
  std::vector<void*> unaligned{regions[0] + 8, regions[1], regions[2], regions[3]};
  expect_error([&] { EpRank(s, 64, 0, unaligned); }, "argument 'region_bases': entry 0 must be 256-byte aligned");
  std::vector<void*> with_null{regions[0], nullptr, regions[2], regions[3]};
  expect_error([&] { EpRank(s, 64, 0, with_null); }, "argument 'region_bases': entry 1 is null");
  std::vector<void*> repeated{regions[0], regions[1], regions[0], regions[3]};
  expect_error([&] { EpRank(s, 64, 0, repeated); }, "argument 'region_bases': entries 0 and 2 are the same region");
  expect_error([&] { EpRank::region_bytes(s, -1000); }, "argument 'tokens_per_rank'");
  Config wide;
  wide.minibatch_rows = std::int64_t{1} << 32;
  expect_error([&] { validate(wide); }, "argument 'minibatch_rows': minibatch_rows and ring_rows must be below 2^31");
  MoeShape too_many = s;
  too_many.num_experts = 32, too_many.num_local_experts = 2;  // 16 ranks
  expect_error([&] { EpRank(too_many, 64, 0, bases); }, "makes 16 ranks (num_experts / num_local_experts); at most 8");
  expect_error([&] { VirtualRanks(too_many, 64); }, "makes 16 ranks (num_experts / num_local_experts); at most 8");
  expect_error([&] { VirtualRanks(s, 0); }, "mok::VirtualRanks: argument 'tokens_per_rank': must be >= 1, got 0");
  Config once;
  once.pull_tokens_once = true;
  expect_error([&] { VirtualRanks(s, 64, once); }, "mok::VirtualRanks: argument 'config.pull_tokens_once': is for EpRank");
}

TEST(ValidateEp, RegionBytesNeedNoGpu) {
  MoeShape s;
  s.hidden = 256, s.intermediate = 128, s.num_experts = 8, s.num_local_experts = 2, s.top_k = 2;  // 4 ranks
  const std::int64_t T = 100, bytes = EpRank::region_bytes(s, T);
  EXPECT_EQ(bytes % 256, 0);
  // x and dy rows, every rank's ids and weights, the bf16 combine slots and the backward's
  // d_topk_weights partials (ceil(128 / 256) = 1 a pair), and the header and push counters, each
  // rounded up to 256 bytes.
  const std::int64_t parts = 2 * (2 * T * 256) + 2 * (4 * 4 * T * 2) + (2 * T * 2 * 256 + 4 * T * 2 * 1);
  EXPECT_GE(bytes, parts);
  EXPECT_LE(bytes, parts + 7 * 256 + 1024);
}

}  // namespace
}  // namespace mok
