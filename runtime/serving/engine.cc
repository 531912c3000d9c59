#include "runtime/serving/engine.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "parallel/mixed_ring.h"
#include "runtime/handoff/kv_handoff.h"
#include "runtime/serving/step_wire.h"

namespace cpfill::runtime {
namespace {

using Clock = Engine::Clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

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

SchedulerOptions SchedulerOptionsFor(const EngineOptions& o, const LlamaModel& model) {
  return {.max_batch_tokens = o.max_batch_tokens,
          .max_queue = o.max_queue,
          .max_running = o.max_running,
          .eos_ids = o.eos_ids,
          .prefix_cache = o.prefix_cache,
          .max_prefix_entries = o.max_prefix_entries,
          .vocab_size = model.config().vocab_size,
          .max_positions = model.config().max_position_embeddings,
          .block_tokens = static_cast<int>(model.kv_cache().spec().block_tokens)};
}

}  // namespace

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
      scheduler_(SchedulerOptionsFor(options_, model), *this) {
  // Half the cores this rank may run on (mpirun binds a rank to one core unless told
  // --bind-to none), at most 8: the HTTP threads need the rest.
  if (root_) sampler_pool_ = std::make_unique<ThreadPool>(std::clamp(UsableCores() / 2, 1, 8));
}

Engine::~Engine() = default;

void Engine::AttachKvHandoff(KvHandoff* handoff, std::string engine_id,
                             std::chrono::milliseconds lease) {
  std::lock_guard lock(mu_);
  handoff_ = handoff;
  engine_id_ = std::move(engine_id);
  scheduler_.EnableLeases(handoff->max_leases(), lease);
}

absl::Status Engine::ReleaseKv(const std::string& request_id, const std::string& nonce) {
  std::lock_guard lock(mu_);
  CPFILL_RETURN_IF_ERROR(scheduler_.ReleaseKv(request_id, nonce));
  work_.notify_one();
  return absl::OkStatus();
}

absl::Status Engine::ReleaseKvMessage(const std::string& payload) {
  const std::vector<std::string> parts = absl::StrSplit(payload, '\n');
  std::lock_guard lock(mu_);
  if (parts.size() != 3 || parts[0] != engine_id_) {
    return absl::NotFoundError("a KV release for another engine (a stale or forged handle)");
  }
  CPFILL_RETURN_IF_ERROR(scheduler_.ReleaseKv(parts[1], parts[2]));
  work_.notify_one();
  return absl::OkStatus();
}

absl::StatusOr<double> Engine::RenewKv(const std::string& request_id, const std::string& nonce) {
  std::lock_guard lock(mu_);
  return scheduler_.RenewKv(request_id, nonce, Clock::now());
}

absl::StatusOr<Engine::Reply> Engine::Submit(EngineRequest request) {
  std::vector<EngineRequest> one;
  one.push_back(std::move(request));
  CPFILL_ASSIGN_OR_RETURN(std::vector<Reply> replies, SubmitAll(std::move(one)));
  return std::move(replies[0]);
}

// The checks read only what is fixed before Run (options, the hand-off), so they run outside the
// lock: a long prompt's ids are not checked while the loop waits.
absl::StatusOr<std::vector<Engine::Reply>> Engine::SubmitAll(std::vector<EngineRequest> requests) {
  CPFILL_CHECK_ARG(root_, "requests go to world rank 0");
  for (const EngineRequest& request : requests) CPFILL_RETURN_IF_ERROR(scheduler_.Check(request));
  const Clock::time_point now = Clock::now();
  std::lock_guard lock(mu_);
  CPFILL_ASSIGN_OR_RETURN(std::vector<Reply> replies, scheduler_.Submit(std::move(requests), now));
  work_.notify_one();
  return replies;
}

std::future<absl::Status> Engine::EndSession(std::string name) {
  std::lock_guard lock(mu_);
  if (!root_) {
    std::promise<absl::Status> refused;
    refused.set_value(absl::FailedPreconditionError("sessions are ended on world rank 0"));
    return refused.get_future();
  }
  std::future<absl::Status> ended = scheduler_.EndSession(std::move(name));
  work_.notify_one();
  return ended;
}

void Engine::Shutdown() {
  std::lock_guard lock(mu_);
  scheduler_.Shutdown();
  work_.notify_one();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s = scheduler_.stats();
  s.kv_usage_ratio = kv_usage_ratio_;
  s.kv_blocks_shared = kv_blocks_shared_;
  s.kv_staging_usage_ratio = kv_staging_usage_ratio_;
  return s;
}

std::vector<std::string> Engine::sessions() const {
  std::lock_guard lock(mu_);
  return scheduler_.sessions();
}

absl::Status Engine::Run() {
  for (;;) {
    StepPlan plan;
    if (root_) plan = NextStep();
    absl::Status s = Broadcast(plan);
    if (s.ok() && plan.kind == StepPlan::kShutdown) return absl::OkStatus();
    if (s.ok()) s = Execute(plan);
    if (!s.ok()) {  // the job cannot go on: every waiting request learns why (Unavailable: the
                    // server's 503), in the words of the failure, which name the rank
      if (root_) {
        std::lock_guard lock(mu_);
        scheduler_.FailAll(
            plan, absl::UnavailableError(absl::StrCat("the job is ending: ", s.message())));
      }
      return s;
    }
  }
}

StepPlan Engine::NextStep() {
  std::unique_lock lock(mu_);
  if (!scheduler_.generating()) {
    work_.wait_for(lock, options_.heartbeat, [&] { return scheduler_.HasWork(); });
  }
  return scheduler_.Plan(Clock::now());
}

absl::Status Engine::Broadcast(StepPlan& plan) {
  std::vector<char> bytes;
  if (root_) bytes = StepToWire(plan);
  int64_t size = static_cast<int64_t>(bytes.size());
  CPFILL_RETURN_IF_ERROR(world_.Broadcast(&size, sizeof(size), 0));
  bytes.resize(static_cast<size_t>(size));
  CPFILL_RETURN_IF_ERROR(world_.Broadcast(bytes.data(), bytes.size(), 0));
  if (root_) return absl::OkStatus();
  CPFILL_ASSIGN_OR_RETURN(plan, StepFromWire(bytes));
  return absl::OkStatus();
}

absl::Status Engine::Execute(StepPlan& plan) {
  // A broadcast completes on rank 0 without waiting for anyone (an eager send): the heartbeat
  // ends in a barrier, so rank 0 too learns within the deadline that a rank stopped answering.
  DropSessions(plan.end_sessions);
  if (plan.kind == StepPlan::kHeartbeat) {  // the other kinds' answers update the usage
    if (root_ && !plan.end_sessions.empty()) {
      std::lock_guard lock(mu_);
      UpdateKvUsageLocked();
    }
    return world_.Barrier();
  }
  if (plan.kind == StepPlan::kEndSessions) {
    if (root_) {
      std::lock_guard lock(mu_);
      UpdateKvUsageLocked();
      scheduler_.SessionsEnded(plan);
    }
    return absl::OkStatus();
  }
  const Clock::time_point start = Clock::now();
  StepOutcome outcome;
  CPFILL_RETURN_IF_ERROR(RunStep(plan, start, outcome));
  if (!root_) return absl::OkStatus();
  std::lock_guard lock(mu_);
  UpdateKvUsageLocked();
  if (plan.kind == StepPlan::kDecode) {
    scheduler_.DecodeDone(plan, std::move(outcome), Clock::now());
  } else {
    scheduler_.PrefillDone(plan, std::move(outcome), Clock::now());
  }
  return absl::OkStatus();
}

// The model refuses a step on every rank alike, changing nothing: the refusal goes to the
// scheduler in `outcome` and the loop goes on. Anything else is a fault of the job.
absl::Status Engine::RunStep(StepPlan& plan, Clock::time_point start, StepOutcome& outcome) {
  absl::StatusOr<std::vector<SequenceOutput>> out;
  if (plan.kind == StepPlan::kDecode) {
    out = model_.Decode(plan.batch, static_cast<int64_t>(plan.step), &outcome.timings);
  } else if (absl::Status forked = ForkPrefixes(plan); !forked.ok()) {
    out = forked;
  } else {
    out = model_.Prefill(plan.batch, &outcome.timings, nullptr);
    if (!out.ok()) {  // the batch's forks go with it
      for (const StepPlan::Fork& f : plan.forks) (void)model_.EndSession(f.child);
    }
  }
  if (!out.ok() && !IsRefusal(out.status())) return out.status();
  if (!out.ok()) {
    outcome.status = out.status();
    return absl::OkStatus();
  }
  CPFILL_RETURN_IF_ERROR(KeepPrefixes(plan));
  CPFILL_RETURN_IF_ERROR(PublishKv(plan, &outcome.published));
  if (!root_) return absl::OkStatus();
  outcome.seconds = Since(start);
  const StepTimings& t = outcome.timings;
  if (plan.kind == StepPlan::kPrefill && options_.on_batch) {
    options_.on_batch(static_cast<int>(plan.items.size()), t.new_tokens, t.cached_tokens,
                      parallel::AlgorithmsName(t.algorithms), outcome.seconds);
  }
  outcome.tokens = SampleAll(plan, *out);
  for (SequenceOutput& o : *out) {
    outcome.logits.push_back(std::move(o.logits));
    outcome.prompt_logprobs.push_back(std::move(o.prompt_logprobs));
  }
  return absl::OkStatus();
}

// ForkSession agrees on every rank before it changes anything, so a refusal is every rank's.
absl::Status Engine::ForkPrefixes(const StepPlan& plan) {
  for (size_t i = 0; i < plan.forks.size(); ++i) {
    const StepPlan::Fork& f = plan.forks[i];
    absl::Status s = model_.ForkSession(f.parent, f.child, static_cast<int64_t>(f.tokens));
    if (!s.ok()) {
      for (size_t j = 0; j < i; ++j) (void)model_.EndSession(plan.forks[j].child);
      return s;
    }
  }
  return absl::OkStatus();
}

// A keep the cache has no block for is skipped alike on every rank: the prompt is not cached.
absl::Status Engine::KeepPrefixes(StepPlan& plan) {
  for (const StepPlan::Fork& k : plan.keeps) {
    absl::Status s = model_.ForkSession(k.parent, k.child, static_cast<int64_t>(k.tokens));
    if (!s.ok() && !IsRefusal(s)) return s;
    if (s.ok() && root_) plan.kept.insert(k.child);
  }
  return absl::OkStatus();
}

// On the loop thread, the only one that changes the caches: no race with the engine's steps.
void Engine::UpdateKvUsageLocked() {
  const KvUsage usage = model_.kv_usage();
  kv_usage_ratio_ = usage.usage_ratio();
  kv_blocks_shared_ = usage.blocks_shared;
  if (handoff_ != nullptr) kv_staging_usage_ratio_ = handoff_->staging_usage_ratio();
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
// error (Scheduler::PrefillDone); a failure of the job's communication ends the job.
absl::Status Engine::PublishKv(const StepPlan& plan,
                               std::map<std::string, absl::StatusOr<KvHandle>>* handles) {
  for (const StepPlan::Publish& p : plan.publish) {
    absl::StatusOr<KvHandle> handle =
        handoff_->Export(model_, p.kv_name, {engine_id_, p.request_id});
    if (!handle.ok() && !IsRefusal(handle.status()) && !absl::IsInternal(handle.status())) {
      return handle.status();
    }
    if (handle.ok()) {
      handoff_->Publish(static_cast<int>(p.slot), p.nonce, *handle);
      lease_slot_of_[p.kv_name] = static_cast<int>(p.slot);
      if (root_) handoff_->FillTransport(&*handle, static_cast<int>(p.slot), p.nonce);
    }
    handles->emplace(p.kv_name, std::move(handle));
  }
  return absl::OkStatus();
}

int64_t Engine::BlocksOnlyIn(const std::string& name) const {
  const std::optional<KvCache::SeqId> seq = model_.SessionSequence(name);
  if (!seq) return 0;
  const KvCache& kv = model_.kv_cache();
  int64_t n = 0;
  for (const int32_t block : kv.BlockTable(*seq)) n += kv.refcount(block) == 1 ? 1 : 0;
  return n;
}

std::vector<SampledToken> Engine::SampleAll(const StepPlan& plan,
                                            const std::vector<SequenceOutput>& outputs) {
  std::vector<SampledToken> sampled(plan.items.size());
  sampler_pool_->ParallelFor(static_cast<int64_t>(sampled.size()), [&](int64_t i) {
    const PendingRequest& p = *plan.items[i];
    if (plan.batch[i].draw.has_value()) {  // drawn where the logits were
      sampled[i].id = outputs[i].first_token;
      return;
    }
    // The draw of token k is a function of (seed, k) alone: the same on any thread.
    const size_t k = p.result.tokens.size();
    if (static_cast<int>(k) >= p.request.min_tokens) {
      sampled[i] = SampleToken(outputs[i].logits, p.request.sampling, k);
      return;
    }
    // Before min_tokens: EOS (unless ignored) and the stop ids cannot be drawn (vLLM's
    // MinTokensLogitsProcessor).
    std::vector<float> masked = outputs[i].logits;
    const auto mask = [&](const std::vector<int32_t>& ids) {
      for (const int32_t id : ids) {
        if (id >= 0 && static_cast<size_t>(id) < masked.size()) masked[id] = -INFINITY;
      }
    };
    mask(p.request.stop_ids);
    if (!p.request.ignore_eos) mask(options_.eos_ids);
    sampled[i] = SampleToken(masked, p.request.sampling, k);
  });
  return sampled;
}

}  // namespace cpfill::runtime
