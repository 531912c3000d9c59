// cpfill/runtime/serving/engine.h — the long-running engine: one model, one KV cache, one queue,
// and the sequences it is generating.
//
// Every rank builds an Engine over its LlamaModel and calls Run() (collective; it returns after
// Shutdown). World rank 0 alone takes work: Submit (thread-safe, from any thread, such as an
// HTTP server's) queues a request and returns a future. The loop is
//   receive -> Scheduler::Plan (rank 0; scheduler.h) -> broadcast (step_wire.h) -> every rank
//   executes the StepPlan -> rank 0 answers (Scheduler::PrefillDone / DecodeDone).
// The policy, which scheduler.h holds and tests alone:
//   - a prefill batch: queued requests first come first served up to max_batch_tokens new
//     tokens, never two turns of one session in a batch and never a later turn before an earlier
//     one (nor a turn while the session is still generating);
//   - a decode step (paper Alg. 4, LlamaModel::Decode): one token for every running sequence.
// When both are due they alternate, so neither new prompts nor running generations starve.
// While idle, rank 0 broadcasts a heartbeat every `heartbeat` that ends in a barrier, so every
// rank's waits keep their deadline: a silent rank, rank 0 or another, ends the job.
//
// Generation: each token is drawn (runtime/model/sampling.h: greedy or seeded temperature / top-k /
// top-p) where its logits are, on the GPU of the CP rank holding the sequence, and only its id
// reaches rank 0; a request for logprobs or for the prompt's logits has them sent to rank 0 and
// drawn there, the same token. Generation stops at a stop id (the checkpoint's EOS unless
// ignore_eos), at max_tokens, or at the model's last position. A request with max_tokens 1 is a
// prefill and its first token (the prefill service of a disaggregated deployment); one with more
// keeps its KV while it generates.
//
// Sessions keep their KV in the model's cache between turns. With max_tokens > 1 the generated
// tokens join the conversation (the last one's KV is written with the next turn); with
// max_tokens 1 they do not (the decoder elsewhere owns them, and the next turn brings them). When
// a batch does not fit, rank 0 evicts the least recently used idle session and tries again; a
// later turn of an evicted session prefills its whole history again (reported as recomputed).
//
// Prefix cache (runtime/serving/prefix_cache.md): a prompt's KV is kept after its request as a
// prefix entry, indexed on rank 0 by a hash chain of its full blocks (runtime/kv/prefix_index.h). A
// request without KV of its own (no session, a session's first turn, an evicted one) whose first
// tokens an entry holds forks that entry on every rank (LlamaModel::ForkSession: the blocks are
// shared) and prefills only the rest; `cached_tokens` counts the reuse. Requests of one batch
// that share a block more than the cache holds wait for the next batch, which finds the first
// one's entry (n samples of one prompt prefill it once). Entries are evicted least recently used
// first, before idle sessions, when the KV cache is full.
// When a decode step does not fit and no session is idle, the newest running sequence is
// preempted: its KV is dropped and it is queued again to prefill its prompt and the tokens it has
// generated, then goes on (vLLM's recompute preemption). A batch that fails as a whole (a
// request the model refuses) is retried one request at a time, so a bad request gets its own
// error and the others go on.
//
//   Engine engine(*model, world, {.max_batch_tokens = 65536, .eos_ids = {128001}});
//   std::thread loop([&] { status = engine.Run(); });          // every rank
//   auto reply = engine.Submit({.tokens = ids, .session = "chat-1", .max_tokens = 64});   // rank 0
//   absl::StatusOr<EngineResult> r = reply->get();             // r->tokens, r->finish_reason
//   engine.Shutdown();  loop.join();
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/model/llama_model.h"
#include "runtime/serving/request.h"
#include "runtime/serving/scheduler.h"
#include "runtime/serving/step_plan.h"

namespace cpfill::runtime {

struct EngineOptions {
  int64_t max_batch_tokens = 131072;          // new tokens in one fused batch
  int max_queue = 1024;                       // waiting requests before Submit refuses
  int max_running = 256;                      // sequences generating at once (a decode batch)
  std::vector<int32_t> eos_ids;               // generation stops at these (the checkpoint's EOS)
  std::chrono::milliseconds heartbeat{1000};  // rank 0's idle broadcast; below the deadline
  bool prefix_cache = true;                   // false: --no-prefix-cache
  int max_prefix_entries = 4096;              // kept prompts; the least recently used go first
  // Rank 0, after each batch (the server's log line): requests, new and cached tokens, the ring
  // algorithm, seconds.
  std::function<void(int, int64_t, int64_t, const std::string&, double)> on_batch;
};

class KvHandoff;

class Engine : private KvOccupancy {
 public:
  using Clock = EngineClock;
  using Reply = std::future<absl::StatusOr<EngineResult>>;

  Engine(LlamaModel& model, parallel::Communicator& world, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Rank 0, any thread. InvalidArgument for a request no batch could run (empty, a token id
  // outside the vocabulary, more new tokens than max_batch_tokens, more tokens and max_tokens
  // than the model's positions, bad sampling parameters); Unavailable when max_queue
  // requests wait (retry later); FailedPrecondition after Shutdown. Otherwise the future gets the
  // result or the request's own error (ResourceExhausted when it cannot fit the KV cache even
  // with every idle session evicted).
  absl::StatusOr<Reply> Submit(EngineRequest request);
  // As Submit, for several requests queued together (all or none), so that they can share a
  // batch: the prompts of one HTTP request.
  absl::StatusOr<std::vector<Reply>> SubmitAll(std::vector<EngineRequest> requests);
  // Rank 0, any thread: forgets a session after the requests queued before it (NotFound for a
  // name the engine does not hold).
  std::future<absl::Status> EndSession(std::string name);
  // Every rank, before Run: publish_kv requests are taken, their handles carry `engine_id` and
  // their leases last `lease` (renewed by RenewKv). `handoff` outlives the engine.
  void AttachKvHandoff(KvHandoff* handoff, std::string engine_id, std::chrono::milliseconds lease);
  // Rank 0, any thread: ends the lease of hand-off `request_id` whose handle's lease_nonce is
  // `nonce` ("0x" and hex digits); its KV is freed with the next command. NotFound when no such
  // lease holds (ended, expired, never given, or another nonce: a stale or forged handle).
  absl::Status ReleaseKv(const std::string& request_id, const std::string& nonce);
  // As ReleaseKv, for a release message's payload (KvReleasePayload): NotFound also for another
  // engine's id.
  absl::Status ReleaseKvMessage(const std::string& payload);
  // Rank 0, any thread: the lease lasts `lease` from now; returns that length in seconds. NotFound
  // as ReleaseKv.
  absl::StatusOr<double> RenewKv(const std::string& request_id, const std::string& nonce);
  // Rank 0, any thread: takes no more requests; Run() returns on every rank once the queue is
  // drained.
  void Shutdown();

  // Every rank (collective): the loop. OK after Shutdown; a communication failure (a rank dead
  // or silent past the deadline) ends it with that error on every surviving rank, and every
  // request rank 0 holds is answered Unavailable "the job is ending: <that error>".
  absl::Status Run();

  EngineStats stats() const;                  // rank 0
  std::vector<std::string> sessions() const;  // rank 0: names held, least recently used first

 private:
  // Rank 0, the loop thread: KV blocks of session `name` on this rank that no other holds.
  int64_t BlocksOnlyIn(const std::string& name) const override;

  StepPlan NextStep();  // rank 0: waits up to a heartbeat for work
  // Every rank: broadcasts rank 0's plan and returns it (rank 0's own, with its items).
  absl::Status Broadcast(StepPlan& plan);
  absl::Status Execute(StepPlan& plan);
  // Every rank: the model's step (forks, prefill or decode, kept prefixes, published KV), begun
  // at `start`; rank 0's `outcome` gets the tokens drawn, or the model's refusal.
  absl::Status RunStep(StepPlan& plan, Clock::time_point start, StepOutcome& outcome);
  // Rank 0: the next token of each item: drawn in place, or from its output's logits on
  // sampler_pool_. With 256 samples over Llama 3's 128K logits the host's share of a decode step
  // was 250 ms on one core, 44 ms on 8 (an H100 host,
  // bench/results/2026-11-26-h100x2-prefix-decode).
  std::vector<SampledToken> SampleAll(const StepPlan& plan,
                                      const std::vector<SequenceOutput>& outputs);
  // Every rank, after a prefill batch: exports and publishes the batch's hand-offs.
  absl::Status PublishKv(const StepPlan& plan,
                         std::map<std::string, absl::StatusOr<KvHandle>>* handles);
  void DropSessions(const std::vector<std::string>& names);  // every rank: revoke, then free
  void UpdateKvUsageLocked();  // rank 0, the loop thread: the usage figures of stats()
  // Every rank: the batch's forks before its prefill (a refusal undoes them) and its kept
  // prompts after it.
  absl::Status ForkPrefixes(const StepPlan& plan);
  absl::Status KeepPrefixes(StepPlan& plan);

  LlamaModel& model_;
  parallel::Communicator& world_;
  const EngineOptions options_;
  const bool root_;

  mutable std::mutex mu_;
  std::condition_variable work_;
  Scheduler scheduler_;                                     // rank 0's decisions; guarded by mu_
  double kv_usage_ratio_ = 0, kv_staging_usage_ratio_ = 0;  // rank 0, guarded by mu_
  int64_t kv_blocks_shared_ = 0;
  std::unique_ptr<ThreadPool> sampler_pool_;  // rank 0: SampleAll's threads
  // KV hand-off: set by AttachKvHandoff.
  KvHandoff* handoff_ = nullptr;
  std::string engine_id_;
  std::map<std::string, int> lease_slot_of_;  // every rank: published KV name -> lease record slot
};

}  // namespace cpfill::runtime
