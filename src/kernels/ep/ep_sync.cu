#include "kernels/ep/ep_sync.cuh"
#include "kernels/common/load.cuh"

#include "kernels/forward/forward.cuh"
#include "mok/device_plan.hpp"
#include "mok/ptx/fence.cuh"
#include "mok/ptx/ld_st.cuh"

namespace mok::kernels {
namespace {

__global__ void begin_call_kernel(EpHeader* header, int* counters, int count) {
  if (threadIdx.x == 0) {
    header->epoch += 1u;  // unsigned: wraps around after 2^32 calls
    header->blocks_done = 0;
  }
  for (int i = threadIdx.x; i < count; i += blockDim.x) counters[i] = 0;
}

__global__ void wait_exchange_kernel(const EpHeader* header, int ranks, long long timeout_ns, KernelStatus* status) {
  const unsigned epoch = header->epoch;
  const std::uint64_t start = ptx::globaltimer_ns();
  for (int q = 0; q < ranks; ++q) {
    unsigned seen;
    while (!reached(seen = ptx::ld_acquire_sys(reinterpret_cast<const int*>(&header->exchange_flag[q])), epoch)) {
      __nanosleep(1000);
      if (ptx::globaltimer_ns() - start > static_cast<std::uint64_t>(timeout_ns)) {
        volatile KernelStatus* s = status;
        s->block = 0, s->task = 0, s->site = WaitSite::exchange_flag, s->peer = q, s->observed = seen, s->expected = epoch;
        __threadfence_system();
        s->code = KernelStatus::timeout;
        __threadfence_system();
        __trap();
      }
    }
  }
}

__global__ void publish_plan_kernel(const EpHeader* header, const PlanStatus* plan, const unsigned long long* saved_marker,
                                    const __grid_constant__ PeerFlags peer_flags, int ranks) {
  int code = plan->code;
  if (saved_marker != nullptr && *saved_marker != kSavedValid) code |= 8;
  const unsigned epoch = header->epoch;
  ptx::fence_acq_rel_sys();
  for (int q = 0; q < ranks; ++q) {
    EpHeader* peer = peer_flags.header[q];
    peer->plan_code[peer_flags.rank] = code;  // ordered before the flag by its release
    ptx::st_release_sys(reinterpret_cast<int*>(&peer->plan_flag[peer_flags.rank]), static_cast<int>(epoch));
  }
}

}  // namespace

void load_ep_kernels() {
  load_forward_kernels();
  load_forward_fp8_kernels();
  load_quantize_kernels();
  load_backward_kernels();
  load_wgrad_fp8_kernels();
  load_plan_kernels();
  load_dispatch_kernels();
  load_exchange_kernels();
  load_kernel(begin_call_kernel);
  load_kernel(wait_exchange_kernel);
  load_kernel(publish_plan_kernel);
}

void launch_begin_call(EpHeader* header, int* counters, int count, cudaStream_t stream) {
  begin_call_kernel<<<1, 128, 0, stream>>>(header, counters, count);
}

void launch_wait_exchange(const EpHeader* header, int ranks, long long timeout_ns, KernelStatus* status,
                          cudaStream_t stream) {
  wait_exchange_kernel<<<1, 1, 0, stream>>>(header, ranks, timeout_ns, status);
}

void launch_publish_plan(const EpHeader* header, const void* plan_status, const unsigned long long* saved_marker,
                         const PeerFlags& peer_flags, int ranks, cudaStream_t stream) {
  publish_plan_kernel<<<1, 1, 0, stream>>>(header, static_cast<const PlanStatus*>(plan_status), saved_marker,
                                           peer_flags, ranks);
}

}  // namespace mok::kernels
