#include "parallel/cuda/device_buffer.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <vector>

#include "base/status.h"

namespace cpfill::parallel {

namespace {

// Blocks given up by a growth while enqueued work may still read them, until the host has
// waited for the device (FreeRetired).
std::mutex retired_mu;
std::vector<void*>& Retired() {
  static auto* blocks = new std::vector<void*>;
  return *blocks;
}

}  // namespace

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  // The new block first: a growth that does not fit leaves the old one in place (a caller that
  // then asks for less, a fallback, finds it), and the failed allocation's error is cleared.
  void* grown = nullptr;
  if (const cudaError_t e = cudaMalloc(&grown, bytes); e != cudaSuccess) {
    cudaGetLastError();
    CPFILL_CUDA_CHECK(e);
  }
  // Work enqueued before may still read the old buffer (a ring run that does not wait, a model
  // layer), and waiting here would have no deadline (a dead peer's NCCL kernel never ends).
  if (data_ != nullptr) {
    std::lock_guard lock(retired_mu);
    Retired().push_back(data_);
  }
  data_ = grown;
  capacity_ = bytes;
  return absl::OkStatus();
}

void DeviceBuffer::FreeRetired() {
  std::vector<void*> blocks;
  {
    std::lock_guard lock(retired_mu);
    blocks.swap(Retired());
  }
  for (void* b : blocks) cudaFree(b);
}

}  // namespace cpfill::parallel
