// The fused forward of the layer on one GPU (EP = 1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "mok/device_plan.hpp"
#include "mok/types.hpp"
#include "mok/validate.hpp"

namespace mok {

// Device-side record of a failed wait or bad input, in host-mapped memory: the host can
// read it without synchronising, and it survives a kernel that stopped early.
struct KernelStatus {
  enum Code : std::int32_t { ok = 0, timeout = 1, bad_plan = 2 };
  std::int32_t code;
  std::int32_t block;     // CTA that gave up
  std::int32_t task;      // task it was on
  std::int32_t phase;     // which wait: see kernel_phase_name()
  std::int64_t observed;  // counter value seen last
  std::int64_t expected;  // value it waited for
};

const char* kernel_phase_name(std::int32_t phase);

// Buffers of one layer's forward for a fixed number of tokens T: the plan, the routed
// rows of x in plan order, the SwiGLU
// output h (the context backward reads), fp32 per-slot outputs, dependency counters,
// and the status record. Reusable across calls and layers of the same shape.
class Workspace {
 public:
  Workspace(const MoeShape& shape, std::int64_t tokens, const Config& config = {});
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const MoeShape& shape() const { return shape_; }
  const Config& config() const { return config_; }
  std::int64_t tokens() const { return tokens_; }
  DevicePlan& plan() { return *plan_; }

  // Synchronises `stream`, then throws mok::Error if the planner or a kernel recorded
  // an error (bad expert id, capacity, timeout). Cheap to call after any step.
  void check(cudaStream_t stream);
  // Throws if an earlier call already recorded an error (no synchronisation).
  void throw_if_failed() const;

  // Device buffers (kernels' view).
  void* x_routed() const { return x_routed_; }  // [capacity, H] bf16: routed rows in plan order
  void* hidden() const { return hidden_; }  // [capacity, I] bf16
  float* slots() const { return slots_; }    // [capacity, H] fp32
  int* counters() const { return counters_; }
  std::int64_t counter_count() const;
  KernelStatus* status_device() const { return status_device_; }
  std::int64_t bytes() const { return bytes_; }

 private:
  MoeShape shape_;
  Config config_;
  std::int64_t tokens_;
  std::unique_ptr<DevicePlan> plan_;
  void* x_routed_ = nullptr;
  void* hidden_ = nullptr;
  float* slots_ = nullptr;
  int* counters_ = nullptr;
  KernelStatus* status_host_ = nullptr;
  KernelStatus* status_device_ = nullptr;
  std::int64_t bytes_ = 0;
};

// y = shared(x) + sum_j w_j * expert_j(x), fused: plan on the device, then one persistent
// kernel (gather + GEMM1 + SwiGLU, GEMM2, fixed-order combine). Stream-ordered, no host
// synchronisation; bitwise identical across runs and SM counts. Throws mok::Error on
// invalid arguments; errors found on the device surface at Workspace::check() or the next call.
void forward(const ForwardArgs& args, Workspace& workspace, cudaStream_t stream);

}  // namespace mok
