#include "mok/ep_nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl_device.h>

#include <string>

#include "mok/error.hpp"

namespace mok {
namespace {

constexpr const char* kWhere = "mok::NcclEpRegion";

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(detail::concat(kWhere, ": ", what, ": ", ncclGetErrorString(r)));
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(detail::concat(kWhere, ": ", what, ": ", cudaGetErrorString(e)));
}

__global__ void peer_pointers_kernel(ncclWindow_t window, int ranks, void** out) {
  for (int q = threadIdx.x; q < ranks; q += blockDim.x) out[q] = ncclGetPeerPointer(window, 0, q);
}

}  // namespace

NcclEpRegion::NcclEpRegion(ncclComm_t comm, std::int64_t bytes) : comm_(comm) {
  if (bytes <= 0) throw_argument_error(kWhere, "bytes", "must be positive, got ", bytes);
  int ranks = 0;
  nccl_check(ncclCommCount(comm, &ranks), "ncclCommCount");
  nccl_check(ncclCommUserRank(comm, &rank_), "ncclCommUserRank");
  nccl_check(ncclMemAlloc(&memory_, static_cast<std::size_t>(bytes)), "ncclMemAlloc");
  cuda_check(cudaMemset(memory_, 0, static_cast<std::size_t>(bytes)), "cudaMemset");
  nccl_check(ncclCommWindowRegister(comm, memory_, static_cast<std::size_t>(bytes), &window_, NCCL_WIN_COLL_SYMMETRIC),
             "ncclCommWindowRegister");
  bases_.assign(ranks, nullptr);
  if (ranks == 1) {
    // A one-rank communicator's window has no device-side peer table (ncclGetPeerPointer
    // faulted on an H200 with NCCL 2.28.9); the only peer is this rank's own memory.
    bases_[0] = memory_;
  } else {
    void** device_table = nullptr;
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&device_table), sizeof(void*) * ranks), "cudaMalloc");
    peer_pointers_kernel<<<1, 32>>>(window_, ranks, device_table);
    const cudaError_t copied = cudaMemcpy(bases_.data(), device_table, sizeof(void*) * ranks, cudaMemcpyDeviceToHost);
    cudaFree(device_table);
    cuda_check(copied, "reading the peer pointers");
  }
  for (int q = 0; q < ranks; ++q)
    if (bases_[q] == nullptr)
      throw Error(detail::concat(kWhere, ": rank ", q, " is not load/store accessible from rank ", rank_,
                                 " (another node, or no NVLink/peer access): expert parallelism needs one NVLink node"));
  // Barrier: every rank's region is zeroed before any rank's first call.
  int* one = nullptr;
  cuda_check(cudaMalloc(reinterpret_cast<void**>(&one), sizeof(int)), "cudaMalloc");
  cuda_check(cudaMemset(one, 0, sizeof(int)), "cudaMemset");
  const ncclResult_t reduced = ncclAllReduce(one, one, 1, ncclInt32, ncclSum, comm, nullptr);
  const cudaError_t synced = cudaDeviceSynchronize();
  cudaFree(one);
  nccl_check(reduced, "ncclAllReduce (barrier)");
  cuda_check(synced, "cudaDeviceSynchronize");
}

NcclEpRegion::~NcclEpRegion() {
  if (window_) ncclCommWindowDeregister(comm_, window_);
  if (memory_) ncclMemFree(memory_);
}

}  // namespace mok
