// cpfill/runtime/model/cuda/device_test_util.h — what the runtime's GPU tests share: device copies
// of host vectors that free themselves when a test leaves (an ASSERT's early return included).
//
//   DevicePtr<float> x = ToDevice(host);   // nullptr when the allocation failed
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace cpfill::runtime::cuda {

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

template <typename T>
DevicePtr<T> ToDevice(const std::vector<T>& host) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(16, host.size() * sizeof(T))) != cudaSuccess) return nullptr;
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return DevicePtr<T>(static_cast<T*>(p));
}

}  // namespace cpfill::runtime::cuda
