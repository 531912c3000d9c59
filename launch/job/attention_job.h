// cpfill/launch/job/attention_job.h — one fused batch of synthetic context-parallel attention, as
// the `attention` and `calibrate` commands run it: the batch and its shard plan, the selector's
// decision, repeated timed runs agreed over the world, and the check against one rank.
//
//   CPFILL_ASSIGN_OR_RETURN(AttentionBatch batch, MakeAttentionBatch(spec, grid));
//   CPFILL_ASSIGN_OR_RETURN(auto runner, backend.MakeRunner(batch.plan, batch.shape,
//                                                         batch.inputs, batch.slice));
//   CPFILL_ASSIGN_OR_RETURN(TimedRuns runs, RunTimed(*runner, *grid.world, algo, 5, 0, {}));
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "launch/job/backend.h"
#include "launch/job/synthetic_attention.h"
#include "parallel/grid.h"
#include "parallel/ring_attention.h"
#include "parallel/selector.h"
#include "sharding/plan.h"

namespace cpfill::launch {

struct AttentionSpec {
  std::vector<int64_t> new_lens, cached_lens;    // cached_lens empty: full prefill
  int heads = 16, kv_heads = 1, head_dim = 128;  // model totals (every TP rank together)
  bool causal = true;
  uint64_t seed = 1;
};

struct AttentionBatch {
  std::vector<sharding::SequenceRequest> requests;
  sharding::ShardPlan plan;
  attention::AttentionShape shape;  // this rank's heads
  parallel::ModelSpec model;        // this rank's heads, for the selector
  SyntheticAttention inputs;
  HeadSlice slice;
  double flops_per_pair() const { return 4.0 * shape.head_dim * shape.num_heads; }
};

// InvalidArgument naming the flag when the spec is malformed or does not split over the grid.
absl::StatusOr<AttentionBatch> MakeAttentionBatch(const AttentionSpec& spec,
                                                  const parallel::ProcessGrid& grid);

// Bytes one rank will hold for the batch, counted from the plan before anything is allocated:
// its shard of the fp32 inputs and outputs and the ring's message buffers; on world rank 0 with
// `gather` (--check, --save) the whole batch in global order and, with `check`, the reference.
// `device`: a CUDA ring, which holds the shard and its messages in bf16 on the GPU (the host
// keeps the fp32 shard and a bf16 copy for the upload).
struct BatchMemory {
  int64_t host = 0, device = 0;
};
BatchMemory AttentionMemory(const AttentionBatch& b, const parallel::ProcessGrid& grid, bool device,
                            bool gather, bool check);
// AttentionMemory against what every rank has free (collective): ResourceExhausted, the same on
// every rank, naming the tightest rank's need, its free bytes and `remedy`.
absl::Status CheckAttentionFits(const BatchMemory& need, Backend& backend,
                                parallel::Communicator& world, const std::string& remedy);

// The selector's decision for the whole batch, and for each sequence alone (its reason too).
struct BatchSelection {
  parallel::Selection batch;
  std::vector<parallel::Selection> per_sequence;
  std::vector<parallel::RingAlgorithm> Choices() const;
};
absl::StatusOr<BatchSelection> SelectForBatch(const AttentionBatch& b, int cp_size,
                                              const parallel::SystemSpec& system,
                                              parallel::SelectorRule rule,
                                              const parallel::FittedCoefficients& fitted);

// `repeat` timed runs after `warmup` untimed ones, each started together (a barrier) and timed
// on the slowest rank.
struct TimedRuns {
  std::vector<parallel::RingTimings> runs;  // this rank's
  std::vector<double> slowest_s;            // per run, the slowest rank's total
  double median_s = 0;
};
// Progress: `on_step` after every ring step of a timed run, `on_run` after each timed run with
// its slowest-rank time (either may be null).
struct RunProgress {
  std::function<void(int run, const parallel::RingStepTiming&, int steps)> on_step;
  std::function<void(int run, double slowest_s)> on_run;
};
// `per_sequence`: the algorithm of every sequence (Everywhere: one for all).
absl::StatusOr<TimedRuns> RunTimed(Runner& runner, parallel::Communicator& world,
                                   const std::vector<parallel::RingAlgorithm>& per_sequence,
                                   int repeat, int warmup, const RunProgress& progress);
std::vector<parallel::RingAlgorithm> Everywhere(parallel::RingAlgorithm algo, int num_sequences);

// The gathered result against a single-rank computation of the same batch on world rank 0.
struct AttentionCheck {
  double max_abs_o = 0, rel_fro_o = 0, max_abs_lse = 0;
  int64_t lse_inf_mismatch = 0;
  bool pass = false;
};
// The whole batch in global token order: inputs (rounded to bf16 when the backend was) and the
// gathered O and LSE. Collective; the vectors are filled on world rank 0 only.
struct GlobalAttention {
  std::vector<float> q, k, v, o, lse;
};
absl::StatusOr<GlobalAttention> GatherGlobal(Runner& runner, const AttentionBatch& b,
                                             const parallel::ProcessGrid& grid, bool bf16);
// On world rank 0: the single-rank reference (every core) and the comparison.
absl::StatusOr<AttentionCheck> CheckAgainstOneRank(const AttentionBatch& b,
                                                   const GlobalAttention& g, double tolerance);
// q, k, v, o, lse as safetensors with the batch's description as metadata.
absl::Status SaveAttention(const std::string& path, const AttentionBatch& b,
                           const AttentionSpec& spec, const GlobalAttention& g,
                           const std::vector<parallel::RingAlgorithm>& per_sequence);

}  // namespace cpfill::launch
