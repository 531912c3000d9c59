// cpfill/attention/cuda/pdl.cuh — programmatic dependent launch (sm_90): a kernel launched with
// LaunchAsDependent may be placed on the GPU while the kernel before it in the stream still
// runs, from the moment every CTA of that one has called LetDependentsLaunch (or exited), which
// hides the launch gap between short kernels (2-3 µs each on an H100). Such a kernel must call
// WaitForPrecedingGrids before it touches memory the kernel before it reads or writes: the wait
// returns once that grid has finished and its writes are visible. Launched the plain way, both
// calls do nothing.
//
//   __global__ void Next(...) { WaitForPrecedingGrids(); ... }
//   CPFILL_CUDA_CHECK(LaunchAsDependent(Next, grid, block, 0, stream, args...));
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace cpfill::attention::cuda::internal {

__device__ __forceinline__ void WaitForPrecedingGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void LetDependentsLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

template <typename... Params, typename... Args>
cudaError_t LaunchAsDependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace cpfill::attention::cuda::internal
