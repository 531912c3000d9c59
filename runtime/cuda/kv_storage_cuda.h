// cpfill/runtime/cuda/kv_storage_cuda.h — the KV cache's pool in device memory: one cudaMalloc
// at start-up, and every batch of block copies as one kernel launch on the compute stream (a
// layer's K/V of every sequence moves in one launch, not a cudaMemcpyAsync per block).
//
//   CPFILL_ASSIGN_OR_RETURN(auto kv, KvCache::Create(spec, MakeDeviceKvStorage(stream)));
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "runtime/kv_cache.h"

namespace cpfill::runtime::cuda {

// Copies run on `stream`, asynchronously; nothing synchronizes with the host.
std::unique_ptr<KvStorage> MakeDeviceKvStorage(cudaStream_t stream);

// Free device memory of the current device (cudaMemGetInfo).
absl::StatusOr<int64_t> FreeDeviceBytes();

}  // namespace cpfill::runtime::cuda
