#include "runtime/handoff/kv_handoff.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "runtime/handoff/kv_export.h"

namespace cpfill::runtime {
namespace {

// One rank's reach as it travels to world rank 0 at start (trusted: the ranks of one job).
std::string TransportText(const KvHandoffPlace& place, const KvRankTransport& t) {
  return nlohmann::json{{"tp", place.tp_rank},
                        {"cp", place.cp_rank},
                        {"worker", absl::Base64Escape(t.worker_address)},
                        {"rkey", absl::Base64Escape(t.rkey)},
                        {"pool", t.pool_address},
                        {"lease_rkey", absl::Base64Escape(t.lease_rkey)},
                        {"lease", t.lease_address}}
      .dump();
}

absl::Status ReadTransport(const std::string& text, int cp_size, int world_rank,
                           std::vector<KvRankTransport>* into) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const auto bad = [&] {
    return absl::InternalError(
        absl::StrCat("KV hand-off: world rank ", world_rank, " sent a malformed transport"));
  };
  if (!j.is_object()) return bad();
  try {
    const size_t index = j.at("tp").get<size_t>() * cp_size + j.at("cp").get<size_t>();
    if (index >= into->size()) return bad();
    KvRankTransport& t = (*into)[index];
    if (!absl::Base64Unescape(j.at("worker").get<std::string>(), &t.worker_address) ||
        !absl::Base64Unescape(j.at("rkey").get<std::string>(), &t.rkey) ||
        !absl::Base64Unescape(j.at("lease_rkey").get<std::string>(), &t.lease_rkey)) {
      return bad();
    }
    t.pool_address = j.at("pool").get<uint64_t>();
    t.lease_address = j.at("lease").get<uint64_t>();
  } catch (const nlohmann::json::exception&) {
    return bad();
  }
  return absl::OkStatus();
}

}  // namespace

KvHandoff::KvHandoff(KvHandoffOptions options, int world_rank)
    : options_(std::move(options)), world_rank_(world_rank) {}

absl::StatusOr<std::unique_ptr<KvHandoff>> KvHandoff::Create(const KvCache& kv,
                                                             parallel::Communicator& world,
                                                             const KvHandoffPlace& place,
                                                             KvHandoffOptions options) {
  CPFILL_CHECK_ARG(options.max_leases >= 1 && options.max_leases <= (1 << 20),
                   "--kv-max-leases is ", options.max_leases, ", must be in [1, 2^20]");
  std::unique_ptr<KvHandoff> h(new KvHandoff(std::move(options), world.rank()));
  h->world_ = &world;
  h->place_ = place;
  const absl::Status registered = h->Register(kv, place);
  // Every rank learns whether all could: the first failing rank's reason is everyone's.
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::string> reasons,
                          parallel::AllGatherText(world, std::string(registered.message())));
  for (size_t r = 0; r < reasons.size(); ++r) {
    if (!reasons[r].empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--kv-handoff: world rank ", r, ": ", reasons[r]));
    }
  }
  CPFILL_RETURN_IF_ERROR(h->GatherTransports(world, place));
  h->progress_ = std::thread([p = h.get()] { p->ProgressLoop(); });
  return h;
}

absl::Status KvHandoff::Register(const KvCache& kv, const KvHandoffPlace& place) {
  CPFILL_ASSIGN_OR_RETURN(
      ucx_, parallel::UcxTransport::Create(
                {.name = absl::StrCat("prefill tp ", place.tp_rank, " cp ", place.cp_rank),
                 .ucx_config = options_.ucx_config}));
  // UCX reads the KV cache itself, or (a GPU cache that this UCX cannot read) a host staging pool.
  const bool stage = options_.force_staging || (kv.on_device() && !ucx_->supports_cuda_memory());
  if (stage) {
    const int64_t tokens =
        options_.staging_tokens > 0 ? options_.staging_tokens : kv.spec().capacity_tokens;
    CPFILL_ASSIGN_OR_RETURN(staging_, KvStaging::Create(kv.spec(), tokens, kv.on_device()));
  }
  const KvCache& exposed = stage ? staging_->cache() : kv;
  const parallel::UcxMemoryKind kind =
      exposed.on_device() ? parallel::UcxMemoryKind::kCuda : parallel::UcxMemoryKind::kHost;
  const KvPoolLayout pool = KvPoolLayout::OfKvCache(exposed.spec(), exposed.num_blocks());
  CPFILL_ASSIGN_OR_RETURN(
      pool_region_,
      ucx_->RegisterMemory(exposed.BlockAddress(0, 0, 0), static_cast<uint64_t>(pool.bytes), kind));
  lease_slots_ = std::make_unique<LeaseSlot[]>(options_.max_leases);
  CPFILL_ASSIGN_OR_RETURN(
      lease_region_,
      ucx_->RegisterMemory(lease_slots_.get(), sizeof(LeaseSlot) * options_.max_leases,
                           parallel::UcxMemoryKind::kHost));
  description_ = absl::StrCat(
      "UCX ", parallel::UcxTransport::LibraryVersion(), ", ",
      !stage ? absl::StrCat(kind == parallel::UcxMemoryKind::kCuda ? "CUDA" : "host",
                            " memory read in place")
             : absl::StrCat("staged through ", kv.on_device() ? "pinned " : "", "host memory (",
                            exposed.spec().capacity_tokens, " tokens per rank",
                            kv.on_device() ? "; this UCX has no CUDA transport" : "", ")"),
      ", ", options_.max_leases, " lease records");
  return absl::OkStatus();
}

absl::Status KvHandoff::GatherTransports(parallel::Communicator& world,
                                         const KvHandoffPlace& place) {
  const KvRankTransport mine{.worker_address = ucx_->worker_address(),
                             .rkey = pool_region_->packed_key(),
                             .pool_address = reinterpret_cast<uint64_t>(pool_region_->address()),
                             .lease_rkey = lease_region_->packed_key(),
                             .lease_address = reinterpret_cast<uint64_t>(lease_slots_.get())};
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::string> texts,
                          parallel::AllGatherText(world, TransportText(place, mine)));
  // World rank 0 keeps them; every rank learns whether it could read them.
  absl::Status read = absl::OkStatus();
  if (world_rank_ == 0) {
    transports_.resize(static_cast<size_t>(place.tp_size) * place.cp_size);
    for (size_t r = 0; r < texts.size() && read.ok(); ++r) {
      read = ReadTransport(texts[r], place.cp_size, static_cast<int>(r), &transports_);
    }
  }
  CPFILL_ASSIGN_OR_RETURN(bool all, parallel::AllRanksOk(world, read.ok()));
  if (!read.ok()) return read;
  if (!all) return absl::InternalError("KV hand-off: world rank 0 could not read the transports");
  return absl::OkStatus();
}

KvHandoff::~KvHandoff() {
  stop_ = true;
  if (progress_.joinable()) progress_.join();
  lease_region_.reset();
  pool_region_.reset();
  ucx_.reset();
  staging_.reset();  // after its registration is gone
}

absl::StatusOr<KvHandle> KvHandoff::Export(LlamaModel& model, const std::string& session,
                                           const KvHandleIds& ids) {
  if (!staging_) return ExportSessionKv(model, session, ids);
  const std::optional<LlamaModel::SessionKvRows> rows = model.SessionRows(session);
  const KvCache& kv = model.kv_cache();
  // Every rank stages, or none: the fullest rank's shortfall decides.
  int64_t short_blocks = rows ? staging_->BlocksShort(kv.length(rows->seq)) : 0;
  CPFILL_RETURN_IF_ERROR(
      world_->AllReduce(&short_blocks, 1, parallel::DataType::kInt64, parallel::ReduceOp::kMax));
  if (short_blocks > 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the KV hand-off's host staging pool is full (", short_blocks,
        " blocks short on some rank; --kv-staging-tokens, or wait for leases to end)"));
  }
  // A copy that fails leaves this rank's part out: the gather then fails on every rank alike
  // (no rank leaves the collective early), and this rank reports its own cause.
  std::optional<KvRankPart> mine;
  absl::Status copied = absl::OkStatus();
  if (rows) {
    absl::StatusOr<KvCache::SeqId> staged = staging_->Stage(kv, rows->seq);
    copied = staged.status();
    if (staged.ok()) {
      staged_[session] = *staged;
      mine = DescribeRankKv(staging_->cache(), *staged, rows->runs_in_row_order, place_.tp_rank,
                            place_.cp_rank, rows->tokens);
    }
  }
  absl::StatusOr<KvHandle> handle = GatherKvHandle(
      *world_, mine, KvGeometry(staging_->cache().spec(), place_.tp_size, place_.cp_size), ids,
      session);
  if (!copied.ok()) handle = copied;
  if (!handle.ok()) Forget(session);
  (void)model.EndSession(session);  // the lease holds the staged copy only
  return handle;
}

void KvHandoff::Forget(const std::string& session) {
  auto it = staged_.find(session);
  if (it == staged_.end()) return;
  staging_->Release(it->second);
  staged_.erase(it);
}

// The digest first, then the nonce: a record whose nonce holds has its digest. The handle is only
// answered after every rank has published, so no puller reads a record half written.
void KvHandoff::Publish(int slot, const KvNonce& nonce, const KvHandle& handle) {
  KvHandle published = handle;
  published.lease_nonce = nonce;
  const Sha256Digest digest =
      KvRankDigest(published, place_.tp_rank * place_.cp_size + place_.cp_rank);
  LeaseSlot& s = lease_slots_[slot];
  std::memcpy(s.digest, digest.data(), digest.size());
  s.nonce_hi.store(nonce.hi, std::memory_order_seq_cst);
  s.nonce_lo.store(nonce.lo, std::memory_order_seq_cst);
}

// seq_cst: the nonce is clear before any later store of the caller (the blocks' reuse) is seen.
// A puller that reads half of it sees no nonce of any lease (nonces are random, never reused).
void KvHandoff::Revoke(int slot) {
  lease_slots_[slot].nonce_lo.store(0, std::memory_order_seq_cst);
  lease_slots_[slot].nonce_hi.store(0, std::memory_order_seq_cst);
}

void KvHandoff::FillTransport(KvHandle* handle, int slot, const KvNonce& nonce) const {
  handle->lease_nonce = nonce;
  for (size_t i = 0; i < handle->ranks.size() && i < transports_.size(); ++i) {
    KvRankTransport t = transports_[i];
    t.lease_address += sizeof(LeaseSlot) * static_cast<uint64_t>(slot);
    handle->ranks[i].transport = std::move(t);
  }
}

// Progresses the worker, hands messages on, and sleeps a little longer each time nothing moved
// (up to a millisecond): a pull wakes it within that, then keeps it busy.
void KvHandoff::ProgressLoop() {
  using namespace std::chrono_literals;
  auto idle_sleep = 0us;
  while (!stop_.load()) {
    bool moved = ucx_->Progress();
    for (parallel::UcxMessage& m : ucx_->PollMessages()) {
      moved = true;
      if (m.id == kKvReleaseMessageId && world_rank_ == 0) {
        if (options_.on_release) options_.on_release(m.payload);
      } else if (options_.on_note) {
        options_.on_note(absl::StrCat("a message of id ", m.id, " (", m.payload.size(),
                                      " bytes) that this rank does not take; ignored"));
      }
    }
    if (moved) {
      idle_sleep = 0us;
      continue;
    }
    idle_sleep = std::min<std::chrono::microseconds>(1000us, idle_sleep * 2 + 10us);
    std::this_thread::sleep_for(idle_sleep);
  }
}

}  // namespace cpfill::runtime
