// cpfill/runtime/handoff/kv_handle.h — the KV hand-off handle: what a prefill server returns in a
// response's `kv_transfer_params` so that a decode worker can pull the request's KV.
//
// One request's KV is spread over every (tp_rank, cp_rank) of the prefill: TP splits the KV heads,
// CP splits the token positions (2N-chunk load-balanced sharding, sharding/plan.h). The handle
// says, for each rank, which global positions it holds, in which of its KV pool's blocks, where
// the pool's K and V live, and how to reach it (UCX worker address, memory key, remote address).
// runtime/handoff/kv_pull_plan.h turns a handle into the copies a decode rank makes.
//
// The handle is untrusted input on the decode side (a stale version, a truncated or forged
// handle): ParseKvHandle checks every field and returns InvalidArgument naming the field; it never
// throws. ValidateKvHandle runs the same value checks on a handle built in-process.
//
// JSON shape, format "cpfill.kv.v2" (keys not listed here are ignored, so a router may add its
// own; every listed key is required):
//   {"version": "cpfill.kv.v2", "engine_id": "cpfill-a1", "request_id": "kv-9f0c...",
//    "compat_hash": "8e99ad01a2868416",          // KvCompatHash(layout), 16 hex digits
//    "lease_nonce": "0x5be1...",                  // 128 random bits: 32 hex digits (below)
//    "layout": {"num_layers": 32, "kv_heads": 8, "kv_heads_per_tp_rank": 4, "head_dim": 128,
//               "dtype": "bfloat16", "block_tokens": 16, "tokens": 41, "tp_size": 2,
//               "cp_size": 2},
//    "ranks": [                                  // tp-major: [tp_rank * cp_size + cp_rank]
//      {"tp_rank": 0, "cp_rank": 0,
//       "positions": [[0, 11], [31, 41]],        // [begin, end) runs, sorted: 21 positions
//       "blocks": [7, 3],                        // local row i in blocks[i / block_tokens]
//       "pool": {"bytes": 67108864, "num_blocks": 64, "block_stride_bytes": 16384,
//                "layer_stride_bytes": 2097152, "k_offset_bytes": 0, "v_offset_bytes": 1048576},
//       "ucx": {"worker_address": "<base64>", "rkey": "<base64>", "pool_address": "0x7f3a...",
//               "lease_rkey": "<base64>", "lease_address": "0x55d0..."}},
//      ...]}
//
// The lease record. Each rank keeps one registered 64-byte KvLeaseRecord per lease (at
// lease_address, under lease_rkey): while the lease holds, the nonce and the SHA-256 of that
// rank's part of the handle (KvRankDigest: the ids, the nonce, the layout, the rank's coordinates,
// positions, blocks and pool); the nonce is cleared before the rank frees the blocks (a release,
// the lease's expiry, DELETE /v1/kv/{request_id}). A puller reads the record before any KV and
// refuses a rank whose record does not hold the handle's nonce (a stale handle) or whose digest
// differs from the digest of the handle's part for that rank (an edited or forged handle: other
// blocks, another rank's transport, another engine's or request's ids): nothing is read. It reads
// the nonce again after its gets: still there means the blocks it read were the request's
// throughout; anything else means the lease ended mid-pull, and the data is void. Nonces come
// from the operating system's CSPRNG and are never reused within an engine.
//
// The release: when every decode rank has pulled, the decode side sends one UCX active message of
// id kKvReleaseMessageId to ranks[0]'s worker, payload KvReleasePayload(handle); the lease ends
// at once. Unacknowledged; a release that names no lease holding now (another engine, an ended
// lease, another nonce) is ignored (the server logs it).
//
// A rank's local rows are its positions in order (the packing of sharding/plan.h); row i sits in
// block blocks[i / block_tokens] at row i % block_tokens. Each row is [kv_heads_per_tp_rank,
// head_dim] of dtype (global heads [tp_rank * kv_heads_per_tp_rank, ...)).
//
//   KvHandle handle = ...;                                 // server side, from its KvCache
//   nlohmann::ordered_json params = ToJson(handle);
//   ...
//   CPFILL_ASSIGN_OR_RETURN(KvHandle got, ParseKvHandle(body["kv_transfer_params"]));
//   CPFILL_CHECK_ARG(got.compat_hash() == KvCompatHash(my_layout), "model mismatch");
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/secure.h"
#include "nlohmann/json.hpp"
#include "runtime/kv/kv_cache.h"
#include "sharding/plan.h"

namespace cpfill::runtime {

inline constexpr std::string_view kKvHandleVersion = "cpfill.kv.v2";

// A lease's nonce: 128 bits from the operating system's CSPRNG, never zero once published; "0x"
// and 32 lowercase hex digits in JSON, in release messages and in the HTTP lease routes.
struct KvNonce {
  uint64_t hi = 0, lo = 0;

  static KvNonce Random();
  // Exactly "0x" and 32 hex digits (either case); nullopt otherwise.
  static std::optional<KvNonce> Parse(std::string_view text);
  std::string ToString() const;
  bool zero() const { return hi == 0 && lo == 0; }
  bool operator==(const KvNonce&) const = default;
};

// What a prefill rank publishes for one lease in its registered lease region (the layout a
// puller reads, 64 bytes a lease slot): the nonce while the lease holds (zero otherwise) and the
// SHA-256 of the rank's part of the handle.
struct KvLeaseRecord {
  uint64_t nonce_hi = 0;
  uint64_t nonce_lo = 0;
  uint8_t digest[32] = {};
  uint8_t reserved[16] = {};
};
static_assert(sizeof(KvLeaseRecord) == 64, "lease records are 64 bytes a slot on the wire");

// Bounds a handle must stay within: generous for any real model, small enough that no size
// derived from them overflows int64 and no forged handle makes the reader allocate much.
inline constexpr int kKvHandleMaxLayers = 4096;
inline constexpr int kKvHandleMaxHeads = 4096;
inline constexpr int kKvHandleMaxHeadDim = 4096;
inline constexpr int kKvHandleMaxBlockTokens = 4096;
inline constexpr int kKvHandleMaxRanks = 4096;  // tp_size * cp_size
inline constexpr int64_t kKvHandleMaxTokens = int64_t{1} << 32;
inline constexpr int kKvHandleMaxIdBytes = 256;               // engine_id, request_id
inline constexpr int kKvHandleMaxTransportBytes = 64 * 1024;  // decoded worker address, rkey
inline constexpr uint64_t kKvReleaseMessageId = 0x6b76'0001;  // "kv" 1: see "The release"

std::string_view KvDtypeName(KvDtype dtype);  // "float32", "bfloat16"

// The model geometry and the request's sharding, shared by every rank of the handle.
struct KvHandleLayout {
  int num_layers = 0;
  int kv_heads = 0;              // over every TP rank
  int kv_heads_per_tp_rank = 0;  // kv_heads / tp_size
  int head_dim = 0;
  KvDtype dtype = KvDtype::kBfloat16;
  int block_tokens = 0;
  int64_t tokens = 0;  // the prompt's: positions [0, tokens)
  int tp_size = 0;
  int cp_size = 0;

  // One token of one layer's K (or V) on one prefill rank: kv_heads_per_tp_rank * head_dim
  // elements. Valid once the layout is validated (no overflow then).
  int64_t row_bytes() const;
  bool operator==(const KvHandleLayout&) const = default;
};

// Where one layer's K and V blocks sit in a rank's pool (kv_cache.h's layout is one instance:
// KvPoolLayout::OfKvCache). Block b of layer l, kind k (0 = K, 1 = V) starts at byte
//   (k == 0 ? k_offset_bytes : v_offset_bytes) + l * layer_stride_bytes + b * block_stride_bytes
// and holds block_tokens rows of row_bytes, back to back.
struct KvPoolLayout {
  int64_t bytes = 0;  // the registered range, from the pool's first byte
  int64_t num_blocks = 0;
  int64_t block_stride_bytes = 0;
  int64_t layer_stride_bytes = 0;
  int64_t k_offset_bytes = 0;
  int64_t v_offset_bytes = 0;

  // kv_cache.h's pool: ((l * 2 + k) * num_blocks + b) * block_bytes.
  static KvPoolLayout OfKvCache(const KvCacheSpec& spec, int64_t num_blocks);
  int64_t BlockOffset(int layer, int kind, int64_t block) const {
    return (kind == 0 ? k_offset_bytes : v_offset_bytes) + layer * layer_stride_bytes +
           block * block_stride_bytes;
  }
  bool operator==(const KvPoolLayout&) const = default;
};

// Every block (block_bytes of rows, at most block_stride_bytes) of `num_layers` layers' K and V
// inside pool.bytes, all offsets non-negative, int64 arithmetic checked. InvalidArgument
// `<prefix>"<path>.<field>" ...` naming the field that is wrong. Shared by the handle's pools and
// a paged pull destination's.
absl::Status ValidatePoolLayout(const KvPoolLayout& pool, int num_layers, int64_t block_bytes,
                                std::string_view prefix, std::string_view path);

// How a decode worker reaches a rank over UCX. Opaque bytes here (base64 in JSON): the packed
// ucp worker address and the packed rkey of the rank's pool, registered once as a whole (one
// allocation, kv_cache.h), plus that pool's address in the prefill process (ucp_get_nbx's
// remote_addr is pool_address + a source offset).
//
// "No transport yet" is the empty value (KvRankTransport{}): a handle built in-process before its
// pools are registered with UCX (ExportSessionKv, runtime/handoff/kv_export.h; the server fills
// these fields when
// --kv-handoff is on). ToJson leaves such a rank's "ucx" out, so ParseKvHandle refuses it.
struct KvRankTransport {
  std::string worker_address;
  std::string rkey;
  uint64_t pool_address = 0;
  std::string lease_rkey;      // the rank's lease records' region
  uint64_t lease_address = 0;  // this lease's record (a KvLeaseRecord, 64 bytes, aligned)
  bool empty() const {
    return worker_address.empty() && rkey.empty() && pool_address == 0 && lease_rkey.empty() &&
           lease_address == 0;
  }
  bool operator==(const KvRankTransport&) const = default;
};

// What one (tp_rank, cp_rank) holds of the request.
struct KvRankShard {
  int tp_rank = 0;
  int cp_rank = 0;
  std::vector<sharding::PositionRun> positions;  // sorted, non-empty runs; may be empty
  std::vector<int32_t> blocks;  // ceil(held tokens / block_tokens) distinct ids, row order
  KvPoolLayout pool;
  KvRankTransport transport;

  int64_t held_tokens() const { return sharding::TotalLength(positions); }
  bool operator==(const KvRankShard&) const = default;
};

struct KvHandle {
  std::string engine_id;
  std::string request_id;
  KvHandleLayout layout;
  std::vector<KvRankShard> ranks;  // [tp_rank * cp_size + cp_rank]
  KvNonce lease_nonce;             // non-zero once published (transport present)

  const KvRankShard& rank(int tp_rank, int cp_rank) const {
    return ranks[tp_rank * layout.cp_size + cp_rank];
  }
  std::string compat_hash() const;  // KvCompatHash(layout)
  bool operator==(const KvHandle&) const = default;
};

// 16 lowercase hex digits: FNV-1a 64 of the format version and the geometry that decides whether
// two engines' KV is interchangeable (num_layers, kv_heads, head_dim, dtype, block_tokens). Stable
// across processes and builds, unlike absl::Hash.
std::string KvCompatHash(const KvHandleLayout& layout);

// Value checks of a handle: ranges, the ranks' order, each rank's runs sorted and disjoint and the
// runs of the CP ranks of every TP rank covering [0, tokens) exactly once, block counts matching
// the runs, block ids distinct and inside the pool, every block's bytes inside the pool (int64
// arithmetic checked), transport present (or, with kAbsentAllowed, either present or empty on
// each rank). InvalidArgument naming the JSON field.
enum class KvTransportCheck { kRequired, kAbsentAllowed };
absl::Status ValidateKvHandle(const KvHandle& handle,
                              KvTransportCheck transport = KvTransportCheck::kRequired);

// The SHA-256 of what rank `rank_index` ([tp_rank * cp_size + cp_rank]) of `handle` is asked for:
// engine_id, request_id, the nonce, the layout, the rank's coordinates, positions, blocks and
// pool; not its transport (world rank 0 fills it; a copied transport is caught by the record it
// leads to). The prefill rank publishes it in its lease record; a puller compares.
Sha256Digest KvRankDigest(const KvHandle& handle, int rank_index);

// The release message's payload: engine_id, request_id and the lease nonce (KvNonce::ToString),
// separated by newlines.
std::string KvReleasePayload(const KvHandle& handle);

// The JSON shape above; a rank without transport (empty) has no "ucx" key. Assumes a valid handle
// (ValidateKvHandle).
nlohmann::ordered_json ToJson(const KvHandle& handle);

// The handle in `params` (a kv_transfer_params object): types, the version, base64, the
// compat_hash against the layout, then ValidateKvHandle. InvalidArgument "kv handle: ..." naming
// the field (as a JSON path, e.g. `ranks[3].blocks[2]`) on anything wrong.
absl::StatusOr<KvHandle> ParseKvHandle(const nlohmann::json& params);

}  // namespace cpfill::runtime
