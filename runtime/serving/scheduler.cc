#include "runtime/serving/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/secure.h"
#include "base/status.h"
#include "runtime/kv/kv_cache.h"

namespace cpfill::runtime {
namespace {

double Seconds(EngineClock::duration d) { return std::chrono::duration<double>(d).count(); }

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

}  // namespace

Scheduler::Scheduler(SchedulerOptions options, const KvOccupancy& kv)
    : options_(std::move(options)), kv_(kv), prefix_(options_.block_tokens) {}

absl::Status Scheduler::Check(const EngineRequest& request) const {
  CPFILL_CHECK_ARG(!request.tokens.empty(), "the prompt is empty");
  CPFILL_CHECK_ARG(static_cast<int64_t>(request.tokens.size()) <= options_.max_batch_tokens,
                   "the prompt has ", request.tokens.size(), " tokens, more than a batch takes (",
                   options_.max_batch_tokens, ", --max-batch-tokens)");
  const int64_t vocab = options_.vocab_size;
  for (size_t i = 0; i < request.tokens.size(); ++i) {
    CPFILL_CHECK_ARG(request.tokens[i] >= 0 && request.tokens[i] < vocab, "token ", i, " is ",
                     request.tokens[i], ", outside the vocabulary [0, ", vocab, ")");
  }
  CPFILL_CHECK_ARG(!HasControlCharacter(request.session),
                   "the session name has a control character");
  // A session's cached turns left no logits for this turn's first token.
  CPFILL_CHECK_ARG(request.prompt_logprobs < 0 || request.session.empty(),
                   "prompt logprobs take no session");
  CPFILL_CHECK_ARG(request.prompt_logprobs <= 20 && request.min_tokens >= 0 &&
                       request.min_tokens <= request.max_tokens,
                   "prompt_logprobs ", request.prompt_logprobs, " (at most 20) or min_tokens ",
                   request.min_tokens, " (0 to max_tokens ", request.max_tokens, ") is out of range");
  CPFILL_CHECK_ARG(request.max_tokens >= 1, "max_tokens is ", request.max_tokens,
                   ", must be at least 1");
  const int64_t wanted = static_cast<int64_t>(request.tokens.size()) + request.max_tokens - 1;
  CPFILL_CHECK_ARG(wanted <= options_.max_positions, "the prompt's ", request.tokens.size(),
                   " tokens and max_tokens ", request.max_tokens, " need ", wanted,
                   " positions; the model has ", options_.max_positions);
  for (int32_t id : request.stop_ids) {
    CPFILL_CHECK_ARG(id >= 0 && id < vocab, "stop token ", id, " is outside the vocabulary [0, ",
                     vocab, ")");
  }
  if (request.publish_kv) {
    CPFILL_CHECK_ARG(leases_enabled_,
                     "a KV hand-off (do_remote_decode) was asked of a server started without "
                     "--kv-handoff");
    CPFILL_CHECK_ARG(request.max_tokens == 1, "a KV hand-off's request has max_tokens ",
                     request.max_tokens, "; it must be 1 (the decode worker generates the rest)");
    CPFILL_CHECK_ARG(request.session.empty(),
                     "a KV hand-off of a session is not supported (its KV changes with each turn)");
  }
  return ValidateSampling(request.sampling, static_cast<int>(vocab));
}

absl::StatusOr<std::vector<Scheduler::Reply>> Scheduler::Submit(std::vector<EngineRequest> requests,
                                                                Clock::time_point now) {
  if (shutdown_) return absl::FailedPreconditionError("the engine is shutting down");
  if (static_cast<int64_t>(queue_.size() + requests.size()) > options_.max_queue) {
    return absl::UnavailableError(
        absl::StrCat("the queue is full (", queue_.size(), " requests wait); retry later"));
  }
  std::vector<Reply> replies;
  for (EngineRequest& request : requests) {
    auto p = std::make_unique<PendingRequest>();
    p->request = std::move(request);
    p->submitted = now;
    replies.push_back(p->reply.get_future());
    queue_.push_back(std::move(p));
  }
  return replies;
}

std::future<absl::Status> Scheduler::EndSession(std::string name) {
  auto p = std::make_unique<PendingRequest>();
  p->end_session = true;
  p->end_name = std::move(name);
  std::future<absl::Status> ended = p->ended.get_future();
  // The engine's own KV (generations without a session, leased hand-offs) is named with a control
  // character, which no client's session has: it is not a client's to end.
  if (HasControlCharacter(p->end_name)) {
    p->ended.set_value(absl::NotFoundError(absl::StrCat("no session '", p->end_name, "'")));
  } else if (shutdown_) {
    p->ended.set_value(absl::FailedPreconditionError("the engine is shutting down"));
  } else {
    queue_.push_back(std::move(p));
  }
  return ended;
}

void Scheduler::EnableLeases(int max_leases, std::chrono::milliseconds length) {
  leases_enabled_ = true;
  leases_.Reset(max_leases, length);
}

absl::Status Scheduler::ReleaseKv(const std::string& request_id, const std::string& nonce) {
  CPFILL_ASSIGN_OR_RETURN(std::string kv_name, leases_.Release(request_id, nonce));
  drop_next_.push_back(std::move(kv_name));
  ++stats_.kv_leases_released;
  return absl::OkStatus();
}

absl::StatusOr<double> Scheduler::RenewKv(const std::string& request_id, const std::string& nonce,
                                          Clock::time_point now) {
  return leases_.Renew(request_id, nonce, now);
}

bool Scheduler::HasWork() const {
  return !queue_.empty() || shutdown_ || !drop_next_.empty() || !running_.empty();
}

StepPlan Scheduler::Plan(Clock::time_point now) {
  std::vector<std::string> expired = leases_.Expire(now);
  stats_.kv_leases_expired += static_cast<int64_t>(expired.size());
  drop_next_.insert(drop_next_.end(), expired.begin(), expired.end());
  // A session end waits for the generation of that session queued before it.
  const bool blocked = !queue_.empty() && queue_.front()->end_session &&
                       std::any_of(running_.begin(), running_.end(), [&](const auto& p) {
                         return p->request.session == queue_.front()->end_name;
                       });
  if (running_.empty()) prefill_waits_ = false;
  const bool prefill =
      !queue_.empty() && !blocked && !prefill_waits_ && (running_.empty() || prefill_next_);
  prefill_next_ = !prefill;
  if (prefill) return queue_.front()->end_session ? EndSessionStep() : FormBatch();
  if (!running_.empty()) return DecodeStep();
  StepPlan c;
  c.kind = shutdown_ ? StepPlan::kShutdown : StepPlan::kHeartbeat;
  if (c.kind == StepPlan::kHeartbeat) {  // ended leases are freed while idle too
    c.end_sessions = std::move(drop_next_);
    drop_next_.clear();
  }
  return c;
}

// A barrier: ends after everything queued before it.
StepPlan Scheduler::EndSessionStep() {
  StepPlan c;
  c.kind = StepPlan::kEndSessions;
  c.end_sessions.push_back(queue_.front()->end_name);
  c.items.push_back(std::move(queue_.front()));
  queue_.pop_front();
  return c;
}

StepPlan Scheduler::FormBatch() {
  StepPlan c;
  c.kind = StepPlan::kPrefill;
  c.end_sessions = std::move(drop_next_);
  drop_next_.clear();
  // Sessions in this batch, generating, or whose turn waits for an earlier one.
  std::set<std::string> taken, waiting;
  for (const auto& r : running_) waiting.insert(r->request.session);
  int64_t tokens = 0, generating = static_cast<int64_t>(running_.size());
  for (auto it = queue_.begin(); it != queue_.end();) {
    PendingRequest& p = **it;
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
          "all ", leases_.max_leases(),
          " KV leases are held (--kv-max-leases); retry when decode workers release some")));
      it = queue_.erase(it);
      continue;
    }
    std::optional<PrefillRequest> r = BatchRequest(p, c);
    if (!r) {
      if (!name.empty()) waiting.insert(name);  // its later turns wait for it
      ++it;
      continue;
    }
    const int64_t n = static_cast<int64_t>(r->tokens.size());
    if (!c.batch.empty() && (solo_ > 0 || tokens + n > options_.max_batch_tokens)) break;
    tokens += n;
    if (generates) ++generating;
    if (!name.empty()) taken.insert(name);
    AddToBatch(p, std::move(*r), c);
    c.items.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  if (solo_ > 0) --solo_;
  return c;
}

// What the cache lacks: the session's unfed tokens (all of them once evicted), this turn's, and
// what a preempted generation had made.
std::optional<PrefillRequest> Scheduler::BatchRequest(PendingRequest& p, const StepPlan& plan) {
  const std::string& name = p.request.session;
  const bool generates = p.request.max_tokens > 1;
  PrefillRequest r{.session = name, .draw = DrawInPlace(p), .sparq = p.request.sparq};
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
  // Prompt logprobs need the logits of every prompt position: a cached prefix has none.
  if (!p.started) r.prompt_logprobs = p.request.prompt_logprobs;
  if (p.cached == 0 && options_.prefix_cache && r.prompt_logprobs < 0 &&
      !PlanPrefix(p, r, plan)) {
    return std::nullopt;
  }
  return r;
}

void Scheduler::AddToBatch(PendingRequest& p, PrefillRequest r, StepPlan& c) {
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
  c.batch.push_back(std::move(r));
}

bool Scheduler::PlanPrefix(PendingRequest& p, PrefillRequest& r, const StepPlan& c) {
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

void Scheduler::KeepPrefix(PendingRequest& p, const StepPlan& plan) {
  if (p.keep_as.empty()) return;
  if (!p.keep_by_fork) p.kv_name.clear();  // its KV is the entry now, not the request's to drop
  if (!p.keep_by_fork || plan.kept.count(p.keep_as)) {
    prefix_.Add(p.keep_as, std::move(p.sequence), ++prefix_now_);
  }
  p.keep_as.clear();
  while (prefix_.entries() > options_.max_prefix_entries) {
    DropEntry(prefix_.LeastRecentlyUsedFirst().front());
  }
}

void Scheduler::DropEntry(const std::string& entry) {
  prefix_.Remove(entry);
  drop_next_.push_back(entry);
  ++stats_.prefix_evictions;
}

// A publish keeps its slot, nonce and name across retries (a requeued batch).
bool Scheduler::TakeLeaseSlot(PendingRequest& p) {
  if (p.lease_slot >= 0) return true;
  std::optional<LeaseTable::Slot> slot = leases_.TakeSlot();
  if (!slot) return false;
  p.lease_slot = slot->slot;
  p.lease_nonce = slot->nonce;
  p.lease_id = absl::StrCat("kv-", RandomHex(16));  // a name, not a capability: the nonce is
  p.kv_name = LeaseSession(p.lease_id);
  return true;
}

void Scheduler::ReturnLeaseSlot(PendingRequest& p) {
  if (p.lease_slot >= 0) leases_.ReturnSlot(p.lease_slot);
  p.lease_slot = -1;
}

StepPlan Scheduler::DecodeStep() {
  StepPlan c;
  c.kind = StepPlan::kDecode;
  c.step = static_cast<uint64_t>(step_++);
  c.end_sessions = std::move(drop_next_);
  drop_next_.clear();
  for (auto& p : running_) {
    c.batch.push_back(
        {.tokens = {p->result.tokens.back().id},
         .session = p->kv_name,
         .draw = DrawInPlace(*p),
         .sparq = p->request.sparq});
    c.items.push_back(std::move(p));
  }
  decoding_ = static_cast<int64_t>(running_.size());
  running_.clear();
  return c;
}

void Scheduler::SessionsEnded(StepPlan& plan) {
  PendingRequest& p = *plan.items.front();
  const bool held = sessions_.erase(p.end_name) > 0;
  p.ended.set_value(held ? absl::OkStatus()
                         : absl::NotFoundError(absl::StrCat("no session '", p.end_name, "'")));
}

void Scheduler::PrefillDone(StepPlan& plan, StepOutcome outcome, Clock::time_point now) {
  if (!outcome.status.ok()) return Requeue(plan, outcome.status);
  ++stats_.batches;
  stats_.prefix_batched_key_rows += outcome.timings.prefix_batch.key_rows_saved;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    std::unique_ptr<PendingRequest> p = std::move(plan.items[i]);
    const bool first = !p->started;
    if (first) AnswerFirstToken(*p, outcome, i, plan, now);
    KeepPrefix(*p, plan);
    if (p->request.publish_kv) {
      absl::StatusOr<KvHandle>& handle = outcome.published.at(p->kv_name);
      if (!handle.ok()) {
        drop_next_.push_back(p->kv_name);
        ReturnLeaseSlot(*p);
        ++stats_.requests_failed;
        p->reply.set_value(handle.status());
        continue;
      }
      p->result.kv_handle = std::move(*handle);
      p->result.kv_lease_s = leases_.length_s();
    }
    p->positions_left = options_.max_positions - p->cached - p->reused -
                        static_cast<int64_t>(plan.batch[i].tokens.size());
    // Before NextToken: a stream's first token carries them (GeneratedToken::prompt_logprobs).
    if (first && i < outcome.prompt_logprobs.size()) {
      p->result.prompt_logprobs = std::move(outcome.prompt_logprobs[i]);
    }
    const bool done = NextToken(*p, outcome.tokens[i]);
    if (first) {
      p->result.first_token = p->result.tokens.front().id;
      p->result.logits = std::move(outcome.logits[i]);
    }
    Continue(std::move(p), done, now);
  }
}

// A preempted generation keeps its first prefill's figures.
void Scheduler::AnswerFirstToken(PendingRequest& p, StepOutcome& outcome, size_t i,
                                 const StepPlan& plan, Clock::time_point now) {
  EngineResult& r = p.result;
  p.started = true;
  r.prompt_tokens = static_cast<int64_t>(p.request.tokens.size());
  r.cached_tokens = p.cached + p.reused;
  r.recomputed = p.recomputed;
  r.queue_s = std::max(0.0, Seconds(now - p.submitted) - outcome.seconds);
  r.prefill_s = outcome.seconds;
  r.batch_requests = static_cast<int>(plan.items.size());
  r.algorithm = outcome.timings.algorithms[i];
  r.selector = outcome.timings.selections[i].reason;
  r.timings = outcome.timings;
  p.first_token_at = now;
  stats_.prompt_tokens += r.prompt_tokens;
  stats_.cached_tokens += r.cached_tokens;
  stats_.prefix_queries += p.looked_up ? 1 : 0;
  stats_.prefix_hits += p.reused > 0 ? 1 : 0;
  stats_.prefix_hit_tokens += p.reused;
}

void Scheduler::DecodeDone(StepPlan& plan, StepOutcome outcome, Clock::time_point now) {
  decoding_ = 0;
  if (!outcome.status.ok()) {
    for (auto& p : plan.items) running_.push_back(std::move(p));
    return MakeRoomToDecode(plan, outcome.status, now);
  }
  ++stats_.decode_steps;
  stats_.prefix_batched_key_rows += outcome.timings.prefix_batch.key_rows_saved;
  bool sparq_step = false;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    std::unique_ptr<PendingRequest> p = std::move(plan.items[i]);
    --p->positions_left;  // the token this step fed
    // The sequence held its cached and prompt tokens and every token generated so far.
    const EngineResult& so_far = p->result;
    if (SparqAttends(p->request.sparq, so_far.prompt_tokens + so_far.cached_tokens +
                                           static_cast<int64_t>(so_far.tokens.size()))) {
      ++p->result.sparq_decode_steps;
      sparq_step = true;
    }
    p->result.decode_timings.AddPhases(outcome.timings);
    const bool done = NextToken(*p, outcome.tokens[i]);
    Continue(std::move(p), done, now);
  }
  stats_.sparq_decode_steps += sparq_step ? 1 : 0;
}

void Scheduler::Continue(std::unique_ptr<PendingRequest> p, bool done, Clock::time_point now) {
  if (done) {
    Finish(std::move(p), now);
  } else {
    running_.push_back(std::move(p));
  }
}

std::vector<std::string> Scheduler::IdleSessionsLruFirst(const StepPlan& plan) const {
  std::set<std::string> busy;
  for (const PrefillRequest& r : plan.batch) busy.insert(r.session);
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

// An entry whose blocks all have other holders (running sequences, other entries) would free
// nothing: the least recently used entry that frees some goes (judged on rank 0's blocks; the
// ranks hold balanced shares of every sequence). Leases are never evicted: they are neither
// entries nor sessions.
bool Scheduler::EvictOne(const StepPlan& plan) {
  for (const std::string& entry : prefix_.LeastRecentlyUsedFirst()) {
    if (kv_.BlocksOnlyIn(entry) == 0) continue;
    DropEntry(entry);
    return true;
  }
  std::vector<std::string> idle = IdleSessionsLruFirst(plan);
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
void Scheduler::Requeue(StepPlan& plan, const absl::Status& why) {
  const bool evicted = IsKvCacheFull(why) && EvictOne(plan);
  // Generations hold the rest: the batch waits for one of them to end.
  const bool wait = IsKvCacheFull(why) && !evicted && !running_.empty();
  if (!wait && !evicted && plan.items.size() == 1) {
    ++stats_.requests_failed;
    ReturnLeaseSlot(*plan.items.front());
    plan.items.front()->reply.set_value(why);
    return;
  }
  if (wait) {
    prefill_waits_ = true;
  } else if (!evicted) {
    solo_ = static_cast<int>(plan.items.size());
  }
  for (auto it = plan.items.rbegin(); it != plan.items.rend(); ++it) {
    queue_.push_front(std::move(*it));
  }
}

// A decode step that changed nothing: the KV cache is full. An idle session is evicted; with
// none, the newest generation is preempted (its KV dropped, queued again to prefill what it has);
// the only one left ends at the capacity ("length"). Another error ends the step's sequences.
void Scheduler::MakeRoomToDecode(const StepPlan& plan, const absl::Status& why,
                                 Clock::time_point now) {
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
  if (EvictOne(plan)) return;
  if (running_.size() == 1) {
    running_.front()->result.finish_reason = "length";
    Finish(std::move(running_.front()), now);
    running_.clear();
    return;
  }
  std::unique_ptr<PendingRequest> p = std::move(running_.back());
  running_.pop_back();
  drop_next_.push_back(p->kv_name);
  if (!p->request.session.empty()) sessions_[p->request.session].evicted = true;
  ++p->result.preemptions;
  ++stats_.preemptions;
  queue_.push_front(std::move(p));
}

std::optional<TokenDraw> Scheduler::DrawInPlace(const PendingRequest& p) {
  const EngineRequest& q = p.request;
  // min_tokens masks stop tokens out of the logits on the host (Engine::SampleAll).
  if (q.sampling.logprobs > 0 || (q.return_logits && !p.started) ||
      static_cast<int>(p.result.tokens.size()) < q.min_tokens) {
    return std::nullopt;
  }
  return TokenDraw{.params = q.sampling, .step = p.result.tokens.size()};
}

bool Scheduler::NextToken(PendingRequest& p, const SampledToken& token) {
  EngineResult& r = p.result;
  const EngineRequest& q = p.request;
  const int index = static_cast<int>(r.tokens.size());
  r.tokens.push_back(token);
  ++stats_.generation_tokens;
  const int32_t id = r.tokens.back().id;
  const auto in = [id](const std::vector<int32_t>& ids) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  // Before min_tokens nothing stops it (stop ids and EOS were masked; stop strings wait).
  const bool may_stop = static_cast<int>(r.tokens.size()) > q.min_tokens;
  if (may_stop && (in(q.stop_ids) || (!q.ignore_eos && in(options_.eos_ids)) ||
                   (q.stop_when && q.stop_when(r.tokens)))) {
    r.finish_reason = "stop";
  } else if (static_cast<int>(r.tokens.size()) >= q.max_tokens || p.positions_left <= 0) {
    r.finish_reason = "length";
  } else if (q.cancelled && q.cancelled->load()) {
    r.finish_reason = "abort";
  }
  if (q.on_token) {
    q.on_token({index, r.tokens.back(), r.finish_reason,
                index == 0 ? r.prompt_logprobs : std::vector<SampledToken>{}});
  }
  return !r.finish_reason.empty();
}

// Answers a finished request; its session now holds this turn (and what it generated when it
// generated more than the first token), a request without one gives its KV back.
void Scheduler::Finish(std::unique_ptr<PendingRequest> p, Clock::time_point now) {
  EngineResult& r = p->result;
  r.decode_s = Seconds(now - p->first_token_at);
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
    leases_.Hold(p->lease_id,
                 {.kv_name = p->kv_name,
                  .slot = p->lease_slot,
                  .nonce = p->lease_nonce,
                  .tokens = static_cast<int64_t>(q.tokens.size())},
                 now);
  } else if (!p->kv_name.empty()) {
    drop_next_.push_back(p->kv_name);
  }
  ++stats_.requests_ok;
  prefill_waits_ = false;  // its KV is free now
  p->reply.set_value(std::move(r));
}

void Scheduler::FailAll(StepPlan& plan, const absl::Status& status) {
  shutdown_ = true;
  auto fail = [&](PendingRequest& p) {
    if (p.end_session) {
      p.ended.set_value(status);
    } else {
      ++stats_.requests_failed;
      p.reply.set_value(status);
    }
  };
  for (auto& p : plan.items) fail(*p);
  for (auto& p : queue_) fail(*p);
  for (auto& p : running_) fail(*p);
  queue_.clear();
  running_.clear();
}

EngineStats Scheduler::stats() const {
  EngineStats s = stats_;
  s.waiting = static_cast<int64_t>(queue_.size());
  s.running = static_cast<int64_t>(running_.size()) + decoding_;
  s.sessions = static_cast<int64_t>(sessions_.size());
  s.kv_leases = leases_.held();
  s.kv_leased_tokens = leases_.held_tokens();
  s.prefix_entries = prefix_.entries();
  s.prefix_tokens = prefix_.tokens();
  return s;
}

std::vector<std::string> Scheduler::sessions() const {
  std::vector<std::pair<int64_t, std::string>> by_use;
  for (const auto& [name, s] : sessions_) by_use.push_back({s.last_used, name});
  std::sort(by_use.begin(), by_use.end());
  std::vector<std::string> names;
  for (auto& [used, name] : by_use) names.push_back(std::move(name));
  return names;
}

}  // namespace cpfill::runtime
