// cpfill/runtime/handoff/kv_handle.cc — the KV hand-off handle: its checks, its JSON, its hash.
//
// Parsing runs in two passes: the JSON reader checks each key's presence and type and fills a
// KvHandle (nothing sized from a claimed count, only from arrays actually present), then
// ValidateKvHandle checks the values. Both name the field by its JSON path.
#include "runtime/handoff/kv_handle.h"

#include <algorithm>
#include <climits>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/random.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::runtime {
namespace {

using OrderedJson = nlohmann::ordered_json;

std::string Path(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string(key) : absl::StrCat(Sv(parent), ".", Sv(key));
}

std::string Index(std::string_view array_path, size_t i) {
  return absl::StrCat(Sv(array_path), "[", i, "]");
}

absl::Status FieldError(std::string_view path, std::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("kv handle: \"", Sv(path), "\" ", Sv(problem)));
}

// a * b and a + b, or nullopt when the result does not fit in int64.
std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}
std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

std::optional<KvDtype> DtypeFromName(std::string_view name) {
  if (name == KvDtypeName(KvDtype::kFloat32)) return KvDtype::kFloat32;
  if (name == KvDtypeName(KvDtype::kBfloat16)) return KvDtype::kBfloat16;
  return std::nullopt;
}

// --- value checks ------------------------------------------------------------------------------

absl::Status CheckRange(std::string_view path, int64_t value, int64_t lo, int64_t hi) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return FieldError(path, absl::StrCat("is ", value, ", must be in [", lo, ", ", hi, "]"));
}

absl::Status ValidateLayout(const KvHandleLayout& l) {
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.num_layers", l.num_layers, 1, kKvHandleMaxLayers));
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.kv_heads", l.kv_heads, 1, kKvHandleMaxHeads));
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.head_dim", l.head_dim, 1, kKvHandleMaxHeadDim));
  CPFILL_RETURN_IF_ERROR(
      CheckRange("layout.block_tokens", l.block_tokens, 1, kKvHandleMaxBlockTokens));
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.tokens", l.tokens, 1, kKvHandleMaxTokens));
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.tp_size", l.tp_size, 1, kKvHandleMaxRanks));
  CPFILL_RETURN_IF_ERROR(CheckRange("layout.cp_size", l.cp_size, 1, kKvHandleMaxRanks));
  if (l.dtype != KvDtype::kFloat32 && l.dtype != KvDtype::kBfloat16) {
    return FieldError("layout.dtype", absl::StrCat("is unknown (", static_cast<int>(l.dtype), ")"));
  }
  if (int64_t{l.tp_size} * l.cp_size > kKvHandleMaxRanks) {
    return FieldError("layout.cp_size",
                      absl::StrCat("times tp_size is ", int64_t{l.tp_size} * l.cp_size,
                                   " ranks, more than ", kKvHandleMaxRanks));
  }
  if (l.kv_heads % l.tp_size != 0) {
    return FieldError("layout.tp_size", absl::StrCat("is ", l.tp_size, ", which does not divide ",
                                                     l.kv_heads, " KV heads"));
  }
  if (l.kv_heads_per_tp_rank != l.kv_heads / l.tp_size) {
    return FieldError("layout.kv_heads_per_tp_rank",
                      absl::StrCat("is ", l.kv_heads_per_tp_rank,
                                   ", expected kv_heads / tp_size = ", l.kv_heads / l.tp_size));
  }
  return absl::OkStatus();
}

// Runs sorted, non-empty, disjoint, inside [0, tokens).
absl::Status ValidatePositions(const KvRankShard& shard, int64_t tokens, const std::string& path) {
  int64_t previous_end = 0;
  for (size_t i = 0; i < shard.positions.size(); ++i) {
    const sharding::PositionRun& run = shard.positions[i];
    const std::string run_path = Index(Path(path, "positions"), i);
    if (run.begin < 0 || run.length < 1 || run.begin > tokens - run.length) {
      return FieldError(run_path,
                        absl::StrCat("is ", run.length, " positions from ", run.begin,
                                     ", expected a non-empty run inside [0, ", tokens, ")"));
    }
    if (i > 0 && run.begin < previous_end) {
      return FieldError(run_path,
                        absl::StrCat("begins at ", run.begin, ", before the end ", previous_end,
                                     " of the run before it (runs must be sorted and "
                                     "disjoint)"));
    }
    previous_end = run.end();
  }
  return absl::OkStatus();
}

// ceil(held / block_tokens) ids, distinct, each inside the pool.
absl::Status ValidateBlocks(const KvRankShard& shard, int block_tokens, const std::string& path) {
  const std::string blocks_path = Path(path, "blocks");
  const int64_t expected = (shard.held_tokens() + block_tokens - 1) / block_tokens;
  if (static_cast<int64_t>(shard.blocks.size()) != expected) {
    return FieldError(blocks_path,
                      absl::StrCat("has ", shard.blocks.size(), " ids; ", shard.held_tokens(),
                                   " positions in blocks of ", block_tokens, " need ", expected));
  }
  for (size_t i = 0; i < shard.blocks.size(); ++i) {
    if (shard.blocks[i] < 0 || shard.blocks[i] >= shard.pool.num_blocks) {
      return FieldError(Index(blocks_path, i),
                        absl::StrCat("is ", shard.blocks[i], ", outside the pool's ",
                                     shard.pool.num_blocks, " blocks"));
    }
  }
  std::vector<int32_t> sorted = shard.blocks;
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return FieldError(blocks_path, absl::StrCat("names block ", *dup, " twice"));
  }
  return absl::OkStatus();
}

absl::Status ValidateTransport(const KvRankTransport& t, int64_t pool_bytes,
                               const std::string& path) {
  const std::string ucx_path = Path(path, "ucx");
  const std::pair<std::string_view, const std::string*> fields[] = {
      {"worker_address", &t.worker_address}, {"rkey", &t.rkey}, {"lease_rkey", &t.lease_rkey}};
  for (const auto& [name, bytes] : fields) {
    if (bytes->empty() || bytes->size() > kKvHandleMaxTransportBytes) {
      return FieldError(Path(ucx_path, name),
                        absl::StrCat("decodes to ", bytes->size(), " bytes, expected 1 to ",
                                     kKvHandleMaxTransportBytes));
    }
  }
  if (t.pool_address > UINT64_MAX - static_cast<uint64_t>(pool_bytes)) {
    return FieldError(Path(ucx_path, "pool_address"),
                      absl::StrCat("plus the pool's ", pool_bytes, " bytes wraps around"));
  }
  constexpr uint64_t kRecord = sizeof(KvLeaseRecord);
  if (t.lease_address == 0 || t.lease_address % kRecord != 0 ||
      t.lease_address > UINT64_MAX - kRecord) {
    return FieldError(Path(ucx_path, "lease_address"),
                      "must be a non-zero address of a 64-byte aligned lease record");
  }
  return absl::OkStatus();
}

// The runs of the CP ranks of each TP rank cover [0, tokens) exactly once.
absl::Status ValidateCoverage(const KvHandle& handle) {
  const KvHandleLayout& l = handle.layout;
  struct Owned {
    sharding::PositionRun run;
    int rank_index;
  };
  for (int tp_rank = 0; tp_rank < l.tp_size; ++tp_rank) {
    std::vector<Owned> runs;
    for (int cp_rank = 0; cp_rank < l.cp_size; ++cp_rank) {
      const int rank_index = tp_rank * l.cp_size + cp_rank;
      for (const sharding::PositionRun& run : handle.ranks[rank_index].positions) {
        runs.push_back({run, rank_index});
      }
    }
    std::sort(runs.begin(), runs.end(),
              [](const Owned& a, const Owned& b) { return a.run.begin < b.run.begin; });
    int64_t covered = 0;
    for (const Owned& owned : runs) {
      if (owned.run.begin != covered) {
        return FieldError(Path(Index("ranks", owned.rank_index), "positions"),
                          absl::StrCat("has a run at ", owned.run.begin, " but tp_rank ", tp_rank,
                                       "'s CP ranks cover [0, ", covered, ") so far: positions ",
                                       owned.run.begin < covered ? "held twice" : "missing"));
      }
      covered = owned.run.end();
    }
    if (covered != l.tokens) {
      return FieldError("ranks", absl::StrCat("of tp_rank ", tp_rank, " hold positions [0, ",
                                              covered, "), expected [0, ", l.tokens, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateIds(const KvHandle& handle) {
  const std::pair<std::string_view, const std::string*> ids[] = {
      {"engine_id", &handle.engine_id}, {"request_id", &handle.request_id}};
  for (const auto& [name, id] : ids) {
    if (id->empty() || id->size() > kKvHandleMaxIdBytes) {
      return FieldError(
          name, absl::StrCat("has ", id->size(), " bytes, expected 1 to ", kKvHandleMaxIdBytes));
    }
  }
  return absl::OkStatus();
}

// --- JSON reading: presence and types ----------------------------------------------------------

absl::StatusOr<const nlohmann::json*> Required(const nlohmann::json& obj, std::string_view parent,
                                               std::string_view key) {
  const nlohmann::json* v = json::Find(obj, key);
  if (v == nullptr) return FieldError(Path(parent, key), "is missing");
  return v;
}

absl::StatusOr<int64_t> AsInt(const nlohmann::json& v, std::string_view path, int64_t lo,
                              int64_t hi) {
  const std::optional<int64_t> i = json::AsInt64(v);
  if (!i || *i < lo || *i > hi) {
    return FieldError(
        path, absl::StrCat("is ", json::Show(v), ", expected an integer in [", lo, ", ", hi, "]"));
  }
  return *i;
}

absl::StatusOr<int64_t> IntMember(const nlohmann::json& obj, std::string_view parent,
                                  std::string_view key, int64_t lo = INT64_MIN,
                                  int64_t hi = INT64_MAX) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* v, Required(obj, parent, key));
  return AsInt(*v, Path(parent, key), lo, hi);
}

absl::StatusOr<int> Int32Member(const nlohmann::json& obj, std::string_view parent,
                                std::string_view key) {
  CPFILL_ASSIGN_OR_RETURN(int64_t v, IntMember(obj, parent, key, INT32_MIN, INT32_MAX));
  return static_cast<int>(v);
}

absl::StatusOr<const nlohmann::json*> TypedMember(const nlohmann::json& obj,
                                                  std::string_view parent, std::string_view key,
                                                  nlohmann::json::value_t type) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* v, Required(obj, parent, key));
  if (v->type() != type) {
    const nlohmann::json expected(type);
    return FieldError(Path(parent, key), absl::StrCat("is ", Sv(json::TypeName(*v)), ", expected ",
                                                      Sv(json::TypeName(expected))));
  }
  return v;
}

absl::StatusOr<std::string> StringMember(const nlohmann::json& obj, std::string_view parent,
                                         std::string_view key) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* v,
                          TypedMember(obj, parent, key, nlohmann::json::value_t::string));
  return v->get<std::string>();
}

// Canonical base64 only: text that re-encodes to itself, so two spellings of one key (missing
// padding, stray whitespace) cannot both pass.
absl::StatusOr<std::string> Base64Member(const nlohmann::json& obj, std::string_view parent,
                                         std::string_view key) {
  CPFILL_ASSIGN_OR_RETURN(std::string text, StringMember(obj, parent, key));
  std::string bytes;
  if (!absl::Base64Unescape(text, &bytes) || absl::Base64Escape(bytes) != text) {
    return FieldError(Path(parent, key), absl::StrCat("is not canonical base64 (",
                                                      json::Show(nlohmann::json(text)), ")"));
  }
  return bytes;
}

// "0x" and 1 to 16 hex digits.
absl::StatusOr<uint64_t> AddressMember(const nlohmann::json& obj, std::string_view parent,
                                       std::string_view key) {
  CPFILL_ASSIGN_OR_RETURN(std::string text, StringMember(obj, parent, key));
  uint64_t value = 0;
  bool valid = text.size() > 2 && text.size() <= 18 && text.starts_with("0x");
  for (size_t i = 2; valid && i < text.size(); ++i) {
    const char c = text[i];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                             : -1;
    valid = digit >= 0;
    value = value * 16 + static_cast<uint64_t>(digit);
  }
  if (!valid) {
    return FieldError(Path(parent, key), absl::StrCat("is ", json::Show(nlohmann::json(text)),
                                                      ", expected \"0x\" and 1 to 16 hex digits"));
  }
  return value;
}

absl::StatusOr<KvHandleLayout> ReadLayout(const nlohmann::json& obj) {
  constexpr std::string_view kPath = "layout";
  KvHandleLayout l;
  CPFILL_ASSIGN_OR_RETURN(l.num_layers, Int32Member(obj, kPath, "num_layers"));
  CPFILL_ASSIGN_OR_RETURN(l.kv_heads, Int32Member(obj, kPath, "kv_heads"));
  CPFILL_ASSIGN_OR_RETURN(l.kv_heads_per_tp_rank, Int32Member(obj, kPath, "kv_heads_per_tp_rank"));
  CPFILL_ASSIGN_OR_RETURN(l.head_dim, Int32Member(obj, kPath, "head_dim"));
  CPFILL_ASSIGN_OR_RETURN(std::string dtype, StringMember(obj, kPath, "dtype"));
  const std::optional<KvDtype> parsed_dtype = DtypeFromName(dtype);
  if (!parsed_dtype) {
    return FieldError("layout.dtype", absl::StrCat("is ", json::Show(nlohmann::json(dtype)),
                                                   ", expected \"float32\" or \"bfloat16\""));
  }
  l.dtype = *parsed_dtype;
  CPFILL_ASSIGN_OR_RETURN(l.block_tokens, Int32Member(obj, kPath, "block_tokens"));
  CPFILL_ASSIGN_OR_RETURN(l.tokens, IntMember(obj, kPath, "tokens"));
  CPFILL_ASSIGN_OR_RETURN(l.tp_size, Int32Member(obj, kPath, "tp_size"));
  CPFILL_ASSIGN_OR_RETURN(l.cp_size, Int32Member(obj, kPath, "cp_size"));
  return l;
}

absl::StatusOr<std::vector<sharding::PositionRun>> ReadPositions(const nlohmann::json& obj,
                                                                 const std::string& parent) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* list,
                          TypedMember(obj, parent, "positions", nlohmann::json::value_t::array));
  std::vector<sharding::PositionRun> runs;
  runs.reserve(list->size());
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& pair = (*list)[i];
    const std::string path = Index(Path(parent, "positions"), i);
    if (!pair.is_array() || pair.size() != 2) {
      return FieldError(path, absl::StrCat("is ", json::Show(pair), ", expected [begin, end]"));
    }
    // Both inside [0, kKvHandleMaxTokens], so end - begin cannot overflow.
    CPFILL_ASSIGN_OR_RETURN(int64_t begin, AsInt(pair[0], path, 0, kKvHandleMaxTokens));
    CPFILL_ASSIGN_OR_RETURN(int64_t end, AsInt(pair[1], path, 0, kKvHandleMaxTokens));
    runs.push_back({.begin = begin, .length = end - begin});
  }
  return runs;
}

absl::StatusOr<std::vector<int32_t>> ReadBlocks(const nlohmann::json& obj,
                                                const std::string& parent) {
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* list,
                          TypedMember(obj, parent, "blocks", nlohmann::json::value_t::array));
  std::vector<int32_t> blocks;
  blocks.reserve(list->size());
  for (size_t i = 0; i < list->size(); ++i) {
    CPFILL_ASSIGN_OR_RETURN(int64_t id,
                            AsInt((*list)[i], Index(Path(parent, "blocks"), i), 0, INT32_MAX));
    blocks.push_back(static_cast<int32_t>(id));
  }
  return blocks;
}

absl::StatusOr<KvPoolLayout> ReadPool(const nlohmann::json& obj, const std::string& parent) {
  const std::string path = Path(parent, "pool");
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* pool,
                          TypedMember(obj, parent, "pool", nlohmann::json::value_t::object));
  KvPoolLayout p;
  CPFILL_ASSIGN_OR_RETURN(p.bytes, IntMember(*pool, path, "bytes"));
  CPFILL_ASSIGN_OR_RETURN(p.num_blocks, IntMember(*pool, path, "num_blocks"));
  CPFILL_ASSIGN_OR_RETURN(p.block_stride_bytes, IntMember(*pool, path, "block_stride_bytes"));
  CPFILL_ASSIGN_OR_RETURN(p.layer_stride_bytes, IntMember(*pool, path, "layer_stride_bytes"));
  CPFILL_ASSIGN_OR_RETURN(p.k_offset_bytes, IntMember(*pool, path, "k_offset_bytes"));
  CPFILL_ASSIGN_OR_RETURN(p.v_offset_bytes, IntMember(*pool, path, "v_offset_bytes"));
  return p;
}

absl::StatusOr<KvRankTransport> ReadTransport(const nlohmann::json& obj,
                                              const std::string& parent) {
  const std::string path = Path(parent, "ucx");
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* ucx,
                          TypedMember(obj, parent, "ucx", nlohmann::json::value_t::object));
  KvRankTransport t;
  CPFILL_ASSIGN_OR_RETURN(t.worker_address, Base64Member(*ucx, path, "worker_address"));
  CPFILL_ASSIGN_OR_RETURN(t.rkey, Base64Member(*ucx, path, "rkey"));
  CPFILL_ASSIGN_OR_RETURN(t.pool_address, AddressMember(*ucx, path, "pool_address"));
  CPFILL_ASSIGN_OR_RETURN(t.lease_rkey, Base64Member(*ucx, path, "lease_rkey"));
  CPFILL_ASSIGN_OR_RETURN(t.lease_address, AddressMember(*ucx, path, "lease_address"));
  return t;
}

absl::StatusOr<KvRankShard> ReadRank(const nlohmann::json& obj, const std::string& path) {
  if (!obj.is_object()) {
    return FieldError(path, absl::StrCat("is ", Sv(json::TypeName(obj)), ", expected an object"));
  }
  KvRankShard shard;
  CPFILL_ASSIGN_OR_RETURN(shard.tp_rank, Int32Member(obj, path, "tp_rank"));
  CPFILL_ASSIGN_OR_RETURN(shard.cp_rank, Int32Member(obj, path, "cp_rank"));
  CPFILL_ASSIGN_OR_RETURN(shard.positions, ReadPositions(obj, path));
  CPFILL_ASSIGN_OR_RETURN(shard.blocks, ReadBlocks(obj, path));
  CPFILL_ASSIGN_OR_RETURN(shard.pool, ReadPool(obj, path));
  CPFILL_ASSIGN_OR_RETURN(shard.transport, ReadTransport(obj, path));
  return shard;
}

// --- JSON writing ------------------------------------------------------------------------------

OrderedJson LayoutJson(const KvHandleLayout& l) {
  return {{"num_layers", l.num_layers},
          {"kv_heads", l.kv_heads},
          {"kv_heads_per_tp_rank", l.kv_heads_per_tp_rank},
          {"head_dim", l.head_dim},
          {"dtype", KvDtypeName(l.dtype)},
          {"block_tokens", l.block_tokens},
          {"tokens", l.tokens},
          {"tp_size", l.tp_size},
          {"cp_size", l.cp_size}};
}

OrderedJson RankJson(const KvRankShard& s) {
  OrderedJson positions = OrderedJson::array();
  for (const sharding::PositionRun& run : s.positions) {
    positions.push_back({run.begin, run.end()});
  }
  OrderedJson rank = {{"tp_rank", s.tp_rank},
                      {"cp_rank", s.cp_rank},
                      {"positions", std::move(positions)},
                      {"blocks", s.blocks},
                      {"pool",
                       {{"bytes", s.pool.bytes},
                        {"num_blocks", s.pool.num_blocks},
                        {"block_stride_bytes", s.pool.block_stride_bytes},
                        {"layer_stride_bytes", s.pool.layer_stride_bytes},
                        {"k_offset_bytes", s.pool.k_offset_bytes},
                        {"v_offset_bytes", s.pool.v_offset_bytes}}}};
  // No transport yet: no "ucx" at all, so the handle cannot be mistaken for a pullable one.
  if (s.transport.empty()) return rank;
  rank["ucx"] = {{"worker_address", absl::Base64Escape(s.transport.worker_address)},
                 {"rkey", absl::Base64Escape(s.transport.rkey)},
                 {"pool_address", absl::StrCat("0x", absl::Hex(s.transport.pool_address))},
                 {"lease_rkey", absl::Base64Escape(s.transport.lease_rkey)},
                 {"lease_address", absl::StrCat("0x", absl::Hex(s.transport.lease_address))}};
  return rank;
}

}  // namespace

std::string_view KvDtypeName(KvDtype dtype) {
  return dtype == KvDtype::kBfloat16 ? "bfloat16" : "float32";
}

int64_t KvHandleLayout::row_bytes() const {
  return int64_t{kv_heads_per_tp_rank} * head_dim * static_cast<int64_t>(KvDtypeBytes(dtype));
}

KvPoolLayout KvPoolLayout::OfKvCache(const KvCacheSpec& spec, int64_t num_blocks) {
  const int64_t kind_bytes = num_blocks * spec.block_bytes();
  return {.bytes = 2 * spec.num_layers * kind_bytes,
          .num_blocks = num_blocks,
          .block_stride_bytes = spec.block_bytes(),
          .layer_stride_bytes = 2 * kind_bytes,
          .k_offset_bytes = 0,
          .v_offset_bytes = kind_bytes};
}

absl::Status ValidatePoolLayout(const KvPoolLayout& pool, int num_layers, int64_t block_bytes,
                                std::string_view prefix, std::string_view path) {
  auto error = [&](std::string_view field, std::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat(Sv(prefix), "\"", Path(path, field), "\" ", Sv(problem)));
  };
  auto check_range = [&](std::string_view field, int64_t value, int64_t lo) {
    return value >= lo ? absl::OkStatus()
                       : error(field, absl::StrCat("is ", value, ", must be at least ", lo));
  };
  if (pool.num_blocks < 1 || pool.num_blocks > int64_t{INT32_MAX} + 1) {
    return error("num_blocks", absl::StrCat("is ", pool.num_blocks, ", must be in [1, 2^31]"));
  }
  CPFILL_RETURN_IF_ERROR(check_range("block_stride_bytes", pool.block_stride_bytes, block_bytes));
  CPFILL_RETURN_IF_ERROR(check_range("layer_stride_bytes", pool.layer_stride_bytes, 0));
  CPFILL_RETURN_IF_ERROR(check_range("k_offset_bytes", pool.k_offset_bytes, 0));
  CPFILL_RETURN_IF_ERROR(check_range("v_offset_bytes", pool.v_offset_bytes, 0));
  // The last block of the last layer of the later kind ends the furthest in.
  std::optional<int64_t> end = CheckedMul(num_layers - 1, pool.layer_stride_bytes);
  if (end) end = CheckedAdd(*end, std::max(pool.k_offset_bytes, pool.v_offset_bytes));
  if (end) {
    const std::optional<int64_t> last_block =
        CheckedMul(pool.num_blocks - 1, pool.block_stride_bytes);
    end = last_block ? CheckedAdd(*end, *last_block) : std::nullopt;
  }
  if (end) end = CheckedAdd(*end, block_bytes);
  if (!end || *end > pool.bytes) {
    return error("bytes", absl::StrCat("is ", pool.bytes, "; the blocks it describes end at ",
                                       end ? absl::StrCat("byte ", *end) : "a byte past int64"));
  }
  return absl::OkStatus();
}

KvNonce KvNonce::Random() {
  KvNonce n;
  while (n.zero()) {  // zero means "no lease": drawn again (once in 2^128)
    uint64_t words[2];
    SecureRandomOrDie(words, sizeof(words));
    n = {.hi = words[0], .lo = words[1]};
  }
  return n;
}

std::optional<KvNonce> KvNonce::Parse(std::string_view text) {
  if (text.size() != 34 || text[0] != '0' || (text[1] != 'x' && text[1] != 'X')) {
    return std::nullopt;
  }
  KvNonce n;
  for (size_t i = 2; i < text.size(); ++i) {
    const char c = text[i];
    int v = 0;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      v = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    uint64_t& word = i < 18 ? n.hi : n.lo;
    word = (word << 4) | static_cast<uint64_t>(v);
  }
  return n;
}

std::string KvNonce::ToString() const {
  return absl::StrCat("0x", absl::Hex(hi, absl::kZeroPad16), absl::Hex(lo, absl::kZeroPad16));
}

Sha256Digest KvRankDigest(const KvHandle& handle, int rank_index) {
  const KvRankShard& r = handle.ranks[static_cast<size_t>(rank_index)];
  const KvHandleLayout& l = handle.layout;
  // Lengths before the ids keep the fields apart: no two handles share a canonical form.
  std::string c = absl::StrCat(Sv(kKvHandleVersion), ";engine=", handle.engine_id.size(), ":",
                               handle.engine_id, ";request=", handle.request_id.size(), ":",
                               handle.request_id, ";nonce=", handle.lease_nonce.ToString());
  absl::StrAppend(&c, ";layout=", l.num_layers, ",", l.kv_heads, ",", l.kv_heads_per_tp_rank, ",",
                  l.head_dim, ",", Sv(KvDtypeName(l.dtype)), ",", l.block_tokens, ",", l.tokens,
                  ",", l.tp_size, ",", l.cp_size);
  absl::StrAppend(&c, ";rank=", r.tp_rank, ",", r.cp_rank, ";positions=");
  for (const sharding::PositionRun& run : r.positions) {
    absl::StrAppend(&c, run.begin, "+", run.length, ",");
  }
  absl::StrAppend(&c, ";blocks=");
  for (int32_t b : r.blocks) absl::StrAppend(&c, b, ",");
  absl::StrAppend(&c, ";pool=", r.pool.bytes, ",", r.pool.num_blocks, ",",
                  r.pool.block_stride_bytes, ",", r.pool.layer_stride_bytes, ",",
                  r.pool.k_offset_bytes, ",", r.pool.v_offset_bytes);
  return Sha256(c);
}

std::string KvCompatHash(const KvHandleLayout& l) {
  const std::string canonical =
      absl::StrCat(Sv(kKvHandleVersion), ";num_layers=", l.num_layers, ";kv_heads=", l.kv_heads,
                   ";head_dim=", l.head_dim, ";dtype=", Sv(KvDtypeName(l.dtype)),
                   ";block_tokens=", l.block_tokens);
  return absl::StrCat(absl::Hex(Fnv1a64(canonical), absl::kZeroPad16));
}

std::string KvHandle::compat_hash() const { return KvCompatHash(layout); }

absl::Status ValidateKvHandle(const KvHandle& handle, KvTransportCheck transport) {
  CPFILL_RETURN_IF_ERROR(ValidateIds(handle));
  CPFILL_RETURN_IF_ERROR(ValidateLayout(handle.layout));
  const KvHandleLayout& l = handle.layout;
  const size_t expected_ranks = static_cast<size_t>(l.tp_size) * l.cp_size;
  if (handle.ranks.size() != expected_ranks) {
    return FieldError(
        "ranks", absl::StrCat("has ", handle.ranks.size(), " entries, expected ", expected_ranks,
                              " (tp_size ", l.tp_size, " x cp_size ", l.cp_size, ")"));
  }
  for (size_t i = 0; i < handle.ranks.size(); ++i) {
    const KvRankShard& shard = handle.ranks[i];
    const std::string path = Index("ranks", i);
    const int tp_rank = static_cast<int>(i) / l.cp_size, cp_rank = static_cast<int>(i) % l.cp_size;
    if (shard.tp_rank != tp_rank || shard.cp_rank != cp_rank) {
      return FieldError(path, absl::StrCat("is tp_rank ", shard.tp_rank, ", cp_rank ",
                                           shard.cp_rank, "; expected tp_rank ", tp_rank,
                                           ", cp_rank ", cp_rank, " (ranks are listed tp-major)"));
    }
    CPFILL_RETURN_IF_ERROR(ValidatePositions(shard, l.tokens, path));
    CPFILL_RETURN_IF_ERROR(ValidatePoolLayout(shard.pool, l.num_layers,
                                              l.row_bytes() * l.block_tokens,  // <= 2^38
                                              "kv handle: ", Path(path, "pool")));
    CPFILL_RETURN_IF_ERROR(ValidateBlocks(shard, l.block_tokens, path));
    if (transport == KvTransportCheck::kRequired || !shard.transport.empty()) {
      CPFILL_RETURN_IF_ERROR(ValidateTransport(shard.transport, shard.pool.bytes, path));
      if (handle.lease_nonce.zero()) {
        return FieldError("lease_nonce", "is 0; a published handle's lease nonce is not");
      }
    }
  }
  return ValidateCoverage(handle);
}

nlohmann::ordered_json ToJson(const KvHandle& handle) {
  OrderedJson ranks = OrderedJson::array();
  for (const KvRankShard& shard : handle.ranks) ranks.push_back(RankJson(shard));
  OrderedJson out = {{"version", kKvHandleVersion},
                     {"engine_id", handle.engine_id},
                     {"request_id", handle.request_id},
                     {"compat_hash", handle.compat_hash()}};
  if (!handle.lease_nonce.zero()) out["lease_nonce"] = handle.lease_nonce.ToString();
  out["layout"] = LayoutJson(handle.layout);
  out["ranks"] = std::move(ranks);
  return out;
}

std::string KvReleasePayload(const KvHandle& handle) {
  return absl::StrCat(handle.engine_id, "\n", handle.request_id, "\n",
                      handle.lease_nonce.ToString());
}

absl::StatusOr<KvHandle> ParseKvHandle(const nlohmann::json& params) {
  if (!params.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv handle: is ", Sv(json::TypeName(params)), ", expected an object"));
  }
  // The version first: a handle of another format is refused as such, not field by field.
  CPFILL_ASSIGN_OR_RETURN(std::string version, StringMember(params, "", "version"));
  if (version != kKvHandleVersion) {
    return FieldError("version", absl::StrCat("is ", json::Show(nlohmann::json(version)),
                                              "; this build reads \"", Sv(kKvHandleVersion), "\""));
  }
  KvHandle handle;
  CPFILL_ASSIGN_OR_RETURN(handle.engine_id, StringMember(params, "", "engine_id"));
  CPFILL_ASSIGN_OR_RETURN(handle.request_id, StringMember(params, "", "request_id"));
  CPFILL_ASSIGN_OR_RETURN(std::string compat_hash, StringMember(params, "", "compat_hash"));
  CPFILL_ASSIGN_OR_RETURN(std::string nonce, StringMember(params, "", "lease_nonce"));
  std::optional<KvNonce> parsed_nonce = KvNonce::Parse(nonce);
  if (!parsed_nonce) {
    return FieldError("lease_nonce", absl::StrCat("is ", json::Show(nlohmann::json(nonce)),
                                                  "; expected \"0x\" and 32 hex digits"));
  }
  handle.lease_nonce = *parsed_nonce;
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* layout,
                          TypedMember(params, "", "layout", nlohmann::json::value_t::object));
  CPFILL_ASSIGN_OR_RETURN(handle.layout, ReadLayout(*layout));
  CPFILL_ASSIGN_OR_RETURN(const nlohmann::json* ranks,
                          TypedMember(params, "", "ranks", nlohmann::json::value_t::array));
  handle.ranks.reserve(std::min<size_t>(ranks->size(), kKvHandleMaxRanks));
  for (size_t i = 0; i < ranks->size(); ++i) {
    CPFILL_ASSIGN_OR_RETURN(KvRankShard shard, ReadRank((*ranks)[i], Index("ranks", i)));
    handle.ranks.push_back(std::move(shard));
  }
  CPFILL_RETURN_IF_ERROR(ValidateKvHandle(handle));
  if (compat_hash != handle.compat_hash()) {
    return FieldError(
        "compat_hash",
        absl::StrCat("is ", json::Show(nlohmann::json(compat_hash)), " but the layout hashes to \"",
                     handle.compat_hash(), "\" (a forged or corrupted handle)"));
  }
  return handle;
}

}  // namespace cpfill::runtime
