// The CTA numbering of the timing variant MOK_DIAG_SIDE_RANKS (kernels/common/sm_sides.cu).
#pragma once

#include <vector>

namespace mok::kernels {

// rank_of_sm[smid] for the current device's SMs: the SMs that read SM 0's L2 lines near first
// (by smid), then the rest — measured once a process (dependent-load latency after a flush,
// ~0.1 s); empty if the measurement failed. Call only where no stream is capturing.
const std::vector<int>& l2_side_rank_of_sm();

}  // namespace mok::kernels
