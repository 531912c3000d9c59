// cpfill/parallel/ring_plan.h — one rank's view of the ring algorithms for a ShardPlan: message
// layouts, the slices each step computes, and which chunk pairs the causal mask hides. The ring
// (ring_attention.h) runs it on every backend, which differ only in memory, kernels and
// transport (RingOps, Communicator).
//
//   RingPlan rp(plan, cp_rank, /*causal=*/true);
//   RingStepTiming step;
//   rp.PassKvSlices(/*source=*/3, &slices, &step);   // this rank's queries vs rank 3's KV
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/attention.h"
#include "parallel/selector.h"
#include "sharding/plan.h"

namespace cpfill::parallel {

// One iteration of the ring loop (the paper's Table 5 rows).
struct RingStepTiming {
  RingAlgorithm algorithm = RingAlgorithm::kPassKV;  // the ring this step belongs to
  int step = 0;
  int source_cp_rank = 0;      // whose KV (pass-KV) or queries (pass-Q) were computed on
  double compute_s = 0;        // partial attention (+ running merge for pass-KV)
  double transfer_s = 0;       // the exchange's own duration, posted to completed
  double wait_s = 0;           // exposed: how long compute waited for the exchange
  int64_t exchange_bytes = 0;  // sent (= received) this step; 0 on the last step
  int64_t visible_pairs = 0;   // (query, key) pairs computed, one head
  // (query chunk, key chunk) pairs this step, and those the causal mask hides entirely: they
  // are not computed (a sequence whose pairs are all hidden is left out of the launch; the
  // kernel skips hidden tiles of the others).
  int64_t chunk_pairs = 0;
  int64_t chunk_pairs_hidden = 0;
};

// One interval of a ring run on one rank, for timelines (--trace): seconds from the run's first
// mark. Lane "compute" holds the packing, each step's attention, its exposed wait and the merge
// (on a GPU: the compute stream); lane "exchange" the ring transfers (drawn from the step's
// compute start, when they were posted, for their measured duration) and the collectives.
struct RingSpan {
  std::string name;  // "step 2 attention", "step 2 wait", "step 2 exchange", "all-to-all", ...
  std::string lane;  // "compute" | "exchange"
  double start_s = 0;
  double duration_s = 0;
};

struct RingTimings {
  RingAlgorithm algorithm = RingAlgorithm::kPassKV;
  double start_unix_s = 0;  // wall clock (system) at the spans' origin, to line ranks up
  std::vector<RingSpan> spans;
  std::vector<RingStepTiming> steps;
  double pack_s = 0;        // copies into message layout and back
  double all_gather_s = 0;  // all-gather baseline only
  double all_to_all_s = 0;  // pass-Q only
  int64_t all_to_all_bytes = 0;
  double merge_s = 0;  // final merge (pass-Q); running merges count as compute
  double total_s = 0;
  int64_t visible_pairs = 0;  // sum over steps; FLOPs = 4 * head_dim * heads * visible_pairs
};

// Byte layout of a message of `slots` token rows: [A: slots x row_bytes][B: ...][positions].
// pass-KV and all-gather: A = K, B = V (kv row bytes); pass-Q: A = Q, no B (b_row_bytes = 0).
struct MessageLayout {
  size_t a_offset = 0, b_offset = 0, pos_offset = 0, bytes = 0;
  static MessageLayout Make(int64_t slots, size_t a_row_bytes, size_t b_row_bytes) {
    MessageLayout m;
    m.b_offset = slots * a_row_bytes;
    m.pos_offset = m.b_offset + slots * b_row_bytes;
    m.bytes = m.pos_offset + slots * sizeof(int32_t);
    return m;
  }
};

class RingPlan {
 public:
  RingPlan(const sharding::ShardPlan& plan, int cp_rank, bool causal);

  const sharding::ShardPlan& shard_plan() const { return plan_; }
  const sharding::LocalLayout& layout() const { return layout_; }
  int cp_rank() const { return cp_rank_; }
  int cp_size() const { return plan_.cp_size; }
  int num_sequences() const { return plan_.num_sequences(); }

  // pass-KV / all-gather messages: sequence i at slot kv_slot_offset(i), L^i slots, this rank's
  // cached-then-new keys first, padding (position -1) after.
  int64_t kv_slot_offset(int seq) const { return kv_slot_offset_[seq]; }
  int64_t kv_slots(int seq) const { return kv_slots_[seq]; }
  int64_t kv_slots_total() const { return kv_slots_total_; }
  // pass-Q messages carry their source rank's queries as that rank holds them (its LocalLayout:
  // sequence after sequence, no padding between them) in q_message_slots() = max over ranks of
  // their query rows; the rows past the source's own are in no slice. A decode step's message
  // thus holds the source's B/N sequences, not a slot for each of the batch's B: N times fewer
  // bytes, and forks of one prompt lie side by side for prefix batching's roots.
  int64_t q_message_slots() const { return q_message_slots_; }
  int64_t source_q_rows(int source) const { return source_q_rows_[source]; }
  int64_t source_q_offset(int source, int seq) const { return source_q_offset_[source][seq]; }

  // Step slices. pass-KV: this rank's query rows against `source`'s keys in a KV message.
  // pass-Q: `source`'s queries in a Q message against this rank's key rows. All-gather: this
  // rank's query rows against the gathered keys (sequence i at N * kv_slot_offset(i), N * L^i
  // slots). Sequences whose pairs are all hidden are left out; `step` gets the pair counts.
  void PassKvSlices(int source, std::vector<attention::SequenceSlice>* slices,
                    RingStepTiming* step) const;
  // `keyless` (optional): the query rows of sequences left out that `source` does hold (real
  // queries that see no key here, unlike padding), as q ranges.
  void PassQSlices(int source, std::vector<attention::SequenceSlice>* slices, RingStepTiming* step,
                   std::vector<attention::SequenceSlice>* keyless = nullptr) const;
  void AllGatherSlices(std::vector<attention::SequenceSlice>* slices) const;
  // A ring of one rank: this rank's query rows against its own key rows, both in local layout.
  void LocalSlices(std::vector<attention::SequenceSlice>* slices, RingStepTiming* step) const;
  // (query, key) pairs the mask leaves visible for this rank's queries against every key.
  int64_t AllGatherVisiblePairs() const;

 private:
  // Counts the (query run, key run) pairs between `q_rank`'s new tokens of `seq` and
  // `kv_rank`'s keys of `seq`, and those the causal mask hides entirely. A run is a chunk of the
  // load-balanced cut (or a cached run). Returns true when some pair is visible.
  // Also adds the visible (query, key) pairs, counted in closed form from the runs.
  bool CountChunkPairs(int seq, int q_rank, int kv_rank, RingStepTiming* step) const;

  sharding::ShardPlan plan_;
  sharding::LocalLayout layout_;
  int cp_rank_;
  bool causal_;
  std::vector<int64_t> kv_slot_offset_, kv_slots_;
  int64_t kv_slots_total_ = 0;
  std::vector<std::vector<int64_t>> source_q_offset_;  // [source][seq]
  std::vector<int64_t> source_q_rows_;
  int64_t q_message_slots_ = 0;
};

}  // namespace cpfill::parallel
