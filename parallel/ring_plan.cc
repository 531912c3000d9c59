#include "parallel/ring_plan.h"

#include <algorithm>

namespace cpfill::parallel {
namespace {

// Visible (query, key) pairs between the query positions [a, a + lq) and the key positions
// [b, b + lk): causal, each query p sees the keys at or before it, min(max(p - b + 1, 0), lk).
int64_t RunPairs(int64_t a, int64_t lq, int64_t b, int64_t lk, bool causal) {
  if (lq <= 0 || lk <= 0) return 0;
  if (!causal) return lq * lk;
  const int64_t q_end = a + lq - 1;
  int64_t pairs = 0;
  // Ramp: queries b .. b + lk - 2 see 1 .. lk - 1 keys.
  const int64_t r0 = std::max(a, b), r1 = std::min(q_end, b + lk - 2);
  if (r1 >= r0) pairs += (r0 - b + 1 + r1 - b + 1) * (r1 - r0 + 1) / 2;
  // Plateau: queries from b + lk - 1 on see every key.
  const int64_t p0 = std::max(a, b + lk - 1);
  if (q_end >= p0) pairs += (q_end - p0 + 1) * lk;
  return pairs;
}

}  // namespace

RingPlan::RingPlan(const sharding::ShardPlan& plan, int cp_rank, bool causal)
    : plan_(plan),
      layout_(sharding::MakeLocalLayout(plan, cp_rank)),
      cp_rank_(cp_rank),
      causal_(causal) {
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    kv_slot_offset_.push_back(kv_slots_total_);
    kv_slots_.push_back(plan_.PaddedKvTokens(s));
    kv_slots_total_ += kv_slots_.back();
  }
  // Every source's queries in its own local order: the offsets MakeLocalLayout gives that rank.
  source_q_offset_.resize(plan_.cp_size);
  for (int r = 0; r < plan_.cp_size; ++r) {
    int64_t rows = 0;
    for (int s = 0; s < plan_.num_sequences(); ++s) {
      source_q_offset_[r].push_back(rows);
      rows += plan_.shard(r, s).new_tokens();
    }
    source_q_rows_.push_back(rows);
    q_message_slots_ = std::max(q_message_slots_, rows);
  }
}

bool RingPlan::CountChunkPairs(int seq, int q_rank, int kv_rank, RingStepTiming* step) const {
  const auto& qs = plan_.shard(q_rank, seq);
  const auto& ks = plan_.shard(kv_rank, seq);
  bool any_visible = false;
  for (const auto& q_run : qs.new_runs) {
    for (const auto* key_runs : {&ks.cached_runs, &ks.new_runs}) {
      for (const auto& k_run : *key_runs) {
        if (q_run.length == 0 || k_run.length == 0) continue;
        ++step->chunk_pairs;
        step->visible_pairs +=
            RunPairs(q_run.begin, q_run.length, k_run.begin, k_run.length, causal_);
        // Causal: the pair is hidden when its first key comes after its last query.
        if (causal_ && k_run.begin > q_run.end() - 1) {
          ++step->chunk_pairs_hidden;
        } else {
          any_visible = true;
        }
      }
    }
  }
  return any_visible;
}

void RingPlan::PassKvSlices(int source, std::vector<attention::SequenceSlice>* slices,
                            RingStepTiming* step) const {
  slices->clear();
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    if (!CountChunkPairs(s, cp_rank_, source, step)) continue;
    // The source's real keys come first in the sequence's slots; the padding is left out.
    slices->push_back({.q_begin = layout_.q_offset[s],
                       .q_len = layout_.q_len[s],
                       .kv_begin = kv_slot_offset_[s],
                       .kv_len = plan_.shard(source, s).kv_tokens()});
  }
}

void RingPlan::PassQSlices(int source, std::vector<attention::SequenceSlice>* slices,
                           RingStepTiming* step,
                           std::vector<attention::SequenceSlice>* keyless) const {
  slices->clear();
  if (keyless != nullptr) keyless->clear();
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    if (!CountChunkPairs(s, source, cp_rank_, step)) {
      const int64_t rows = plan_.shard(source, s).new_tokens();
      if (keyless != nullptr && rows > 0) {
        keyless->push_back({.q_begin = source_q_offset_[source][s], .q_len = rows});
      }
      continue;
    }
    slices->push_back({.q_begin = source_q_offset_[source][s],
                       .q_len = plan_.shard(source, s).new_tokens(),
                       .kv_begin = layout_.kv_offset[s],
                       .kv_len = layout_.kv_len[s]});
  }
}

void RingPlan::LocalSlices(std::vector<attention::SequenceSlice>* slices,
                           RingStepTiming* step) const {
  slices->clear();
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    if (!CountChunkPairs(s, cp_rank_, cp_rank_, step)) continue;
    slices->push_back({.q_begin = layout_.q_offset[s],
                       .q_len = layout_.q_len[s],
                       .kv_begin = layout_.kv_offset[s],
                       .kv_len = layout_.kv_len[s]});
  }
}

int64_t RingPlan::AllGatherVisiblePairs() const {
  int64_t pairs = 0;
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    for (const auto& q_run : plan_.shard(cp_rank_, s).new_runs) {
      for (int r = 0; r < plan_.cp_size; ++r) {
        for (const auto* runs : {&plan_.shard(r, s).cached_runs, &plan_.shard(r, s).new_runs}) {
          for (const auto& k_run : *runs) {
            pairs += RunPairs(q_run.begin, q_run.length, k_run.begin, k_run.length, causal_);
          }
        }
      }
    }
  }
  return pairs;
}

void RingPlan::AllGatherSlices(std::vector<attention::SequenceSlice>* slices) const {
  slices->clear();
  const int n = plan_.cp_size;
  for (int s = 0; s < plan_.num_sequences(); ++s) {
    if (layout_.q_len[s] == 0) continue;
    slices->push_back({.q_begin = layout_.q_offset[s],
                       .q_len = layout_.q_len[s],
                       .kv_begin = n * kv_slot_offset_[s],
                       .kv_len = n * kv_slots_[s]});
  }
}

}  // namespace cpfill::parallel
