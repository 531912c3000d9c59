// cpfill/runtime/handoff/kv_export.cc — a session's KV handle from every rank's part: the parts'
// wire form, their all-gather, and the assembly every rank runs on the same gathered words.
#include "runtime/handoff/kv_export.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

// A part on the wire, int64 words:
//   [0] 1 when the rank knows the session, else 0 and nothing follows
//   [1] tp_rank  [2] cp_rank  [3] tokens  [4] rows
//   [5..10] pool: bytes, num_blocks, block_stride_bytes, layer_stride_bytes, k_offset_bytes,
//           v_offset_bytes
//   [11] runs R  [12] blocks B, then R (begin, length) pairs, then B block ids.
constexpr size_t kHeaderWords = 13;

std::vector<int64_t> EncodePart(const std::optional<KvRankPart>& part) {
  if (!part) return {0};
  const KvRankShard& s = part->shard;
  const KvPoolLayout& p = s.pool;
  std::vector<int64_t> words = {1,
                                s.tp_rank,
                                s.cp_rank,
                                part->tokens,
                                part->rows,
                                p.bytes,
                                p.num_blocks,
                                p.block_stride_bytes,
                                p.layer_stride_bytes,
                                p.k_offset_bytes,
                                p.v_offset_bytes,
                                static_cast<int64_t>(s.positions.size()),
                                static_cast<int64_t>(s.blocks.size())};
  for (const sharding::PositionRun& run : s.positions) {
    words.push_back(run.begin);
    words.push_back(run.length);
  }
  words.insert(words.end(), s.blocks.begin(), s.blocks.end());
  return words;
}

absl::StatusOr<std::optional<KvRankPart>> DecodePart(std::span<const int64_t> words,
                                                     int world_rank) {
  CPFILL_CHECK_INTERNAL(!words.empty() && (words[0] == 0 || words[0] == 1), "world rank ",
                        world_rank, "'s KV part does not start with a known/unknown flag");
  if (words[0] == 0) return std::nullopt;
  CPFILL_CHECK_INTERNAL(words.size() >= kHeaderWords, "world rank ", world_rank, "'s KV part has ",
                        words.size(), " words, fewer than its header's ", kHeaderWords);
  const int64_t num_runs = words[11], num_blocks = words[12];
  CPFILL_CHECK_INTERNAL(num_runs >= 0 && num_blocks >= 0 &&
                            static_cast<int64_t>(words.size()) ==
                                static_cast<int64_t>(kHeaderWords) + 2 * num_runs + num_blocks,
                        "world rank ", world_rank, "'s KV part has ", words.size(), " words for ",
                        num_runs, " runs and ", num_blocks, " blocks");
  KvRankPart part{.tokens = words[3], .rows = words[4]};
  KvRankShard& s = part.shard;
  s.tp_rank = static_cast<int>(words[1]);
  s.cp_rank = static_cast<int>(words[2]);
  s.pool = {.bytes = words[5],
            .num_blocks = words[6],
            .block_stride_bytes = words[7],
            .layer_stride_bytes = words[8],
            .k_offset_bytes = words[9],
            .v_offset_bytes = words[10]};
  const std::span<const int64_t> runs = words.subspan(kHeaderWords, 2 * num_runs);
  for (size_t i = 0; i < runs.size(); i += 2) s.positions.push_back({runs[i], runs[i + 1]});
  for (int64_t id : words.subspan(kHeaderWords + 2 * num_runs)) {
    CPFILL_CHECK_INTERNAL(id >= 0 && id <= INT32_MAX, "world rank ", world_rank,
                          "'s KV part names block ", id);
    s.blocks.push_back(static_cast<int32_t>(id));
  }
  return part;
}

// Every rank's words on every rank, in world rank order, through the communicator's gather of
// variable-length bytes (parallel::AllGatherText).
absl::StatusOr<std::vector<std::vector<int64_t>>> AllGatherWords(
    parallel::Communicator& world, const std::vector<int64_t>& words) {
  const std::string bytes(reinterpret_cast<const char*>(words.data()),
                          words.size() * sizeof(int64_t));
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::string> all, parallel::AllGatherText(world, bytes));
  std::vector<std::vector<int64_t>> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    out[r].resize(all[r].size() / sizeof(int64_t));
    std::memcpy(out[r].data(), all[r].data(), out[r].size() * sizeof(int64_t));
  }
  return out;
}

// NotFound when no rank knows the session, Internal when only some do.
absl::Status CheckKnownEverywhere(const std::vector<std::optional<KvRankPart>>& parts,
                                  const std::string& session) {
  std::vector<int> known, unknown;
  for (size_t r = 0; r < parts.size(); ++r) {
    (parts[r] ? known : unknown).push_back(static_cast<int>(r));
  }
  if (known.empty()) return absl::NotFoundError(absl::StrCat("no session '", session, "'"));
  CPFILL_CHECK_INTERNAL(unknown.empty(), "session '", session, "' is known to world ranks ",
                        absl::StrJoin(known, ", "), " but not to ", absl::StrJoin(unknown, ", "));
  return absl::OkStatus();
}

// The rows of a part are its positions and sit in ascending position order: the handle says row i
// is the i-th position in run order, and its runs must be sorted.
absl::Status CheckRows(const KvRankPart& part, int world_rank) {
  const KvRankShard& s = part.shard;
  CPFILL_CHECK_INTERNAL(part.rows == s.held_tokens(), "world rank ", world_rank,
                        "'s KV sequence holds ", part.rows, " rows for ", s.held_tokens(),
                        " positions");
  for (size_t i = 1; i < s.positions.size(); ++i) {
    CPFILL_CHECK_INTERNAL(s.positions[i].begin >= s.positions[i - 1].end(), "world rank ",
                          world_rank, "'s KV rows are not in ascending position order (run ", i,
                          " begins at ", s.positions[i].begin, ", before ",
                          s.positions[i - 1].end(), ")");
  }
  return absl::OkStatus();
}

// Each (tp_rank, cp_rank) of the geometry exactly once, at its tp-major index.
absl::StatusOr<std::vector<KvRankShard>> PlaceShards(
    const std::vector<std::optional<KvRankPart>>& parts, const KvHandleLayout& geometry) {
  const int tp = geometry.tp_size, cp = geometry.cp_size;
  CPFILL_CHECK_INTERNAL(static_cast<int64_t>(parts.size()) == int64_t{tp} * cp, "the world has ",
                        parts.size(), " ranks, the grid TP", tp, " x CP", cp);
  std::vector<KvRankShard> shards(parts.size());
  std::vector<bool> placed(parts.size(), false);
  for (size_t r = 0; r < parts.size(); ++r) {
    const KvRankShard& s = parts[r]->shard;
    CPFILL_CHECK_INTERNAL(s.tp_rank >= 0 && s.tp_rank < tp && s.cp_rank >= 0 && s.cp_rank < cp,
                          "world rank ", r, " says it is tp_rank ", s.tp_rank, ", cp_rank ",
                          s.cp_rank, " of TP", tp, " x CP", cp);
    const size_t index = static_cast<size_t>(s.tp_rank) * cp + s.cp_rank;
    CPFILL_CHECK_INTERNAL(!placed[index], "world rank ", r, " is tp_rank ", s.tp_rank, ", cp_rank ",
                          s.cp_rank, ", like a rank before it");
    placed[index] = true;
    shards[index] = s;
  }
  return shards;
}

absl::StatusOr<KvHandle> AssembleHandle(const std::vector<std::optional<KvRankPart>>& parts,
                                        const KvHandleLayout& geometry, const KvHandleIds& ids,
                                        const std::string& session) {
  CPFILL_RETURN_IF_ERROR(CheckKnownEverywhere(parts, session));
  for (const std::string* id : {&ids.engine_id, &ids.request_id}) {
    CPFILL_CHECK_ARG(!id->empty() && id->size() <= kKvHandleMaxIdBytes, "KV handle ids must have ",
                     "1 to ", kKvHandleMaxIdBytes, " bytes, got '", *id, "'");
  }
  KvHandle handle{.engine_id = ids.engine_id, .request_id = ids.request_id, .layout = geometry};
  handle.layout.tokens = parts[0]->tokens;
  for (size_t r = 0; r < parts.size(); ++r) {
    CPFILL_CHECK_INTERNAL(parts[r]->tokens == handle.layout.tokens, "session '", session, "' has ",
                          parts[r]->tokens, " tokens on world rank ", r, " and ",
                          handle.layout.tokens, " on world rank 0");
    CPFILL_RETURN_IF_ERROR(CheckRows(*parts[r], static_cast<int>(r)));
  }
  CPFILL_ASSIGN_OR_RETURN(handle.ranks, PlaceShards(parts, geometry));
  if (absl::Status valid = ValidateKvHandle(handle, KvTransportCheck::kAbsentAllowed);
      !valid.ok()) {
    return absl::InternalError(absl::StrCat(
        "session '", session, "': the KV handle its ranks describe is invalid: ", valid.message()));
  }
  return handle;
}

}  // namespace

KvRankPart DescribeRankKv(const KvCache& kv, KvCache::SeqId seq,
                          const std::vector<sharding::PositionRun>& runs_in_row_order, int tp_rank,
                          int cp_rank, int64_t tokens) {
  KvRankPart part{.tokens = tokens, .rows = kv.length(seq)};
  KvRankShard& s = part.shard;
  s.tp_rank = tp_rank;
  s.cp_rank = cp_rank;
  for (const sharding::PositionRun& run : runs_in_row_order) {
    if (run.length == 0) continue;
    if (!s.positions.empty() && s.positions.back().end() == run.begin) {
      s.positions.back().length += run.length;  // adjacent rows continue one run
    } else {
      s.positions.push_back(run);
    }
  }
  // Only the blocks that hold rows: a sequence may have reserved more than it filled.
  const int64_t block_tokens = kv.spec().block_tokens;
  const int64_t used = (s.held_tokens() + block_tokens - 1) / block_tokens;
  const std::span<const int32_t> table = kv.BlockTable(seq);
  s.blocks.assign(table.begin(), table.begin() + std::min<int64_t>(used, table.size()));
  s.pool = KvPoolLayout::OfKvCache(kv.spec(), kv.num_blocks());
  return part;
}

KvHandleLayout KvGeometry(const KvCacheSpec& spec, int tp_size, int cp_size) {
  return {.num_layers = spec.num_layers,
          .kv_heads = spec.kv_heads * tp_size,
          .kv_heads_per_tp_rank = spec.kv_heads,
          .head_dim = spec.head_dim,
          .dtype = spec.dtype,
          .block_tokens = spec.block_tokens,
          .tp_size = tp_size,
          .cp_size = cp_size};
}

absl::StatusOr<KvHandle> GatherKvHandle(parallel::Communicator& world,
                                        const std::optional<KvRankPart>& mine,
                                        const KvHandleLayout& geometry, const KvHandleIds& ids,
                                        const std::string& session) {
  // Step 1: every rank's part on every rank (a few words per run and block).
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::vector<int64_t>> words,
                          AllGatherWords(world, EncodePart(mine)));
  // Step 2: every rank decodes and assembles the same words, so it reaches the same handle or
  // the same error without another exchange.
  std::vector<std::optional<KvRankPart>> parts;
  for (size_t r = 0; r < words.size(); ++r) {
    CPFILL_ASSIGN_OR_RETURN(std::optional<KvRankPart> part,
                            DecodePart(words[r], static_cast<int>(r)));
    parts.push_back(std::move(part));
  }
  return AssembleHandle(parts, geometry, ids, session);
}

absl::StatusOr<KvHandle> ExportSessionKv(LlamaModel& model, const std::string& session,
                                         const KvHandleIds& ids) {
  ModelBackend& backend = model.backend();
  const int tp_rank = backend.tp().rank(), cp_rank = backend.cp().rank();
  std::optional<KvRankPart> mine;
  if (std::optional<LlamaModel::SessionKvRows> rows = model.SessionRows(session)) {
    mine = DescribeRankKv(model.kv_cache(), rows->seq, rows->runs_in_row_order, tp_rank, cp_rank,
                          rows->tokens);
  }
  return GatherKvHandle(
      model.world(), mine,
      KvGeometry(model.kv_cache().spec(), backend.tp().size(), backend.cp().size()), ids, session);
}

}  // namespace cpfill::runtime
