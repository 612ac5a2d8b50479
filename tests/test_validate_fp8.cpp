// Precision::fp8's argument checks (the rest: test_validate.cpp).
#include <gtest/gtest.h>

#include "mok/ep.hpp"
#include "mok/forward.hpp"
#include "mok/validate.hpp"
#include "validate_fixture.hpp"

namespace mok {
namespace {

using testing::expect_error;
using testing::Fixture;

// Precision::fp8: the quantized weights' tensors, and what a workspace (or an EP group) of that
// precision cannot do yet, are refused before anything touches a GPU.
TEST(Validate, Fp8WeightsAndWorkspace) {
  Fixture f;
  const Device cpu = Device::cpu();
  const std::int64_t El = f.shape.num_local_experts, I = f.shape.intermediate, H = f.shape.hidden;
  Fp8Weights w;
  w.gate = w.up = TensorView::contiguous(Fixture::memory, DType::u8, cpu, {El, I, H});
  w.down = TensorView::contiguous(Fixture::memory, DType::u8, cpu, {El, H, I});
  w.gate_exponents = w.up_exponents = TensorView::contiguous(Fixture::memory, DType::i32, cpu, {El, 1, 1});
  w.down_exponents = w.gate_exponents;
  f.args.fp8 = w;
  EXPECT_NO_THROW(f.forward());
  f.args.fp8->gate.dtype = DType::bf16;
  expect_error([&] { f.forward(); }, "argument 'fp8.gate': dtype must be u8, got bf16");
  f.args.fp8 = w;
  f.args.fp8->down_exponents = TensorView::contiguous(Fixture::memory, DType::i32, cpu, {El, 2, 1});
  expect_error([&] { f.forward(); }, "argument 'fp8.down_exponents': shape must be [4, 1, 1], got [4, 2, 1]");

  f.args.fp8 = w;
  Fp8DgradWeights d;  // the backward's transposed weights
  d.down_t = TensorView::contiguous(Fixture::memory, DType::u8, cpu, {El, I, H});
  d.gate_up_t = TensorView::contiguous(Fixture::memory, DType::u8, cpu, {El, H, 2 * I});
  d.down_t_exponents = TensorView::contiguous(Fixture::memory, DType::i32, cpu, {El, 1, 1});
  d.gate_up_t_exponents = TensorView::contiguous(Fixture::memory, DType::i32, cpu, {El, 1, 2});
  f.grads.fp8 = d;
  EXPECT_NO_THROW(f.backward());
  f.grads.fp8->gate_up_t = TensorView::contiguous(Fixture::memory, DType::u8, cpu, {El, H, I});
  expect_error([&] { f.backward(); }, "argument 'fp8.gate_up_t': shape must be [4, 128, 128], got [4, 128, 64]");
  f.grads.fp8 = d;
  f.grads.fp8->down_t_exponents.dtype = DType::f32;
  expect_error([&] { f.backward(); }, "argument 'fp8.down_t_exponents': dtype must be i32, got f32");
  f.grads.fp8 = d;
  f.grads.fp8->gate_up_t_exponents = d.down_t_exponents;
  expect_error([&] { f.backward(); }, "argument 'fp8.gate_up_t_exponents': shape must be [4, 1, 2], got [4, 1, 1]");
  f.grads.fp8.reset();

  Config fp8;
  fp8.precision = Precision::fp8;
  MoeShape s = f.shape;
  s.num_local_experts = s.num_experts;  // one GPU
  expect_error([&] { Workspace(s, 8, fp8); },
               "argument 'shape': Precision::fp8 needs hidden and intermediate multiples of 128 (its scale blocks), "
               "got hidden = 128, intermediate = 64");
  s.intermediate = 256;
  Config interleaved = fp8;
  interleaved.interleave_rows = 1024;
  expect_error([&] { Workspace(s, 8, interleaved); },
               "argument 'config.interleave_rows': must be 0 with Precision::fp8 (its kernel runs GEMM1 before GEMM2), "
               "got 1024");
  expect_error([&] { Workspace(s, 8, fp8, Training::recompute); },
               "argument 'config.precision': fp8 trains with Training::save");
  // Expert parallelism: FP8 forwards pull their rows before the kernel; the ring is bf16 only.
  MoeShape ep = s;
  ep.num_experts = 2 * s.num_local_experts;  // two ranks
  Config ring = fp8;
  ring.comm_sms = 2;
  expect_error([&] { VirtualRanks(ep, 8, ring); },
               "argument 'config.comm_sms': must be 0 with Precision::fp8 (an EP rank's FP8 forward pulls and "
               "quantizes its rows before the kernel; the ring token buffer carries bf16 rows only for now), got "
               "comm_sms = 2, ring_rows = 0");
  ring.comm_sms = 0, ring.ring_rows = 4096;
  expect_error([&] { VirtualRanks(ep, 8, ring); }, "argument 'config.ring_rows': must be 0 with Precision::fp8");
  Config virtual_dgrad = fp8;  // (rows every virtual rank would hold and no call could read)
  virtual_dgrad.fp8_dgrad = true;
  expect_error([&] { VirtualRanks(ep, 8, virtual_dgrad); },
               "mok::VirtualRanks: argument 'config.fp8_dgrad': the FP8 dgrad of an EP group runs in mok::EpRank");
  Config rows_without_fp8;
  rows_without_fp8.fp8_dgrad = true;
  expect_error([&] { validate(rows_without_fp8); },
               "argument 'fp8_dgrad': is true, but precision is bf16 (the FP8 dgrad's rows serve a Precision::fp8 "
               "EP rank)");
  Config e4m3_rows;
  e4m3_rows.pull_fp8_rows = true;
  expect_error([&] { validate(e4m3_rows); },
               "argument 'pull_fp8_rows': is true, but precision is bf16 (E4M3 rows are pulled by Precision::fp8 EP "
               "ranks)");
  e4m3_rows.precision = Precision::fp8, e4m3_rows.pull_tokens_once = true;
  expect_error([&] { validate(e4m3_rows); },
               "argument 'pull_fp8_rows': cannot be combined with pull_tokens_once");
  Config bad;
  bad.precision = static_cast<Precision>(7);
  expect_error([&] { validate(bad); }, "argument 'precision': must be Precision::bf16 or Precision::fp8, got 7");
  EXPECT_STREQ(precision_name(Precision::fp8), "fp8");
}

}  // namespace
}  // namespace mok
