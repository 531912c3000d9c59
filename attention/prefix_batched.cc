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

// The runs of one level and, recursively, the levels under their roots.
class RunFinder {
 public:
  RunFinder(const AttentionShape& shape, const PagedKv& paged, const SharedBlockRule& rule,
            SharedBlockTree* tree)
      : group_(shape.group_size()),
        causal_(shape.causal),
        paged_(paged),
        rule_(rule),
        tree_(tree) {}

  // `slices` (ascending) into level `level`: each a root over a run or whole; each root's
  // members' rows past it into the next levels. No run spans a row of `keyless`.
  void Find(std::span<const SequenceSlice> slices, size_t level,
            std::span<const SequenceSlice> keyless) {
    for (size_t i = 0; i < slices.size();) {
      int64_t common = 0;
      const size_t end = RunEnd(slices, i, keyless, &common);
      const SequenceSlice& head = slices[i];
      const int64_t members = static_cast<int64_t>(end - i);
      const int64_t rows = slices[end - 1].q_begin + slices[end - 1].q_len - head.q_begin;
      const int64_t reads = (rows * group_ + rule_.rows_per_read - 1) / rule_.rows_per_read;
      if (members < 2 || (reads >= members && !rule_.always_root)) {
        Level(level).push_back(head);
        ++i;
        continue;
      }
      const int64_t shared_rows = common * paged_.block_tokens;
      Level(level).push_back({.q_begin = head.q_begin,
                              .q_len = rows,
                              .kv_begin = head.kv_begin,
                              .kv_len = shared_rows});
      if (level == 0) tree_->outer_roots.push_back(Level(0).size() - 1);
      std::vector<SequenceSlice> rest;
      // A member with no rows past the root has no slice a level deeper, but its queries still
      // lie between the others': no deeper root may span them (it would give them its keys).
      std::vector<SequenceSlice> fenced(keyless.begin(), keyless.end());
      for (size_t m = i; m < end; ++m) {
        const SequenceSlice& s = slices[m];
        if (s.kv_len == shared_rows) {
          fenced.push_back({.q_begin = s.q_begin, .q_len = s.q_len});
          continue;
        }
        rest.push_back({.q_begin = s.q_begin,
                        .q_len = s.q_len,
                        .kv_begin = s.kv_begin + shared_rows,
                        .kv_len = s.kv_len - shared_rows});
      }
      tree_->counts +=
          {.roots = 1, .sequences = members, .key_rows_saved = (members - 1) * shared_rows};
      if (!rest.empty()) Find(rest, level + 1, fenced);
      i = end;
    }
  }

 private:
  std::vector<SequenceSlice>& Level(size_t level) {
    if (tree_->levels.size() <= level) tree_->levels.resize(level + 1);
    return tree_->levels[level];
  }

  // Where a slice's blocks start in the table, and how many whole blocks of keys it has there
  // (0: it can join no root).
  int64_t BlocksOf(const SequenceSlice& s, int64_t* table_begin) const {
    const int64_t entries = static_cast<int64_t>(paged_.host_table.size());
    *table_begin = paged_.TableBegin(s.kv_begin);
    if (entries == 0 || s.q_len == 0 || *table_begin < 0) return 0;
    return std::min(s.kv_len / paged_.block_tokens, entries - *table_begin);
  }

  // Blocks slices a and b start with in common, at most `limit`.
  int64_t Common(const SequenceSlice& a, const SequenceSlice& b, int64_t limit) const {
    int64_t a_table = 0, b_table = 0;
    const int64_t n = std::min({limit, BlocksOf(a, &a_table), BlocksOf(b, &b_table)});
    return n > 0 ? CommonBlocks(paged_.host_table, a_table, b_table, n) : 0;
  }

  // The end of the run that starts at slices[i], and the blocks its members all start with. A
  // run takes every next slice that shares a block with it: what its members share beyond that
  // is found a level deeper, so joining loses no shared read.
  size_t RunEnd(std::span<const SequenceSlice> slices, size_t i,
                std::span<const SequenceSlice> keyless, int64_t* common) const {
    const SequenceSlice& head = slices[i];
    int64_t head_table = 0;
    *common = BlocksOf(head, &head_table);
    size_t end = i + 1;
    for (; *common > 0 && end < slices.size(); ++end) {
      const SequenceSlice& next = slices[end];
      if ((next.q_begin + next.q_len - head.q_begin) * group_ > rule_.max_root_rows) break;
      // Members' rows ascend; rows between them see no key only under a causal mask (position
      // -1 sees none), and only if they are padding, not another sequence's queries.
      const SequenceSlice& prev = slices[end - 1];
      const int64_t prev_end = prev.q_begin + prev.q_len;
      if (next.q_begin < prev_end || (!causal_ && next.q_begin != prev_end)) break;
      if (AnyRowIn(keyless, prev_end, next.q_begin)) break;
      const int64_t shared = Common(head, next, *common);
      if (shared == 0) break;
      *common = shared;
    }
    return end;
  }

  const int64_t group_;
  const bool causal_;
  const PagedKv& paged_;
  const SharedBlockRule& rule_;
  SharedBlockTree* tree_;
};

// Whether the tree's roots spare more reads than its levels cost (TreeCosts).
bool TreePays(const AttentionShape& shape, const SharedBlockTree& tree, const TreeCosts& costs) {
  const double row_values = double(shape.num_kv_heads) * shape.head_dim * 2;
  const double saved = double(tree.counts.key_rows_saved) * row_values;
  double merged_rows = 0;
  for (size_t l = 1; l < tree.levels.size(); ++l) {
    for (const SequenceSlice& s : tree.levels[l]) merged_rows += double(s.q_len);
  }
  const double merged = merged_rows * shape.num_heads * shape.head_dim;
  return saved >= double(costs.min_saved_values) + costs.merge_cost * merged;
}

}  // namespace

SharedBlockTree FindSharedBlocks(const AttentionShape& shape, std::span<const SequenceSlice> slices,
                                 const PagedKv& paged, const SharedBlockRule& rule,
                                 std::span<const SequenceSlice> keyless) {
  SharedBlockTree tree;
  tree.levels.emplace_back();
  RunFinder(shape, paged, rule, &tree).Find(slices, 0, keyless);
  if (tree.counts.roots == 0 || TreePays(shape, tree, rule.costs)) return tree;
  return {.levels = {{slices.begin(), slices.end()}}};
}

bool GathersPagedKv(std::span<const SequenceSlice> slices) {
  return std::any_of(slices.begin(), slices.end(),
                     [](const SequenceSlice& s) { return s.q_len > kMaxInPlaceQueryRows; });
}

SharedBlockRule RuleForStep(std::span<const SequenceSlice> slices, const TreeCosts& costs) {
  if (!GathersPagedKv(slices)) return {.costs = costs};
  return {
      .max_root_rows = std::numeric_limits<int64_t>::max(), .always_root = true, .costs = costs};
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
  for (const std::vector<SequenceSlice>& level : tree.levels) {
    std::vector<SequenceSlice>& to = g.levels.emplace_back();
    for (const SequenceSlice& s : level) to.push_back(place(s));
  }
  return g;
}

WideRootsPlan PlanWideRoots(const AttentionShape& shape, const SharedBlockTree& tree,
                            const PagedKv& paged, std::span<const int32_t> table,
                            const WideRootRule& rule) {
  WideRootsPlan plan;
  plan.in_place = tree.levels;
  if (tree.levels.empty()) return plan;
  const std::vector<SequenceSlice>& outer = tree.levels[0];
  std::vector<bool> wide(outer.size(), false);
  SharedBlockTree roots{.levels = {{}}};
  int64_t rows = 0;
  const double row_values = double(shape.num_kv_heads) * shape.head_dim * 2;
  for (size_t i : tree.outer_roots) {
    const SequenceSlice& r = outer[i];
    const int64_t packed = r.q_len * shape.group_size();
    const double rereads = (double(packed) / rule.rows_per_read - 1) * r.kv_len * row_values;
    const int64_t tiles =
        (packed + rule.rows_per_tile - 1) / rule.rows_per_tile * shape.num_kv_heads;
    if (packed <= rule.min_packed_rows || rereads < double(rule.min_reread_values) ||
        tiles < rule.min_tiles || rows + r.kv_len > rule.max_rows) {
      continue;
    }
    wide[i] = true;
    rows += r.kv_len;
    roots.levels[0].push_back(r);
  }
  if (rows == 0) return plan;
  plan.gathered = PlanPagedGather(roots, paged, table);
  plan.in_place[0].clear();
  for (size_t i = 0; i < outer.size(); ++i) {
    if (!wide[i]) plan.in_place[0].push_back(outer[i]);
  }
  return plan;
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
