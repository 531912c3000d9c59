// cpfill/runtime/plan/cost_model.h — predicts one prefill (and one decode step) of a model on a
// TP x CP grid over N nodes from a device profile and a link profile, without running it.
//
// The model, per layer and on the slowest rank (cost_model.cc has the arithmetic):
//   linear layers  2 R W_layer / TP FLOPs at the GEMM rate for R rows (R: the rank's new tokens),
//                  two all-reduces of R D e bytes: 2 (TP-1)/TP bytes / BW_tp + 2 (TP-1) latency;
//   the ring       the shard plan of sharding/ (2N chunks, rank i holds i and 2N-1-i), step j on
//                  rank k against source s = (k - j) mod N: the visible (query, key) pairs of
//                  that step under the causal mask, 4 D_H H pairs FLOPs at the attention rate
//                  for that many pairs; the exchange (the message layout of parallel/ring_plan.h:
//                  pass-KV L slots x (2 H_kv D_H e + 4), pass-Q max-rank-rows x (H D_H e + 4))
//                  over the ring's link, posted when the step's compute starts, received from
//                  the previous rank; the next step starts when both are done (exposed wait);
//                  pass-Q then all-to-all of fp32 partials (O and LSE) and the merge;
//   KV writes and elementwise layers  bytes at the device's memory bandwidth.
// TTFT = layers x (linear + ring + KV writes + elementwise) + LM head on the last tokens.
//
//   PlanInput in{.model = PlanModelOf(config), .requests = {{.new_tokens = 131072}},
//                .gpus_per_node = 8, .nodes = 4, .tp = 8, .cp = 4};
//   CPFILL_ASSIGN_OR_RETURN(Prediction p, PredictPrefill(in, device, links));
//   p.ttft_s; p.ToJson();
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "parallel/selector.h"
#include "runtime/model/model_config.h"
#include "runtime/plan/profile.h"
#include "sharding/plan.h"

namespace cpfill::runtime::plan {

// Heads of one rank's attention (the model's divided by TP).
struct AttentionGeometry {
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 128;
};

// One step of one rank's ring, as `cpfill attention --json` reports it.
struct RingStepCost {
  int step = 0;
  int source_cp_rank = 0;
  int64_t visible_pairs = 0;  // (query, key) pairs of one head
  int64_t chunk_pairs = 0, chunk_pairs_hidden = 0;
  int64_t key_rows = 0;        // keys streamed by the step's launch (decode's memory bound)
  int64_t exchange_bytes = 0;  // sent this step; 0 on the last
  double compute_s = 0, transfer_s = 0, wait_s = 0;
};

struct RankRingCost {
  int cp_rank = 0;
  std::vector<RingStepCost> steps;
  int64_t all_to_all_bytes = 0;  // pass-Q: partials this rank sends
  double all_to_all_s = 0, merge_s = 0;
  double total_s = 0;  // from the ring's start to this rank's output
};

struct RingCost {
  parallel::RingAlgorithm algorithm = parallel::RingAlgorithm::kPassKV;
  std::vector<int> sequences;  // indices into the request list
  std::vector<RankRingCost> ranks;
  double total_s = 0;  // the slowest rank's
  nlohmann::ordered_json ToJson() const;
};

// The ring of `algorithm` over `shards` (one fused ring): every rank's steps, in time.
// InvalidArgument for all-gather (not modelled) or a geometry with no heads.
absl::StatusOr<RingCost> PredictRing(const sharding::ShardPlan& shards,
                                     parallel::RingAlgorithm algorithm,
                                     const AttentionGeometry& geometry, double elem_bytes,
                                     const DeviceProfile& device, const Link& link);

// What is planned: a model (a config) or attention alone (no config: one layer of attention with
// the given heads, as `cpfill attention` runs it).
struct PlanModel {
  std::optional<ModelConfig> config;
  int heads = 0, kv_heads = 0, head_dim = 128;  // the model's, every TP rank together
  int layers = 1;
  std::string name;
};
PlanModel PlanModelOf(const ModelConfig& config);

struct PlanInput {
  PlanModel model;
  std::vector<sharding::SequenceRequest> requests;
  int gpus_per_node = 8;
  int nodes = 1;
  int tp = 1, cp = 1;  // tp * cp = gpus_per_node * nodes; TP groups fill nodes first
  std::optional<parallel::RingAlgorithm> algorithm;  // forced for every request; else selector
  parallel::SelectorRule rule = parallel::SelectorRule::kAlg5;
  parallel::FittedCoefficients fitted = parallel::FittedCoefficients::Paper();
};

struct LayerCost {
  double gemm_s = 0, all_reduce_s = 0, attention_s = 0, kv_write_s = 0, elementwise_s = 0;
  double total_s() const {
    return gemm_s + all_reduce_s + attention_s + kv_write_s + elementwise_s;
  }
};

struct MemoryEstimate {
  int64_t weight_bytes = 0;      // runtime::HostWeightBytes at the device's element size
  int64_t kv_bytes = 0;          // the most any rank holds after the prefill, every layer
  int64_t activation_bytes = 0;  // the largest step's working set (estimate)
  int64_t total_bytes() const { return weight_bytes + kv_bytes + activation_bytes; }
  std::string verdict;  // "fits", "unknown" or CheckFits' message
  bool fits = true;
};

struct Prediction {
  PlanInput input;
  std::string ring_link, tp_link;
  std::vector<parallel::Selection> selections;      // per request
  std::vector<parallel::RingAlgorithm> algorithms;  // per request, what ran
  std::vector<RingCost> rings;                      // one per algorithm used, in run order
  LayerCost layer;
  double lm_head_s = 0;
  double ttft_s = 0;
  double decode_step_s = 0;  // one decode step of the batch after this prefill (TTIT)
  MemoryEstimate memory;
  std::vector<std::string> assumptions;
  nlohmann::ordered_json ToJson() const;
};

// InvalidArgument naming the quantity for a grid that does not cover the GPUs, heads that do not
// split over TP (the rules of ModelConfig::ValidateForTp), no requests, a model plan with no GEMM
// rates in the profile.
absl::StatusOr<Prediction> PredictPrefill(const PlanInput& input, const DeviceProfile& device,
                                          const LinkProfile& links);

// Every TP x CP that covers gpus_per_node * nodes (TP a power of two that the heads allow), each
// predicted; sorted by TTFT, those that do not fit last.
absl::StatusOr<std::vector<Prediction>> SearchGrids(const PlanInput& input,
                                                    const DeviceProfile& device,
                                                    const LinkProfile& links);

}  // namespace cpfill::runtime::plan
