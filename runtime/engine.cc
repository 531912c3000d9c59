#include "runtime/engine.h"

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "parallel/mixed_ring.h"
#include "runtime/kv_handoff.h"

namespace cpfill::runtime {
namespace {

using Clock = Engine::Clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Names the KV of a generating request without a session. Clients cannot use it: session names
// with control characters are refused.
std::string InternalSession(int64_t id) { return absl::StrCat("\x01gen-", id); }
// Client session names never have one (Check); the engine's own KV names do.
bool HasControlCharacter(const std::string& name) {
  return std::any_of(name.begin(), name.end(),
                     [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; });
}
// Names the KV of a published request (its lease id is the rest).
std::string LeaseSession(const std::string& lease_id) { return absl::StrCat("\x01", lease_id); }
// Names a prefix cache entry.
std::string PrefixEntryName(int64_t id) { return absl::StrCat("\x01pfx-", id); }
// What the model refuses on every rank alike, changing nothing (the loop goes on).
bool IsRefusal(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) || absl::IsNotFound(s);
}

// Cores this process may run on: its affinity mask, else the machine's.
int UsableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  return static_cast<int>(std::thread::hardware_concurrency());
}

// Sums a step's phase times (and its total) into `into`.
void AddPhases(const PrefillTimings& step, PrefillTimings* into) {
  into->total_s += step.total_s;
  into->embed_s += step.embed_s;
  into->gemm_s += step.gemm_s;
  into->attention_s += step.attention_s;
  into->allreduce_s += step.allreduce_s;
  into->lm_head_s += step.lm_head_s;
  into->other_s += step.other_s;
  into->kv_s += step.kv_s;
  into->host_plan_s += step.host_plan_s;
  into->host_enqueue_s += step.host_enqueue_s;
}

// The broadcast form of a command: little-endian words and length-prefixed strings. Rank 0 is
// trusted, but a reader still checks every length against what is left.
class Writer {
 public:
  void U32(uint32_t x) { Raw(&x, 4); }
  void U64(uint64_t x) { Raw(&x, 8); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Ids(const std::vector<int32_t>& ids) {
    U32(static_cast<uint32_t>(ids.size()));
    Raw(ids.data(), ids.size() * 4);
  }
  void Draw(const std::optional<TokenDraw>& d) {
    U32(d.has_value());
    if (!d.has_value()) return;
    Raw(&d->params.temperature, 8);
    U32(static_cast<uint32_t>(d->params.top_k));
    Raw(&d->params.top_p, 8);
    U64(d->params.seed);
    U64(d->step);
  }
  std::vector<char> bytes;

 private:
  void Raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    bytes.insert(bytes.end(), c, c + n);
  }
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& bytes) : bytes_(bytes) {}
  bool U32(uint32_t* x) { return Raw(x, 4); }
  bool U64(uint64_t* x) { return Raw(x, 8); }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!U32(&n) || n > left()) return false;
    s->assign(bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  bool Draw(std::optional<TokenDraw>* d) {
    uint32_t has = 0, top_k = 0;
    if (!U32(&has) || has > 1) return false;
    if (has == 0) return true;
    TokenDraw& x = d->emplace();
    if (!Raw(&x.params.temperature, 8) || !U32(&top_k) || !Raw(&x.params.top_p, 8)) return false;
    x.params.top_k = static_cast<int>(top_k);
    return U64(&x.params.seed) && U64(&x.step);
  }
  bool Ids(std::vector<int32_t>* ids) {
    uint32_t n = 0;
    if (!U32(&n) || uint64_t{n} * 4 > left()) return false;
    ids->resize(n);
    return Raw(ids->data(), uint64_t{n} * 4);
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  size_t left() const { return bytes_.size() - at_; }
  bool Raw(void* p, size_t n) {
    if (n > left()) return false;
    if (n > 0) std::memcpy(p, bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  const std::vector<char>& bytes_;
  size_t at_ = 0;
};

}  // namespace

// A request or a session end waiting on rank 0, the promise that answers it, and (once it has
// begun) its generation so far.
struct Engine::Pending {
  bool end_session = false;
  EngineRequest request;
  std::string end_name;
  std::promise<absl::StatusOr<EngineResult>> reply;
  std::promise<absl::Status> ended;
  Clock::time_point submitted = Clock::now();
  int64_t cached = 0;       // set when batched: the session's tokens already in the cache
  bool recomputed = false;  // set when batched: the session's history is in this request
  // Generation: the session holding its KV (the request's, or an internal one), the result so
  // far (filled by the first prefill), the positions it may still use, and when it started.
  std::string kv_name;
  EngineResult result;
  int64_t positions_left = 0;
  Clock::time_point first_token_at;
  bool started = false;  // its first prefill ran (a preempted one is queued again)
  // publish_kv: the lease it will hold, picked when first batched.
  std::string lease_id;
  int lease_slot = -1;
  uint64_t lease_nonce = 0;
  bool deferred = false;  // it waited a batch once for a request sharing its prefix (PlanPrefix)
  // Prefix cache, set when batched without KV of its own (PlanPrefix): the tokens its KV holds
  // after the batch, the entry it forks and how many tokens that gives it, and the entry its KV
  // becomes ("" none; keep_by_fork: a fork of its KV, else its KV itself).
  bool looked_up = false;
  std::vector<int32_t> sequence;
  std::string fork_from;
  int64_t reused = 0;
  std::string keep_as;
  bool keep_by_fork = false;
};

// What every rank does next. `items` (rank 0 only) are the pendings it answers, in batch order.
struct Engine::Command {
  enum Kind : uint32_t {
    kHeartbeat = 0,
    kPrefill = 1,
    kEndSessions = 2,
    kDecode = 3,
    kShutdown = 4
  };
  Kind kind = kHeartbeat;
  uint64_t step = 0;                      // kDecode: the decode step (PlanDecode's offset)
  std::vector<std::string> end_sessions;  // sessions to end, evict or drop first
  std::vector<PrefillRequest> batch;
  // kPrefill: KV every rank exports and publishes after the batch, under lease word `slot`.
  struct Publish {
    std::string kv_name, request_id;
    uint32_t slot = 0;
    uint64_t nonce = 0;
  };
  std::vector<Publish> publish;
  // kPrefill: prefix cache forks: `forks` before the batch (a request reuses an entry), `keeps`
  // after it (a prompt's KV kept as an entry); `kept` (rank 0): the keeps that held.
  struct Fork {
    std::string parent, child;
    uint64_t tokens = 0;
  };
  std::vector<Fork> forks, keeps;
  std::set<std::string> kept;
  std::vector<std::unique_ptr<Pending>> items;

  static void EncodeForks(const std::vector<Fork>& forks, Writer& w) {
    w.U32(static_cast<uint32_t>(forks.size()));
    for (const Fork& f : forks) {
      w.Str(f.parent);
      w.Str(f.child);
      w.U64(f.tokens);
    }
  }
  static bool DecodeForks(Reader& r, std::vector<Fork>* forks) {
    uint32_t n = 0;
    bool ok = r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
      Fork& f = forks->emplace_back();
      ok = r.Str(&f.parent) && r.Str(&f.child) && r.U64(&f.tokens);
    }
    return ok;
  }

  std::vector<char> Encode() const {
    Writer w;
    w.U32(kind);
    w.U64(step);
    w.U32(static_cast<uint32_t>(end_sessions.size()));
    for (const std::string& s : end_sessions) w.Str(s);
    w.U32(static_cast<uint32_t>(batch.size()));
    for (const PrefillRequest& r : batch) {
      w.Str(r.session);
      w.Ids(r.tokens);
      w.Draw(r.draw);
    }
    w.U32(static_cast<uint32_t>(publish.size()));
    for (const Publish& p : publish) {
      w.Str(p.kv_name);
      w.Str(p.request_id);
      w.U32(p.slot);
      w.U64(p.nonce);
    }
    EncodeForks(forks, w);
    EncodeForks(keeps, w);
    return std::move(w.bytes);
  }
  static absl::StatusOr<Command> Decode(const std::vector<char>& bytes) {
    Command c;
    Reader r(bytes);
    uint32_t kind = 0, n = 0;
    bool ok = r.U32(&kind) && kind <= kShutdown && r.U64(&c.step) && r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) ok = r.Str(&c.end_sessions.emplace_back());
    ok = ok && r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
      PrefillRequest& req = c.batch.emplace_back();
      ok = r.Str(&req.session) && r.Ids(&req.tokens) && r.Draw(&req.draw);
    }
    ok = ok && r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
      Publish& p = c.publish.emplace_back();
      ok = r.Str(&p.kv_name) && r.Str(&p.request_id) && r.U32(&p.slot) && r.U64(&p.nonce);
    }
    ok = ok && DecodeForks(r, &c.forks) && DecodeForks(r, &c.keeps);
    if (!ok || !r.done()) {
      return absl::InternalError(absl::StrCat("engine: a malformed command of ", bytes.size(),
                                              " bytes from world rank 0"));
    }
    c.kind = static_cast<Kind>(kind);
    return c;
  }
};

std::vector<int32_t> EngineResult::token_ids() const {
  std::vector<int32_t> ids;
  for (const SampledToken& t : tokens) ids.push_back(t.id);
  return ids;
}

double EngineResult::tpot_s() const {
  return tokens.size() > 1 ? decode_s / double(tokens.size() - 1) : 0.0;
}

Engine::Engine(LlamaModel& model, parallel::Communicator& world, EngineOptions options)
    : model_(model),
      world_(world),
      options_(options),
      root_(world.rank() == 0),
      prefix_(model.kv_cache().spec().block_tokens) {
  // Half the cores this rank may run on (mpirun binds a rank to one core unless told
  // --bind-to none), at most 8: the HTTP threads need the rest.
  if (root_) sampler_pool_ = std::make_unique<ThreadPool>(std::clamp(UsableCores() / 2, 1, 8));
}

Engine::~Engine() = default;

absl::Status Engine::Check(const EngineRequest& request) const {
  const ModelConfig& c = model_.config();
  CPFILL_CHECK_ARG(!request.tokens.empty(), "the prompt is empty");
  CPFILL_CHECK_ARG(static_cast<int64_t>(request.tokens.size()) <= options_.max_batch_tokens,
                   "the prompt has ", request.tokens.size(), " tokens, more than a batch takes (",
                   options_.max_batch_tokens, ", --max-batch-tokens)");
  for (size_t i = 0; i < request.tokens.size(); ++i) {
    CPFILL_CHECK_ARG(request.tokens[i] >= 0 && request.tokens[i] < c.vocab_size, "token ", i,
                     " is ", request.tokens[i], ", outside the vocabulary [0, ", c.vocab_size, ")");
  }
  CPFILL_CHECK_ARG(!HasControlCharacter(request.session),
                   "the session name has a control character");
  CPFILL_CHECK_ARG(request.max_tokens >= 1, "max_tokens is ", request.max_tokens,
                   ", must be at least 1");
  const int64_t wanted = static_cast<int64_t>(request.tokens.size()) + request.max_tokens - 1;
  CPFILL_CHECK_ARG(wanted <= c.max_position_embeddings, "the prompt's ", request.tokens.size(),
                   " tokens and max_tokens ", request.max_tokens, " need ", wanted,
                   " positions; the model has ", c.max_position_embeddings);
  for (int32_t id : request.stop_ids) {
    CPFILL_CHECK_ARG(id >= 0 && id < c.vocab_size, "stop token ", id,
                     " is outside the vocabulary [0, ", c.vocab_size, ")");
  }
  if (request.publish_kv) {
    CPFILL_CHECK_ARG(handoff_ != nullptr,
                     "a KV hand-off (do_remote_decode) was asked of a server started without "
                     "--kv-handoff");
    CPFILL_CHECK_ARG(request.max_tokens == 1, "a KV hand-off's request has max_tokens ",
                     request.max_tokens, "; it must be 1 (the decode worker generates the rest)");
    CPFILL_CHECK_ARG(request.session.empty(),
                     "a KV hand-off of a session is not supported (its KV changes with each turn)");
  }
  return ValidateSampling(request.sampling, c.vocab_size);
}

void Engine::AttachKvHandoff(KvHandoff* handoff, std::string engine_id,
                             std::chrono::milliseconds lease) {
  std::lock_guard lock(mu_);
  handoff_ = handoff;
  engine_id_ = std::move(engine_id);
  lease_length_ = lease;
  free_lease_slots_.clear();
  for (int slot = handoff->max_leases() - 1; slot >= 0; --slot) free_lease_slots_.push_back(slot);
}

absl::Status Engine::ReleaseKv(const std::string& request_id, const std::string& nonce) {
  std::lock_guard lock(mu_);
  return ReleaseLocked(request_id, nonce);
}

absl::Status Engine::ReleaseKvMessage(const std::string& payload) {
  const std::vector<std::string> parts = absl::StrSplit(payload, '\n');
  std::lock_guard lock(mu_);
  if (parts.size() != 3 || parts[0] != engine_id_) {
    return absl::NotFoundError("a KV release for another engine (a stale or forged handle)");
  }
  return ReleaseLocked(parts[1], parts[2]);
}

absl::StatusOr<std::map<std::string, Engine::Lease>::iterator> Engine::FindLease(
    const std::string& request_id, const std::string& nonce) {
  auto it = leases_.find(request_id);
  if (it == leases_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no KV lease '", request_id, "' holds (released, expired, or never given)"));
  }
  if (nonce != absl::StrCat("0x", absl::Hex(it->second.nonce))) {
    return absl::NotFoundError(
        absl::StrCat("KV lease '", request_id, "' has another nonce (a stale or forged handle)"));
  }
  return it;
}

absl::Status Engine::ReleaseLocked(const std::string& request_id, const std::string& nonce) {
  CPFILL_RETURN_IF_ERROR(FindLease(request_id, nonce).status());
  EndLease(request_id);
  ++stats_.kv_leases_released;
  work_.notify_one();
  return absl::OkStatus();
}

absl::StatusOr<double> Engine::RenewKv(const std::string& request_id, const std::string& nonce) {
  std::lock_guard lock(mu_);
  CPFILL_ASSIGN_OR_RETURN(auto it, FindLease(request_id, nonce));
  it->second.expires = Clock::now() + lease_length_;
  return std::chrono::duration<double>(lease_length_).count();
}

void Engine::EndLease(const std::string& id) {
  auto it = leases_.find(id);
  drop_next_.push_back(it->second.kv_name);
  free_lease_slots_.push_back(it->second.slot);
  leases_.erase(it);
}

void Engine::ExpireLeases() {
  const Clock::time_point now = Clock::now();
  std::vector<std::string> expired;
  for (const auto& [id, lease] : leases_) {
    if (lease.expires <= now) expired.push_back(id);
  }
  for (const std::string& id : expired) EndLease(id);
  stats_.kv_leases_expired += static_cast<int64_t>(expired.size());
}

// A publish keeps its slot, nonce and name across retries (a requeued batch).
bool Engine::TakeLeaseSlot(Pending& p) {
  if (p.lease_slot >= 0) return true;
  if (free_lease_slots_.empty()) return false;
  p.lease_slot = free_lease_slots_.back();
  free_lease_slots_.pop_back();
  p.lease_nonce = next_nonce_++;
  p.lease_id = absl::StrCat("kv-", next_id_++);
  p.kv_name = LeaseSession(p.lease_id);
  return true;
}

void Engine::ReturnLeaseSlot(Pending& p) {
  if (p.lease_slot >= 0) free_lease_slots_.push_back(p.lease_slot);
  p.lease_slot = -1;
}

absl::StatusOr<Engine::Reply> Engine::Submit(EngineRequest request) {
  std::vector<EngineRequest> one;
  one.push_back(std::move(request));
  CPFILL_ASSIGN_OR_RETURN(std::vector<Reply> replies, SubmitAll(std::move(one)));
  return std::move(replies[0]);
}

absl::StatusOr<std::vector<Engine::Reply>> Engine::SubmitAll(std::vector<EngineRequest> requests) {
  CPFILL_CHECK_ARG(root_, "requests go to world rank 0");
  for (const EngineRequest& request : requests) CPFILL_RETURN_IF_ERROR(Check(request));
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<Reply> replies;
  for (EngineRequest& request : requests) {
    pending.push_back(std::make_unique<Pending>());
    pending.back()->request = std::move(request);
    replies.push_back(pending.back()->reply.get_future());
  }
  std::lock_guard lock(mu_);
  if (shutdown_) return absl::FailedPreconditionError("the engine is shutting down");
  if (static_cast<int64_t>(queue_.size() + pending.size()) > options_.max_queue) {
    return absl::UnavailableError(
        absl::StrCat("the queue is full (", queue_.size(), " requests wait); retry later"));
  }
  for (auto& p : pending) queue_.push_back(std::move(p));
  work_.notify_one();
  return replies;
}

std::future<absl::Status> Engine::EndSession(std::string name) {
  auto p = std::make_unique<Pending>();
  p->end_session = true;
  p->end_name = std::move(name);
  std::future<absl::Status> ended = p->ended.get_future();
  // The engine's own KV (generations without a session, leased hand-offs) is named with a control
  // character, which no client's session has: it is not a client's to end.
  if (HasControlCharacter(p->end_name)) {
    p->ended.set_value(absl::NotFoundError(absl::StrCat("no session '", p->end_name, "'")));
    return ended;
  }
  std::lock_guard lock(mu_);
  if (!root_ || shutdown_) {
    p->ended.set_value(absl::FailedPreconditionError(root_ ? "the engine is shutting down"
                                                           : "sessions are ended on world rank 0"));
    return ended;
  }
  queue_.push_back(std::move(p));
  work_.notify_one();
  return ended;
}

void Engine::Shutdown() {
  std::lock_guard lock(mu_);
  shutdown_ = true;
  work_.notify_one();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s = stats_;
  s.waiting = static_cast<int64_t>(queue_.size());
  s.running = static_cast<int64_t>(running_.size()) + decoding_;
  s.sessions = static_cast<int64_t>(sessions_.size());
  s.kv_leases = static_cast<int64_t>(leases_.size());
  s.prefix_entries = prefix_.entries();
  s.prefix_tokens = prefix_.tokens();
  for (const auto& [id, lease] : leases_) s.kv_leased_tokens += lease.tokens;
  return s;
}

std::vector<std::string> Engine::sessions() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<int64_t, std::string>> by_use;
  for (const auto& [name, s] : sessions_) by_use.push_back({s.last_used, name});
  std::sort(by_use.begin(), by_use.end());
  std::vector<std::string> names;
  for (auto& [used, name] : by_use) names.push_back(std::move(name));
  return names;
}

absl::Status Engine::Run() {
  for (;;) {
    Command command;
    std::vector<char> bytes;
    if (root_) {
      CPFILL_ASSIGN_OR_RETURN(command, NextCommand());
      bytes = command.Encode();
    }
    int64_t size = static_cast<int64_t>(bytes.size());
    absl::Status s = world_.Broadcast(&size, sizeof(size), 0);
    if (s.ok()) {
      bytes.resize(static_cast<size_t>(size));
      s = world_.Broadcast(bytes.data(), bytes.size(), 0);
    }
    if (s.ok() && !root_) {
      absl::StatusOr<Command> decoded = Command::Decode(bytes);
      s = decoded.status();
      if (s.ok()) command = std::move(*decoded);
    }
    if (s.ok() && command.kind == Command::kShutdown) return absl::OkStatus();
    if (s.ok()) s = Execute(command);
    if (!s.ok()) {  // the job cannot go on: every waiting request learns why
      if (root_) Fail(command, s);
      return s;
    }
  }
}

absl::StatusOr<Engine::Command> Engine::NextCommand() {
  std::unique_lock lock(mu_);
  if (running_.empty()) {
    work_.wait_for(lock, options_.heartbeat,
                   [&] { return !queue_.empty() || shutdown_ || !drop_next_.empty(); });
  }
  ExpireLeases();
  // A session end waits for the generation of that session queued before it.
  const bool blocked = !queue_.empty() && queue_.front()->end_session &&
                       std::any_of(running_.begin(), running_.end(), [&](const auto& p) {
                         return p->request.session == queue_.front()->end_name;
                       });
  if (running_.empty()) prefill_waits_ = false;
  const bool prefill =
      !queue_.empty() && !blocked && !prefill_waits_ && (running_.empty() || prefill_next_);
  prefill_next_ = !prefill;
  if (prefill) return FormBatch();
  if (!running_.empty()) return DecodeStep();
  Command c;
  c.kind = shutdown_ ? Command::kShutdown : Command::kHeartbeat;
  if (c.kind == Command::kHeartbeat) {  // ended leases are freed while idle too
    c.end_sessions = std::move(drop_next_);
    drop_next_.clear();
  }
  return c;
}

Engine::Command Engine::FormBatch() {
  Command c;
  if (queue_.front()->end_session) {  // a barrier: ends after everything queued before it
    c.kind = Command::kEndSessions;
    c.end_sessions.push_back(queue_.front()->end_name);
    c.items.push_back(std::move(queue_.front()));
    queue_.pop_front();
    return c;
  }
  c.kind = Command::kPrefill;
  c.end_sessions = std::move(drop_next_);
  drop_next_.clear();
  // Sessions in this batch, generating, or whose turn waits for an earlier one.
  std::set<std::string> taken, waiting;
  for (const auto& r : running_) waiting.insert(r->request.session);
  int64_t tokens = 0, generating = static_cast<int64_t>(running_.size());
  for (auto it = queue_.begin(); it != queue_.end();) {
    Pending& p = **it;
    if (p.end_session) break;
    const std::string& name = p.request.session;
    if (!name.empty() && (taken.count(name) || waiting.count(name))) {
      waiting.insert(name);  // a later turn: after the one in this batch
      ++it;
      continue;
    }
    const bool generates = p.request.max_tokens > 1;
    if (generates && generating >= options_.max_running) break;
    if (p.request.publish_kv && !TakeLeaseSlot(p)) {  // answered now, not batched
      ++stats_.requests_failed;
      p.reply.set_value(absl::UnavailableError(absl::StrCat(
          "all ", handoff_->max_leases(),
          " KV leases are held (--kv-max-leases); retry when decode workers release some")));
      it = queue_.erase(it);
      continue;
    }
    // What the cache lacks: the session's unfed tokens (all of them once evicted), this turn's,
    // and what a preempted generation had made.
    PrefillRequest r{.session = name, .draw = DrawInPlace(p)};
    p.cached = 0;
    p.recomputed = false;
    p.looked_up = false;
    p.reused = 0;
    p.fork_from.clear();
    p.keep_as.clear();
    p.keep_by_fork = false;
    if (auto s = sessions_.find(name); !name.empty() && s != sessions_.end()) {
      const int64_t from = s->second.evicted ? 0 : s->second.fed;
      r.tokens.assign(s->second.history.begin() + from, s->second.history.end());
      p.cached = from;
      p.recomputed = s->second.evicted;
    }
    r.tokens.insert(r.tokens.end(), p.request.tokens.begin(), p.request.tokens.end());
    for (const SampledToken& t : p.result.tokens) r.tokens.push_back(t.id);
    if (generates && p.kv_name.empty()) {
      p.kv_name = name.empty() ? InternalSession(next_id_++) : name;
    }
    if (generates || p.request.publish_kv) r.session = p.kv_name;
    if (p.cached == 0 && options_.prefix_cache && !PlanPrefix(p, r, c)) {
      if (!name.empty()) waiting.insert(name);  // its later turns wait for it
      ++it;
      continue;
    }
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    if (!c.batch.empty() && (solo_ > 0 || tokens + n > options_.max_batch_tokens)) break;
    tokens += n;
    if (generates) ++generating;
    if (p.reused > 0) c.forks.push_back({p.fork_from, r.session, static_cast<uint64_t>(p.reused)});
    if (p.keep_by_fork && !p.keep_as.empty()) {
      c.keeps.push_back({r.session, p.keep_as, static_cast<uint64_t>(p.sequence.size())});
    }
    if (p.request.publish_kv) {
      c.publish.push_back({.kv_name = p.kv_name,
                           .request_id = p.lease_id,
                           .slot = static_cast<uint32_t>(p.lease_slot),
                           .nonce = p.lease_nonce});
    }
    if (!name.empty()) taken.insert(name);
    c.batch.push_back(std::move(r));
    c.items.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  if (solo_ > 0) --solo_;
  return c;
}

bool Engine::PlanPrefix(Pending& p, PrefillRequest& r, const Command& c) {
  p.looked_up = true;
  p.sequence = r.tokens;
  const int64_t size = static_cast<int64_t>(p.sequence.size());
  std::optional<PrefixIndex::Match> match = prefix_.Longest(p.sequence, size - 1, ++prefix_now_);
  const int64_t reused = match ? match->tokens : 0;
  // An earlier request of this batch will hold a block more of this prompt than the cache does.
  // It waits once: if that request's entry is not kept after all (no block for its copy, or
  // evicted at once), waiting again could serialize every request of a shared prompt.
  const int64_t block = prefix_.block_tokens();
  for (const auto& q : c.items) {
    if (!p.deferred && !q->keep_as.empty() &&
        prefix_.SharedBlockTokens(p.sequence, q->sequence) >= reused / block * block + block) {
      p.deferred = true;
      return false;
    }
  }
  p.reused = reused;
  p.fork_from = match ? match->entry : "";
  p.keep_as = prefix_.NewBlocks(p.sequence) > 0 ? PrefixEntryName(next_id_++) : "";
  // A request that names its KV (a session, a generation, a hand-off) forks it into the entry;
  // a prefill without one writes the entry itself, or a scratch copy of its fork.
  const bool named = !r.session.empty();
  p.keep_by_fork = named && !p.keep_as.empty();
  if (!named) {
    p.kv_name = !p.keep_as.empty() ? p.keep_as : reused > 0 ? InternalSession(next_id_++) : "";
    r.session = p.kv_name;
  }
  r.tokens.erase(r.tokens.begin(), r.tokens.begin() + reused);
  return true;
}

void Engine::KeepPrefix(Pending& p, const Command& command) {
  if (p.keep_as.empty()) return;
  if (!p.keep_by_fork) p.kv_name.clear();  // its KV is the entry now, not the request's to drop
  if (!p.keep_by_fork || command.kept.count(p.keep_as)) {
    prefix_.Add(p.keep_as, std::move(p.sequence), ++prefix_now_);
  }
  p.keep_as.clear();
  while (prefix_.entries() > options_.max_prefix_entries) {
    DropEntry(prefix_.LeastRecentlyUsedFirst().front());
  }
}

void Engine::DropEntry(const std::string& entry) {
  prefix_.Remove(entry);
  drop_next_.push_back(entry);
  ++stats_.prefix_evictions;
}

Engine::Command Engine::DecodeStep() {
  Command c;
  c.kind = Command::kDecode;
  c.step = static_cast<uint64_t>(step_++);
  c.end_sessions = std::move(drop_next_);
  drop_next_.clear();
  for (auto& p : running_) {
    c.batch.push_back(
        {.tokens = {p->result.tokens.back().id}, .session = p->kv_name, .draw = DrawInPlace(*p)});
    c.items.push_back(std::move(p));
  }
  decoding_ = static_cast<int64_t>(running_.size());
  running_.clear();
  return c;
}

absl::Status Engine::Execute(Command& command) {
  // A broadcast completes on rank 0 without waiting for anyone (an eager send): the heartbeat
  // ends in a barrier, so rank 0 too learns within the deadline that a rank stopped answering.
  DropSessions(command.end_sessions);
  if (command.kind == Command::kHeartbeat) {  // the other kinds' answers update the usage
    if (root_ && !command.end_sessions.empty()) UpdateKvUsage();
    return world_.Barrier();
  }
  if (command.kind == Command::kEndSessions) {
    if (root_) Answer(command, std::vector<SequenceOutput>{}, {}, 0, nullptr);
    return absl::OkStatus();
  }
  const Clock::time_point start = Clock::now();
  PrefillTimings timings;
  absl::StatusOr<std::vector<SequenceOutput>> out;
  if (command.kind == Command::kDecode) {
    out = model_.Decode(command.batch, static_cast<int64_t>(command.step), &timings);
  } else if (absl::Status forked = ForkPrefixes(command); !forked.ok()) {
    out = forked;
  } else {
    out = model_.Prefill(command.batch, &timings, nullptr);
    if (!out.ok()) {  // the batch's forks go with it
      for (const Command::Fork& f : command.forks) (void)model_.EndSession(f.child);
    }
  }
  // The model refuses a batch on every rank alike, changing nothing: answered on rank 0, the
  // loop goes on. Anything else is a fault of the job.
  if (!out.ok() && !IsRefusal(out.status())) return out.status();
  std::map<std::string, absl::StatusOr<KvHandle>> handles;
  if (out.ok()) CPFILL_RETURN_IF_ERROR(KeepPrefixes(command));
  if (out.ok()) CPFILL_RETURN_IF_ERROR(PublishKv(command, &handles));
  if (!root_) return absl::OkStatus();
  if (command.kind == Command::kDecode) {
    AnswerDecode(command, std::move(out), timings);
  } else {
    Answer(command, std::move(out), timings, Since(start), &handles);
  }
  return absl::OkStatus();
}

// ForkSession agrees on every rank before it changes anything, so a refusal is every rank's.
absl::Status Engine::ForkPrefixes(Command& command) {
  for (size_t i = 0; i < command.forks.size(); ++i) {
    const Command::Fork& f = command.forks[i];
    absl::Status s = model_.ForkSession(f.parent, f.child, static_cast<int64_t>(f.tokens));
    if (!s.ok()) {
      for (size_t j = 0; j < i; ++j) (void)model_.EndSession(command.forks[j].child);
      return s;
    }
  }
  return absl::OkStatus();
}

// A keep the cache has no block for is skipped alike on every rank: the prompt is not cached.
absl::Status Engine::KeepPrefixes(Command& command) {
  for (const Command::Fork& k : command.keeps) {
    absl::Status s = model_.ForkSession(k.parent, k.child, static_cast<int64_t>(k.tokens));
    if (!s.ok() && !IsRefusal(s)) return s;
    if (s.ok() && root_) command.kept.insert(k.child);
  }
  return absl::OkStatus();
}

void Engine::UpdateKvUsage() {
  std::lock_guard lock(mu_);
  UpdateKvUsageLocked();
}

// On the loop thread, the only one that changes the caches: no race with the engine's steps.
void Engine::UpdateKvUsageLocked() {
  const KvUsage usage = model_.kv_usage();
  stats_.kv_usage_ratio = usage.usage_ratio();
  stats_.kv_blocks_shared = usage.blocks_shared;
  if (handoff_ != nullptr) stats_.kv_staging_usage_ratio = handoff_->staging_usage_ratio();
}

// Ending or evicting a session every rank holds: NotFound only means it was gone already. A
// published KV's lease word is cleared first, so no puller takes the freed blocks for its own.
void Engine::DropSessions(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (auto it = lease_slot_of_.find(name); it != lease_slot_of_.end()) {
      handoff_->Revoke(it->second);
      handoff_->Forget(name);
      lease_slot_of_.erase(it);
    }
    (void)model_.EndSession(name);
  }
}

// Every rank alike (ExportSessionKv agrees on its verdict). A request whose export fails gets that
// error (Answer); a failure of the job's communication ends the job.
absl::Status Engine::PublishKv(const Command& command,
                               std::map<std::string, absl::StatusOr<KvHandle>>* handles) {
  for (const Command::Publish& p : command.publish) {
    absl::StatusOr<KvHandle> handle =
        handoff_->Export(model_, p.kv_name, {engine_id_, p.request_id});
    if (!handle.ok() && !IsRefusal(handle.status()) && !absl::IsInternal(handle.status())) {
      return handle.status();
    }
    if (handle.ok()) {
      handoff_->Publish(static_cast<int>(p.slot), p.nonce);
      lease_slot_of_[p.kv_name] = static_cast<int>(p.slot);
      if (root_) handoff_->FillTransport(&*handle, static_cast<int>(p.slot), p.nonce);
    }
    handles->emplace(p.kv_name, std::move(handle));
  }
  return absl::OkStatus();
}

std::vector<std::string> Engine::IdleSessionsLruFirst(const Command& command) const {
  std::set<std::string> busy;
  for (const PrefillRequest& r : command.batch) busy.insert(r.session);
  for (const auto& p : running_) busy.insert(p->kv_name);
  std::vector<std::pair<int64_t, std::string>> idle;
  for (const auto& [name, s] : sessions_) {
    if (!s.evicted && !busy.count(name)) idle.push_back({s.last_used, name});
  }
  std::sort(idle.begin(), idle.end());
  std::vector<std::string> names;
  for (auto& [used, name] : idle) names.push_back(std::move(name));
  return names;
}

int64_t Engine::BlocksOnlyIn(const std::string& name) const {
  const std::optional<KvCache::SeqId> seq = model_.SessionSequence(name);
  if (!seq) return 0;
  const KvCache& kv = model_.kv_cache();
  int64_t n = 0;
  for (const int32_t block : kv.BlockTable(*seq)) n += kv.refcount(block) == 1 ? 1 : 0;
  return n;
}

// An entry whose blocks all have other holders (running sequences, other entries) would free
// nothing: the least recently used entry that frees some goes (judged on rank 0's blocks; the
// ranks hold balanced shares of every sequence).
bool Engine::EvictOne(const Command& command) {
  for (const std::string& entry : prefix_.LeastRecentlyUsedFirst()) {
    if (BlocksOnlyIn(entry) == 0) continue;
    DropEntry(entry);
    return true;
  }
  std::vector<std::string> idle = IdleSessionsLruFirst(command);
  if (idle.empty()) return false;
  drop_next_.push_back(idle.front());
  sessions_[idle.front()].evicted = true;
  ++stats_.evictions;
  return true;
}

// A batch that failed changing nothing goes back to the front of the queue, after making room:
// the KV cache is full, so the least recently used prefix entry or idle session is evicted
// (EvictOne); with none left, for another shortfall (activations: evicting frees none of that
// memory), or for a request the model refuses, the next batches run one request at a time, and a
// request alone gets its own error.
void Engine::Requeue(Command& command, const absl::Status& why) {
  const bool evicted = IsKvCacheFull(why) && EvictOne(command);
  // Generations hold the rest: the batch waits for one of them to end.
  const bool wait = IsKvCacheFull(why) && !evicted && !running_.empty();
  if (!wait && !evicted && command.items.size() == 1) {
    ++stats_.requests_failed;
    ReturnLeaseSlot(*command.items.front());
    command.items.front()->reply.set_value(why);
    return;
  }
  if (wait) {
    prefill_waits_ = true;
  } else if (!evicted) {
    solo_ = static_cast<int>(command.items.size());
  }
  for (auto it = command.items.rbegin(); it != command.items.rend(); ++it) {
    queue_.push_front(std::move(*it));
  }
}

void Engine::Answer(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
                    const PrefillTimings& timings, double seconds,
                    std::map<std::string, absl::StatusOr<KvHandle>>* published) {
  std::lock_guard lock(mu_);
  UpdateKvUsageLocked();
  if (command.kind == Command::kEndSessions) {
    Pending& p = *command.items.front();
    const bool held = sessions_.erase(p.end_name) > 0;
    p.ended.set_value(held ? absl::OkStatus()
                           : absl::NotFoundError(absl::StrCat("no session '", p.end_name, "'")));
    return;
  }
  if (!outputs.ok()) return Requeue(command, outputs.status());
  ++stats_.batches;
  stats_.prefix_batched_key_rows += timings.prefix_batch.key_rows_saved;
  if (options_.on_batch) {
    options_.on_batch(static_cast<int>(command.items.size()), timings.new_tokens,
                      timings.cached_tokens, parallel::AlgorithmsName(timings.algorithms), seconds);
  }
  const std::vector<SampledToken> sampled = SampleAll(command, *outputs);
  for (size_t i = 0; i < command.items.size(); ++i) {
    std::unique_ptr<Pending> p = std::move(command.items[i]);
    SequenceOutput& out = (*outputs)[i];
    EngineResult& r = p->result;
    const bool first = !p->started;
    if (first) {  // a preempted generation keeps its first prefill's figures
      p->started = true;
      r.prompt_tokens = static_cast<int64_t>(p->request.tokens.size());
      r.cached_tokens = p->cached + p->reused;
      r.recomputed = p->recomputed;
      r.queue_s = std::max(0.0, Since(p->submitted) - seconds);
      r.prefill_s = seconds;
      r.batch_requests = static_cast<int>(command.items.size());
      r.algorithm = timings.algorithms[i];
      r.selector = timings.selections[i].reason;
      r.timings = timings;
      p->first_token_at = Clock::now();
      stats_.prompt_tokens += r.prompt_tokens;
      stats_.cached_tokens += r.cached_tokens;
      stats_.prefix_queries += p->looked_up ? 1 : 0;
      stats_.prefix_hits += p->reused > 0 ? 1 : 0;
      stats_.prefix_hit_tokens += p->reused;
    }
    KeepPrefix(*p, command);
    if (p->request.publish_kv) {
      absl::StatusOr<KvHandle>& handle = published->at(p->kv_name);
      if (!handle.ok()) {
        drop_next_.push_back(p->kv_name);
        ReturnLeaseSlot(*p);
        ++stats_.requests_failed;
        p->reply.set_value(handle.status());
        continue;
      }
      r.kv_handle = std::move(*handle);
      r.kv_lease_s = std::chrono::duration<double>(lease_length_).count();
    }
    p->positions_left = model_.config().max_position_embeddings - p->cached - p->reused -
                        static_cast<int64_t>(command.batch[i].tokens.size());
    const bool done = NextToken(*p, sampled[i]);
    if (first) {
      r.first_token = r.tokens.front().id;
      r.logits = std::move(out.logits);
    }
    if (done) {
      Finish(std::move(p));
    } else {
      running_.push_back(std::move(p));
    }
  }
}

void Engine::AnswerDecode(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
                          const PrefillTimings& timings) {
  std::lock_guard lock(mu_);
  UpdateKvUsageLocked();
  decoding_ = 0;
  if (!outputs.ok()) {
    for (auto& p : command.items) running_.push_back(std::move(p));
    return MakeRoomToDecode(command, outputs.status());
  }
  ++stats_.decode_steps;
  const std::vector<SampledToken> sampled = SampleAll(command, *outputs);
  stats_.prefix_batched_key_rows += timings.prefix_batch.key_rows_saved;
  for (size_t i = 0; i < command.items.size(); ++i) {
    std::unique_ptr<Pending> p = std::move(command.items[i]);
    --p->positions_left;  // the token this step fed
    AddPhases(timings, &p->result.decode_timings);
    if (NextToken(*p, sampled[i])) {
      Finish(std::move(p));
    } else {
      running_.push_back(std::move(p));
    }
  }
}

// A decode step that changed nothing: the KV cache is full. An idle session is evicted; with
// none, the newest generation is preempted (its KV dropped, queued again to prefill what it has);
// the only one left ends at the capacity ("length"). Another error ends the step's sequences.
void Engine::MakeRoomToDecode(const Command& command, const absl::Status& why) {
  if (!IsKvCacheFull(why)) {
    // Their KV holds a turn that did not finish: every rank drops it, and a session's next turn
    // prefills its history again (not onto the unfinished turn's rows, nor forks onto them).
    for (auto& p : running_) {
      drop_next_.push_back(p->kv_name);
      if (auto s = sessions_.find(p->request.session); s != sessions_.end()) {
        s->second.evicted = true;
      }
      ++stats_.requests_failed;
      p->reply.set_value(why);
    }
    running_.clear();
    return;
  }
  if (EvictOne(command)) return;
  if (running_.size() == 1) {
    running_.front()->result.finish_reason = "length";
    Finish(std::move(running_.front()));
    running_.clear();
    return;
  }
  std::unique_ptr<Pending> p = std::move(running_.back());
  running_.pop_back();
  drop_next_.push_back(p->kv_name);
  if (!p->request.session.empty()) sessions_[p->request.session].evicted = true;
  ++p->result.preemptions;
  ++stats_.preemptions;
  queue_.push_front(std::move(p));
}

std::optional<TokenDraw> Engine::DrawInPlace(const Pending& p) const {
  const EngineRequest& q = p.request;
  if (q.sampling.logprobs > 0 || (q.return_logits && !p.started)) return std::nullopt;
  return TokenDraw{.params = q.sampling, .step = p.result.tokens.size()};
}

std::vector<SampledToken> Engine::SampleAll(const Command& command,
                                            const std::vector<SequenceOutput>& outputs) {
  std::vector<SampledToken> sampled(command.items.size());
  sampler_pool_->ParallelFor(static_cast<int64_t>(sampled.size()), [&](int64_t i) {
    const Pending& p = *command.items[i];
    if (command.batch[i].draw.has_value()) {  // drawn where the logits were
      sampled[i].id = outputs[i].first_token;
      return;
    }
    // The draw of token k is a function of (seed, k) alone: the same on any thread.
    sampled[i] = SampleToken(outputs[i].logits, p.request.sampling, p.result.tokens.size());
  });
  return sampled;
}

bool Engine::NextToken(Pending& p, const SampledToken& token) {
  EngineResult& r = p.result;
  const EngineRequest& q = p.request;
  const int index = static_cast<int>(r.tokens.size());
  r.tokens.push_back(token);
  ++stats_.generation_tokens;
  const int32_t id = r.tokens.back().id;
  const auto in = [id](const std::vector<int32_t>& ids) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  if (in(q.stop_ids) || (!q.ignore_eos && in(options_.eos_ids)) ||
      (q.stop_when && q.stop_when(r.tokens))) {
    r.finish_reason = "stop";
  } else if (static_cast<int>(r.tokens.size()) >= q.max_tokens || p.positions_left <= 0) {
    r.finish_reason = "length";
  } else if (q.cancelled && q.cancelled->load()) {
    r.finish_reason = "abort";
  }
  if (q.on_token) q.on_token({index, r.tokens.back(), r.finish_reason});
  return !r.finish_reason.empty();
}

// Answers a finished request; its session now holds this turn (and what it generated when it
// generated more than the first token), a request without one gives its KV back.
void Engine::Finish(std::unique_ptr<Pending> p) {
  EngineResult& r = p->result;
  r.decode_s = Since(p->first_token_at);
  const EngineRequest& q = p->request;
  if (!q.session.empty()) {
    SessionState& s = sessions_[q.session];
    s.history.insert(s.history.end(), q.tokens.begin(), q.tokens.end());
    const bool generated = q.max_tokens > 1;
    if (generated) {
      for (const SampledToken& t : r.tokens) s.history.push_back(t.id);
    }
    s.fed = static_cast<int64_t>(s.history.size()) - (generated ? 1 : 0);
    s.evicted = false;
    s.last_used = stats_.batches;
  } else if (q.publish_kv) {  // held for the decode worker
    leases_[p->lease_id] = {.kv_name = p->kv_name,
                            .slot = p->lease_slot,
                            .nonce = p->lease_nonce,
                            .expires = Clock::now() + lease_length_,
                            .tokens = static_cast<int64_t>(q.tokens.size())};
  } else if (!p->kv_name.empty()) {
    drop_next_.push_back(p->kv_name);
  }
  ++stats_.requests_ok;
  prefill_waits_ = false;  // its KV is free now
  p->reply.set_value(std::move(r));
}

void Engine::Fail(Command& command, const absl::Status& status) {
  std::lock_guard lock(mu_);
  shutdown_ = true;
  auto fail = [&](Pending& p) {
    if (p.end_session) {
      p.ended.set_value(status);
    } else {
      ++stats_.requests_failed;
      p.reply.set_value(status);
    }
  };
  for (auto& p : command.items) fail(*p);
  for (auto& p : queue_) fail(*p);
  for (auto& p : running_) fail(*p);
  queue_.clear();
  running_.clear();
}

}  // namespace cpfill::runtime
