// Two shortcuts in the SwiGLU code every GEMM1 and dh epilogue runs (kernels/common/swiglu.cuh),
// checked against the forms they replaced on the device that runs them, for every float:
// exp_neg() (MUFU.EX2 with subnormal results flushed) gives the sigmoid's denominator
// 1 + e^-g with __expf(-g)'s bits, and saved_up() (two selects) is the nested conditional it
// was written as, for the clamp limits a layer can have (finite positive, or +inf for none).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "gpu_support.hpp"
#include "kernels/common/swiglu.cuh"

namespace mok {
namespace {

constexpr unsigned kBlocks = 1024, kThreads = 256;

__device__ bool same_bits_or_both_nan(float a, float b) {
  return __float_as_uint(a) == __float_as_uint(b) || (isnan(a) && isnan(b));
}

// Every 32-bit pattern g: 1 + exp_neg(g) against 1 + __expf(-g).
__global__ void denominator_kernel(unsigned long long* mismatches, std::uint32_t* first) {
  for (std::uint64_t bits = blockIdx.x * blockDim.x + threadIdx.x; bits <= 0xffffffffull;
       bits += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const float g = __uint_as_float(static_cast<std::uint32_t>(bits));
    const float fast = __fadd_rn(1.0f, kernels::exp_neg(g)), before = __fadd_rn(1.0f, __expf(-g));
    if (!same_bits_or_both_nan(fast, before) && atomicAdd(mismatches, 1ull) == 0) *first = static_cast<std::uint32_t>(bits);
  }
}

TEST(SwigluMath, ExpNegGivesExpfsDenominatorForEveryFloat) {
  MOK_REQUIRE_HOPPER();
  testing::DeviceBuffer<unsigned long long> mismatches(1);
  testing::DeviceBuffer<std::uint32_t> first(1);
  cudaMemset(mismatches.get(), 0, sizeof(unsigned long long));
  denominator_kernel<<<kBlocks, kThreads>>>(mismatches.get(), first.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const unsigned long long n = mismatches.download()[0];
  EXPECT_EQ(n, 0ull) << "first mismatch at g = 0x" << std::hex << (n ? first.download()[0] : 0u);
}

// Every 32-bit pattern u at one limit: saved_up against the nested conditional.
__global__ void saved_up_kernel(float limit, unsigned long long* mismatches, std::uint32_t* first) {
  const float inf = __int_as_float(0x7f800000);
  for (std::uint64_t bits = blockIdx.x * blockDim.x + threadIdx.x; bits <= 0xffffffffull;
       bits += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    const float u = __uint_as_float(static_cast<std::uint32_t>(bits));
    const float want = u > limit ? inf : u < -limit ? -inf : u;
    if (__float_as_uint(kernels::saved_up(u, limit)) != __float_as_uint(want) && atomicAdd(mismatches, 1ull) == 0)
      *first = static_cast<std::uint32_t>(bits);
  }
}

TEST(SwigluMath, SavedUpIsTheNestedConditionalForEveryFloat) {
  MOK_REQUIRE_HOPPER();
  for (const float limit : {7.0f, 0.5f, 1e-30f, 3e38f, INFINITY}) {
    testing::DeviceBuffer<unsigned long long> mismatches(1);
    testing::DeviceBuffer<std::uint32_t> first(1);
    cudaMemset(mismatches.get(), 0, sizeof(unsigned long long));
    saved_up_kernel<<<kBlocks, kThreads>>>(limit, mismatches.get(), first.get());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const unsigned long long n = mismatches.download()[0];
    EXPECT_EQ(n, 0ull) << "limit " << limit << ": first mismatch at u = 0x" << std::hex << (n ? first.download()[0] : 0u);
  }
}

}  // namespace
}  // namespace mok
