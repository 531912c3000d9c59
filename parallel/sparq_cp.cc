#include "parallel/sparq_cp.h"

#include <algorithm>
#include <vector>

#include "base/status.h"

namespace cpfill::parallel {
namespace {

using attention::sparq::Candidate;
using attention::sparq::GroupQuery;
using attention::sparq::LocalCandidate;
using attention::sparq::Normaliser;
using attention::sparq::PartialLayout;
using attention::sparq::SparqBatch;
using attention::sparq::SparqSelection;

// One (sequence, KV head) on this rank, carried between the exchanges.
struct GroupState {
  GroupQuery gq;
  std::vector<float> logits;      // [group, local rows]
  std::vector<Normaliser> norms;  // [group], local
  std::vector<float> lse;         // [group], the normalisers ranking keys are taken against
  std::vector<LocalCandidate> candidates;
  std::vector<int64_t> rows;  // local rows attended, ascending
};

void ForEach(ThreadPool* pool, int64_t n, const std::function<void(int64_t)>& fn) {
  if (pool != nullptr) {
    pool->ParallelFor(n, fn);
  } else {
    for (int64_t i = 0; i < n; ++i) fn(i);
  }
}

// Step 1: the global normaliser of every head from every rank's local one.
absl::Status GlobalNormalisers(Communicator& cp, std::vector<GroupState>& groups, int group) {
  std::vector<Normaliser> send;
  for (const GroupState& st : groups) send.insert(send.end(), st.norms.begin(), st.norms.end());
  std::vector<Normaliser> recv(send.size() * cp.size());
  CPFILL_RETURN_IF_ERROR(cp.AllGather(send.data(), send.size() * sizeof(Normaliser), recv.data()));
  for (size_t i = 0; i < groups.size(); ++i) {
    for (int g = 0; g < group; ++g) {
      Normaliser total;
      for (int r = 0; r < cp.size(); ++r) total.Merge(recv[r * send.size() + i * group + g]);
      groups[i].lse[g] = total.Lse();
    }
  }
  return absl::OkStatus();
}

// Step 2: the global top-k of each group from every rank's local top-k; keeps this rank's rows
// among them. Returns the global selections (positions, ascending) when `selection` is set.
absl::Status GlobalTopK(Communicator& cp, const SparqBatch& b, std::vector<GroupState>& groups,
                        SparqSelection* selection) {
  const int k = b.config.k;
  std::vector<Candidate> send(groups.size() * k);  // padding: position -1
  for (size_t i = 0; i < groups.size(); ++i) {
    for (size_t t = 0; t < groups[i].candidates.size(); ++t)
      send[i * k + t] = groups[i].candidates[t].c;
  }
  std::vector<Candidate> recv(send.size() * cp.size());
  CPFILL_RETURN_IF_ERROR(cp.AllGather(send.data(), send.size() * sizeof(Candidate), recv.data()));
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t seq = static_cast<int64_t>(i) / b.shape.num_kv_heads;
    std::vector<Candidate> all;
    for (int r = 0; r < cp.size(); ++r) {
      for (int t = 0; t < k; ++t) {
        const Candidate& c = recv[(r * groups.size() + i) * k + t];
        if (c.position >= 0) all.push_back(c);
      }
    }
    const auto top = attention::sparq::SelectTop(
        std::move(all), attention::sparq::WindowBegin(b.global_len(seq), b.config.local_window), k);
    std::vector<int32_t> chosen;
    for (const Candidate& c : top) chosen.push_back(c.position);
    std::sort(chosen.begin(), chosen.end());
    for (const LocalCandidate& lc : groups[i].candidates) {
      if (std::binary_search(chosen.begin(), chosen.end(), lc.c.position)) {
        groups[i].rows.push_back(lc.row);
      }
    }
    std::sort(groups[i].rows.begin(), groups[i].rows.end());
    if (selection != nullptr) selection->positions[i] = std::move(chosen);
  }
  return absl::OkStatus();
}

// kLocalTopK's report: every rank's attended positions, gathered (k padded to k per rank).
absl::Status GatherLocalSelections(Communicator& cp, const SparqBatch& b,
                                   const std::vector<GroupState>& groups, int64_t per_rank,
                                   SparqSelection* selection) {
  std::vector<int32_t> send(groups.size() * per_rank, -1);
  for (size_t i = 0; i < groups.size(); ++i) {
    for (size_t t = 0; t < groups[i].rows.size(); ++t) {
      send[i * per_rank + t] = b.position(i / b.shape.num_kv_heads, groups[i].rows[t]);
    }
  }
  std::vector<int32_t> recv(send.size() * cp.size());
  CPFILL_RETURN_IF_ERROR(cp.AllGather(send.data(), send.size() * sizeof(int32_t), recv.data()));
  for (size_t i = 0; i < groups.size(); ++i) {
    auto& out = selection->positions[i];
    for (int r = 0; r < cp.size(); ++r) {
      for (int64_t t = 0; t < per_rank; ++t) {
        const int32_t p = recv[(r * groups.size() + i) * per_rank + t];
        if (p >= 0) out.push_back(p);
      }
    }
    std::sort(out.begin(), out.end());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SparqAttentionCp(Communicator& cp, const SparqBatch& b, SparqCpSelection mode,
                              float* o, SparqSelection* selection, ThreadPool* pool) {
  CPFILL_RETURN_IF_ERROR(attention::sparq::ValidateSparqBatch(b));
  CPFILL_CHECK_ARG(b.k_pos != nullptr && !b.seq_len.empty(),
                   "SparqAttentionCp: k_pos and seq_len must give the shard's global positions");
  const int kv_heads = b.shape.num_kv_heads, group = b.shape.group_size();
  const int d = b.shape.head_dim, n_ranks = cp.size();
  const bool global = mode == SparqCpSelection::kGlobalTopK;
  // kLocalTopK: each rank's share of the budget.
  const int64_t per_rank = global ? b.config.k : (b.config.k + n_ranks - 1) / n_ranks;
  std::vector<GroupState> groups(b.num_seqs() * kv_heads);
  if (selection != nullptr) selection->positions.assign(groups.size(), {});
  // Local approximate logits and normalisers (no exchange).
  ForEach(pool, groups.size(), [&](int64_t i) {
    GroupState& st = groups[i];
    st.gq = attention::sparq::PrepareGroupQuery(b, i / kv_heads, i % kv_heads);
    st.logits.resize(group * b.kv_len[i / kv_heads]);
    st.norms.resize(group);
    attention::sparq::ApproximateLogits(b, i / kv_heads, i % kv_heads, st.gq, st.logits.data(),
                                        st.norms.data());
    st.lse.resize(group);
    for (int g = 0; g < group; ++g) st.lse[g] = st.norms[g].Lse();
  });
  // Step 1 (global only): keys against the global normalisers.
  if (global) CPFILL_RETURN_IF_ERROR(GlobalNormalisers(cp, groups, group));
  ForEach(pool, groups.size(), [&](int64_t i) {
    GroupState& st = groups[i];
    st.candidates = attention::sparq::LocalCandidates(b, i / kv_heads, group, st.logits.data(),
                                                      st.lse.data(), per_rank);
    if (global) return;
    for (const LocalCandidate& c : st.candidates) st.rows.push_back(c.row);
    std::sort(st.rows.begin(), st.rows.end());
  });
  // Step 2 (global only): the global top-k.
  if (global) CPFILL_RETURN_IF_ERROR(GlobalTopK(cp, b, groups, selection));
  if (!global && selection != nullptr) {
    CPFILL_RETURN_IF_ERROR(GatherLocalSelections(cp, b, groups, per_rank, selection));
  }
  // Step 3: partial records of every rank, merged into the output on every rank.
  const PartialLayout lay{group, d};
  std::vector<float> send(groups.size() * lay.floats());
  ForEach(pool, groups.size(), [&](int64_t i) {
    const GroupState& st = groups[i];
    attention::sparq::ComputeGroupPartial(b, i / kv_heads, i % kv_heads, st.gq, st.logits.data(),
                                          st.norms.data(), st.rows, &send[i * lay.floats()]);
  });
  std::vector<float> recv(send.size() * n_ranks);
  CPFILL_RETURN_IF_ERROR(cp.AllGather(send.data(), send.size() * sizeof(float), recv.data()));
  ForEach(pool, groups.size(), [&](int64_t i) {
    std::vector<float> records(static_cast<size_t>(n_ranks) * lay.floats());
    for (int r = 0; r < n_ranks; ++r) {
      const float* src = &recv[(r * groups.size() + i) * lay.floats()];
      std::copy(src, src + lay.floats(), &records[r * lay.floats()]);
    }
    attention::sparq::FinishGroup(
        lay, records.data(), n_ranks,
        o + (i / kv_heads * b.shape.num_heads + i % kv_heads * group) * d);
  });
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
