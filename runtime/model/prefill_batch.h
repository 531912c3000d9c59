// cpfill/runtime/model/prefill_batch.h — the requests and results of a prefill and the planning
// around its layers: check the requests and plan the batch on top of the sessions' KV, choose the
// ring algorithm, count the model FLOPs, and collect last-position logits on world rank 0.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "attention/prefix_batched.h"
#include "attention/sparq/sparq.h"
#include "parallel/communicator.h"
#include "parallel/ring_plan.h"
#include "parallel/selector.h"
#include "runtime/model/model_config.h"
#include "runtime/model/sampling.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

struct PrefillRequest {
  std::vector<int32_t> tokens;  // this turn's new tokens
  std::string session;          // "": nothing kept; else continue and keep this session's cache
  // Set: the next token is drawn where the last position's logits are (on the GPU, on the CP
  // rank that holds it) and only its id comes back, no logits. Unset: the logits come back.
  std::optional<TokenDraw> draw;
  // >= 0: SequenceOutput::prompt_logprobs, with the top this many at each position; -1: none.
  // Costs the LM head over every new position of this request (a chunk of rows at a time).
  int prompt_logprobs = -1;
  // Set: decode steps attend with SparQ (attention/sparq/sparq.h; the CPU backend only), once the
  // sequence is longer than k + local_window (shorter ones stay dense, which SparQ would equal).
  // Prefill is always dense.
  std::optional<attention::sparq::SparqConfig> sparq;
};

// Whether a decode step of a sequence that holds `seq_tokens` tokens (the new one included)
// attends with SparQ: the model decides with it, and the engine counts with it.
// A request's SparQ config against the model's head_dim: InvalidArgument naming the field
// ("sparq.r" 1..head_dim, "sparq.k" >= 1, "sparq.l" >= 0), for the HTTP body and --sparq.
inline absl::Status CheckSparqConfig(const attention::sparq::SparqConfig& c, int head_dim) {
  if (c.r < 1 || c.r > head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("sparq.r = ", c.r, " must be in 1..", head_dim, " (the head dim)"));
  }
  if (c.k < 1) return absl::InvalidArgumentError(absl::StrCat("sparq.k = ", c.k, " must be >= 1"));
  if (c.local_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("sparq.l = ", c.local_window, " must be >= 0"));
  }
  return absl::OkStatus();
}

inline bool SparqAttends(const std::optional<attention::sparq::SparqConfig>& config,
                         int64_t seq_tokens) {
  return config.has_value() && seq_tokens > int64_t{config->k} + config->local_window;
}

// World rank 0's (the others' are empty).
struct SequenceOutput {
  std::vector<float> logits;  // [vocab] of the last position; empty for a request with a draw
  int32_t first_token = -1;   // the argmax of the logits, or the token drawn
  // With PrefillRequest::prompt_logprobs: entry i for the request's token i + 1 (a position's
  // logits score the next token): its id, log-softmax and top k, most likely first.
  std::vector<SampledToken> prompt_logprobs;
};

struct StepOptions {
  bool auto_algorithm = true;  // the selector picks per sequence; else `algorithm` for all
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  parallel::SelectorRule rule = parallel::SelectorRule::kAlg5;
  parallel::SystemSpec system{.tflops = 800, .gbps = 50, .elem_bytes = 2};
  parallel::FittedCoefficients fitted;
  // The KV cache, allocated once at model creation: a capacity in tokens per rank (every layer's
  // K and V), or, when that is 0, this fraction of the rank's free memory.
  int64_t kv_capacity_tokens = int64_t{1} << 16;
  double kv_memory_fraction = 0;
  int kv_block_tokens = 64;   // tokens per KV block (16..256)
  int threads = 1;            // kernel threads per rank (CPU backend)
  bool record_spans = false;  // StepTimings::spans: every phase of every layer (--trace)
  // Sequences whose KV starts with the same blocks (forks of one prompt: n samples, questions
  // after a cached document, a cached system prompt) attend to those blocks together, read once:
  // in decode steps, and in prefills over cached rows, which then read the cache in place
  // (attention/prefix_batched.h). Off: each sequence reads its own, and a prefill
  // copies every sequence's cached rows out for the ring.
  bool prefix_batching = true;
  // Every token's result independent of the batch it runs in, bit for bit (CPU backend only): a
  // prompt after a cached prefix gives the logits of the same prompt prefilled whole, on one rank
  // (CP rings merge partials in an order the layout decides). GEMMs run a row at a time and
  // decode reads no shared prefix as a root (its merge rounds differently). Slow: for checks.
  bool batch_invariant = false;
};

struct StepTimings {
  double total_s = 0, embed_s = 0, gemm_s = 0, attention_s = 0, allreduce_s = 0, lm_head_s = 0;
  double other_s = 0;  // norms, RoPE, SwiGLU, residual adds
  double kv_s = 0;     // new K/V into the KV cache, each sequence's K/V out for the ring
  // Host wall time (the phases above are the device's): from the step's start to its first
  // layer's enqueue (checks, planning, the KV blocks agreed with every rank, ring plan, block
  // tables), and enqueueing every layer (with the first layer's attention plan and position
  // upload). The GPU waits on the host where enqueueing takes longer than the phases it
  // enqueues (the CPU backend runs each phase as it is enqueued: there it is the work itself).
  double host_plan_s = 0, host_enqueue_s = 0;
  parallel::Selection selection;  // the selector's decision for the batch taken as one
  // In request order: the selector's decision for each sequence alone (on its own new and
  // cached lengths), and the algorithm it ran (that choice, or the one forced for all).
  std::vector<parallel::Selection> selections;
  std::vector<parallel::RingAlgorithm> algorithms;
  int rings = 1;  // fused rings per layer: one per algorithm that ran
  int64_t new_tokens = 0, cached_tokens = 0;
  // This rank's prefix batching in the step (StepOptions::prefix_batching), summed
  // over layers and ring steps.
  attention::PrefixBatchCounts prefix_batch;
  double model_flops = 0;  // 2 * params * tokens + causal attention FLOPs (whole batch)
  // With StepOptions::record_spans: this rank's timeline, "embedding", then per layer "layer
  // L <phase>" (norms, GEMMs, RoPE, KV cache, attention ring on lane "compute"; the TP
  // all-reduces on lane "exchange"), seconds from the first; the wall clock at that first span.
  std::deque<parallel::RingSpan> spans;  // a deque: phases hold pointers into it until Finish
  double spans_origin_unix_s = 0;

  // Adds `step`'s phase times and total (the decode steps a request took part in, summed).
  void AddPhases(const StepTimings& step);
};

// A session's cache as far as planning needs it: how many tokens, and where they live.
struct SessionLayout {
  int64_t tokens = 0;
  sharding::KvLayout layout;  // one sequence
};

struct BatchPlan {
  std::vector<sharding::SequenceRequest> sequences;
  sharding::ShardPlan plan;
  sharding::LocalLayout layout;    // this CP rank's
  std::vector<int32_t> local_ids;  // token id of every local query row
};

// Checks the requests (non-empty, ids in the vocabulary, a session at most once, positions
// within the model's) and plans them. `session` returns the cache of a named session, or null.
// With `decode_step`, a decode step (paper §3.6): one new token per request, each placed whole
// on one CP rank, round-robin with an offset that moves every step (sharding::PlanDecode).
absl::StatusOr<BatchPlan> PlanBatch(
    const ModelConfig& config, const std::vector<PrefillRequest>& batch, int cp_size, int cp_rank,
    const std::function<const SessionLayout*(const std::string&)>& session,
    std::optional<int64_t> decode_step = std::nullopt);

// KV token rows that any one of `cp_size` ranks needs for `batch` alone (every sequence's share
// of 2N chunks rounded up, plus a partly filled block each): the capacity of a one-shot run.
int64_t KvTokensForBatch(const std::vector<PrefillRequest>& batch, int cp_size, int block_tokens);

// The model FLOPs of a batch: 2 x every layer's linear weights x new tokens, the LM head at each
// sequence's last position, and causal attention (unmasked pairs only) in every layer.
double ModelFlops(const ModelConfig& config, const std::vector<sharding::SequenceRequest>& seqs);

// Local query rows that are some sequence's last position: (sequence, row) pairs.
std::vector<std::pair<int, int64_t>> LastPositionRows(const BatchPlan& b);

// Collects on world rank 0 the logits every rank computed for its last-position rows:
// `logits` holds, for each entry of `rows`, this TP rank's vocabulary slice (vocab / tp values).
// Sequences with wants_logits[seq] false get none (their tokens come by GatherDrawnTokens).
absl::StatusOr<std::vector<SequenceOutput>> GatherLastLogits(
    const ModelConfig& config, int num_sequences, const std::vector<std::pair<int, int64_t>>& rows,
    std::span<const float> logits, const std::vector<bool>& wants_logits, int tp_rank, int tp_size,
    parallel::Communicator& world);

// Collects on world rank 0 the tokens drawn in place, (sequence, token) pairs from each rank
// (one TP rank per group sends), into (*out)[seq].first_token: every sequence with
// wants_logits[seq] false must get one (Internal otherwise). Collective over the world.
absl::Status GatherDrawnTokens(const std::vector<std::pair<int, int64_t>>& drawn,
                               const std::vector<bool>& wants_logits, parallel::Communicator& world,
                               std::vector<SequenceOutput>* out);

// Fills `t`'s token totals, the selector's decisions (on this rank's heads) for the batch as one
// and for each sequence alone, the algorithm each sequence runs, and the model FLOPs. Each
// sequence runs its own choice, unless `options` forces one for all, the ring has one rank
// (nothing travels: one ring), or this is a decode step (`decode`: pass-Q, Alg. 4).
absl::Status ChooseAlgorithms(const StepOptions& options, const ModelConfig& config, int tp_size,
                              int cp_size, const BatchPlan& b, bool decode, StepTimings* t);

// The layout a session has after this batch: its runs in the plan's KvLayoutAfter (built for
// this sequence alone, O(cp_size) per call).
SessionLayout SessionAfter(const BatchPlan& b, int seq);

}  // namespace cpfill::runtime
