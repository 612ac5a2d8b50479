// NCCL (>= 2.28) as the source of an EpRank's symmetric region, for the C++ API (library
// target mok::mok_nccl; the Python package uses PyTorch symmetric memory instead):
//
//   ncclComm_t comm = ...;                       // one rank per GPU of one NVLink node
//   mok::NcclEpRegion region(comm, mok::EpRank::region_bytes(shape, T));
//   mok::EpRank rank(shape, T, region.rank(), region.bases(), config);
//
// The region is ncclMemAlloc'd, registered as a symmetric window, zeroed, and the peers'
// addresses come from the device-side ncclGetPeerPointer. Construction is collective (every
// rank of `comm`, the same bytes) and ends with a barrier, so EpRank's rule — every region
// zeroed before any rank's first call — holds.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <span>
#include <vector>

namespace mok {

class NcclEpRegion {
 public:
  NcclEpRegion(ncclComm_t comm, std::int64_t bytes);
  ~NcclEpRegion();
  NcclEpRegion(const NcclEpRegion&) = delete;
  NcclEpRegion& operator=(const NcclEpRegion&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(bases_.size()); }
  // bases()[q]: rank q's region as mapped on this GPU.
  std::span<void* const> bases() const { return bases_; }

 private:
  ncclComm_t comm_;
  ncclWindow_t window_ = nullptr;
  void* memory_ = nullptr;
  std::vector<void*> bases_;
  int rank_ = 0;
};

}  // namespace mok
