#include "runtime/handoff/kv_staging.h"

#include <cstring>
#include <vector>

#if CPFILL_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "runtime/handoff/kv_handle.h"

namespace cpfill::runtime {
namespace {

struct Run {
  char* dst;
  const char* src;
  int64_t bytes;
};

// One copy per (layer, kind) and stretch of blocks consecutive on both sides: the lowest-id
// allocator (KvCache) makes a fresh sequence's blocks consecutive, so this is mostly one run per
// layer and kind.
std::vector<Run> RunsOf(const KvCache& from, std::span<const int32_t> from_blocks,
                        const KvCache& to, std::span<const int32_t> to_blocks, int64_t rows) {
  const KvCacheSpec& spec = from.spec();
  const int64_t bt = spec.block_tokens, row_bytes = spec.row_bytes();
  std::vector<Run> runs;
  for (int layer = 0; layer < spec.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      for (size_t b = 0; static_cast<int64_t>(b) * bt < rows; ++b) {
        const int64_t bytes = std::min(bt, rows - static_cast<int64_t>(b) * bt) * row_bytes;
        char* dst = to.BlockAddress(layer, kind, to_blocks[b]);
        const char* src = from.BlockAddress(layer, kind, from_blocks[b]);
        if (!runs.empty() && runs.back().dst + runs.back().bytes == dst &&
            runs.back().src + runs.back().bytes == src) {
          runs.back().bytes += bytes;
        } else {
          runs.push_back({dst, src, bytes});
        }
      }
    }
  }
  return runs;
}

}  // namespace

KvStaging::KvStaging(std::unique_ptr<KvCache> cache, bool pinned)
    : cache_(std::move(cache)), pinned_(pinned) {}

absl::StatusOr<std::unique_ptr<KvStaging>> KvStaging::Create(KvCacheSpec spec,
                                                             int64_t capacity_tokens, bool pin) {
  spec.capacity_tokens = capacity_tokens;
  CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<KvCache> cache,
                          KvCache::Create(spec, MakeHostKvStorage()));
  if (!pin) return std::unique_ptr<KvStaging>(new KvStaging(std::move(cache), false));
#if CPFILL_HAVE_CUDA
  const int64_t bytes = KvPoolLayout::OfKvCache(cache->spec(), cache->num_blocks()).bytes;
  const cudaError_t e = cudaHostRegister(cache->BlockAddress(0, 0, 0), static_cast<size_t>(bytes),
                                         cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV hand-off staging: pinning ", bytes, " bytes of host memory: ", cudaGetErrorString(e)));
  }
  return std::unique_ptr<KvStaging>(new KvStaging(std::move(cache), true));
#else
  return absl::FailedPreconditionError("KV hand-off staging: pinned memory needs a CUDA build");
#endif
}

KvStaging::~KvStaging() {
#if CPFILL_HAVE_CUDA
  if (pinned_) cudaHostUnregister(cache_->BlockAddress(0, 0, 0));
#endif
}

int64_t KvStaging::BlocksShort(int64_t rows) const {
  const int64_t bt = cache_->spec().block_tokens;
  return std::max<int64_t>(0, (rows + bt - 1) / bt - cache_->free_blocks());
}

absl::StatusOr<KvCache::SeqId> KvStaging::Stage(const KvCache& from, KvCache::SeqId seq) {
  const int64_t rows = from.length(seq);
  const KvCache::SeqId staged = next_++;
  CPFILL_RETURN_IF_ERROR(cache_->Reserve(staged, rows));
  CPFILL_RETURN_IF_ERROR(cache_->Append(staged, rows));
  if (absl::Status copied = Copy(from, seq, staged, rows); !copied.ok()) {
    cache_->Release(staged);
    return copied;
  }
  return staged;
}

absl::Status KvStaging::Copy(const KvCache& from, KvCache::SeqId seq, KvCache::SeqId staged,
                             int64_t rows) {
  CPFILL_CHECK_INTERNAL(from.spec().row_bytes() == cache_->spec().row_bytes() &&
                            from.spec().block_tokens == cache_->spec().block_tokens &&
                            from.spec().num_layers == cache_->spec().num_layers,
                        "KV hand-off staging: the device cache's geometry differs");
  const std::vector<Run> runs =
      RunsOf(from, from.BlockTable(seq), *cache_, cache_->BlockTable(staged), rows);
  if (!from.on_device()) {
    for (const Run& r : runs) std::memcpy(r.dst, r.src, static_cast<size_t>(r.bytes));
    return absl::OkStatus();
  }
#if CPFILL_HAVE_CUDA
  // The default stream after the forward's own synchronization: the rows are written by then.
  for (const Run& r : runs) {
    const cudaError_t e =
        cudaMemcpy(r.dst, r.src, static_cast<size_t>(r.bytes), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      return absl::InternalError(
          absl::StrCat("KV hand-off staging: copying from the GPU: ", cudaGetErrorString(e)));
    }
  }
  return absl::OkStatus();
#else
  return absl::InternalError("KV hand-off staging: a device cache in a build without CUDA");
#endif
}

}  // namespace cpfill::runtime
