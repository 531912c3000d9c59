// cpfill/runtime/handoff/kv_handoff.h — the prefill side's UCX for the KV hand-off, on every
// rank of a server started with --kv-handoff: the rank's KV pool registered once, its lease records
// (kv_handle.h, "The lease record"), what every rank's handle entry needs to reach it (gathered to
// world rank 0 at start), and a thread that progresses the rank's UCX worker and hands release
// messages to a callback.
//
// The engine (runtime/serving/engine.h) owns the leases: it picks a lease's slot and nonce on world
// rank 0, every rank calls Publish after exporting the request's KV, and Revoke before it frees the
// blocks. The thread is why a pull moves at all over transports that emulate RMA in software (tcp:
// the owner's worker must be progressed) and why UCX's wire-up replies leave at once
// (parallel/ucx_transport.h, "Known UCX 1.13 hazard").
//
// GPU pools: registered as CUDA memory where the loaded UCX has a CUDA transport (PyPI's
// libucx-cu*). Debian's and Ubuntu's UCX have none: then each hand-off is copied, when it is
// published, into a pinned host staging pool (runtime/handoff/kv_staging.h) that UCX reads instead,
// and the request's GPU blocks are freed at once (the lease holds host memory only).
//
//   CPFILL_ASSIGN_OR_RETURN(auto handoff, KvHandoff::Create(model.kv_cache(), world, place,
//                                                           {.on_release = ...}));
//   engine.AttachKvHandoff(handoff.get(), engine_id, std::chrono::seconds(30));
//   handoff->Export(model, session, ids)  (every rank; the engine does it after a prefill)
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/ucx_transport.h"
#include "runtime/handoff/kv_export.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/handoff/kv_staging.h"
#include "runtime/kv/kv_cache.h"
#include "runtime/model/llama_model.h"

namespace cpfill::runtime {

struct KvHandoffOptions {
  int max_leases = 1024;  // lease records per rank: requests whose KV may be held at once
  // Host staging (see above): its capacity in tokens per rank (0: the KV cache's), and whether to
  // stage even a host KV cache (tests exercise the staging path on the CPU backend with it).
  int64_t staging_tokens = 0;
  bool force_staging = false;
  // UCX settings for this context (parallel::UcxTransportOptions::ucx_config).
  std::vector<std::pair<std::string, std::string>> ucx_config;
  // World rank 0, from the progress thread: a release message's payload (KvReleasePayload).
  // Must not block.
  std::function<void(const std::string&)> on_release;
  // Any rank, from the progress thread: a message that is not a release or not for rank 0.
  std::function<void(const std::string&)> on_note;
};

// This rank's place in the grid.
struct KvHandoffPlace {
  int tp_rank = 0, tp_size = 1, cp_rank = 0, cp_size = 1;
};

class KvHandoff {
 public:
  // Collective over `world`: every rank registers its pool and lease records and the ranks'
  // transports are gathered; the same error on every rank when any rank fails (FailedPrecondition
  // for a GPU pool without CUDA support in UCX, naming the library version).
  static absl::StatusOr<std::unique_ptr<KvHandoff>> Create(const KvCache& kv,
                                                           parallel::Communicator& world,
                                                           const KvHandoffPlace& place,
                                                           KvHandoffOptions options);
  ~KvHandoff();  // stops the progress thread, then unregisters
  KvHandoff(const KvHandoff&) = delete;
  KvHandoff& operator=(const KvHandoff&) = delete;

  int max_leases() const { return options_.max_leases; }
  // Every rank, collective: the handle of `session` (ExportSessionKv, runtime/handoff/kv_export.h),
  // its KV first copied to the staging pool when staging (then the session ends on the model: its
  // GPU blocks are free). The same error on every rank: ResourceExhausted when the staging pool of
  // some rank cannot take it, else ExportSessionKv's.
  absl::StatusOr<KvHandle> Export(LlamaModel& model, const std::string& session,
                                  const KvHandleIds& ids);
  // Every rank: frees what Export staged for `session` (nothing when it staged nothing).
  void Forget(const std::string& session);
  // Used share of the staging pool's blocks (0 without staging). Export's and Forget's thread.
  double staging_usage_ratio() const {
    return staging_ ? staging_->cache().usage().usage_ratio() : 0.0;
  }
  // Every rank: lease record `slot` holds `nonce` (non-zero) and the digest of this rank's part of
  // `handle` (KvRankDigest, with `nonce` as its lease_nonce; the exported handle, every rank's
  // the same). Revoke clears the nonce; call it before the blocks go.
  void Publish(int slot, const KvNonce& nonce, const KvHandle& handle);
  void Revoke(int slot);
  // World rank 0: every rank of `handle` gets its transport for lease `slot`, and the nonce.
  void FillTransport(KvHandle* handle, int slot, const KvNonce& nonce) const;
  // "UCX 1.13.1, host memory" or "..., CUDA memory": for the start-up log.
  const std::string& description() const { return description_; }

 private:
  KvHandoff(KvHandoffOptions options, int world_rank);
  absl::Status Register(const KvCache& kv, const KvHandoffPlace& place);
  absl::Status GatherTransports(parallel::Communicator& world, const KvHandoffPlace& place);
  void ProgressLoop();

  const KvHandoffOptions options_;
  const int world_rank_;
  parallel::Communicator* world_ = nullptr;
  KvHandoffPlace place_;
  std::unique_ptr<KvStaging> staging_;            // null: UCX reads the KV cache itself
  std::map<std::string, KvCache::SeqId> staged_;  // by session
  std::unique_ptr<parallel::UcxTransport> ucx_;
  std::unique_ptr<parallel::UcxMemoryRegion> pool_region_, lease_region_;
  // The registered lease records (KvLeaseRecord's layout, one a slot). The nonce words are atomic:
  // the engine's thread writes them while UCX may read them.
  struct alignas(64) LeaseSlot {
    std::atomic<uint64_t> nonce_hi{0}, nonce_lo{0};
    uint8_t digest[32] = {};
    uint8_t reserved[16] = {};
  };
  static_assert(sizeof(LeaseSlot) == sizeof(KvLeaseRecord) &&
                    std::atomic<uint64_t>::is_always_lock_free,
                "a lease slot is a KvLeaseRecord in memory");
  std::unique_ptr<LeaseSlot[]> lease_slots_;
  std::string description_;
  // World rank 0: [tp_rank * cp_size + cp_rank], lease_address the rank's first word.
  std::vector<KvRankTransport> transports_;
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace cpfill::runtime
