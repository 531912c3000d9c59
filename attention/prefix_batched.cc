#include "attention/prefix_batched.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::attention {
namespace {

bool Overlap(int64_t a_begin, int64_t a_len, int64_t b_begin, int64_t b_len) {
  return a_len > 0 && b_len > 0 && a_begin < b_begin + b_len && b_begin < a_begin + a_len;
}

// Leading block ids two tables (from entries a and b) have in common, at most `limit`.
int64_t CommonBlocks(std::span<const int32_t> table, int64_t a, int64_t b, int64_t limit) {
  const auto first = table.begin() + a;
  return std::mismatch(first, first + limit, table.begin() + b).first - first;
}

// True when a range of `ranges` has a query row in [begin, end).
bool AnyRowIn(std::span<const SequenceSlice> ranges, int64_t begin, int64_t end) {
  return std::any_of(ranges.begin(), ranges.end(), [&](const SequenceSlice& r) {
    return Overlap(r.q_begin, r.q_len, begin, end - begin);
  });
}

}  // namespace

SharedBlockTree FindSharedBlocks(const AttentionShape& shape, std::span<const SequenceSlice> slices,
                                 const PagedKv& paged, const SharedBlockRule& rule,
                                 std::span<const SequenceSlice> keyless) {
  SharedBlockTree tree;
  const int64_t group = shape.group_size();
  const int64_t entries = static_cast<int64_t>(paged.host_table.size());
  // Where a slice's blocks start in the table, and how many whole blocks of keys it has there
  // (0: it can join no root).
  auto blocks_of = [&](const SequenceSlice& s, int64_t* table_begin) -> int64_t {
    *table_begin = paged.TableBegin(s.kv_begin);
    if (entries == 0 || s.q_len == 0 || *table_begin < 0) return 0;
    return std::min(s.kv_len / paged.block_tokens, entries - *table_begin);
  };
  // Blocks slices a and b (indices) start with in common, at most `limit`.
  auto common_of = [&](size_t a, size_t b, int64_t limit) -> int64_t {
    int64_t a_table = 0, b_table = 0;
    const int64_t n =
        std::min({limit, blocks_of(slices[a], &a_table), blocks_of(slices[b], &b_table)});
    return n > 0 ? CommonBlocks(paged.host_table, a_table, b_table, n) : 0;
  };
  size_t i = 0;
  while (i < slices.size()) {
    const SequenceSlice& head = slices[i];
    int64_t head_table = 0;
    int64_t common = blocks_of(head, &head_table);
    size_t end = i + 1;
    for (; common > 0 && end < slices.size(); ++end) {
      const SequenceSlice& next = slices[end];
      if ((next.q_begin + next.q_len - head.q_begin) * group > rule.max_root_rows) break;
      // Members' rows ascend; rows between them see no key only under a causal mask (position
      // -1 sees none), and only if they are padding, not another sequence's queries.
      const SequenceSlice& prev = slices[end - 1];
      const int64_t prev_end = prev.q_begin + prev.q_len;
      if (next.q_begin < prev_end || (!shape.causal && next.q_begin != prev_end)) break;
      if (AnyRowIn(keyless, prev_end, next.q_begin)) break;
      const int64_t shared = common_of(i, end, common);
      if (shared == 0) break;
      const int64_t members = static_cast<int64_t>(end - i);
      // A head that shares less with the next slice than the next shares with its own next
      // (a system prompt's fork before forks of one document) goes alone: the run starts there.
      if (members == 1 && end + 1 < slices.size() && common_of(end, end + 1, shared + 1) > shared) {
        break;
      }
      // Joining must not cut the rows the run reads once: members x shared against
      // (members - 1) x common.
      if (members * shared < (members - 1) * common) break;
      common = shared;
    }
    const int64_t members = static_cast<int64_t>(end - i);
    const int64_t rows = slices[end - 1].q_begin + slices[end - 1].q_len - head.q_begin;
    const int64_t reads = (rows * group + rule.rows_per_read - 1) / rule.rows_per_read;
    if (members < 2 || (reads >= members && !rule.always_root)) {
      tree.first.push_back(head);
      ++i;
      continue;
    }
    const int64_t shared_rows = common * paged.block_tokens;
    tree.first.push_back(
        {.q_begin = head.q_begin, .q_len = rows, .kv_begin = head.kv_begin, .kv_len = shared_rows});
    for (size_t m = i; m < end; ++m) {
      const SequenceSlice& s = slices[m];
      if (s.kv_len == shared_rows) continue;
      tree.second.push_back({.q_begin = s.q_begin,
                             .q_len = s.q_len,
                             .kv_begin = s.kv_begin + shared_rows,
                             .kv_len = s.kv_len - shared_rows});
    }
    tree.counts +=
        {.roots = 1, .sequences = members, .key_rows_saved = (members - 1) * shared_rows};
    i = end;
  }
  return tree;
}

bool GathersPagedKv(std::span<const SequenceSlice> slices) {
  return std::any_of(slices.begin(), slices.end(),
                     [](const SequenceSlice& s) { return s.q_len > kMaxInPlaceQueryRows; });
}

SharedBlockRule RuleForStep(std::span<const SequenceSlice> slices) {
  if (!GathersPagedKv(slices)) return {};
  return {.max_root_rows = std::numeric_limits<int64_t>::max(), .always_root = true};
}

PagedGather PlanPagedGather(const SharedBlockTree& tree, const PagedKv& paged,
                            std::span<const int32_t> table) {
  PagedGather g;
  // Slices that read the same blocks, as many rows, share one gathered copy: forks of one prompt
  // outside a root (their run broken by another sequence, or their own rows past a shorter
  // shared part) copy the prompt once, not once each.
  std::map<std::pair<std::vector<int32_t>, int64_t>, int64_t> gathered;
  const auto place = [&](const SequenceSlice& s) -> SequenceSlice {
    if (s.q_len == 0 || s.kv_len == 0) return {.q_begin = s.q_begin, .q_len = s.q_len};
    const int64_t table_begin = paged.TableBegin(s.kv_begin);
    const auto first = table.begin() + table_begin;
    std::vector<int32_t> blocks(first,
                                first + (s.kv_len + paged.block_tokens - 1) / paged.block_tokens);
    const auto [it, fresh] = gathered.try_emplace({std::move(blocks), s.kv_len}, g.rows);
    if (fresh) {
      for (int64_t r = 0; r < s.kv_len; r += paged.block_tokens) {
        g.copies.push_back(
            {.block = table[table_begin + r / paged.block_tokens],
             .rows = static_cast<int32_t>(std::min<int64_t>(paged.block_tokens, s.kv_len - r)),
             .from_row = s.kv_begin + r,
             .to_row = g.rows + r});
      }
      g.rows += s.kv_len;
    }
    return {.q_begin = s.q_begin, .q_len = s.q_len, .kv_begin = it->second, .kv_len = s.kv_len};
  };
  for (const SequenceSlice& s : tree.first) g.first.push_back(place(s));
  for (const SequenceSlice& s : tree.second) g.second.push_back(place(s));
  return g;
}

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
