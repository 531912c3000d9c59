// cpfill/parallel/ring_attention.h — context-parallel attention over a CP ring.
//
// Three algorithms, written once on the Communicator interface and one AttentionKernels backend:
//   pass-KV    (paper Alg. 2) each rank's KV, padded per sequence to L^i = max_j(P_j^i + T_j^i)
//              so every message has one size, travels the ring; the exchange for step j+1 runs
//              while step j computes; partial outputs are merged as they arrive.
//   pass-Q     (Alg. 3) queries and their positions travel, KV stays; each rank's partial outputs
//              for the other ranks' queries go back to their owners in one all-to-all, and every
//              rank merges the N partials of its own queries (App. B eq. 4).
//   all-gather the baseline: gather every rank's KV, then one attention per sequence.
// All three handle full prefill (P = 0) and partial prefill (P > 0) alike: the plan says where
// cached KV lives and every token carries its global position, so the causal mask is exact.
// A (sequence, step) pair whose keys the causal mask hides from every query is skipped.
//
//   CPFILL_ASSIGN_OR_RETURN(auto ring, RingAttention::Create(*grid.cp, plan, shape, &kernels));
//   for (layer ...) CPFILL_RETURN_IF_ERROR(ring->Run(RingAlgorithm::kPassKV, q, k, v, o, lse,
//                                                   &timings));
// Buffers are sized from the plan on the first Run of each algorithm and reused after, so the
// per-layer loop allocates nothing.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention/attention.h"
#include "base/host_buffer.h"
#include "base/thread_pool.h"
#include "parallel/communicator.h"
#include "parallel/ring_plan.h"
#include "parallel/selector.h"
#include "sharding/plan.h"

namespace cpfill::parallel {

// The attention compute a ring runs on: CPU now; the CUDA backend implements the same.
class AttentionKernels {
 public:
  virtual ~AttentionKernels() = default;
  virtual absl::Status Attend(const attention::AttentionParams& p) = 0;
  virtual absl::Status MergeInto(const attention::AttentionShape& shape, int64_t rows, float* o_acc,
                                 float* lse_acc, const float* o, const float* lse) = 0;
  virtual absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                             std::span<const attention::PartialView> parts, float* o,
                             float* lse) = 0;
};

class CpuAttentionKernels : public AttentionKernels {
 public:
  explicit CpuAttentionKernels(ThreadPool* pool) : pool_(pool) {}
  absl::Status Attend(const attention::AttentionParams& p) override;
  absl::Status MergeInto(const attention::AttentionShape& shape, int64_t rows, float* o_acc,
                         float* lse_acc, const float* o, const float* lse) override;
  absl::Status Merge(const attention::AttentionShape& shape, int64_t rows,
                     std::span<const attention::PartialView> parts, float* o, float* lse) override;

 private:
  ThreadPool* pool_;
};

class RingAttention {
 public:
  // `cp` must be the CP ring the plan is for (size and rank). Queries/keys follow
  // sharding::MakeLocalLayout(plan, cp.rank()).
  static absl::StatusOr<std::unique_ptr<RingAttention>> Create(
      Communicator& cp, const sharding::ShardPlan& plan, const attention::AttentionShape& shape,
      AttentionKernels* kernels);

  // q [layout.q_rows, H, D], k/v [layout.kv_rows, H_kv, D] -> o [q_rows, H, D], lse [q_rows, H].
  // `on_step`, when set, is called after every ring step (progress for long runs).
  using StepCallback = std::function<void(const RingStepTiming&, int num_steps)>;
  absl::Status Run(RingAlgorithm algorithm, const float* q, const float* k, const float* v,
                   float* o, float* lse, RingTimings* timings, StepCallback on_step = nullptr);

  const sharding::LocalLayout& layout() const { return ring_plan_.layout(); }

 private:
  // Step j.1 of both rings: send msg_[cur] to the next rank, receive into msg_[1 - cur]
  // (nothing after the last step). Step j.4: wait for it, recording the exposed time.
  absl::StatusOr<std::unique_ptr<PendingExchange>> StartExchange(int step_index, int cur,
                                                                 size_t bytes,
                                                                 RingStepTiming* step);
  absl::Status FinishExchange(PendingExchange* exchange, RingStepTiming* step);
  void StepDone(RingTimings* t, const RingStepTiming& step, int num_steps);

  RingAttention(Communicator& cp, const sharding::ShardPlan& plan,
                const attention::AttentionShape& shape, AttentionKernels* kernels);

  absl::Status RunPassKV(const float* q, const float* k, const float* v, float* o, float* lse,
                         RingTimings* t);
  absl::Status RunPassQ(const float* q, const float* k, const float* v, float* o, float* lse,
                        RingTimings* t);
  absl::Status RunAllGather(const float* q, const float* k, const float* v, float* o, float* lse,
                            RingTimings* t);

  // Message layouts (ring_plan.h): pass-KV [K][V][positions], pass-Q [Q][positions], fp32.
  MessageLayout KvMessage() const;
  MessageLayout QMessage() const;
  void PackKv(const float* k, const float* v, HostBuffer& msg) const;
  void PackQ(const float* q, HostBuffer& msg) const;

  Communicator& cp_;
  RingPlan ring_plan_;
  attention::AttentionShape shape_;
  AttentionKernels* kernels_;
  int cp_rank_;
  int cp_size_;

  // Buffers, sized on first use and reused.
  HostBuffer msg_[2];       // ring messages: the one computed on, the one arriving
  HostBuffer step_out_;     // pass-KV: one step's partial [O | LSE] before the running merge
  HostBuffer partials_;     // pass-Q: N blocks [O | LSE] in q-slot layout, block s for rank s
  HostBuffer received_;     // pass-Q: N blocks, block p = my queries against rank p's KV
  HostBuffer merged_;       // pass-Q: merged [O | LSE] in q-slot layout
  HostBuffer gathered_;     // all-gather: N pass-KV messages
  HostBuffer gathered_kv_;  // all-gather: per sequence, every rank's keys side by side
  StepCallback on_step_;
};

// Single-rank attention of a whole batch, for checks: every sequence's new queries against its
// cached + new keys in position order. Tensors in global token order (q: new tokens of sequence
// 0, then 1, ...; k/v: cached then new of sequence 0, then 1, ...).
absl::Status SingleRankAttention(const std::vector<sharding::SequenceRequest>& sequences,
                                 const attention::AttentionShape& shape, const float* q,
                                 const float* k, const float* v, float* o, float* lse,
                                 AttentionKernels* kernels);

}  // namespace cpfill::parallel
