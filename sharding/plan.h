// cpfill/sharding/plan.h — who holds which tokens: load-balanced context-parallel sharding.
//
// Pure functions, no communication, no device code. Everything downstream (ring attention, the
// KV cache, the check against one rank) reads a ShardPlan; nothing else recomputes ownership.
//
// Full prefill (paper §3.5.1, Fig. 1): each sequence's T tokens are cut into 2N chunks whose
// sizes differ by at most one token; CP rank i takes chunks i and 2N-1-i, so causal work and KV
// per rank are balanced. Ranks end up with floor(T/N) or ceil(T/N) tokens; messages are padded to
// ceil(T/N) slots, so padding exists only where N does not divide T (reported).
// Partial prefill (Fig. 2): the same on the T new tokens only, which sit at global positions
// [P, P+T); the P cached tokens stay on the ranks that hold them (a KvLayout).
// Decode (§3.6): one new token per sequence, placed round-robin with an offset that moves every
// step, so every rank's KV cache grows at the same rate.
//
//   CPFILL_ASSIGN_OR_RETURN(ShardPlan plan, PlanPrefill({{.new_tokens = 32768}}, /*cp_size=*/4));
//   const RankSequenceShard& mine = plan.shard(cp_rank, /*seq=*/0);  // 2 runs of 4096 positions
//   KvLayout cache = plan.KvLayoutAfter();   // where every sequence's KV now lives, for turn 2
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace cpfill::sharding {

// A run of consecutive global positions [begin, begin + length) within one sequence.
struct PositionRun {
  int64_t begin = 0;
  int64_t length = 0;
  int64_t end() const { return begin + length; }
  bool operator==(const PositionRun&) const = default;
};

int64_t TotalLength(const std::vector<PositionRun>& runs);

// One request of a fused batch: T new tokens after P tokens already in the KV cache.
struct SequenceRequest {
  int64_t new_tokens = 0;     // T >= 0
  int64_t cached_tokens = 0;  // P >= 0; the new tokens sit at positions [P, P + T)
};

// Where each sequence's cached KV lives: runs[cp_rank][seq]. The runs of one sequence over all
// ranks cover [0, P) exactly once.
struct KvLayout {
  int cp_size = 0;
  std::vector<std::vector<std::vector<PositionRun>>> runs;
  int64_t tokens(int cp_rank, int seq) const { return TotalLength(runs[cp_rank][seq]); }
};

// What one CP rank holds of one sequence. Local packing order (every tensor on the rank uses it):
// queries = new_runs in order; keys/values = cached_runs in order, then new_runs in order.
struct RankSequenceShard {
  std::vector<PositionRun> new_runs;
  std::vector<PositionRun> cached_runs;
  int64_t new_tokens() const { return TotalLength(new_runs); }
  int64_t cached_tokens() const { return TotalLength(cached_runs); }
  int64_t kv_tokens() const { return new_tokens() + cached_tokens(); }
};

enum class PlanKind { kPrefill, kDecode };

struct ShardPlan {
  PlanKind kind = PlanKind::kPrefill;
  int cp_size = 0;
  std::vector<SequenceRequest> sequences;
  std::vector<std::vector<RankSequenceShard>> shards;  // [cp_rank][seq]

  int num_sequences() const { return static_cast<int>(sequences.size()); }
  const RankSequenceShard& shard(int cp_rank, int seq) const { return shards[cp_rank][seq]; }

  // The most new tokens one rank holds, over the whole batch: the slots of a pass-Q message,
  // which carries its rank's queries unpadded (about B/N for a decode step of B sequences).
  int64_t MaxRankNewTokens() const;
  // L^i of Alg. 2: the max over ranks of cached + new tokens of a sequence.
  int64_t PaddedKvTokens(int seq) const;
  // Padding slots the equal-sized messages add over all ranks: pass-Q's (N messages of
  // MaxRankNewTokens) and pass-KV's (per sequence, N x L^i).
  int64_t NewTokenPadding() const;
  int64_t KvPadding() const;

  // Where every sequence's KV lives once this plan's new tokens are in the cache (the next turn's
  // cached layout): each rank keeps its cached runs and appends its new runs (adjacent runs are
  // joined).
  KvLayout KvLayoutAfter() const;
  // One entry of KvLayoutAfter, runs[cp_rank][seq], without building the others: callers that
  // need one sequence (a session's layout) stay linear in the batch.
  std::vector<PositionRun> KvRunsAfter(int cp_rank, int seq) const;

  // Sequences [first, first + count) alone, as their own plan: every rank's share of them is
  // unchanged, and on every rank their local rows are the same contiguous slice of this plan's
  // (MakeLocalLayout lays sequences out one after another).
  ShardPlan Slice(int first, int count) const;

  std::string DebugString() const;  // one line per rank and sequence
};

// The layout a single full prefill of `cached_tokens[seq]` tokens per sequence leaves behind:
// the default cache layout for a partial prefill whose earlier turn was one full prefill.
absl::StatusOr<KvLayout> LayoutOfFullPrefill(const std::vector<int64_t>& cached_tokens,
                                             int cp_size);

// Full (P = 0) or partial prefill. `cache` says where the cached tokens live; it may be null only
// when every P is 0, or to mean LayoutOfFullPrefill of the P's. InvalidArgument on a negative
// length, cp_size < 1, or a cache that does not match the requests (sequence count, rank count,
// runs not covering [0, P) exactly once).
absl::StatusOr<ShardPlan> PlanPrefill(const std::vector<SequenceRequest>& sequences, int cp_size,
                                      const KvLayout* cache = nullptr);

// Decode step `step` (0, 1, ...): sequence b's one new token, at position P_b, goes to CP rank
// (b + step) mod N. Same cache rules as PlanPrefill; every request must have new_tokens == 1.
absl::StatusOr<ShardPlan> PlanDecode(const std::vector<SequenceRequest>& sequences, int cp_size,
                                     int64_t step, const KvLayout* cache = nullptr);

// The rank's view of a plan, flattened: offsets and global positions of every local row.
// Queries of sequence b are rows [q_offset[b], q_offset[b] + q_len[b]) of the local Q; keys of
// sequence b are rows [kv_offset[b], kv_offset[b] + kv_len[b]) of the local K and V.
// Key positions stay runs: a decode step of 256 sequences after 16K tokens has 4M key rows but
// a few runs per sequence, and listing every position (16 MB, filled and uploaded each step)
// took more of its host time than the step's planning. ExpandPositions lists them where one
// position per row is needed; the GPU ring expands them on the device.
struct LocalLayout {
  std::vector<int64_t> q_offset, q_len, kv_offset, kv_len;
  std::vector<int32_t> q_positions;  // [local q rows]
  std::vector<PositionRun> kv_runs;  // the local key rows in order, run after run (none empty)
  int64_t kv_row_count = 0;          // the runs' total length
  int64_t q_rows() const { return static_cast<int64_t>(q_positions.size()); }
  int64_t kv_rows() const { return kv_row_count; }
};
LocalLayout MakeLocalLayout(const ShardPlan& plan, int cp_rank);

// One position per row of `runs`, in order.
std::vector<int32_t> ExpandPositions(std::span<const PositionRun> runs);

// Balanced chunk sizes of a sequence of `tokens` cut into 2N chunks: sizes differ by at most one,
// and the extra tokens go to chunks 0..N-1 then 2N-1 down to N, so the two chunks of one rank
// together hold floor(T/N) or ceil(T/N) tokens.
std::vector<int64_t> ChunkSizes(int64_t tokens, int cp_size);

}  // namespace cpfill::sharding
