// cpfill/parallel/cuda/device_buffer.h — an owned device allocation that grows on demand and
// never shrinks.
//
// Long-lived owners (the ring's ops, a model's activations) keep their DeviceBuffers between
// calls, so a steady loop allocates nothing: cudaMalloc and cudaFree cost milliseconds and
// synchronize the device.
//
//   DeviceBuffer msg;
//   CPFILL_RETURN_IF_ERROR(msg.Reserve(bytes));     // a no-op once large enough
//   __nv_bfloat16* k = msg.As<__nv_bfloat16>(0);
//   int32_t* pos = msg.As<int32_t>(positions_offset_bytes);
#pragma once

#include <cstddef>
#include <utility>

#include "absl/status/status.h"

namespace cpfill::parallel {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : data_(o.data_), capacity_(o.capacity_) {
    o.data_ = nullptr;
    o.capacity_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(capacity_, o.capacity_);
    return *this;
  }
  // At least `bytes`; contents are not kept across a growth. The old block is retired, not
  // freed: work already enqueued may still read it. A growth that fails (out of memory) keeps
  // the old block and returns the error.
  absl::Status Reserve(size_t bytes);
  // Frees every retired block. Call only once the host has waited for all the device's work
  // (the ring's and the backend's Finish do).
  static void FreeRetired();
  template <typename T>
  T* As(size_t offset_bytes = 0) const {
    return reinterpret_cast<T*>(static_cast<char*>(data_) + offset_bytes);
  }
  size_t capacity() const { return capacity_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace cpfill::parallel
