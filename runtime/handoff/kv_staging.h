// cpfill/runtime/handoff/kv_staging.h — host memory that a leased KV hand-off is copied into when
// the loaded UCX cannot read the GPU's KV pool (Debian's and Ubuntu's UCX have no CUDA transport;
// runtime/handoff/kv_handoff.h). The staging pool is a host KvCache of the device cache's geometry
// (layers, heads, block size, dtype), so a staged sequence's blocks hold their rows exactly as the
// device's did and the handle describes it like any pool (kv_handle.h). On a GPU its memory is
// pinned (cudaHostRegister), so the copies run at the link's speed.
//
//   CPFILL_ASSIGN_OR_RETURN(auto staging, KvStaging::Create(device_kv.spec(), 131072));
//   CPFILL_ASSIGN_OR_RETURN(KvCache::SeqId staged, staging->Stage(device_kv, seq));
//   ... describe staging->cache(), seq `staged`; the device sequence may go now ...
//   staging->Release(staged);
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "runtime/kv/kv_cache.h"

namespace cpfill::runtime {

class KvStaging {
 public:
  // A host pool of `capacity_tokens` (whole blocks) of `device_spec`'s geometry; pinned when
  // `pin` (a CUDA build; FailedPrecondition elsewhere). ResourceExhausted when the memory is not
  // there.
  static absl::StatusOr<std::unique_ptr<KvStaging>> Create(KvCacheSpec device_spec,
                                                           int64_t capacity_tokens, bool pin);
  ~KvStaging();  // unpins
  KvStaging(const KvStaging&) = delete;
  KvStaging& operator=(const KvStaging&) = delete;

  const KvCache& cache() const { return *cache_; }
  // Blocks staging `rows` rows would take beyond the free ones (0 when they fit): for a verdict
  // every rank agrees on before any copy.
  int64_t BlocksShort(int64_t rows) const;
  // Copies every row of `from`'s sequence `seq` (device or host memory, the same geometry) into a
  // new staged sequence and returns its id; synchronous. ResourceExhausted when it does not fit,
  // Internal for a failed copy (nothing is kept then).
  absl::StatusOr<KvCache::SeqId> Stage(const KvCache& from, KvCache::SeqId seq);
  void Release(KvCache::SeqId staged) { cache_->Release(staged); }

 private:
  KvStaging(std::unique_ptr<KvCache> cache, bool pinned);
  absl::Status Copy(const KvCache& from, KvCache::SeqId seq, KvCache::SeqId staged, int64_t rows);

  std::unique_ptr<KvCache> cache_;
  bool pinned_;
  KvCache::SeqId next_ = 0;
};

}  // namespace cpfill::runtime
