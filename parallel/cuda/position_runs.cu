#include <algorithm>

#include "parallel/cuda/position_runs.h"

namespace cpfill::parallel::cuda {
namespace {

constexpr int kThreads = 256;

// One thread a row: the last run whose first row is at or before it, by bisection (the runs'
// first rows stay in L1/L2 across a block's threads).
__global__ void ExpandKernel(const int2* __restrict__ runs, int num_runs,
                             int32_t* __restrict__ positions, int32_t rows) {
  // A 64-bit index: the last stride past a row count near 2^31 would wrap an int32.
  for (int64_t row = int64_t{blockIdx.x} * kThreads + threadIdx.x; row < rows;
       row += int64_t{gridDim.x} * kThreads) {
    int lo = 0, hi = num_runs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (runs[mid].x <= row) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    positions[row] = runs[lo].y + static_cast<int32_t>(row - runs[lo].x);
  }
}

}  // namespace

cudaError_t ExpandPositionRuns(const int32_t* runs, int num_runs, int32_t* positions, int64_t rows,
                               cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (num_runs <= 0 || rows >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((rows + kThreads - 1) / kThreads, 8192);
  ExpandKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const int2*>(runs), num_runs, positions, static_cast<int32_t>(rows));
  return cudaGetLastError();
}

}  // namespace cpfill::parallel::cuda
