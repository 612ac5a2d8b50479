// Which SMs read each other's L2 lines near: the probe (kernels/common/sm_sides.cu) behind the
// timing variant MOK_DIAG_SIDE_RANKS and bench/l2_sides.cu.
#pragma once

#include <cstdint>
#include <vector>

namespace mok::kernels {

// Dependent-load latencies on the current device, one thread of one SM at a time, with one CTA
// on every SM (the launches take the shared memory that admits one) and nothing else running.
class L2LatencyProbe {
 public:
  explicit L2LatencyProbe(int lines = 2048);  // a random cycle through `lines` 128-byte lines
  ~L2LatencyProbe();
  L2LatencyProbe(const L2LatencyProbe&) = delete;
  L2LatencyProbe& operator=(const L2LatencyProbe&) = delete;

  bool ok() const { return ok_; }  // false: a CUDA call failed (the rest then return -1 / empty)
  int sms() const { return sms_; }
  int shared_bytes() const { return smem_; }
  // Cycles a load of SM `reader` takes walking the chain after the L2 was flushed and SM `writer`
  // walked it (writer < 0: after the flush alone), the least of `repeats`; -1: no CTA ran there.
  double latency(int writer, int reader, int repeats = 2) const;
  // The SM each blockIdx of a persistent launch (grid = SMs, one CTA each) ran on.
  std::vector<int> block_sms() const;

 private:
  int lines_, sms_ = 0, smem_ = 0;
  bool ok_ = false;
  std::uint32_t* chain_ = nullptr;
  long long* out_ = nullptr;
  void* flush_ = nullptr;
  int* map_ = nullptr;
};

// rank_of_sm[smid] for the current device's SMs: the SMs that read SM 0's L2 lines near first
// (by smid), then the rest — measured once a process (~0.1 s); empty if the measurement failed.
// Call only where no stream is capturing.
const std::vector<int>& l2_side_rank_of_sm();

}  // namespace mok::kernels
