#include "bench/gpu_spin.h"

namespace cpfill::bench {
namespace {

__global__ void SpinKernel(int64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(500);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < static_cast<uint64_t>(ns));
}

}  // namespace

void SpinGpu(int64_t ns, cudaStream_t stream) { SpinKernel<<<1, 32, 0, stream>>>(ns); }

}  // namespace cpfill::bench
