// Helpers for tests that need a GPU: they skip (reported as skipped) without one.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "mok/device.hpp"

#define MOK_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(call)

// Skips the test unless device 0 is a Hopper GPU (the kernels are built for sm_90a only).
#define MOK_REQUIRE_HOPPER()                                                             \
  do {                                                                                   \
    if (mok::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA GPU on this machine";     \
    if (!mok::query_device(0).is_hopper())                                               \
      GTEST_SKIP() << "GPU 0 is " << mok::query_device(0).name << ", not Hopper (sm_90)"; \
  } while (0)

namespace mok::testing {

// A device allocation that frees itself.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : n_(n) {
    if (n > 0 && cudaMalloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T)) != cudaSuccess) throw std::bad_alloc();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void upload(const std::vector<T>& host, cudaStream_t stream = nullptr) {
    if (!host.empty()) cudaMemcpyAsync(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
  }
  std::vector<T> download() const {
    std::vector<T> out(n_);
    if (n_ > 0) cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return out;
  }
  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

}  // namespace mok::testing
