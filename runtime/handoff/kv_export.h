// cpfill/runtime/handoff/kv_export.h — the prefill side of the KV hand-off: one session's KV,
// spread over every (tp_rank, cp_rank) of the world, described as a KvHandle (kv_handle.h).
//
// Each rank describes its own part (DescribeRankKv: the global positions its KvCache sequence
// holds, in row order, its block ids, its pool layout), the parts travel to every rank in two
// all-gathers, and every rank assembles and validates the same handle, or returns the same error:
// no rank leaves the collective early, and the verdict never depends on which rank looks.
// ExportSessionKv (below) is the caller; the functions are separate so that the model stays
// small and the assembly can be read on its own.
//
// The handle has no transport yet (every rank's KvRankTransport is empty): the server fills the
// UCX fields when --kv-handoff is on, before ToJson publishes it.
//
//   KvRankPart mine = DescribeRankKv(kv, seq, session_runs, tp_rank, cp_rank, session_tokens);
//   CPFILL_ASSIGN_OR_RETURN(
//       KvHandle handle,
//       GatherKvHandle(world, mine, KvGeometry(kv.spec(), tp, cp), {"cpfill-a1", "cmpl-7"}, "s"));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/kv/kv_cache.h"
#include "runtime/model/llama_model.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

struct KvHandleIds {
  std::string engine_id;   // 1 to kKvHandleMaxIdBytes bytes
  std::string request_id;  // likewise
};

// What one rank holds of one session.
struct KvRankPart {
  KvRankShard shard;   // transport empty
  int64_t tokens = 0;  // the session's positions over every rank: [0, tokens)
  int64_t rows = 0;    // rows the rank's KvCache sequence holds: shard.held_tokens() when sound
};

// The rank's part of sequence `seq`, whose KvCache rows hold the global positions
// `runs_in_row_order` (a session's sharding::KvLayout entry for this CP rank: cached runs then
// each turn's new runs, in the order the rows were written). Adjacent runs are joined; the runs
// stay in row order, so the handle's contract (row i is the i-th position in run order) holds
// exactly when they are ascending, which GatherKvHandle checks.
KvRankPart DescribeRankKv(const KvCache& kv, KvCache::SeqId seq,
                          const std::vector<sharding::PositionRun>& runs_in_row_order, int tp_rank,
                          int cp_rank, int64_t tokens);

// The geometry of a handle for a KvCache of `spec` (this TP rank's heads) on a TP x CP grid;
// its tokens are filled by GatherKvHandle.
KvHandleLayout KvGeometry(const KvCacheSpec& spec, int tp_size, int cp_size);

// Collective over `world` (tp_size * cp_size ranks): gathers every rank's part (nullopt where the
// rank does not know the session) and returns the same handle on every rank, validated with its
// transport absent (ValidateKvHandle, KvTransportCheck::kAbsentAllowed). Errors, identical on
// every rank: NotFound when no rank knows `session`; InvalidArgument for bad ids; Internal when
// the parts disagree (a session known to some ranks only, different token counts, a (tp, cp)
// rank missing or twice, rows that do not match the positions or are not in ascending position
// order) or the handle does not validate; a communication error as the communicator reports it.
absl::StatusOr<KvHandle> GatherKvHandle(parallel::Communicator& world,
                                        const std::optional<KvRankPart>& mine,
                                        const KvHandleLayout& geometry, const KvHandleIds& ids,
                                        const std::string& session);

// The KV hand-off handle of `model`'s session `session`, collective over the model's world: every
// rank describes its part of the session's KV (LlamaModel::SessionRows) and every rank returns
// the same handle, without transport (the server fills the UCX fields when --kv-handoff is on),
// or the same error: NotFound for an unknown session, InvalidArgument for bad ids, Internal for
// ranks that disagree. The handle describes the session as it is now: valid until the session
// changes (another turn, a decode step, its end).
absl::StatusOr<KvHandle> ExportSessionKv(LlamaModel& model, const std::string& session,
                                         const KvHandleIds& ids);

}  // namespace cpfill::runtime
