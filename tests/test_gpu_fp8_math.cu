// Exactness of the shortcuts in the FP8 mainloop (kernels/fp8/mainloop_fp8.cuh), checked on
// the device that runs them: exp2_int() gives ldexpf(1, e)'s bits for every int
// exponent a scale can have (and beyond); the E8M0 byte the quantizations store for a scale
// (e8m0_byte) decodes (e8m0_scale) to that scale, 2^e, for every exponent of the recipe; and a
// K-major sw128 descriptor rebuilt from its low 32 bits and the constant high word
// (wgmma_m64n128k32_e4m3's operands) is the 64-bit descriptor (its fields written out here), for
// every 16-byte-aligned shared address and K step the kernels use.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gpu_support.hpp"
#include "kernels/fp8/fp8_math.cuh"
#include "mok/ptx/wgmma.cuh"

namespace mok {
namespace {

constexpr int kLowest = -400, kHighest = 400;  // (fp8_scale_exponent's range is [-127, 120]; products of two scales reach further)

__global__ void exp2_kernel(std::uint32_t* exact, std::uint32_t* fast) {
  const int e = kLowest + static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e > kHighest) return;
  exact[e - kLowest] = __float_as_uint(ldexpf(1.0f, e));
  fast[e - kLowest] = __float_as_uint(kernels::exp2_int(e));
}

TEST(Fp8Math, Exp2IntIsLdexpfForEveryExponent) {
  MOK_REQUIRE_HOPPER();
  constexpr int n = kHighest - kLowest + 1;
  testing::DeviceBuffer<std::uint32_t> exact(n), fast(n);
  exp2_kernel<<<(n + 255) / 256, 256>>>(exact.get(), fast.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto x = exact.download(), f = fast.download();
  for (int i = 0; i < n; ++i) ASSERT_EQ(f[i], x[i]) << "exp2_int(" << kLowest + i << ")";
  EXPECT_EQ(x[0 - kLowest], 0x3f800000u);                    // 2^0
  EXPECT_EQ(x[-149 - kLowest], 1u);                          // the smallest subnormal
  EXPECT_EQ(x[-150 - kLowest], 0u);
  EXPECT_EQ(x[128 - kLowest], 0x7f800000u);                  // infinity
}

// e in fp8_scale_exponent's range: its byte, and the scale the mainloop decodes from it.
constexpr int kMinExponent = -127, kMaxExponent = 120;

__global__ void e8m0_kernel(std::uint32_t* bytes, std::uint32_t* decoded, std::uint32_t* exact) {
  const int e = kMinExponent + static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e > kMaxExponent) return;
  const std::uint8_t byte = kernels::e8m0_byte(e);
  bytes[e - kMinExponent] = byte;
  decoded[e - kMinExponent] = __float_as_uint(kernels::e8m0_scale(byte));
  exact[e - kMinExponent] = __float_as_uint(ldexpf(1.0f, e));
}

TEST(Fp8Math, E8m0ByteDecodesToTheScaleForEveryExponent) {
  MOK_REQUIRE_HOPPER();
  constexpr int n = kMaxExponent - kMinExponent + 1;
  testing::DeviceBuffer<std::uint32_t> bytes(n), decoded(n), exact(n);
  e8m0_kernel<<<(n + 255) / 256, 256>>>(bytes.get(), decoded.get(), exact.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto b = bytes.download(), d = decoded.download(), x = exact.download();
  for (int i = 0; i < n; ++i) {
    const int e = kMinExponent + i;
    ASSERT_EQ(b[i], static_cast<std::uint32_t>(e + 127)) << "e8m0_byte(" << e << ")";  // (the float 2^e's exponent field)
    ASSERT_EQ(d[i], x[i]) << "e8m0_scale(e8m0_byte(" << e << "))";
  }
  EXPECT_EQ(x[0], 0x00400000u);  // 2^-127: subnormal, byte 0
}

constexpr int kSharedBytes = 200 * 1024;

// Thread t checks every 16-byte-aligned tile address 16 t, 16 (t + threads), ... and the
// four K steps of an FP8 stage (the descriptor adds 2 a step: 32 bytes).
__global__ void descriptor_kernel(int* mismatches) {
  extern __shared__ __align__(1024) unsigned char smem[];
  for (int offset = 16 * static_cast<int>(threadIdx.x); offset + 128 <= kSharedBytes; offset += 16 * blockDim.x) {
    const void* tile = smem + offset;
    // the descriptor's fields as the PTX ISA lays them out, written here independently
    const std::uint64_t address = ptx::smem_address(tile);
    const std::uint64_t want = ((address & 0x3FFFF) >> 4) | (std::uint64_t{1} << 16) | (std::uint64_t{1024 >> 4} << 32) |
                               (std::uint64_t{1} << 62);
    const std::uint64_t full = ptx::wgmma_descriptor_sw128(tile);
    const std::uint32_t low = ptx::wgmma_descriptor_sw128_lo(tile);
    for (int kk = 0; kk < 4; ++kk) {
      const std::uint64_t rebuilt = (std::uint64_t{ptx::kSw128DescriptorHigh} << 32) | (low + 2u * kk);
      if (rebuilt != want + 2u * kk || full + 2u * kk != want + 2u * kk) atomicAdd(mismatches, 1);
    }
  }
}

TEST(Fp8Math, DescriptorLowWordAndConstantHighWordAreTheDescriptor) {
  MOK_REQUIRE_HOPPER();
  ASSERT_EQ(cudaFuncSetAttribute(descriptor_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes),
            cudaSuccess);
  testing::DeviceBuffer<int> mismatches(1);
  cudaMemset(mismatches.get(), 0, sizeof(int));
  descriptor_kernel<<<2, 256, kSharedBytes>>>(mismatches.get());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(mismatches.download()[0], 0);
}

}  // namespace
}  // namespace mok
