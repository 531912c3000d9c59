// cpfill/runtime/serving/scheduler.h — the engine's policy as a plain object: what runs next.
//
// World rank 0's scheduler owns the waiting queue, the running generations, the sessions' order
// and history, the prefix cache's index and the hand-off's leases. Plan() turns them into a
// StepPlan (step_plan.h); once every rank has executed it, PrefillDone/DecodeDone/SessionsEnded
// give it the outcome and it answers, requeues, evicts or preempts. It calls no MPI, no model
// and no clock: the engine passes `now`, and the KV cache is seen only through KvOccupancy.
//
// The policy:
//   - a prefill batch takes queued requests first come first served up to max_batch_tokens new
//     tokens, never two turns of one session in a batch and never a later turn before an earlier
//     one (nor a turn while the session is still generating);
//   - a decode step gives one token to every running sequence; when both are due, prefill
//     batches and decode steps alternate, so neither new prompts nor generations starve;
//   - prefix cache (prefix_cache.md): a request without KV of its own forks the longest cached
//     prefix of its prompt and prefills the rest; its prompt is kept as an entry after it;
//   - the KV cache full (a refused batch): the least recently used prefix entry that frees
//     blocks goes first, then the least recently used idle session (its next turn prefills its
//     history again); a lease is never evicted; with neither left, a batch waits for a running
//     generation to end, and a decode step preempts its newest sequence (recomputed later, as
//     vLLM's recompute preemption); any other refusal runs the batch one request at a time, so a
//     bad request gets its own error.
//
//   FakeKv kv;  Scheduler s({.max_batch_tokens = 64, .vocab_size = 100, .max_positions = 512}, kv);
//   auto replies = s.Submit(requests, now);
//   StepPlan plan = s.Plan(now);             // kPrefill: plan.batch, plan.forks, ...
//   s.PrefillDone(plan, outcome, now);       // answers, or requeues after a refusal
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/kv/prefix_index.h"
#include "runtime/serving/lease_table.h"
#include "runtime/serving/request.h"
#include "runtime/serving/step_plan.h"

namespace cpfill::runtime {

struct SchedulerOptions {
  int64_t max_batch_tokens = 131072;  // new tokens in one fused batch
  int max_queue = 1024;               // waiting requests before Submit refuses
  int max_running = 256;              // sequences generating at once (a decode batch)
  std::vector<int32_t> eos_ids;       // generation stops at these (the checkpoint's EOS)
  bool prefix_cache = true;           // false: --no-prefix-cache
  int max_prefix_entries = 4096;      // kept prompts; the least recently used go first
  // The model's: token ids must be below vocab_size, a request's positions at most
  // max_positions; the KV cache's block size (the prefix index's unit).
  int64_t vocab_size = 0;
  int64_t max_positions = 0;
  int block_tokens = 16;
};

// What the scheduler asks of world rank 0's KV cache.
class KvOccupancy {
 public:
  virtual ~KvOccupancy() = default;
  // The blocks of the KV named `name` that no other sequence holds (0 for an unknown name): what
  // evicting it would free.
  virtual int64_t BlocksOnlyIn(const std::string& name) const = 0;
};

// What executing a prefill batch or a decode step gave, per item of its plan.
struct StepOutcome {
  absl::Status status;  // OK, or the refusal of the whole step (nothing changed on any rank)
  std::vector<SampledToken> tokens;        // the next token of each item
  std::vector<std::vector<float>> logits;  // each item's last logits (return_logits only)
  // kPrefill: each item's prompt logprobs (PrefillRequest::prompt_logprobs; empty when none).
  std::vector<std::vector<SampledToken>> prompt_logprobs;
  StepTimings timings;
  double seconds = 0;  // the step, every rank together
  // kPrefill with publishes: each published KV's handle, by KV name.
  std::map<std::string, absl::StatusOr<KvHandle>> published;
};

class Scheduler {
 public:
  using Clock = EngineClock;
  using Reply = std::future<absl::StatusOr<EngineResult>>;

  Scheduler(SchedulerOptions options, const KvOccupancy& kv);

  // What Submit refuses at once (InvalidArgument): see Engine::Submit.
  absl::Status Check(const EngineRequest& request) const;
  // Queues checked requests together (all or none). Unavailable when max_queue requests wait;
  // FailedPrecondition after Shutdown.
  absl::StatusOr<std::vector<Reply>> Submit(std::vector<EngineRequest> requests,
                                            Clock::time_point now);
  // Forgets a session after the requests queued before it (NotFound for one it does not hold).
  std::future<absl::Status> EndSession(std::string name);
  void Shutdown() { shutdown_ = true; }

  // Hand-off: publish_kv requests are taken, `max_leases` at once, each lease lasting `length`.
  void EnableLeases(int max_leases, std::chrono::milliseconds length);
  double lease_length_s() const { return leases_.length_s(); }
  absl::Status ReleaseKv(const std::string& request_id, const std::string& nonce);
  absl::StatusOr<double> RenewKv(const std::string& request_id, const std::string& nonce,
                                 Clock::time_point now);

  // True when a step is due now; false: the engine may wait (a heartbeat) for Submit.
  bool HasWork() const;
  bool generating() const { return !running_.empty(); }
  // The next step. A heartbeat or shutdown when there is nothing to do.
  StepPlan Plan(Clock::time_point now);

  // After every rank executed `plan`: answers its requests, or acts on the step's refusal.
  void PrefillDone(StepPlan& plan, StepOutcome outcome, Clock::time_point now);
  void DecodeDone(StepPlan& plan, StepOutcome outcome, Clock::time_point now);
  void SessionsEnded(StepPlan& plan);
  // The job cannot go on: every request held, and the plan's, is answered with `status`.
  void FailAll(StepPlan& plan, const absl::Status& status);

  // How `p`'s next token is drawn where its logits are; nullopt when rank 0 needs the logits
  // (logprobs, or the prompt's logits with return_logits on its prefill).
  static std::optional<TokenDraw> DrawInPlace(const PendingRequest& p);

  EngineStats stats() const;                  // the scheduler's counters and sizes
  std::vector<std::string> sessions() const;  // names held, least recently used first

 private:
  struct SessionState {
    std::vector<int32_t> history;  // every token of the conversation so far
    int64_t fed = 0;               // of which the KV cache holds the first `fed`
    bool evicted = false;          // its KV is gone; the next turn prefills the history again
    int64_t last_used = 0;         // batch counter when last used (LRU)
  };

  StepPlan FormBatch();
  StepPlan DecodeStep();
  StepPlan EndSessionStep();
  // `p`'s request as the model sees it (what the cache lacks), its prefix plan made; nullopt
  // when it waits for the next batch (PlanPrefix).
  std::optional<PrefillRequest> BatchRequest(PendingRequest& p, const StepPlan& plan);
  void AddToBatch(PendingRequest& p, PrefillRequest r, StepPlan& plan);
  bool PlanPrefix(PendingRequest& p, PrefillRequest& r, const StepPlan& plan);
  void KeepPrefix(PendingRequest& p, const StepPlan& plan);
  void DropEntry(const std::string& entry);
  bool TakeLeaseSlot(PendingRequest& p);
  void ReturnLeaseSlot(PendingRequest& p);
  void AnswerFirstToken(PendingRequest& p, StepOutcome& outcome, size_t i, const StepPlan& plan,
                        Clock::time_point now);
  void Requeue(StepPlan& plan, const absl::Status& why);
  void MakeRoomToDecode(const StepPlan& plan, const absl::Status& why, Clock::time_point now);
  std::vector<std::string> IdleSessionsLruFirst(const StepPlan& plan) const;
  bool EvictOne(const StepPlan& plan);
  bool NextToken(PendingRequest& p, const SampledToken& token);
  void Finish(std::unique_ptr<PendingRequest> p, Clock::time_point now);
  void Continue(std::unique_ptr<PendingRequest> p, bool done, Clock::time_point now);

  const SchedulerOptions options_;
  const KvOccupancy& kv_;

  std::deque<std::unique_ptr<PendingRequest>> queue_;     // requests, session ends: arrival order
  std::vector<std::unique_ptr<PendingRequest>> running_;  // generating, oldest first
  int64_t decoding_ = 0;  // of them, in the decode step under way (taken out of running_)
  bool shutdown_ = false;
  bool prefill_next_ = true;    // prefill batches and decode steps alternate when both are due
  bool prefill_waits_ = false;  // the KV cache is full of generations: prefill after one ends
  int64_t step_ = 0;            // decode steps so far: PlanDecode's moving offset
  int64_t next_id_ = 0;         // names the engine's own KV (generations, entries, leases)
  int solo_ = 0;  // next batches run one request at a time (after a batch failed as a whole)
  std::vector<std::string> drop_next_;  // KV every rank drops with the next step
  std::map<std::string, SessionState> sessions_;
  PrefixIndex prefix_;
  int64_t prefix_now_ = 0;  // the prefix index's clock (LRU)
  bool leases_enabled_ = false;
  LeaseTable leases_;
  EngineStats stats_;
};

}  // namespace cpfill::runtime
