// cpfill/runtime/serving/request.h — what a client gives the engine and gets back, and the state
// of one request on world rank 0 while the scheduler holds it.
//
//   EngineRequest r{.tokens = ids, .session = "chat-1", .max_tokens = 64};
//   auto reply = engine.Submit(std::move(r));   // runtime/serving/engine.h
//   absl::StatusOr<EngineResult> result = reply->get();   // result->tokens, ->finish_reason
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/selector.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/model/prefill_batch.h"
#include "runtime/model/sampling.h"

namespace cpfill::runtime {

using EngineClock = std::chrono::steady_clock;

// One generated token, as a stream sees it.
struct GeneratedToken {
  int index = 0;  // 0: the first token (from the prefill)
  SampledToken token;
  std::string finish_reason;  // set on the last token: "stop", "length" or "abort"
  // The first token only, with EngineRequest::prompt_logprobs: EngineResult::prompt_logprobs, so
  // that a stream can send them before the generation ends (echo).
  std::vector<SampledToken> prompt_logprobs;
};

struct EngineRequest {
  std::vector<int32_t> tokens;  // this turn's new tokens
  std::string session;          // "": nothing kept; else continue and keep this conversation
  int max_tokens = 1;           // tokens to generate; 1: prefill and the first token only
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // stop at these too
  bool ignore_eos = false;        // do not stop at the engine's eos_ids
  // Until this many tokens are generated, EOS and the stop ids are masked out of the logits
  // (drawn on rank 0's host then, as vLLM's min_tokens does).
  int min_tokens = 0;
  // >= 0: the log-probability of every prompt token after the first under the model, and the
  // top `prompt_logprobs` tokens at each position (EngineResult::prompt_logprobs; echo with
  // logprobs). The LM head then runs over every prompt position of this request only, a chunk
  // of rows at a time; the prefix cache is not used for it (a cached prefix has no logits).
  int prompt_logprobs = -1;
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
  // Decode with SparQ (PrefillRequest::sparq; the CPU backend only); unset: dense.
  std::optional<attention::sparq::SparqConfig> sparq;
};

struct EngineResult {
  int32_t first_token = -1;
  std::vector<float> logits;         // [vocab] of the prompt's last position, with return_logits
  std::vector<SampledToken> tokens;  // generated, first token first
  // With prompt_logprobs: entry i is prompt token i + 1 (its id, logprob and top k).
  std::vector<SampledToken> prompt_logprobs;
  std::string finish_reason;  // "stop" (a stop id), "length" (max_tokens, positions), "abort"
  int64_t prompt_tokens = 0;  // this turn's new tokens
  int64_t cached_tokens = 0;  // tokens whose KV was reused: the session's, or a cached prefix's
  bool recomputed = false;    // the session had been evicted: its history was prefilled again
  int preemptions = 0;        // times the KV cache filled and this sequence was recomputed
  int64_t sparq_decode_steps = 0;  // decode steps that attended with SparQ (SparqAttends)
  double queue_s = 0;         // from Submit to the start of the batch that answered it
  double prefill_s = 0;       // that batch's prefill, every rank together
  double decode_s = 0;        // from the first token to the last
  int batch_requests = 0;     // requests in that batch
  // This request's ring algorithm in its first prefill, and the selector's reason for it.
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  std::string selector;
  StepTimings timings;  // that batch's
  // The decode steps this request took part in, their phases summed (each step's whole batch).
  StepTimings decode_timings;
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
  int64_t sparq_decode_steps = 0;  // decode steps where some sequence attended with SparQ
  double kv_usage_ratio = 0;  // rank 0's KV cache, after the last batch or session end
  int64_t kv_leases = 0, kv_leased_tokens = 0;  // held now
  int64_t kv_leases_released = 0, kv_leases_expired = 0;
  double kv_staging_usage_ratio = 0;  // rank 0's hand-off staging pool (0 without one)
  // Prefix cache: requests looked up, those that reused a prefix and the tokens they reused;
  // entries held and their tokens; entries evicted; rank 0's KV blocks held by more than one
  // sequence.
  int64_t prefix_queries = 0, prefix_hits = 0, prefix_hit_tokens = 0;
  int64_t prefix_entries = 0, prefix_tokens = 0, prefix_evictions = 0, kv_blocks_shared = 0;
  // Prefix batching on rank 0 (StepTimings::prefix_batch, summed over prefill batches and
  // decode steps): the key rows read once for several sequences instead of once each (over
  // layers and ring steps).
  int64_t prefix_batched_key_rows = 0;
};

// A request or a session end waiting on rank 0, the promise that answers it, and (once it has
// begun) its generation so far. The scheduler owns it from Submit to its answer.
struct PendingRequest {
  bool end_session = false;
  EngineRequest request;
  std::string end_name;
  std::promise<absl::StatusOr<EngineResult>> reply;
  std::promise<absl::Status> ended;
  EngineClock::time_point submitted;
  int64_t cached = 0;       // set when batched: the session's tokens already in the cache
  bool recomputed = false;  // set when batched: the session's history is in this request
  // Generation: the session holding its KV (the request's, or an internal one), the result so
  // far (filled by the first prefill), the positions it may still use, and when it started.
  std::string kv_name;
  EngineResult result;
  int64_t positions_left = 0;
  EngineClock::time_point first_token_at;
  bool started = false;  // its first prefill ran (a preempted one is queued again)
  // publish_kv: the lease it will hold, picked when first batched.
  std::string lease_id;
  int lease_slot = -1;
  KvNonce lease_nonce;
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

}  // namespace cpfill::runtime
