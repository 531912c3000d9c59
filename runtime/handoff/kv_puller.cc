#include "runtime/handoff/kv_puller.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {

struct KvPuller::Source {
  std::unique_ptr<parallel::UcxPeer> peer;
  const parallel::UcxRemoteKey* pool_key = nullptr;
  const parallel::UcxRemoteKey* lease_key = nullptr;
};

namespace {

std::string RankName(const KvHandle& handle, int rank_index) {
  const KvRankShard& s = handle.ranks[rank_index];
  return absl::StrCat("prefill tp ", s.tp_rank, " cp ", s.cp_rank, " of engine '", handle.engine_id,
                      "'");
}

// Where the plan's last byte lands, relative to the destination's first.
int64_t PlanEnd(const KvPullPlan& plan) {
  int64_t end = 0;
  for (const KvCopyRun& run : plan.runs) {
    end = std::max(
        end, run.dst_offset_bytes + (run.pieces - 1) * run.dst_stride_bytes + run.piece_bytes);
  }
  return end;
}

}  // namespace

KvPuller::KvPuller(std::unique_ptr<parallel::UcxTransport> ucx) : ucx_(std::move(ucx)) {}

KvPuller::~KvPuller() {
  sources_.clear();  // endpoints before the worker
  ucx_.reset();
}

absl::StatusOr<std::unique_ptr<KvPuller>> KvPuller::Create(KvPullerOptions options) {
  CPFILL_ASSIGN_OR_RETURN(auto ucx, parallel::UcxTransport::Create(
                                        {.name = options.name, .ucx_config = options.ucx_config}));
  return std::unique_ptr<KvPuller>(new KvPuller(std::move(ucx)));
}

absl::StatusOr<KvPuller::Source*> KvPuller::Connect(const KvHandle& handle, int rank_index) {
  const KvRankTransport& t = handle.ranks[rank_index].transport;
  const std::string key = absl::StrCat(t.worker_address, "\n", t.rkey, "\n", t.lease_rkey);
  if (auto it = sources_.find(key); it != sources_.end()) return it->second.get();
  auto source = std::make_unique<Source>();
  CPFILL_ASSIGN_OR_RETURN(source->peer,
                          ucx_->Connect(t.worker_address, RankName(handle, rank_index)));
  CPFILL_ASSIGN_OR_RETURN(source->pool_key, source->peer->UnpackKey(t.rkey));
  CPFILL_ASSIGN_OR_RETURN(source->lease_key, source->peer->UnpackKey(t.lease_rkey));
  return sources_.emplace(key, std::move(source)).first->second.get();
}

// `before`: the record must also hold the digest of the handle's part for this rank, so that an
// edited handle (other blocks, another rank's transport, other ids) reads nothing.
absl::Status KvPuller::CheckLease(const KvHandle& handle, int rank_index, Source& source,
                                  parallel::UcxDeadline deadline, bool before) {
  KvLeaseRecord record;
  const parallel::UcxGetRun run{.remote_address = handle.ranks[rank_index].transport.lease_address,
                                .key = source.lease_key,
                                .local = &record,
                                .bytes = sizeof(record)};
  if (absl::Status got = source.peer->Get({&run, 1}, deadline); !got.ok()) {
    return DropSource(&source, got);
  }
  if (record.nonce_hi != handle.lease_nonce.hi || record.nonce_lo != handle.lease_nonce.lo) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV hand-off '", handle.request_id, "': the lease no longer holds on ",
        RankName(handle, rank_index), before ? " before the pull" : " after the pull",
        " (released, expired, or a stale handle)", before ? "" : "; the KV pulled is void"));
  }
  const Sha256Digest digest = KvRankDigest(handle, rank_index);
  if (before && std::memcmp(record.digest, digest.data(), digest.size()) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "KV hand-off '", handle.request_id, "': ", RankName(handle, rank_index),
        " published another digest for this lease: the handle's ranks[", rank_index,
        "] is not what that rank holds (an edited or forged handle: its blocks, positions, pool, "
        "ids or transport); nothing was read"));
  }
  return absl::OkStatus();
}

absl::StatusOr<KvPullStats> KvPuller::Pull(const KvHandle& handle, const KvPullDestination& dst,
                                           void* base, uint64_t bytes,
                                           parallel::UcxDeadline deadline,
                                           const std::function<void(const KvPullStats&)>& on_rank) {
  CPFILL_RETURN_IF_ERROR(ValidateKvHandle(handle));
  CPFILL_ASSIGN_OR_RETURN(KvPullPlan plan, PlanKvPull(handle, dst));
  CPFILL_CHECK_ARG(base != nullptr, "KV pull: the destination is null");
  CPFILL_CHECK_ARG(static_cast<uint64_t>(PlanEnd(plan)) <= bytes, "KV pull: the destination has ",
                   bytes, " bytes; the plan writes up to byte ", PlanEnd(plan));
  const auto start = std::chrono::steady_clock::now();
  KvPullStats stats;
  char* const dst_base = static_cast<char*>(base);
  for (size_t i = 0; i < plan.runs.size(); ++i) {
    stats.total_source_ranks += i == 0 ||
                                plan.runs[i].src_tp_rank != plan.runs[i - 1].src_tp_rank ||
                                plan.runs[i].src_cp_rank != plan.runs[i - 1].src_cp_rank;
  }
  // Step 1: every source rank's lease record, before any KV is read: a stale or edited handle
  // leaves the destination untouched, whichever rank it names wrongly.
  for (size_t i = 0; i < plan.runs.size(); ++i) {
    if (i > 0 && plan.runs[i].src_tp_rank == plan.runs[i - 1].src_tp_rank &&
        plan.runs[i].src_cp_rank == plan.runs[i - 1].src_cp_rank) {
      continue;
    }
    const int rank_index =
        plan.runs[i].src_tp_rank * handle.layout.cp_size + plan.runs[i].src_cp_rank;
    CPFILL_ASSIGN_OR_RETURN(Source * source, Connect(handle, rank_index));
    CPFILL_RETURN_IF_ERROR(CheckLease(handle, rank_index, *source, deadline, /*before=*/true));
  }
  // Step 2: each rank's gets, then its nonce again. Runs are grouped by source rank (PlanKvPull's
  // order).
  for (size_t first = 0; first < plan.runs.size();) {
    const int tp = plan.runs[first].src_tp_rank, cp = plan.runs[first].src_cp_rank;
    size_t last = first;
    while (last < plan.runs.size() && plan.runs[last].src_tp_rank == tp &&
           plan.runs[last].src_cp_rank == cp) {
      ++last;
    }
    const int rank_index = tp * handle.layout.cp_size + cp;
    CPFILL_ASSIGN_OR_RETURN(Source * source, Connect(handle, rank_index));
    const uint64_t pool = handle.ranks[rank_index].transport.pool_address;
    std::vector<parallel::UcxGetRun> gets;
    for (size_t i = first; i < last; ++i) {
      const KvCopyRun& run = plan.runs[i];
      for (int64_t piece = 0; piece < run.pieces; ++piece) {
        gets.push_back(
            {.remote_address =
                 pool + static_cast<uint64_t>(run.src_offset_bytes + piece * run.src_stride_bytes),
             .key = source->pool_key,
             .local = dst_base + run.dst_offset_bytes + piece * run.dst_stride_bytes,
             .bytes = static_cast<uint64_t>(run.piece_bytes)});
      }
      stats.bytes += run.bytes();
    }
    const auto get_start = std::chrono::steady_clock::now();
    absl::Status got = source->peer->Get(gets, deadline);
    stats.get_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - get_start).count();
    if (!got.ok()) return DropSource(source, got);
    CPFILL_RETURN_IF_ERROR(CheckLease(handle, rank_index, *source, deadline, /*before=*/false));
    stats.gets += static_cast<int64_t>(gets.size());
    ++stats.source_ranks;
    first = last;
    if (on_rank) {
      stats.seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      on_rank(stats);
    }
  }
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

absl::Status KvPuller::Release(const KvHandle& handle, parallel::UcxDeadline deadline) {
  CPFILL_RETURN_IF_ERROR(ValidateKvHandle(handle));
  CPFILL_ASSIGN_OR_RETURN(Source * source, Connect(handle, 0));
  absl::Status sent =
      source->peer->SendMessage(kKvReleaseMessageId, KvReleasePayload(handle), deadline);
  return sent.ok() ? sent : DropSource(source, sent);
}

absl::Status KvPuller::DropSource(Source* source, absl::Status why) {
  std::erase_if(sources_, [&](const auto& s) { return s.second.get() == source; });
  return why;
}

}  // namespace cpfill::runtime
