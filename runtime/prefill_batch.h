// cpfill/runtime/prefill_batch.h — what every model backend does around the layers of a
// prefill: check the requests and plan the batch on top of the sessions' KV caches, agree on the
// KV capacity, choose the ring algorithm, count the model FLOPs, and collect last-position
// logits on world rank 0. The CPU model (llama_model.h) and the CUDA model
// (cuda/llama_model_cuda.h) share it, so they plan and report identically.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/selector.h"
#include "runtime/model_config.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

struct PrefillRequest {
  std::vector<int32_t> tokens;  // this turn's new tokens
  std::string session;          // "": nothing kept; else continue and keep this session's cache
};

struct SequenceOutput {
  std::vector<float> logits;  // [vocab] of the last position (world rank 0 only)
  int32_t first_token = -1;   // argmax of the logits
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
absl::StatusOr<BatchPlan> PlanBatch(
    const ModelConfig& config, const std::vector<PrefillRequest>& batch, int cp_size, int cp_rank,
    const std::function<const SessionLayout*(const std::string&)>& session);

// ResourceExhausted on every rank (agreed over `world`) when some rank would hold more than
// `capacity` token slots: what it holds plus its share of the batch's new tokens.
absl::Status CheckKvCapacity(const BatchPlan& b, int64_t held, int64_t capacity, size_t requests,
                             parallel::Communicator& world);

// The model FLOPs of a batch: 2 x every layer's linear weights x new tokens, the LM head at each
// sequence's last position, and causal attention (unmasked pairs only) in every layer.
double ModelFlops(const ModelConfig& config, const std::vector<sharding::SequenceRequest>& seqs);

// Local query rows that are some sequence's last position: (sequence, row) pairs.
std::vector<std::pair<int, int64_t>> LastPositionRows(const BatchPlan& b);

// Collects on world rank 0 the logits every rank computed for its last-position rows:
// `logits` holds, for each entry of `rows`, this TP rank's vocabulary slice (vocab / tp values).
absl::StatusOr<std::vector<SequenceOutput>> GatherLastLogits(
    const ModelConfig& config, int num_sequences, const std::vector<std::pair<int, int64_t>>& rows,
    const std::vector<float>& logits, int tp_rank, int tp_size, parallel::Communicator& world);

// The layout a session has after this batch: its runs in the plan's KvLayoutAfter.
SessionLayout SessionAfter(const BatchPlan& b, int seq);

}  // namespace cpfill::runtime
