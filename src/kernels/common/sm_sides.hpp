// Which SMs read each other's L2 lines near: the probe (kernels/common/sm_sides.cu) behind
// bench/l2_sides.cu.
#pragma once

#include <algorithm>
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

// The latency that separates the SMs on a reference SM's side of the L2 from the rest: the middle
// of the widest gap between the sorted latencies (> 0; the rest are SMs that had no CTA). On an
// H200 the near side reads in 278–302 cycles and the far side in 364–388, while the DRAM is ~680:
// a cut halfway to the DRAM (the first probe's) put every SM on one side. Negative when there are
// fewer than two latencies or the widest gap is under 10 % of the least latency (one side).
inline double near_far_cut(std::vector<double> latencies) {
  std::erase_if(latencies, [](double l) { return !(l > 0); });
  std::sort(latencies.begin(), latencies.end());
  double gap = 0, cut = -1;
  for (std::size_t i = 1; i < latencies.size(); ++i)
    if (latencies[i] - latencies[i - 1] > gap) gap = latencies[i] - latencies[i - 1], cut = (latencies[i] + latencies[i - 1]) / 2;
  return latencies.size() >= 2 && gap >= 0.1 * latencies.front() ? cut : -1.0;
}

}  // namespace mok::kernels
