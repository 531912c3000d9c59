#include "attention/prefix_batched.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::attention {
namespace {

bool Overlap(int64_t a_begin, int64_t a_len, int64_t b_begin, int64_t b_len) {
  return a_len > 0 && b_len > 0 && a_begin < b_begin + b_len && b_begin < a_begin + a_len;
}

}  // namespace

absl::Status ValidateKvTree(const AttentionParams& p, KvTree levels) {
  CPFILL_CHECK_ARG(!levels.empty(), "a KV tree needs at least one level");
  for (size_t l = 0; l < levels.size(); ++l) {
    AttentionParams level = p;
    level.slices = levels[l].data();
    level.num_slices = static_cast<int64_t>(levels[l].size());
    absl::Status s = ValidateAttentionParams(level);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat("level ", l, ": ", s.message()));
  }
  // Slices of two levels that share query rows must not share key rows. Levels are few and a
  // level's slices are sorted by query row in practice, but this check assumes neither.
  for (size_t a = 0; a < levels.size(); ++a) {
    for (size_t b = a + 1; b < levels.size(); ++b) {
      for (const SequenceSlice& x : levels[a]) {
        for (const SequenceSlice& y : levels[b]) {
          CPFILL_CHECK_ARG(!(Overlap(x.q_begin, x.q_len, y.q_begin, y.q_len) &&
                             Overlap(x.kv_begin, x.kv_len, y.kv_begin, y.kv_len)),
                           "levels ", a, " and ", b, " give query rows from ",
                           std::max(x.q_begin, y.q_begin), " the key rows from ",
                           std::max(x.kv_begin, y.kv_begin), " twice");
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PrefixBatchedAttentionCpu(const AttentionParams& p, KvTree levels, float* o_part,
                                       float* lse_part, ThreadPool* pool) {
  CPFILL_RETURN_IF_ERROR(ValidateKvTree(p, levels));
  CPFILL_CHECK_ARG(levels.size() == 1 || (o_part != nullptr && lse_part != nullptr),
                   "a KV tree of ", levels.size(), " levels needs scratch for the partials");
  for (size_t l = 0; l < levels.size(); ++l) {
    AttentionParams level = p;
    level.slices = levels[l].data();
    level.num_slices = static_cast<int64_t>(levels[l].size());
    if (l > 0) {
      level.o = o_part;
      level.lse = lse_part;
    }
    CPFILL_RETURN_IF_ERROR(PartialAttentionCpu(level, pool));
    if (l > 0)
      CPFILL_RETURN_IF_ERROR(MergeInto(p.shape, p.q_tokens, p.o, p.lse, o_part, lse_part, pool));
  }
  return absl::OkStatus();
}

}  // namespace cpfill::attention
