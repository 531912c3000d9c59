// cpfill/parallel/mixed_ring.h — one fused batch whose sequences each run the ring algorithm the
// selector chose for their own (new, cached) lengths.
//
// Every local tensor lays sequences out one after another (sharding::MakeLocalLayout), so a run
// of adjacent sequences is one contiguous slice of Q, K, V, O and LSE on every rank. Each maximal
// run of sequences with the same algorithm is its own fused ring over its slice
// (ShardPlan::Slice): nothing is copied, and the rings go one after the other on the same ops.
// A batch with one algorithm is one ring, exactly RingAttention. Callers that want one ring per
// algorithm put each algorithm's sequences next to each other first (GroupOrder).
//
//   CPFILL_ASSIGN_OR_RETURN(auto ring, MixedRing::Create(*grid.cp, plan, shape, &ops));
//   const std::vector<RingAlgorithm> algos = {kPassKV, kPassQ, kPassQ};   // one per sequence
//   CPFILL_RETURN_IF_ERROR(ring->Run(algos, q, k, v, o, lse, &timings));
#pragma once

#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/ring_attention.h"

namespace cpfill::parallel {

// Adjacent sequences that run one algorithm: sequences [first, first + count).
struct AlgorithmRun {
  RingAlgorithm algorithm = RingAlgorithm::kPassKV;
  int first = 0;
  int count = 0;
};
std::vector<AlgorithmRun> AlgorithmRuns(std::span<const RingAlgorithm> per_sequence);

// "pass-kv" when every sequence runs one algorithm, else one name per sequence, comma separated.
std::string AlgorithmsName(std::span<const RingAlgorithm> per_sequence);

// A stable order that puts each algorithm's sequences next to each other, pass-KV's first:
// order[i] is the original index of the i-th sequence. Two algorithms then make two rings.
std::vector<int> GroupOrder(std::span<const RingAlgorithm> per_sequence);

class MixedRing {
 public:
  // As RingAttention::Create, for the whole batch.
  static absl::StatusOr<std::unique_ptr<MixedRing>> Create(Communicator& cp,
                                                           const sharding::ShardPlan& plan,
                                                           const attention::AttentionShape& shape,
                                                           RingOps* ops);

  // As RingAttention::Run, with one algorithm per sequence of the plan. The rings of the runs
  // are made on first use and kept. `timings` holds every ring's steps (each tagged with its
  // algorithm; span names prefixed with it when more than one ring ran), their sums, and the
  // wall time of them all; `algorithm` is the first ring's.
  absl::Status Run(std::span<const RingAlgorithm> per_sequence, const void* q, const void* k,
                   const void* v, float* o, float* lse, RingTimings* timings,
                   RingAttention::StepCallback on_step = nullptr, const RunOptions& options = {});
  // Every sequence on `algorithm`: one ring.
  absl::Status Run(RingAlgorithm algorithm, const void* q, const void* k, const void* v, float* o,
                   float* lse, RingTimings* timings, RingAttention::StepCallback on_step = nullptr,
                   const RunOptions& options = {});
  // The host wait of runs made with options.wait = false (every ring shares the ops).
  absl::Status Finish() { return whole_->Finish(); }

  const sharding::LocalLayout& layout() const { return whole_->layout(); }

 private:
  MixedRing(Communicator& cp, const sharding::ShardPlan& plan,
            const attention::AttentionShape& shape, RingOps* ops,
            std::unique_ptr<RingAttention> whole);
  // The ring of sequences [first, first + count) (the whole batch's when that is all of them).
  absl::StatusOr<RingAttention*> RingOf(int first, int count);

  Communicator& cp_;
  sharding::ShardPlan plan_;
  attention::AttentionShape shape_;
  RingOps* ops_;
  std::unique_ptr<RingAttention> whole_;
  std::map<std::pair<int, int>, std::unique_ptr<RingAttention>> parts_;
};

}  // namespace cpfill::parallel
