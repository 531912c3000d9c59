// cpfill/runtime/engine.h — the long-running engine: one model, one KV cache, one queue, and the
// sequences it is generating.
//
// Every rank builds an Engine over its LlamaModel and calls Run() (collective; it returns after
// Shutdown). World rank 0 alone takes work: Submit (thread-safe, from any thread, such as an
// HTTP server's) queues a request and returns a future. The loop on rank 0 decides each step and
// broadcasts it; every rank runs it together:
//   - a prefill batch: queued requests first come first served up to max_batch_tokens new
//     tokens, never two turns of one session in a batch and never a later turn before an earlier
//     one (nor a turn while the session is still generating);
//   - a decode step (paper Alg. 4, LlamaModel::Decode): one token for every running sequence.
// When both are due they alternate, so neither new prompts nor running generations starve.
// While idle, rank 0 broadcasts a heartbeat every `heartbeat` that ends in a barrier, so every
// rank's waits keep their deadline: a silent rank, rank 0 or another, ends the job.
//
// Generation: each token is drawn (runtime/sampling.h: greedy or seeded temperature / top-k /
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
// Prefix cache (issue 21; runtime/prefix_cache.md): a prompt's KV is kept after its request as a
// prefix entry, indexed on rank 0 by a hash chain of its full blocks (runtime/prefix_index.h). A
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

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"
#include "runtime/kv_handle.h"
#include "runtime/llama_model.h"
#include "runtime/prefill_batch.h"
#include "runtime/prefix_index.h"
#include "runtime/sampling.h"

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

// One generated token, as a stream sees it.
struct GeneratedToken {
  int index = 0;  // 0: the first token (from the prefill)
  SampledToken token;
  std::string finish_reason;  // set on the last token: "stop", "length" or "abort"
};

struct EngineRequest {
  std::vector<int32_t> tokens;  // this turn's new tokens
  std::string session;          // "": nothing kept; else continue and keep this conversation
  int max_tokens = 1;           // tokens to generate; 1: prefill and the first token only
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // stop at these too
  bool ignore_eos = false;        // do not stop at the engine's eos_ids
  // Rank 0's engine thread asks it after each token (the generated tokens so far, the newest
  // last); true ends the generation with finish_reason "stop", as a stop id does (its decode slot
  // and, without a session, its KV are freed). The token that made it true is kept like any
  // other (the result's tokens, a session's history): the caller cuts the text. The server's
  // stop strings: only it has the text. Must be quick and must not block (it runs with the
  // engine's lock held).
  std::function<bool(const std::vector<SampledToken>&)> stop_when;
  // Rank 0's engine thread calls it with each token as it is chosen (streaming); must not block.
  std::function<void(const GeneratedToken&)> on_token;
  // Set by the client (a stream whose reader left, cpfill_request_cancel): generation ends with
  // finish_reason "abort" at its next token.
  std::shared_ptr<std::atomic<bool>> cancelled;
  // Return the logits of the prompt's last position (EngineResult::logits; the C API's, a
  // check's). Otherwise, and for every later token, the token is drawn where its logits are
  // (on the GPU) unless `sampling` asks for logprobs.
  bool return_logits = false;
  // Keep the KV under a lease and return its hand-off handle (EngineResult::kv_handle). Needs
  // AttachKvHandoff, max_tokens 1 (decode runs elsewhere) and no session.
  bool publish_kv = false;
};

struct EngineResult {
  int32_t first_token = -1;
  std::vector<float> logits;         // [vocab] of the prompt's last position, with return_logits
  std::vector<SampledToken> tokens;  // generated, first token first
  std::string finish_reason;  // "stop" (a stop id), "length" (max_tokens, positions), "abort"
  int64_t prompt_tokens = 0;  // this turn's new tokens
  int64_t cached_tokens = 0;  // tokens whose KV was reused: the session's, or a cached prefix's
  bool recomputed = false;    // the session had been evicted: its history was prefilled again
  int preemptions = 0;        // times the KV cache filled and this sequence was recomputed
  double queue_s = 0;         // from Submit to the start of the batch that answered it
  double prefill_s = 0;       // that batch's prefill, every rank together
  double decode_s = 0;        // from the first token to the last
  int batch_requests = 0;     // requests in that batch
  // This request's ring algorithm in its first prefill, and the selector's reason for it.
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  std::string selector;
  PrefillTimings timings;  // that batch's
  // The decode steps this request took part in, their phases summed (each step's whole batch).
  PrefillTimings decode_timings;
  // publish_kv: the handle (transport filled) and the lease's length.
  std::optional<KvHandle> kv_handle;
  double kv_lease_s = 0;

  std::vector<int32_t> token_ids() const;  // of `tokens`
  double tpot_s() const;  // time per output token after the first (0 for one token)
};

// Counters since start (rank 0), for /metrics.
struct EngineStats {
  int64_t requests_ok = 0, requests_failed = 0, prompt_tokens = 0, cached_tokens = 0;
  int64_t batches = 0, evictions = 0, waiting = 0, sessions = 0;
  int64_t generation_tokens = 0, decode_steps = 0, preemptions = 0, running = 0;
  double kv_usage_ratio = 0;  // rank 0's KV cache, after the last batch or session end
  int64_t kv_leases = 0, kv_leased_tokens = 0;  // held now
  int64_t kv_leases_released = 0, kv_leases_expired = 0;
  double kv_staging_usage_ratio = 0;  // rank 0's hand-off staging pool (0 without one)
  // Prefix cache: requests looked up, those that reused a prefix and the tokens they reused;
  // entries held and their tokens; entries evicted; rank 0's KV blocks held by more than one
  // sequence.
  int64_t prefix_queries = 0, prefix_hits = 0, prefix_hit_tokens = 0;
  int64_t prefix_entries = 0, prefix_tokens = 0, prefix_evictions = 0, kv_blocks_shared = 0;
  // Prefix batching on rank 0 (PrefillTimings::prefix_batch, summed over prefill batches and
  // decode steps): the key rows read once for several sequences instead of once each (over
  // layers and ring steps).
  int64_t prefix_batched_key_rows = 0;
};

class KvHandoff;

class Engine {
 public:
  using Clock = std::chrono::steady_clock;
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
  // or silent past the deadline) ends it with that error on every surviving rank.
  absl::Status Run();

  EngineStats stats() const;                  // rank 0
  std::vector<std::string> sessions() const;  // rank 0: names held, least recently used first

 private:
  struct Pending;
  struct Command;
  // A held hand-off (rank 0).
  struct Lease {
    std::string kv_name;
    int slot = 0;
    uint64_t nonce = 0;
    Clock::time_point expires;
    int64_t tokens = 0;
  };
  struct SessionState {
    std::vector<int32_t> history;  // every token of the conversation so far
    int64_t fed = 0;               // of which the KV cache holds the first `fed`
    bool evicted = false;          // its KV is gone; the next turn prefills the history again
    int64_t last_used = 0;         // batch counter when last used (LRU)
  };

  absl::Status Check(const EngineRequest& request) const;  // what Submit refuses at once
  absl::StatusOr<Command> NextCommand();  // rank 0: waits up to a heartbeat for work
  Command FormBatch();                    // rank 0, lock held: the next batch or control op
  Command DecodeStep();                   // rank 0, lock held: a token for each running one
  absl::Status Execute(Command& command);
  // `published`: the batch's hand-off handles by KV name (PublishKv); null for a session end.
  void Answer(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
              const PrefillTimings& timings, double seconds,
              std::map<std::string, absl::StatusOr<KvHandle>>* published);
  void AnswerDecode(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
                    const PrefillTimings& timings);
  void Requeue(Command& command, const absl::Status& why);
  void MakeRoomToDecode(const Command& command, const absl::Status& why);
  // Rank 0: how `p`'s next token is drawn where its logits are (LlamaModel, PrefillRequest::
  // draw); nullopt when rank 0 needs the logits: the request reports logprobs, or asks for the
  // prompt's logits (return_logits) and this is its prefill.
  std::optional<TokenDraw> DrawInPlace(const Pending& p) const;
  // Rank 0: the next token of each item: drawn in place, or from its output's logits on
  // sampler_pool_. With 256 samples over Llama 3's 128K logits the host's share of a decode step
  // was 250 ms on one core, 44 ms on 8 (an H100 host,
  // bench/results/2026-11-26-h100x2-prefix-decode).
  std::vector<SampledToken> SampleAll(const Command& command,
                                      const std::vector<SequenceOutput>& outputs);
  // Rank 0, lock held: `token` is the next of `p`; true when `p` is finished.
  bool NextToken(Pending& p, const SampledToken& token);
  void Finish(std::unique_ptr<Pending> p);
  void Fail(Command& command, const absl::Status& status);
  void ReturnLeaseSlot(Pending& p);  // rank 0, lock held: a publish that never held
  bool TakeLeaseSlot(Pending& p);    // rank 0, lock held: false when every slot is held
  // Rank 0, lock held: the lease of `request_id` if it holds with `nonce`, else NotFound.
  absl::StatusOr<std::map<std::string, Lease>::iterator> FindLease(const std::string& request_id,
                                                                   const std::string& nonce);
  absl::Status ReleaseLocked(const std::string& request_id, const std::string& nonce);
  void EndLease(const std::string& id);  // rank 0, lock held: frees with the next command
  void ExpireLeases();                   // rank 0, lock held
  // Every rank, after a prefill batch: exports and publishes the batch's hand-offs.
  absl::Status PublishKv(const Command& command,
                         std::map<std::string, absl::StatusOr<KvHandle>>* handles);
  void DropSessions(const std::vector<std::string>& names);  // every rank: revoke, then free
  void UpdateKvUsage();  // rank 0, the loop thread, lock not held: the usage figures of stats_
  void UpdateKvUsageLocked();  // the same, lock held
  std::vector<std::string> IdleSessionsLruFirst(const Command& command) const;
  // Rank 0, lock held: the KV cache is full. Drops the least recently used prefix entry that
  // holds blocks no other sequence holds, else evicts the least recently used idle session;
  // false when there is neither.
  bool EvictOne(const Command& command);
  // Rank 0, the loop thread: KV blocks of session `name` on this rank that no other holds.
  int64_t BlocksOnlyIn(const std::string& name) const;
  // Rank 0, lock held, FormBatch: the prefix cache's plan for `p`, whose KV holds nothing now
  // and would hold `r`'s tokens after the batch: the entry it forks (shortening `r`'s tokens)
  // and whether its KV is kept as an entry. False: wait for the next batch, an earlier request
  // of this one will hold more of its prefix.
  bool PlanPrefix(Pending& p, PrefillRequest& r, const Command& c);
  void KeepPrefix(Pending& p, const Command& command);  // rank 0, lock held, Answer
  void DropEntry(const std::string& entry);  // rank 0, lock held: out of the index, then the ranks
  // Every rank: the batch's forks before its prefill (a refusal undoes them) and its kept
  // prompts after it.
  absl::Status ForkPrefixes(Command& command);
  absl::Status KeepPrefixes(Command& command);
  LlamaModel& model_;
  parallel::Communicator& world_;
  const EngineOptions options_;
  const bool root_;

  mutable std::mutex mu_;
  std::condition_variable work_;
  std::deque<std::unique_ptr<Pending>> queue_;     // requests and session ends, in arrival order
  std::vector<std::unique_ptr<Pending>> running_;  // generating, oldest first
  int64_t decoding_ = 0;  // of them, in the decode step under way (taken out of running_)
  bool shutdown_ = false;
  bool prefill_next_ = true;    // prefill batches and decode steps alternate when both are due
  bool prefill_waits_ = false;  // the KV cache is full of generations: prefill after one ends
  std::unique_ptr<ThreadPool> sampler_pool_;  // rank 0: SampleAll's threads
  int64_t step_ = 0;            // decode steps so far: PlanDecode's moving offset
  int64_t next_id_ = 0;         // names the KV of generating requests without a session
  int solo_ = 0;  // next batches run one request at a time (after a batch failed as a whole)
  std::vector<std::string> drop_next_;  // sessions every rank drops with the next command
  std::map<std::string, SessionState> sessions_;
  PrefixIndex prefix_;      // rank 0
  int64_t prefix_now_ = 0;  // the prefix index's clock (LRU)
  EngineStats stats_;
  // KV hand-off: set by AttachKvHandoff.
  KvHandoff* handoff_ = nullptr;
  std::string engine_id_;
  std::chrono::milliseconds lease_length_{30000};
  std::map<std::string, Lease> leases_;       // rank 0: by request id
  std::vector<int> free_lease_slots_;         // rank 0
  uint64_t next_nonce_ = 1;                   // rank 0
  std::map<std::string, int> lease_slot_of_;  // every rank: published KV name -> lease word
};

}  // namespace cpfill::runtime
