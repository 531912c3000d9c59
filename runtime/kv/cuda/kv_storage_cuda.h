// cpfill/runtime/kv/cuda/kv_storage_cuda.h — the KvCache pool in device memory: one cudaMalloc for
// the whole pool, and a copy kernel that carries out a batch of copy runs in one launch.
//
// CopyRuns is asynchronous on the storage's stream and never waits for the device: the run list
// is written to a pinned staging slot (kStagingSlots to begin with, reused in turn once the
// device has taken a slot's previous upload; when none has, as when the host runs a forward's
// layers ahead of the device, a slot is added rather than waited for), uploaded with
// cudaMemcpyAsync to a device buffer owned by the storage, and read there by the kernel. Stream
// order keeps the device buffer safe: the next upload runs after the previous kernel. The
// buffers are sized at KvCache::Create (ReserveRuns) and grown geometrically when a batch needs
// more; growing allocates pinned memory, which may stall the host, so it stays off the hot path.
//
// Copy kernel: a run is cut into chunks of kCopyChunkBytes; one CTA per chunk (grid-stride),
// which finds its run by binary search over the runs' first chunks. A chunk whose source and
// destination share their alignment modulo 16 moves in 16-byte vectors (bytes before the first
// aligned address and after the last one one by one); any other chunk moves byte by byte. KV
// rows (kv_heads * head_dim * 2 bytes) from cudaMalloc'd buffers are always 16-byte aligned.
//
//   cudaStream_t stream = ...;
//   CPFILL_ASSIGN_OR_RETURN(int64_t free_bytes, FreeDeviceBytes());
//   CPFILL_ASSIGN_OR_RETURN(int64_t capacity, CapacityFromMemory(spec, 0.9, free_bytes));
//   spec.capacity_tokens = capacity;
//   CPFILL_ASSIGN_OR_RETURN(auto kv, KvCache::Create(spec, MakeDeviceKvStorage(stream)));
//   CPFILL_RETURN_IF_ERROR(kv->Write(layer, rows));   // rows' k, v: device pointers
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "runtime/kv/kv_cache.h"

namespace cpfill::runtime::cuda {

inline constexpr int64_t kCopyChunkBytes = 16 * 1024;
inline constexpr int kStagingSlots = 4;  // made with the pool; more are added as needed

// Device storage on `stream` (not owned; it must outlive the storage). The storage's destructor
// synchronizes the stream before freeing its memory.
std::unique_ptr<KvStorage> MakeDeviceKvStorage(cudaStream_t stream);

// cudaMemGetInfo's free bytes on the current device.
absl::StatusOr<int64_t> FreeDeviceBytes();

}  // namespace cpfill::runtime::cuda
