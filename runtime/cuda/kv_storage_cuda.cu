#include "runtime/cuda/kv_storage_cuda.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime::cuda {
namespace {

// One CTA per run: 16-byte copies when the run's ends are 16-byte aligned (KV rows of bf16 with
// head_dim 64 or 128 always are), byte copies otherwise.
// Destinations and sources move by `dst_shift` / `src_shift` bytes (the layer's place in the
// pool).
__global__ void CopyRunsKernel(const CopyRun* runs, int64_t dst_shift, int64_t src_shift) {
  const CopyRun r = runs[blockIdx.x];
  char* dst = static_cast<char*>(r.dst) + dst_shift;
  const char* src = static_cast<const char*>(r.src) + src_shift;
  const auto ends = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                    static_cast<uintptr_t>(r.bytes);
  if ((ends & 15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (int64_t i = threadIdx.x; i < r.bytes / 16; i += blockDim.x) d[i] = s[i];
    return;
  }
  for (int64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) dst[i] = src[i];
}

class DeviceKvStorage : public KvStorage {
 public:
  explicit DeviceKvStorage(cudaStream_t stream) : stream_(stream) {}
  ~DeviceKvStorage() override {
    cudaFree(base_);
    for (Slot& s : slots_) cudaFree(s.runs);
  }
  absl::Status Allocate(int64_t bytes) override {
    CPFILL_CHECK_INTERNAL(base_ == nullptr, "the KV pool is allocated once");
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<int64_t>(bytes, 16)) != cudaSuccess) {
      cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache: cannot allocate ", bytes, " bytes of device memory (", free,
                       " free); lower --kv-capacity-tokens or --kv-memory-fraction"));
    }
    base_ = static_cast<char*>(p);
    return absl::OkStatus();
  }
  char* base() const override { return base_; }
  bool on_device() const override { return true; }

  // The run list goes up through pageable memory, once per prefill (not per layer): the call
  // returns once it is staged, so the caller's vector may change right after.
  absl::Status Stage(int slot, std::span<const CopyRun> runs) override {
    if (slot >= static_cast<int>(slots_.size())) slots_.resize(slot + 1);
    Slot& s = slots_[slot];
    if (runs.size() > s.capacity) {
      cudaFree(s.runs);
      s.runs = nullptr;
      s.capacity = 0;
      CPFILL_CUDA_CHECK(cudaMalloc(&s.runs, runs.size() * sizeof(CopyRun)));
      s.capacity = runs.size();
    }
    if (!runs.empty()) {
      CPFILL_CUDA_CHECK(cudaMemcpyAsync(s.runs, runs.data(), runs.size() * sizeof(CopyRun),
                                        cudaMemcpyHostToDevice, stream_));
    }
    return absl::OkStatus();
  }
  absl::Status Execute(int slot, std::span<const CopyRun> runs, int64_t dst_shift,
                       int64_t src_shift) override {
    CPFILL_CHECK_INTERNAL(slot < static_cast<int>(slots_.size()) &&
                              runs.size() <= slots_[slot].capacity,
                          "KV copy slot ", slot, " was not staged with ", runs.size(), " runs");
    for (size_t first = 0; first < runs.size(); first += kMaxGrid) {
      const unsigned n = static_cast<unsigned>(std::min<size_t>(kMaxGrid, runs.size() - first));
      CopyRunsKernel<<<n, 256, 0, stream_>>>(slots_[slot].runs + first, dst_shift, src_shift);
      CPFILL_CUDA_CHECK(cudaGetLastError());
    }
    return absl::OkStatus();
  }

 private:
  static constexpr size_t kMaxGrid = 65535;
  struct Slot {
    CopyRun* runs = nullptr;  // device copy of the staged list
    size_t capacity = 0;
  };
  cudaStream_t stream_;
  char* base_ = nullptr;
  std::vector<Slot> slots_;
};

}  // namespace

std::unique_ptr<KvStorage> MakeDeviceKvStorage(cudaStream_t stream) {
  return std::make_unique<DeviceKvStorage>(stream);
}

absl::StatusOr<int64_t> FreeDeviceBytes() {
  size_t free = 0, total = 0;
  CPFILL_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(free);
}

}  // namespace cpfill::runtime::cuda
