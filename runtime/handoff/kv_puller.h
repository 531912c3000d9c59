// cpfill/runtime/handoff/kv_puller.h — the decode side of the KV hand-off: pulls one decode
// rank's part of a request's KV from every prefill rank that holds it (kv_handle.h), over UCX, into
// memory of the caller's choosing and layout (kv_pull_plan.h), then releases the lease.
//
// A pull from each prefill rank: its lease record must hold the handle's nonce and the digest of
// the handle's part for that rank before the gets (a stale, edited or forged handle is refused
// without reading blocks) and the nonce after them (a lease that ended mid-pull
// voids the data: FailedPrecondition, and the caller must not use the destination). Gets of one
// rank are issued in a bounded window; ranks are pulled one after another. Every wait has the
// caller's deadline; a prefill rank that is gone is an error within it (Unavailable where UCX
// detects it, DeadlineExceeded otherwise).
//
// A decode worker of several ranks: each rank pulls its part (its own puller and destination),
// then one of them calls Release once all have pulled. A puller that dies before releasing pins
// nothing for long: the lease expires on the prefill side. After a failed pull, keep the
// destination until the puller is destroyed: over transports without peer failure detection a get
// abandoned at the deadline may still land while the worker is progressed (ucx_transport.h).
//
//   CPFILL_ASSIGN_OR_RETURN(auto puller, KvPuller::Create({.name = "decode rank 0"}));
//   CPFILL_ASSIGN_OR_RETURN(KvHandle handle, ParseKvHandle(response["kv_transfer_params"]));
//   KvPullDestination dst{.tp_size = 1, .layout = KvContiguousDestination{.v_offset_bytes = kb}};
//   CPFILL_ASSIGN_OR_RETURN(KvPullStats stats,
//                           puller->Pull(handle, dst, buffer, 2 * kb, UcxDeadlineIn(30s)));
//   CPFILL_RETURN_IF_ERROR(puller->Release(handle, UcxDeadlineIn(5s)));
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/ucx_transport.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/handoff/kv_pull_plan.h"

namespace cpfill::runtime {

struct KvPullerOptions {
  std::string name = "kv puller";  // in error messages
  // UCX settings for this context (parallel::UcxTransportOptions::ucx_config).
  std::vector<std::pair<std::string, std::string>> ucx_config;
};

struct KvPullStats {
  int64_t bytes = 0;           // KV bytes written into the destination
  int64_t gets = 0;            // UCX gets issued for them (pieces of runs)
  int source_ranks = 0;        // prefill ranks pulled from (so far)
  int total_source_ranks = 0;  // that the plan reads
  double seconds = 0;          // from the first lease check to the last (connections included)
  double get_seconds = 0;      // of which in the KV gets themselves
  double gb_per_s() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
  double get_gb_per_s() const {
    return get_seconds > 0 ? static_cast<double>(bytes) / get_seconds / 1e9 : 0;
  }
};

class KvPuller {
 public:
  static absl::StatusOr<std::unique_ptr<KvPuller>> Create(KvPullerOptions options);
  ~KvPuller();
  KvPuller(const KvPuller&) = delete;
  KvPuller& operator=(const KvPuller&) = delete;

  // Pulls decode rank dst.tp_rank's part of `handle` (validated, transport present: ParseKvHandle
  // gives such) into [base, base + bytes), host memory or CUDA memory where UCX supports it.
  // InvalidArgument for a plan that is refused (PlanKvPull) or reaches past `bytes`;
  // FailedPrecondition when a rank's lease record does not hold the nonce (a stale handle, a lease
  // ended before or during the pull: the destination's contents are then void) or the digest of
  // the handle's part for that rank (an edited handle: nothing read); a transport
  // error (Unavailable, DeadlineExceeded) naming the prefill rank.
  // `on_rank` (may be empty) sees the figures so far after each prefill rank (progress).
  absl::StatusOr<KvPullStats> Pull(const KvHandle& handle, const KvPullDestination& dst, void* base,
                                   uint64_t bytes, parallel::UcxDeadline deadline,
                                   const std::function<void(const KvPullStats&)>& on_rank = {});

  // Ends the lease: one message to the handle's ranks[0] (kv_handle.h, "The release").
  absl::Status Release(const KvHandle& handle, parallel::UcxDeadline deadline);

  // The underlying transport, e.g. for supports_cuda_memory().
  parallel::UcxTransport& transport() { return *ucx_; }

 private:
  struct Source;  // a prefill rank's endpoint and unpacked keys
  explicit KvPuller(std::unique_ptr<parallel::UcxTransport> ucx);
  absl::StatusOr<Source*> Connect(const KvHandle& handle, int rank_index);
  absl::Status CheckLease(const KvHandle& handle, int rank_index, Source& source,
                          parallel::UcxDeadline deadline, bool before);
  // After a transport error the endpoint is closed (ucx_transport.h): forget it, so that the next
  // call connects again; returns `why`.
  absl::Status DropSource(Source* source, absl::Status why);

  std::unique_ptr<parallel::UcxTransport> ucx_;
  // By the rank's worker address and keys: a handle of the same server reuses the endpoint.
  std::map<std::string, std::unique_ptr<Source>> sources_;
};

}  // namespace cpfill::runtime
