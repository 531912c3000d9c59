#include "parallel/cuda/device_buffer.h"

#include <cuda_runtime_api.h>

#include "base/status.h"

namespace cpfill::parallel {

DeviceBuffer::~DeviceBuffer() { cudaFree(data_); }

absl::Status DeviceBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  cudaFree(data_);
  data_ = nullptr;
  capacity_ = 0;
  CPFILL_CUDA_CHECK(cudaMalloc(&data_, bytes));
  capacity_ = bytes;
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
