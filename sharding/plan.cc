#include "sharding/plan.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::sharding {
namespace {

void AppendRun(std::vector<PositionRun>& runs, PositionRun run) {
  if (run.length == 0) return;
  if (!runs.empty() && runs.back().end() == run.begin) {
    runs.back().length += run.length;  // adjacent: keep one run
  } else {
    runs.push_back(run);
  }
}

absl::Status ValidateRequests(const std::vector<SequenceRequest>& sequences, int cp_size) {
  CPFILL_CHECK_ARG(cp_size >= 1, "context-parallel size must be >= 1, got ", cp_size);
  for (size_t i = 0; i < sequences.size(); ++i) {
    CPFILL_CHECK_ARG(sequences[i].new_tokens >= 0, "sequence ", i, ": new token count ",
                     sequences[i].new_tokens, " is negative");
    CPFILL_CHECK_ARG(sequences[i].cached_tokens >= 0, "sequence ", i, ": cached token count ",
                     sequences[i].cached_tokens, " is negative");
    // Positions travel as int32 (attention/), so a sequence must fit below 2^31 tokens.
    CPFILL_CHECK_ARG(sequences[i].new_tokens + sequences[i].cached_tokens < (int64_t{1} << 31),
                     "sequence ", i, ": ", sequences[i].cached_tokens + sequences[i].new_tokens,
                     " tokens exceed the 2^31 positions cpfill supports");
  }
  return absl::OkStatus();
}

// Checks that `cache` describes exactly the cached tokens of `sequences`.
absl::Status ValidateCache(const std::vector<SequenceRequest>& sequences, int cp_size,
                           const KvLayout& cache) {
  CPFILL_CHECK_ARG(cache.cp_size == cp_size && static_cast<int>(cache.runs.size()) == cp_size,
                   "KV cache layout is for ", cache.runs.size(), " CP ranks, the plan for ",
                   cp_size);
  for (int r = 0; r < cp_size; ++r) {
    CPFILL_CHECK_ARG(cache.runs[r].size() == sequences.size(), "KV cache layout of CP rank ", r,
                     " has ", cache.runs[r].size(), " sequences, the batch ", sequences.size());
  }
  std::vector<PositionRun> all;  // one sequence's runs over every rank; reused
  for (size_t s = 0; s < sequences.size(); ++s) {
    all.clear();
    for (int r = 0; r < cp_size; ++r) {
      for (const PositionRun& run : cache.runs[r][s]) {
        CPFILL_CHECK_ARG(run.begin >= 0 && run.length >= 0, "sequence ", s, ": KV cache run [",
                         run.begin, ", ", run.end(), ") is invalid");
        if (run.length > 0) all.push_back(run);
      }
    }
    std::sort(all.begin(), all.end(),
              [](const PositionRun& a, const PositionRun& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const PositionRun& run : all) {
      CPFILL_CHECK_ARG(run.begin == next, "sequence ", s, ": KV cache layout ",
                       run.begin < next ? "holds a position twice" : "misses positions",
                       " near position ", std::min(run.begin, next));
      next = run.end();
    }
    CPFILL_CHECK_ARG(next == sequences[s].cached_tokens, "sequence ", s, ": KV cache holds ", next,
                     " tokens but the request says ", sequences[s].cached_tokens, " are cached");
  }
  return absl::OkStatus();
}

// Fills every shard's cached runs from `cache` (or the full-prefill layout when null).
absl::Status AttachCache(ShardPlan& plan, const KvLayout* cache) {
  KvLayout derived;
  if (cache == nullptr) {
    std::vector<int64_t> cached;
    bool any_cached = false;
    for (const SequenceRequest& s : plan.sequences) {
      cached.push_back(s.cached_tokens);
      any_cached |= s.cached_tokens > 0;
    }
    if (any_cached) {
      CPFILL_ASSIGN_OR_RETURN(derived, LayoutOfFullPrefill(cached, plan.cp_size));
    } else {  // nothing cached: an empty layout (and no recursion through a full prefill)
      derived.cp_size = plan.cp_size;
      derived.runs.assign(plan.cp_size,
                          std::vector<std::vector<PositionRun>>(plan.sequences.size()));
    }
    cache = &derived;
  }
  CPFILL_RETURN_IF_ERROR(ValidateCache(plan.sequences, plan.cp_size, *cache));
  for (int r = 0; r < plan.cp_size; ++r) {
    for (int s = 0; s < plan.num_sequences(); ++s) {
      plan.shards[r][s].cached_runs = cache->runs[r][s];
    }
  }
  return absl::OkStatus();
}

// Gives every CP rank its runs of sequence `seq`'s new positions [offset, offset + tokens):
// rank i takes chunks i and 2N-1-i of the balanced 2N-way cut. One pass over the 2N chunks for
// all ranks, so planning costs O(N) per sequence.
void AssignBalancedRuns(ShardPlan& plan, int seq, int64_t offset, int64_t tokens) {
  const int n = plan.cp_size;
  const std::vector<int64_t> sizes = ChunkSizes(tokens, n);
  int64_t start = offset;
  for (int c = 0; c < 2 * n; ++c) {
    const int cp_rank = c < n ? c : 2 * n - 1 - c;
    AppendRun(plan.shards[cp_rank][seq].new_runs, {start, sizes[c]});
    start += sizes[c];
  }
}

}  // namespace

int64_t TotalLength(const std::vector<PositionRun>& runs) {
  int64_t n = 0;
  for (const PositionRun& r : runs) n += r.length;
  return n;
}

std::vector<int64_t> ChunkSizes(int64_t tokens, int cp_size) {
  const int chunks = 2 * cp_size;
  std::vector<int64_t> sizes(chunks, tokens / chunks);
  int64_t extra = tokens % chunks;
  // Extras to chunks 0..N-1 first (one per rank), then to the second chunks 2N-1..N.
  for (int c = 0; c < cp_size && extra > 0; ++c, --extra) ++sizes[c];
  for (int c = chunks - 1; c >= cp_size && extra > 0; --c, --extra) ++sizes[c];
  return sizes;
}

int64_t ShardPlan::MaxRankNewTokens() const {
  int64_t m = 0;
  for (int r = 0; r < cp_size; ++r) {
    int64_t rows = 0;
    for (const RankSequenceShard& shard : shards[r]) rows += shard.new_tokens();
    m = std::max(m, rows);
  }
  return m;
}

int64_t ShardPlan::PaddedKvTokens(int seq) const {
  int64_t m = 0;
  for (int r = 0; r < cp_size; ++r) m = std::max(m, shards[r][seq].kv_tokens());
  return m;
}

int64_t ShardPlan::NewTokenPadding() const {
  int64_t pad = MaxRankNewTokens() * cp_size;
  for (const SequenceRequest& s : sequences) pad -= s.new_tokens;
  return pad;
}

int64_t ShardPlan::KvPadding() const {
  int64_t pad = 0;
  for (int s = 0; s < num_sequences(); ++s) {
    pad += PaddedKvTokens(s) * cp_size - sequences[s].new_tokens - sequences[s].cached_tokens;
  }
  return pad;
}

std::vector<PositionRun> ShardPlan::KvRunsAfter(int cp_rank, int seq) const {
  std::vector<PositionRun> runs;
  for (const PositionRun& run : shards[cp_rank][seq].cached_runs) AppendRun(runs, run);
  for (const PositionRun& run : shards[cp_rank][seq].new_runs) AppendRun(runs, run);
  return runs;
}

KvLayout ShardPlan::KvLayoutAfter() const {
  KvLayout layout;
  layout.cp_size = cp_size;
  layout.runs.resize(cp_size);
  for (int r = 0; r < cp_size; ++r) {
    layout.runs[r].reserve(num_sequences());
    for (int s = 0; s < num_sequences(); ++s) layout.runs[r].push_back(KvRunsAfter(r, s));
  }
  return layout;
}

ShardPlan ShardPlan::Slice(int first, int count) const {
  ShardPlan out;
  out.kind = kind;
  out.cp_size = cp_size;
  out.sequences.assign(sequences.begin() + first, sequences.begin() + first + count);
  for (const auto& rank : shards) {
    out.shards.emplace_back(rank.begin() + first, rank.begin() + first + count);
  }
  return out;
}

std::string ShardPlan::DebugString() const {
  std::string out = absl::StrCat(kind == PlanKind::kDecode ? "decode" : "prefill", " plan, CP",
                                 cp_size, ", ", sequences.size(), " sequences\n");
  auto runs_str = [](const std::vector<PositionRun>& runs) {
    std::string s;
    for (const PositionRun& r : runs) absl::StrAppend(&s, " [", r.begin, ",", r.end(), ")");
    return s.empty() ? std::string(" -") : s;
  };
  for (int r = 0; r < cp_size; ++r) {
    for (int s = 0; s < num_sequences(); ++s) {
      absl::StrAppend(&out, "  cp_rank ", r, " seq ", s, ": new", runs_str(shards[r][s].new_runs),
                      " cached", runs_str(shards[r][s].cached_runs), "\n");
    }
  }
  return out;
}

absl::StatusOr<KvLayout> LayoutOfFullPrefill(const std::vector<int64_t>& cached_tokens,
                                             int cp_size) {
  std::vector<SequenceRequest> full;
  for (int64_t p : cached_tokens) full.push_back({.new_tokens = p, .cached_tokens = 0});
  CPFILL_ASSIGN_OR_RETURN(ShardPlan plan, PlanPrefill(full, cp_size));
  return plan.KvLayoutAfter();
}

absl::StatusOr<ShardPlan> PlanPrefill(const std::vector<SequenceRequest>& sequences, int cp_size,
                                      const KvLayout* cache) {
  CPFILL_RETURN_IF_ERROR(ValidateRequests(sequences, cp_size));
  ShardPlan plan;
  plan.kind = PlanKind::kPrefill;
  plan.cp_size = cp_size;
  plan.sequences = sequences;
  plan.shards.assign(cp_size, std::vector<RankSequenceShard>(sequences.size()));
  for (size_t s = 0; s < sequences.size(); ++s) {
    AssignBalancedRuns(plan, static_cast<int>(s), sequences[s].cached_tokens,
                       sequences[s].new_tokens);
  }
  CPFILL_RETURN_IF_ERROR(AttachCache(plan, cache));
  return plan;
}

absl::StatusOr<ShardPlan> PlanDecode(const std::vector<SequenceRequest>& sequences, int cp_size,
                                     int64_t step, const KvLayout* cache) {
  CPFILL_RETURN_IF_ERROR(ValidateRequests(sequences, cp_size));
  CPFILL_CHECK_ARG(step >= 0, "decode step must be >= 0, got ", step);
  ShardPlan plan;
  plan.kind = PlanKind::kDecode;
  plan.cp_size = cp_size;
  plan.sequences = sequences;
  plan.shards.assign(cp_size, std::vector<RankSequenceShard>(sequences.size()));
  for (size_t s = 0; s < sequences.size(); ++s) {
    CPFILL_CHECK_ARG(sequences[s].new_tokens == 1, "decode: sequence ", s, " has ",
                     sequences[s].new_tokens, " new tokens; a decode step has exactly one");
    const int owner = static_cast<int>((static_cast<int64_t>(s) + step) % cp_size);
    plan.shards[owner][s].new_runs = {{sequences[s].cached_tokens, 1}};
  }
  CPFILL_RETURN_IF_ERROR(AttachCache(plan, cache));
  return plan;
}

LocalLayout MakeLocalLayout(const ShardPlan& plan, int cp_rank) {
  LocalLayout local;
  const int n = plan.num_sequences();
  int64_t q_rows = 0;
  for (int s = 0; s < n; ++s) q_rows += plan.shard(cp_rank, s).new_tokens();
  local.q_positions.resize(q_rows);
  int32_t* q = local.q_positions.data();
  const auto add_keys = [&](const std::vector<PositionRun>& runs) {
    for (const PositionRun& run : runs) {
      if (run.length == 0) continue;
      local.kv_runs.push_back(run);
      local.kv_row_count += run.length;
    }
  };
  for (int s = 0; s < n; ++s) {
    const RankSequenceShard& shard = plan.shard(cp_rank, s);
    local.q_offset.push_back(q - local.q_positions.data());
    local.kv_offset.push_back(local.kv_row_count);
    for (const PositionRun& run : shard.new_runs) {
      std::iota(q, q + run.length, static_cast<int32_t>(run.begin));
      q += run.length;
    }
    add_keys(shard.cached_runs);
    add_keys(shard.new_runs);
    local.q_len.push_back(q - local.q_positions.data() - local.q_offset.back());
    local.kv_len.push_back(local.kv_row_count - local.kv_offset.back());
  }
  return local;
}

std::vector<int32_t> ExpandPositions(std::span<const PositionRun> runs) {
  int64_t rows = 0;
  for (const PositionRun& run : runs) rows += run.length;
  std::vector<int32_t> positions(rows);
  int32_t* at = positions.data();
  for (const PositionRun& run : runs) {
    std::iota(at, at + run.length, static_cast<int32_t>(run.begin));
    at += run.length;
  }
  return positions;
}

}  // namespace cpfill::sharding
