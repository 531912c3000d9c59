// cpfill/base/host_buffer.h — an owned, 64-byte aligned, zero-filled block of host memory.
//
// Messages that carry several tensors of different types (fp32 values and int32 positions in
// one ring message) live in one untyped block; typed views point into disjoint regions.
//
//   HostBuffer msg;
//   msg.Resize(bytes);                 // zero-filled; keeps the block when already large enough
//   float* k = msg.As<float>(0);
//   int32_t* pos = msg.As<int32_t>(positions_offset_bytes);
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace cpfill {

class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(size_t bytes) { Resize(bytes); }

  // Makes the buffer exactly `bytes` long, zero-filled. Reuses the block when it is big enough,
  // so a loop that resizes to the same size allocates once.
  void Resize(size_t bytes) {
    if (bytes > capacity_) {
      const size_t rounded = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
      if (p == nullptr) throw std::bad_alloc();
      data_.reset(static_cast<std::byte*>(p));
      capacity_ = rounded;
    }
    size_ = bytes;
    if (bytes > 0) std::memset(data_.get(), 0, bytes);
  }

  size_t size() const { return size_; }
  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }

  template <typename T>
  T* As(size_t offset_bytes = 0) {
    return reinterpret_cast<T*>(data_.get() + offset_bytes);
  }
  template <typename T>
  const T* As(size_t offset_bytes = 0) const {
    return reinterpret_cast<const T*>(data_.get() + offset_bytes);
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace cpfill
