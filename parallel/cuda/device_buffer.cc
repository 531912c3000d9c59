#include "parallel/cuda/device_buffer.h"

#include <cuda_runtime_api.h>

#include "base/status.h"

namespace cpfill::parallel {

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  // Work enqueued before may still read the old buffer (a ring run that does not wait, a model
  // layer): let it finish before the memory is given back. Growth is rare (a larger batch).
  if (data_ != nullptr) CPFILL_CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(data_);
  data_ = nullptr;
  capacity_ = 0;
  CPFILL_CUDA_CHECK(cudaMalloc(&data_, bytes));
  capacity_ = bytes;
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
