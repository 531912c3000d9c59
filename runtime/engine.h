// cpfill/runtime/engine.h — the long-running prefill engine: one model, one KV cache, one queue.
//
// Every rank builds an Engine over its LlamaModel and calls Run() (collective; it returns after
// Shutdown). World rank 0 alone takes work: Submit (thread-safe, from any thread, such as an
// HTTP server's) queues a request and returns a future; the loop forms fused batches first come
// first served up to max_batch_tokens new tokens, never two turns of one session in a batch and
// never a later turn before an earlier one, broadcasts each batch, and every rank prefills it
// together. While idle, rank 0 broadcasts a heartbeat every `heartbeat` that ends in a barrier,
// so every rank's waits keep their deadline: a silent rank, rank 0 or another, ends the job.
//
// Sessions keep their KV in the model's cache between turns. When a batch does not fit, rank 0
// evicts the least recently used idle session and tries again; a later turn of an evicted session
// prefills its whole history again (reported as recomputed, no cached tokens). A batch that fails
// as a whole (a request the model refuses) is retried one request at a time, so a bad request
// gets its own error and the others go on.
//
//   Engine engine(*model, world, {.max_batch_tokens = 65536});
//   std::thread loop([&] { status = engine.Run(); });          // every rank
//   auto reply = engine.Submit({.tokens = ids, .session = "chat-1"});   // rank 0
//   absl::StatusOr<EngineResult> r = reply->get();
//   engine.Shutdown();  loop.join();
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "runtime/llama_model.h"
#include "runtime/prefill_batch.h"

namespace cpfill::runtime {

struct EngineOptions {
  int64_t max_batch_tokens = 131072;          // new tokens in one fused batch
  int max_queue = 1024;                       // waiting requests before Submit refuses
  std::chrono::milliseconds heartbeat{1000};  // rank 0's idle broadcast; below the deadline
  // Rank 0, after each batch (the server's log line): requests, new and cached tokens, the ring
  // algorithm, seconds.
  std::function<void(int, int64_t, int64_t, parallel::RingAlgorithm, double)> on_batch;
};

struct EngineRequest {
  std::vector<int32_t> tokens;  // this turn's new tokens
  std::string session;          // "": nothing kept; else continue and keep this conversation
};

struct EngineResult {
  int32_t first_token = -1;
  std::vector<float> logits;   // [vocab] of the last position
  int64_t prompt_tokens = 0;   // this turn's new tokens
  int64_t cached_tokens = 0;   // the session's tokens whose KV was reused
  bool recomputed = false;     // the session had been evicted: its history was prefilled again
  double queue_s = 0;          // from Submit to the start of the batch that answered it
  double prefill_s = 0;        // that batch's prefill, every rank together
  int batch_requests = 0;      // requests in that batch
  PrefillTimings timings;      // that batch's
};

// Counters since start (rank 0), for /metrics.
struct EngineStats {
  int64_t requests_ok = 0, requests_failed = 0, prompt_tokens = 0, cached_tokens = 0;
  int64_t batches = 0, evictions = 0, waiting = 0, sessions = 0;
  double kv_usage_ratio = 0;  // rank 0's KV cache, after the last batch or session end
};

class Engine {
 public:
  using Reply = std::future<absl::StatusOr<EngineResult>>;

  Engine(LlamaModel& model, parallel::Communicator& world, EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Rank 0, any thread. InvalidArgument for a request no batch could run (empty, a token id
  // outside the vocabulary, more new tokens than max_batch_tokens); Unavailable when max_queue
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
  struct SessionState {
    std::vector<int32_t> history;  // every token of the conversation so far
    bool evicted = false;          // its KV is gone; the next turn prefills the history again
    int64_t last_used = 0;         // batch counter when last used (LRU)
  };

  absl::Status Check(const EngineRequest& request) const;  // what Submit refuses at once
  absl::StatusOr<Command> NextCommand();  // rank 0: waits up to a heartbeat for work
  Command FormBatch();                    // rank 0, lock held: the next batch or control op
  absl::Status Execute(Command& command);
  void Answer(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
              const PrefillTimings& timings, double prefill_s);
  void Fail(Command& command, const absl::Status& status);
  std::vector<std::string> IdleSessionsLruFirst(const Command& command) const;

  LlamaModel& model_;
  parallel::Communicator& world_;
  const EngineOptions options_;
  const bool root_;

  mutable std::mutex mu_;
  std::condition_variable work_;
  std::deque<std::unique_ptr<Pending>> queue_;  // requests and session ends, in arrival order
  bool shutdown_ = false;
  int solo_ = 0;  // next batches run one request at a time (after a batch failed as a whole)
  std::vector<std::string> evict_next_;
  std::map<std::string, SessionState> sessions_;
  EngineStats stats_;
};

}  // namespace cpfill::runtime
