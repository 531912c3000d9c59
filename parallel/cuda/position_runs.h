// Key positions listed on the device from their runs (sharding::LocalLayout::kv_runs): a decode
// step uploads a few runs per sequence instead of one position per cached key (4M positions,
// 16 MB, at 256 sequences after 16K tokens).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace cpfill::parallel::cuda {

// `runs`: num_runs pairs (first row, first position), first rows ascending from 0. Writes
// positions[row] = first position + (row - first row) of the run holding `row`, for every row
// in [0, rows). Enqueued on `stream`; num_runs > 0 and rows < 2^31.
cudaError_t ExpandPositionRuns(const int32_t* runs, int num_runs, int32_t* positions, int64_t rows,
                               cudaStream_t stream);

}  // namespace cpfill::parallel::cuda
