#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/kv/cuda/kv_storage_cuda.h"

namespace cpfill::runtime::cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCopyCtas = int64_t{1} << 16;

// One run as the kernel sees it: `first_chunk` is the number of chunks of the runs before it, so
// the runs' first chunks are strictly increasing (empty runs are dropped on the host).
struct DeviceRun {
  char* dst;
  const char* src;
  int64_t bytes;
  int64_t first_chunk;
};
static_assert(sizeof(DeviceRun) == 32, "the run list is uploaded as raw bytes");

struct CopyParams {
  const DeviceRun* runs;  // device, num_runs entries
  int64_t num_runs;
  int64_t total_chunks;
};

// The CTA's threads copy `bytes` bytes: 16-byte vectors where src and dst can both be aligned,
// bytes elsewhere. Each thread loads kUnroll vectors before it stores any: independent loads in
// flight hide the memory latency (a load-store-load chain ran at a fraction of the bandwidth:
// the KV copies of a 32K-token layer took about 1.2 ms on an H100 instead of about 0.2).
constexpr int kUnroll = 4;
__device__ void CopyChunk(char* __restrict__ dst, const char* __restrict__ src, int64_t bytes) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  int64_t head = bytes, vectors = 0;
  if (((d ^ s) & 15) == 0) {
    const int64_t to_aligned = static_cast<int64_t>((16 - (d & 15)) & 15);
    head = to_aligned < bytes ? to_aligned : bytes;
    vectors = (bytes - head) / 16;
    uint4* __restrict__ dv = reinterpret_cast<uint4*>(dst + head);
    const uint4* __restrict__ sv = reinterpret_cast<const uint4*>(src + head);
    const int64_t stride = blockDim.x;
    for (int64_t i0 = threadIdx.x; i0 < vectors; i0 += stride * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * stride < vectors) v[u] = sv[i0 + u * stride];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i0 + u * stride < vectors) dv[i0 + u * stride] = v[u];
      }
    }
  }
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  for (int64_t i = head + vectors * 16 + threadIdx.x; i < bytes; i += blockDim.x) {
    dst[i] = src[i];
  }
}

__global__ void __launch_bounds__(kCopyThreads)
    CopyRunsKernel(const __grid_constant__ CopyParams p) {
  for (int64_t chunk = blockIdx.x; chunk < p.total_chunks; chunk += gridDim.x) {
    // The last run whose first chunk is <= chunk.
    int64_t lo = 0, hi = p.num_runs - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (p.runs[mid].first_chunk <= chunk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const DeviceRun r = p.runs[lo];
    const int64_t offset = (chunk - r.first_chunk) * kCopyChunkBytes;
    const int64_t left = r.bytes - offset;
    CopyChunk(r.dst + offset, r.src + offset, left < kCopyChunkBytes ? left : kCopyChunkBytes);
  }
}

class DeviceKvStorage final : public KvStorage {
 public:
  explicit DeviceKvStorage(cudaStream_t stream) : stream_(stream) {}

  ~DeviceKvStorage() override {
    // In-flight copies may still read the run buffers or the pool.
    cudaStreamSynchronize(stream_);
    for (StagingSlot& slot : slots_) {
      cudaEventDestroy(slot.uploaded);
      cudaFreeHost(slot.runs);
    }
    for (DeviceRun* p : retired_staging_) cudaFreeHost(p);
    cudaFree(device_runs_);
    cudaFree(pool_);
  }

  absl::Status Allocate(int64_t bytes) override {
    if (pool_ != nullptr) {
      return absl::FailedPreconditionError("KV device storage: the pool is allocated once");
    }
    CPFILL_CHECK_ARG(bytes > 0, "KV device storage: cannot allocate ", bytes, " bytes");
    const cudaError_t rc = cudaMalloc(&pool_, static_cast<size_t>(bytes));
    if (rc == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // not sticky, but clear it for the next caller's check
      size_t free_bytes = 0, total_bytes = 0;
      cudaMemGetInfo(&free_bytes, &total_bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("KV device storage: cannot allocate ", bytes, " bytes (",
                       bytes / double(int64_t{1} << 30), " GiB) of device memory; ", free_bytes,
                       " bytes are free; lower the KV capacity or memory fraction"));
    }
    CPFILL_CUDA_CHECK(rc);
    slots_.reserve(kStagingSlots);
    while (slots_.size() < static_cast<size_t>(kStagingSlots)) {
      CPFILL_RETURN_IF_ERROR(AddSlot());
    }
    return absl::OkStatus();
  }

  char* base() const override { return pool_; }
  bool on_device() const override { return true; }

  // The device run list; staging slots grow to it when they are next taken.
  absl::Status ReserveRuns(int64_t runs) override {
    CPFILL_CHECK_ARG(runs >= 0, "KV device storage: cannot reserve ", runs, " runs");
    if (runs <= capacity_runs_) return absl::OkStatus();
    const int64_t capacity = std::max(runs, 2 * capacity_runs_);
    // Stream-ordered: the old buffer goes after the kernels that read it.
    if (device_runs_ != nullptr) CPFILL_CUDA_CHECK(cudaFreeAsync(device_runs_, stream_));
    device_runs_ = nullptr;
    CPFILL_CUDA_CHECK(cudaMallocAsync(&device_runs_, capacity * sizeof(DeviceRun), stream_));
    capacity_runs_ = capacity;
    return absl::OkStatus();
  }

  absl::Status CopyRuns(std::span<const CopyRun> runs) override {
    int64_t n = 0;
    for (const CopyRun& r : runs) {
      CPFILL_CHECK_ARG(r.bytes >= 0, "KV copy run of ", r.bytes, " bytes");
      CPFILL_CHECK_ARG(r.bytes == 0 || (r.dst != nullptr && r.src != nullptr), "KV copy run of ",
                       r.bytes, " bytes with a null pointer");
      n += r.bytes > 0;
    }
    if (n == 0) return absl::OkStatus();
    CPFILL_CHECK_ARG(pool_ != nullptr, "KV device storage: CopyRuns before Allocate");
    CPFILL_RETURN_IF_ERROR(ReserveRuns(n));

    // Step 1: a staging slot whose previous upload the device has done.
    CPFILL_ASSIGN_OR_RETURN(StagingSlot * slot, TakeSlot());
    DeviceRun* staged = slot->runs;

    // Step 2: the run list with each run's first chunk.
    int64_t chunks = 0, i = 0;
    for (const CopyRun& r : runs) {
      if (r.bytes == 0) continue;
      staged[i++] = {static_cast<char*>(r.dst), static_cast<const char*>(r.src), r.bytes, chunks};
      chunks += (r.bytes + kCopyChunkBytes - 1) / kCopyChunkBytes;
    }

    // Step 3: upload, mark the slot free again once the upload is done, copy.
    CPFILL_CUDA_CHECK(cudaMemcpyAsync(device_runs_, staged, n * sizeof(DeviceRun),
                                      cudaMemcpyHostToDevice, stream_));
    CPFILL_CUDA_CHECK(cudaEventRecord(slot->uploaded, stream_));
    const CopyParams params{device_runs_, n, chunks};
    const int ctas = static_cast<int>(std::min(chunks, kMaxCopyCtas));
    CopyRunsKernel<<<ctas, kCopyThreads, 0, stream_>>>(params);
    CPFILL_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  }

 private:
  // One upload's run list in pinned memory; free again once `uploaded` has passed.
  struct StagingSlot {
    DeviceRun* runs = nullptr;
    int64_t capacity = 0;
    cudaEvent_t uploaded = nullptr;
  };

  absl::Status AddSlot() {
    StagingSlot slot;
    CPFILL_CUDA_CHECK(cudaEventCreateWithFlags(&slot.uploaded, cudaEventDisableTiming));
    slots_.push_back(slot);
    return absl::OkStatus();
  }

  // The next slot whose upload is done, at capacity_runs_. The host never waits for the device
  // here (it runs a whole forward ahead, and a wait would have no deadline): when every slot's
  // upload is still queued, a new slot is added; there are at most as many as uploads in flight.
  absl::StatusOr<StagingSlot*> TakeSlot() {
    size_t found = slots_.size();
    for (size_t i = 0; i < slots_.size() && found == slots_.size(); ++i) {
      const size_t k = (next_slot_ + i) % slots_.size();
      const cudaError_t e = cudaEventQuery(slots_[k].uploaded);  // never recorded: done
      if (e == cudaSuccess) found = k;
      if (e != cudaSuccess && e != cudaErrorNotReady) CPFILL_CUDA_CHECK(e);
    }
    if (found == slots_.size()) CPFILL_RETURN_IF_ERROR(AddSlot());
    next_slot_ = (found + 1) % slots_.size();
    StagingSlot& slot = slots_[found];
    if (slot.capacity < capacity_runs_) {
      // Its upload is done, but freeing pinned memory may wait for the device: keep it.
      if (slot.runs != nullptr) retired_staging_.push_back(slot.runs);
      slot.runs = nullptr;
      CPFILL_CUDA_CHECK(cudaMallocHost(&slot.runs, capacity_runs_ * sizeof(DeviceRun)));
      slot.capacity = capacity_runs_;
    }
    return &slot;
  }

  cudaStream_t stream_;
  char* pool_ = nullptr;
  // The run list: staging slots in pinned memory, one device buffer of capacity_runs_ runs.
  int64_t capacity_runs_ = 0;
  std::vector<StagingSlot> slots_;
  size_t next_slot_ = 0;
  std::vector<DeviceRun*> retired_staging_;
  DeviceRun* device_runs_ = nullptr;
};

}  // namespace

std::unique_ptr<KvStorage> MakeDeviceKvStorage(cudaStream_t stream) {
  return std::make_unique<DeviceKvStorage>(stream);
}

absl::StatusOr<int64_t> FreeDeviceBytes() {
  size_t free_bytes = 0, total_bytes = 0;
  CPFILL_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return static_cast<int64_t>(free_bytes);
}

}  // namespace cpfill::runtime::cuda
