// cpfill/attention/cuda/paged_gather.h — a gathered paged step's rows (attention/prefix_batched.h
// PlanPagedGather) copied out of a KV cache's blocks on the GPU: K, V and their positions, each
// block piece over as many CTAs as its bytes need (8 KiB of K and of V each), 16 bytes a load.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "attention/prefix_batched.h"

namespace cpfill::attention::cuda {

struct PagedGatherLaunch {
  const PagedGather::Copy* copies = nullptr;  // device memory
  int64_t num_copies = 0;
  int64_t max_copy_rows = 0;     // the most rows of any copy: a block's tokens will do
  const void* k_pool = nullptr;  // block 0 of the layer's pools
  const void* v_pool = nullptr;
  int64_t block_stride_bytes = 0;
  int64_t row_bytes = 0;           // one token's K (or V) row; a multiple of 16
  const int32_t* k_pos = nullptr;  // the step's key positions, by local row
  void* k_out = nullptr;           // [rows][row_bytes], 16-byte aligned
  void* v_out = nullptr;
  int32_t* k_pos_out = nullptr;  // [rows]
};

// InvalidArgument for unaligned rows or pointers; never synchronizes.
absl::Status GatherPagedRowsCuda(const PagedGatherLaunch& g, cudaStream_t stream);

}  // namespace cpfill::attention::cuda
