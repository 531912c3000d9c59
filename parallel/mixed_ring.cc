#include "parallel/mixed_ring.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace cpfill::parallel {
namespace {

using Clock = std::chrono::steady_clock;

// Adds one ring's timings to the batch's: sums, its steps, and its spans moved onto the first
// ring's clock (wall-clock origins), named after their ring when the batch has several.
void AddRing(const RingTimings& part, bool first, bool name_rings, RingTimings* into) {
  if (first) {
    into->algorithm = part.algorithm;
    into->start_unix_s = part.start_unix_s;
  }
  const double shift = part.start_unix_s - into->start_unix_s;
  for (RingSpan s : part.spans) {
    if (name_rings)
      s.name = absl::StrCat(std::string(RingAlgorithmName(part.algorithm)), " ", s.name);
    s.start_s += shift;
    into->spans.push_back(std::move(s));
  }
  into->steps.insert(into->steps.end(), part.steps.begin(), part.steps.end());
  into->pack_s += part.pack_s;
  into->all_gather_s += part.all_gather_s;
  into->all_to_all_s += part.all_to_all_s;
  into->all_to_all_bytes += part.all_to_all_bytes;
  into->merge_s += part.merge_s;
  into->visible_pairs += part.visible_pairs;
}

}  // namespace

std::vector<AlgorithmRun> AlgorithmRuns(std::span<const RingAlgorithm> per_sequence) {
  std::vector<AlgorithmRun> runs;
  for (int s = 0; s < static_cast<int>(per_sequence.size()); ++s) {
    if (runs.empty() || runs.back().algorithm != per_sequence[s]) {
      runs.push_back({.algorithm = per_sequence[s], .first = s, .count = 0});
    }
    ++runs.back().count;
  }
  return runs;
}

std::string AlgorithmsName(std::span<const RingAlgorithm> per_sequence) {
  const std::vector<AlgorithmRun> runs = AlgorithmRuns(per_sequence);
  if (runs.size() == 1) return std::string(RingAlgorithmName(runs[0].algorithm));
  std::vector<std::string> names;
  for (RingAlgorithm a : per_sequence) names.emplace_back(RingAlgorithmName(a));
  return absl::StrJoin(names, ",");
}

std::vector<int> GroupOrder(std::span<const RingAlgorithm> per_sequence) {
  std::vector<int> order(per_sequence.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return static_cast<int>(per_sequence[a]) < static_cast<int>(per_sequence[b]);
  });
  return order;
}

MixedRing::MixedRing(Communicator& cp, const sharding::ShardPlan& plan,
                     const attention::AttentionShape& shape, RingOps* ops,
                     std::unique_ptr<RingAttention> whole)
    : cp_(cp), plan_(plan), shape_(shape), ops_(ops), whole_(std::move(whole)) {}

absl::StatusOr<std::unique_ptr<MixedRing>> MixedRing::Create(Communicator& cp,
                                                             const sharding::ShardPlan& plan,
                                                             const attention::AttentionShape& shape,
                                                             RingOps* ops) {
  CPFILL_ASSIGN_OR_RETURN(std::unique_ptr<RingAttention> whole,
                          RingAttention::Create(cp, plan, shape, ops));
  return std::unique_ptr<MixedRing>(new MixedRing(cp, plan, shape, ops, std::move(whole)));
}

absl::StatusOr<RingAttention*> MixedRing::RingOf(int first, int count) {
  if (first == 0 && count == plan_.num_sequences()) return whole_.get();
  std::unique_ptr<RingAttention>& ring = parts_[{first, count}];
  if (!ring) {
    CPFILL_ASSIGN_OR_RETURN(ring,
                            RingAttention::Create(cp_, plan_.Slice(first, count), shape_, ops_));
  }
  return ring.get();
}

absl::Status MixedRing::Run(RingAlgorithm algorithm, const void* q, const void* k, const void* v,
                            float* o, float* lse, RingTimings* timings,
                            RingAttention::StepCallback on_step, const RunOptions& options) {
  return whole_->Run(algorithm, q, k, v, o, lse, timings, std::move(on_step), options);
}

absl::Status MixedRing::Run(std::span<const RingAlgorithm> per_sequence, const void* q,
                            const void* k, const void* v, float* o, float* lse,
                            RingTimings* timings, RingAttention::StepCallback on_step,
                            const RunOptions& options) {
  CPFILL_CHECK_ARG(static_cast<int>(per_sequence.size()) == plan_.num_sequences(),
                   "mixed ring: ", per_sequence.size(), " algorithms for ", plan_.num_sequences(),
                   " sequences");
  const std::vector<AlgorithmRun> runs = AlgorithmRuns(per_sequence);
  if (runs.size() <= 1) {
    const RingAlgorithm only = runs.empty() ? RingAlgorithm::kPassKV : runs[0].algorithm;
    return Run(only, q, k, v, o, lse, timings, std::move(on_step), options);
  }
  // A run's ring numbers its key rows from its own first sequence; a block table's sequence
  // begins are the whole batch's. Decode, the one caller that reads blocks in place, is one ring.
  CPFILL_CHECK_ARG(options.paged_kv == nullptr,
                   "mixed ring: K/V read in place from a KV cache's blocks needs one algorithm "
                   "for the whole batch");
  RingTimings local;
  RingTimings* t = timings ? timings : &local;
  *t = RingTimings{};
  const auto t0 = Clock::now();
  const sharding::LocalLayout& all = layout();
  const size_t e = ops_->elem_bytes();
  const size_t q_row = size_t(shape_.num_heads) * shape_.head_dim;
  const size_t kv_row = size_t(shape_.num_kv_heads) * shape_.head_dim;
  for (size_t i = 0; i < runs.size(); ++i) {
    const AlgorithmRun& run = runs[i];
    CPFILL_ASSIGN_OR_RETURN(RingAttention * ring, RingOf(run.first, run.count));
    // This run's rows: its first sequence's offsets in the whole batch's layout.
    const int64_t q0 = all.q_offset[run.first], kv0 = all.kv_offset[run.first];
    RingTimings part;
    CPFILL_RETURN_IF_ERROR(ring->Run(run.algorithm, static_cast<const char*>(q) + q0 * q_row * e,
                                     static_cast<const char*>(k) + kv0 * kv_row * e,
                                     static_cast<const char*>(v) + kv0 * kv_row * e, o + q0 * q_row,
                                     lse + q0 * shape_.num_heads, &part, on_step, options));
    AddRing(part, i == 0, /*name_rings=*/true, t);
  }
  t->total_s = std::chrono::duration<double>(Clock::now() - t0).count();
  return absl::OkStatus();
}

}  // namespace cpfill::parallel
