// cpfill/base/host_device.h — CPFILL_HD: __host__ __device__ under nvcc, nothing elsewhere, for
// the small functions the host and the GPU share (attention/online_softmax.h, base/random.h,
// runtime/model/sampling_draw.h).
#pragma once

#if defined(__CUDACC__)
#define CPFILL_HD __host__ __device__
#else
#define CPFILL_HD
#endif
