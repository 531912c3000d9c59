// cpfill/bench/gpu_spin.h — keeps the GPU busy for a while with no memory traffic; and a
// read-only stream, the floor of a memory-bound kernel of a given size.
//
// A timed launch queued behind it starts as soon as the spin ends, so the host's launch latency
// stays out of the timed window, and unlike a memset it leaves no dirty lines in L2 for the timed
// kernel to write back.
//
//   SpinGpu(100'000, stream);   // 100 us
//   cudaEventRecord(start, stream); Launch(...); cudaEventRecord(stop, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cpfill::bench {

void SpinGpu(int64_t ns, cudaStream_t stream);

// One kernel of `ctas` CTAs that only reads `bytes` (a multiple of 16) from device memory: the
// time a kernel needs to stream that much, launch and drain included (the decode floor's
// companion: a copy's asymptotic bandwidth hides both).
void ReadGpu(const void* p, size_t bytes, int ctas, uint32_t* sink, cudaStream_t stream);

}  // namespace cpfill::bench
