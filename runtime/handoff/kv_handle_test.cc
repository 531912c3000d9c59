// The KV hand-off handle and the pull plan, on the CPU: the JSON round trip, every refusal of a
// stale, forged or truncated handle (each naming its field), and the pull plan run with memcpy
// between fake prefill pools and a poisoned destination, every element checked against the value
// its (layer, K/V, position, head, dim) encodes.
#include "runtime/handoff/kv_handle.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "gtest/gtest.h"
#include "runtime/handoff/kv_pull_plan.h"
#include "sharding/plan.h"

namespace cpfill::runtime {
namespace {

using Json = nlohmann::json;

constexpr uint8_t kPoison = 0xFF;  // a float NaN, a bf16 code no element has

::testing::AssertionResult Mentions(const absl::Status& st, const std::string& text) {
  if (std::string(st.message()).find(text) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "'" << st.message() << "' does not mention '" << text << "'";
}

// A prefill's geometry and how its ranks picked blocks.
struct Geometry {
  int tp_size = 2;
  int cp_size = 2;
  int kv_heads = 4;
  int head_dim = 3;
  int num_layers = 2;
  KvDtype dtype = KvDtype::kFloat32;
  int block_tokens = 5;
  int64_t tokens = 41;
  bool shuffled_blocks = true;  // else each rank's blocks are consecutive ids
  uint32_t seed = 1;
};

std::string GeometryText(const Geometry& g) {
  return absl::StrCat("TP", g.tp_size, " x CP", g.cp_size, ", ", g.kv_heads, " heads, ",
                      std::string(KvDtypeName(g.dtype)), ", ", g.tokens, " tokens in blocks of ",
                      g.block_tokens, g.shuffled_blocks ? ", shuffled" : ", consecutive",
                      " blocks");
}

// The handle a TP x CP prefill of g.tokens would publish: positions from the sharding code, block
// ids from a pool with spare blocks (so ids are not simply 0..n-1).
KvHandle MakeHandle(const Geometry& g) {
  absl::StatusOr<sharding::ShardPlan> plan =
      sharding::PlanPrefill({{.new_tokens = g.tokens}}, g.cp_size);
  EXPECT_TRUE(plan.ok()) << plan.status();
  KvHandle h{.engine_id = "cpfill-test",
             .request_id = "cmpl-42",
             .layout = {.num_layers = g.num_layers,
                        .kv_heads = g.kv_heads,
                        .kv_heads_per_tp_rank = g.kv_heads / g.tp_size,
                        .head_dim = g.head_dim,
                        .dtype = g.dtype,
                        .block_tokens = g.block_tokens,
                        .tokens = g.tokens,
                        .tp_size = g.tp_size,
                        .cp_size = g.cp_size}};
  const KvCacheSpec spec{.num_layers = g.num_layers,
                         .kv_heads = g.kv_heads / g.tp_size,
                         .head_dim = g.head_dim,
                         .block_tokens = g.block_tokens,
                         .dtype = g.dtype};
  std::mt19937 rng(g.seed);
  for (int tp_rank = 0; tp_rank < g.tp_size; ++tp_rank) {
    for (int cp_rank = 0; cp_rank < g.cp_size; ++cp_rank) {
      KvRankShard shard{.tp_rank = tp_rank, .cp_rank = cp_rank};
      shard.positions = plan->KvRunsAfter(cp_rank, 0);
      const int64_t needed = (shard.held_tokens() + g.block_tokens - 1) / g.block_tokens;
      const int64_t num_blocks = needed + 3;
      std::vector<int32_t> ids(num_blocks);
      std::iota(ids.begin(), ids.end(), 0);
      if (g.shuffled_blocks) std::shuffle(ids.begin(), ids.end(), rng);
      const int first = g.shuffled_blocks ? 0 : 2;  // consecutive, but not from 0
      shard.blocks.assign(ids.begin() + first, ids.begin() + first + needed);
      shard.pool = KvPoolLayout::OfKvCache(spec, num_blocks);
      shard.transport = {.worker_address = absl::StrCat("ucp-worker-", tp_rank, "-", cp_rank),
                         .rkey = std::string("\x00\xff\x10rkey", 7) + std::to_string(cp_rank),
                         .pool_address = 0x7f0000000000ULL + (uint64_t{1} << 32) * tp_rank,
                         .lease_rkey = absl::StrCat("lease-", tp_rank, "-", cp_rank),
                         .lease_address = 0x550000001000ULL + 0x100000ULL * cp_rank + 64 * 3};
      h.ranks.push_back(std::move(shard));
    }
  }
  h.lease_nonce = {.hi = 0x5be1, .lo = 0x2a};
  return h;
}

// What every element of the request's KV holds: distinct for every (layer, kind, position, global
// head, dim), exact in a float and below 0xFFFF (the poison) in a bf16-sized code.
int64_t Code(const KvHandleLayout& l, int layer, int kind, int64_t t, int head, int d) {
  return (((layer * 2 + kind) * l.tokens + t) * l.kv_heads + head) * l.head_dim + d;
}

void StoreCode(KvDtype dtype, int64_t code, uint8_t* at) {
  if (dtype == KvDtype::kFloat32) {
    const float value = static_cast<float>(code);
    std::memcpy(at, &value, sizeof(value));
  } else {
    const uint16_t value = static_cast<uint16_t>(code);
    std::memcpy(at, &value, sizeof(value));
  }
}

bool HoldsCode(KvDtype dtype, int64_t code, const uint8_t* at) {
  if (dtype == KvDtype::kFloat32) {
    float value;
    std::memcpy(&value, at, sizeof(value));
    return value == static_cast<float>(code);  // NaN poison never equal
  }
  uint16_t value;
  std::memcpy(&value, at, sizeof(value));
  return value == code;
}

// Each rank's pool, poisoned, with its rows of the request written where the handle says.
std::vector<std::vector<uint8_t>> MakeSourcePools(const KvHandle& h) {
  const KvHandleLayout& l = h.layout;
  const int64_t elem = static_cast<int64_t>(KvDtypeBytes(l.dtype));
  std::vector<std::vector<uint8_t>> pools;
  for (const KvRankShard& shard : h.ranks) {
    std::vector<uint8_t> pool(shard.pool.bytes, kPoison);
    int64_t local_row = 0;
    for (const sharding::PositionRun& run : shard.positions) {
      for (int64_t t = run.begin; t < run.end(); ++t, ++local_row) {
        const int32_t block = shard.blocks[local_row / l.block_tokens];
        const int64_t row_in_block = local_row % l.block_tokens;
        for (int layer = 0; layer < l.num_layers; ++layer) {
          for (int kind = 0; kind < 2; ++kind) {
            const int64_t row =
                shard.pool.BlockOffset(layer, kind, block) + row_in_block * l.row_bytes();
            for (int h_local = 0; h_local < l.kv_heads_per_tp_rank; ++h_local) {
              const int head = shard.tp_rank * l.kv_heads_per_tp_rank + h_local;
              for (int d = 0; d < l.head_dim; ++d) {
                StoreCode(l.dtype, Code(l, layer, kind, t, head, d),
                          &pool[row + (int64_t{h_local} * l.head_dim + d) * elem]);
              }
            }
          }
        }
      }
    }
    pools.push_back(std::move(pool));
  }
  return pools;
}

enum class DestKind { kContiguousOneRegion, kContiguousSplitKv, kPaged };

// A decode rank's destination memory: one region, or K and V apart (both offsets 0).
struct TestDestination {
  KvPullDestination spec;
  std::vector<int32_t> block_table;  // paged; spec's span points here
  std::vector<uint8_t> k_region, v_region;
  bool split_kv = false;

  std::vector<uint8_t>& RegionOf(int kind) { return split_kv && kind == 1 ? v_region : k_region; }
  const std::vector<uint8_t>& RegionOf(int kind) const {
    return split_kv && kind == 1 ? v_region : k_region;
  }
};

std::unique_ptr<TestDestination> MakeDestination(const KvHandleLayout& l, DestKind kind,
                                                 int tp_size, int tp_rank, int paged_tokens,
                                                 uint32_t seed) {
  auto dst = std::make_unique<TestDestination>();
  dst->spec.tp_size = tp_size;
  dst->spec.tp_rank = tp_rank;
  const int64_t row_bytes =
      int64_t{l.kv_heads / tp_size} * l.head_dim * static_cast<int64_t>(KvDtypeBytes(l.dtype));
  if (kind == DestKind::kPaged) {
    const int64_t needed = (l.tokens + paged_tokens - 1) / paged_tokens;
    const int64_t num_blocks = needed + 4;
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    dst->block_table.assign(ids.begin(), ids.begin() + needed);
    const KvCacheSpec spec{.num_layers = l.num_layers,
                           .kv_heads = l.kv_heads / tp_size,
                           .head_dim = l.head_dim,
                           .block_tokens = paged_tokens,
                           .dtype = l.dtype};
    const KvPoolLayout pool = KvPoolLayout::OfKvCache(spec, num_blocks);
    dst->spec.layout = KvPagedDestination{
        .block_tokens = paged_tokens, .pool = pool, .block_table = dst->block_table};
    dst->k_region.assign(pool.bytes, kPoison);
    return dst;
  }
  // Contiguous, with room past the prompt's tokens (must stay poisoned).
  const int64_t capacity = l.tokens + 3;
  const int64_t kind_bytes = l.num_layers * capacity * row_bytes;
  KvContiguousDestination c{.capacity_tokens = capacity};
  if (kind == DestKind::kContiguousSplitKv) {
    dst->split_kv = true;
    dst->k_region.assign(kind_bytes, kPoison);
    dst->v_region.assign(kind_bytes, kPoison);
  } else {
    c.k_offset_bytes = 16;  // a gap before K and between K and V, which must stay poisoned
    c.v_offset_bytes = 16 + kind_bytes + 8;
    dst->k_region.assign(c.v_offset_bytes + kind_bytes, kPoison);
  }
  dst->spec.layout = c;
  return dst;
}

// The byte where the destination keeps element (layer, kind, t, local head, d).
int64_t DestinationOffset(const KvHandleLayout& l, const TestDestination& dst, int layer, int kind,
                          int64_t t, int h_local, int d) {
  const int64_t elem = static_cast<int64_t>(KvDtypeBytes(l.dtype));
  const int64_t heads = l.kv_heads / dst.spec.tp_size;
  const int64_t in_row = (h_local * int64_t{l.head_dim} + d) * elem;
  if (const auto* p = std::get_if<KvPagedDestination>(&dst.spec.layout)) {
    return p->pool.BlockOffset(layer, kind, dst.block_table[t / p->block_tokens]) +
           (t % p->block_tokens) * heads * l.head_dim * elem + in_row;
  }
  const auto& c = std::get<KvContiguousDestination>(dst.spec.layout);
  return (kind == 0 ? c.k_offset_bytes : c.v_offset_bytes) +
         ((layer * c.capacity_tokens + t) * heads * l.head_dim) * elem + in_row;
}

// The plan's runs with memcpy, every piece bounds-checked on both sides.
void Execute(const KvPullPlan& plan, const KvHandle& h,
             const std::vector<std::vector<uint8_t>>& pools, TestDestination* dst) {
  for (const KvCopyRun& run : plan.runs) {
    const std::vector<uint8_t>& pool = pools[run.src_tp_rank * h.layout.cp_size + run.src_cp_rank];
    std::vector<uint8_t>& region = dst->RegionOf(run.kind);
    for (int64_t i = 0; i < run.pieces; ++i) {
      const int64_t src = run.src_offset_bytes + i * run.src_stride_bytes;
      const int64_t to = run.dst_offset_bytes + i * run.dst_stride_bytes;
      ASSERT_TRUE(src >= 0 && src + run.piece_bytes <= static_cast<int64_t>(pool.size()))
          << "source piece at " << src;
      ASSERT_TRUE(to >= 0 && to + run.piece_bytes <= static_cast<int64_t>(region.size()))
          << "destination piece at " << to;
      std::memcpy(&region[to], &pool[src], run.piece_bytes);
    }
  }
}

// Every element of every position in the destination holds its code; every other byte is still
// poison (no stray or missed write).
void CheckDestination(const KvHandleLayout& l, const TestDestination& dst) {
  const int64_t elem = static_cast<int64_t>(KvDtypeBytes(l.dtype));
  const int heads = l.kv_heads / dst.spec.tp_size;
  std::vector<bool> k_expected(dst.k_region.size()), v_expected(dst.v_region.size());
  int64_t wrong = 0;
  for (int layer = 0; layer < l.num_layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const std::vector<uint8_t>& region = dst.RegionOf(kind);
      std::vector<bool>& expected = dst.split_kv && kind == 1 ? v_expected : k_expected;
      for (int64_t t = 0; t < l.tokens; ++t) {
        for (int h_local = 0; h_local < heads; ++h_local) {
          const int head = dst.spec.tp_rank * heads + h_local;
          for (int d = 0; d < l.head_dim; ++d) {
            const int64_t at = DestinationOffset(l, dst, layer, kind, t, h_local, d);
            std::fill_n(expected.begin() + at, elem, true);
            if (!HoldsCode(l.dtype, Code(l, layer, kind, t, head, d), &region[at]) && wrong++ < 5) {
              ADD_FAILURE() << "layer " << layer << " kind " << kind << " position " << t
                            << " head " << head << " dim " << d << " is wrong";
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "elements wrong";
  auto count_stray = [](const std::vector<uint8_t>& region, const std::vector<bool>& expected) {
    int64_t stray = 0;
    for (size_t i = 0; i < region.size(); ++i) stray += !expected[i] && region[i] != kPoison;
    return stray;
  };
  EXPECT_EQ(count_stray(dst.k_region, k_expected), 0) << "bytes written outside the KV rows";
  EXPECT_EQ(count_stray(dst.v_region, v_expected), 0) << "bytes written outside the KV rows";
}

// Plans, runs and checks the pull of every decode rank of every decode TP size in `dst_tp_sizes`,
// into every kind of destination.
void SimulatePulls(const Geometry& g, const std::vector<int>& dst_tp_sizes) {
  const KvHandle h = MakeHandle(g);
  ASSERT_TRUE(ValidateKvHandle(h).ok()) << ValidateKvHandle(h);
  const std::vector<std::vector<uint8_t>> pools = MakeSourcePools(h);
  for (int dst_tp : dst_tp_sizes) {
    for (int dst_rank = 0; dst_rank < dst_tp; ++dst_rank) {
      for (DestKind kind :
           {DestKind::kContiguousOneRegion, DestKind::kContiguousSplitKv, DestKind::kPaged}) {
        for (int paged_tokens :
             kind == DestKind::kPaged ? std::vector<int>{4, 7, 16} : std::vector<int>{0}) {
          SCOPED_TRACE(absl::StrCat(GeometryText(g), "; decode TP", dst_tp, " rank ", dst_rank,
                                    ", destination ", static_cast<int>(kind), " paged by ",
                                    paged_tokens));
          std::unique_ptr<TestDestination> dst =
              MakeDestination(h.layout, kind, dst_tp, dst_rank, paged_tokens, g.seed + dst_rank);
          absl::StatusOr<KvPullPlan> plan = PlanKvPull(h, dst->spec);
          ASSERT_TRUE(plan.ok()) << plan.status();
          EXPECT_EQ(plan->total_bytes(),
                    2 * h.layout.num_layers * h.layout.tokens * plan->dst_row_bytes);
          Execute(*plan, h, pools, dst.get());
          if (::testing::Test::HasFatalFailure()) return;
          CheckDestination(h.layout, *dst);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// --- the handle --------------------------------------------------------------------------------

TEST(KvHandle, RoundTripsThroughJsonText) {
  for (KvDtype dtype : {KvDtype::kFloat32, KvDtype::kBfloat16}) {
    const KvHandle h = MakeHandle({.dtype = dtype});
    ASSERT_TRUE(ValidateKvHandle(h).ok()) << ValidateKvHandle(h);
    absl::StatusOr<std::string> text = json::Dump(ToJson(h), 2);
    ASSERT_TRUE(text.ok()) << text.status();
    absl::StatusOr<nlohmann::json> parsed_json = json::Parse(*text);
    ASSERT_TRUE(parsed_json.ok()) << parsed_json.status();
    absl::StatusOr<KvHandle> parsed = ParseKvHandle(*parsed_json);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, h);
  }
}

TEST(KvHandle, JsonHasTheDocumentedShape) {
  const KvHandle h = MakeHandle({.tokens = 41});
  const nlohmann::ordered_json j = ToJson(h);
  EXPECT_EQ(j["version"], "cpfill.kv.v2");
  EXPECT_EQ(j["compat_hash"], KvCompatHash(h.layout));
  EXPECT_EQ(j["layout"]["dtype"], "float32");
  EXPECT_EQ(j["layout"]["kv_heads_per_tp_rank"], 2);
  ASSERT_EQ(j["ranks"].size(), 4u);
  // CP2 of 41 tokens: chunks of 11, 10, 10, 10; CP rank 0 holds chunks 0 and 3.
  EXPECT_EQ(j["ranks"][0]["positions"], nlohmann::ordered_json::parse("[[0, 11], [31, 41]]"));
  EXPECT_EQ(j["ranks"][1]["positions"], nlohmann::ordered_json::parse("[[11, 31]]"));
  EXPECT_EQ(j["ranks"][3]["tp_rank"], 1);
  EXPECT_EQ(j["ranks"][3]["cp_rank"], 1);
  EXPECT_EQ(j["ranks"][1]["ucx"]["pool_address"], "0x7f0000000000");
  EXPECT_EQ(j["ranks"][2]["ucx"]["pool_address"], "0x7f0100000000");
  EXPECT_EQ(j["ranks"][0]["ucx"]["worker_address"], "dWNwLXdvcmtlci0wLTA=");
  EXPECT_EQ(j["lease_nonce"], "0x0000000000005be1000000000000002a");
  EXPECT_EQ(j["ranks"][1]["ucx"]["lease_address"], "0x5500001010c0");
  EXPECT_EQ(KvReleasePayload(h), "cpfill-test\ncmpl-42\n0x0000000000005be1000000000000002a");
}

// A handle built before its pools are registered with UCX: valid in-process only when asked, and
// never published in a form a decode worker would accept.
TEST(KvHandle, WithoutTransportIsValidOnlyInProcess) {
  KvHandle h = MakeHandle({});
  for (KvRankShard& shard : h.ranks) shard.transport = {};
  h.lease_nonce = {};
  EXPECT_TRUE(Mentions(ValidateKvHandle(h), "ranks[0].ucx.worker_address"));
  EXPECT_TRUE(ValidateKvHandle(h, KvTransportCheck::kAbsentAllowed).ok());
  const nlohmann::ordered_json j = ToJson(h);
  EXPECT_FALSE(j["ranks"][0].contains("ucx"));
  const absl::StatusOr<KvHandle> parsed = ParseKvHandle(Json::parse(j.dump()));
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  // Refused before the ranks: an unpublished handle has no lease either.
  EXPECT_TRUE(Mentions(parsed.status(), "\"lease_nonce\" is missing"));
  // Half a transport is still checked.
  h.ranks[1].transport.rkey = "k";
  EXPECT_TRUE(Mentions(ValidateKvHandle(h, KvTransportCheck::kAbsentAllowed),
                       "ranks[1].ucx.worker_address"));
}

TEST(KvHandle, IgnoresKeysItDoesNotKnow) {
  const KvHandle h = MakeHandle({});
  Json j = Json::parse(ToJson(h).dump());
  j["do_remote_prefill"] = true;  // what a router may add (vLLM's convention)
  j["layout"]["note"] = "x";
  absl::StatusOr<KvHandle> parsed = ParseKvHandle(j);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, h);
}

TEST(KvHandle, CompatHashIsStableAndCoversTheGeometry) {
  const KvHandleLayout llama3_8b{.num_layers = 32,
                                 .kv_heads = 8,
                                 .kv_heads_per_tp_rank = 4,
                                 .head_dim = 128,
                                 .dtype = KvDtype::kBfloat16,
                                 .block_tokens = 64,
                                 .tokens = 1000,
                                 .tp_size = 2,
                                 .cp_size = 2};
  // Frozen: a change here breaks every published handle; bump the version with it.
  EXPECT_EQ(KvCompatHash(llama3_8b), "1498b9a92d3e62b4");  // cpfill.kv.v2
  // The request's sharding is not part of the model's compatibility.
  KvHandleLayout other_sharding = llama3_8b;
  other_sharding.tokens = 7;
  other_sharding.tp_size = 8;
  other_sharding.kv_heads_per_tp_rank = 1;
  other_sharding.cp_size = 4;
  EXPECT_EQ(KvCompatHash(other_sharding), KvCompatHash(llama3_8b));
  std::vector<std::function<void(KvHandleLayout&)>> changes = {
      [](KvHandleLayout& l) { l.num_layers = 31; }, [](KvHandleLayout& l) { l.kv_heads = 16; },
      [](KvHandleLayout& l) { l.head_dim = 64; },
      [](KvHandleLayout& l) { l.dtype = KvDtype::kFloat32; },
      [](KvHandleLayout& l) { l.block_tokens = 32; }};
  for (size_t i = 0; i < changes.size(); ++i) {
    KvHandleLayout changed = llama3_8b;
    changes[i](changed);
    EXPECT_NE(KvCompatHash(changed), KvCompatHash(llama3_8b)) << "change " << i;
  }
}

// A handle's JSON with one thing wrong, and the field its refusal must name.
struct Forgery {
  std::string what;
  std::function<void(Json&)> mutate;
  std::string field;  // in the message
};

// Replaces rank r's positions and resizes its blocks to match, so only the coverage is wrong.
void SetPositions(Json& j, int r, const Json& positions) {
  Json& rank = j["ranks"][r];
  rank["positions"] = positions;
  int64_t held = 0;
  for (const Json& run : positions) held += run[1].get<int64_t>() - run[0].get<int64_t>();
  const int64_t bt = j["layout"]["block_tokens"].get<int64_t>();
  const size_t needed = static_cast<size_t>((held + bt - 1) / bt);
  std::vector<int32_t> blocks = rank["blocks"].get<std::vector<int32_t>>();
  for (int32_t id = 0; blocks.size() < needed; ++id) {
    if (std::find(blocks.begin(), blocks.end(), id) == blocks.end()) blocks.push_back(id);
  }
  blocks.resize(needed);
  rank["blocks"] = blocks;
}

std::vector<Forgery> Forgeries() {
  return {
      {"stale version", [](Json& j) { j["version"] = "cpfill.kv.v0"; }, "\"version\""},
      {"no version", [](Json& j) { j.erase("version"); }, "\"version\" is missing"},
      {"version not a string", [](Json& j) { j["version"] = 1; }, "\"version\" is a number"},
      {"no engine id", [](Json& j) { j.erase("engine_id"); }, "\"engine_id\""},
      {"empty engine id", [](Json& j) { j["engine_id"] = ""; }, "\"engine_id\""},
      {"request id a number", [](Json& j) { j["request_id"] = 7; }, "\"request_id\""},
      {"huge request id", [](Json& j) { j["request_id"] = std::string(300, 'x'); },
       "\"request_id\""},
      {"forged hash", [](Json& j) { j["compat_hash"] = "0123456789abcdef"; }, "\"compat_hash\""},
      {"geometry changed, hash kept", [](Json& j) { j["layout"]["head_dim"] = 2; },
       "\"compat_hash\""},
      {"no layout", [](Json& j) { j.erase("layout"); }, "\"layout\" is missing"},
      {"layout an array", [](Json& j) { j["layout"] = Json::array(); }, "\"layout\" is an array"},
      {"head_dim a string", [](Json& j) { j["layout"]["head_dim"] = "3"; }, "\"layout.head_dim\""},
      {"head_dim fractional", [](Json& j) { j["layout"]["head_dim"] = 2.5; },
       "\"layout.head_dim\""},
      {"num_layers past int32", [](Json& j) { j["layout"]["num_layers"] = int64_t{1} << 40; },
       "\"layout.num_layers\""},
      {"num_layers past the limit", [](Json& j) { j["layout"]["num_layers"] = 1 << 20; },
       "\"layout.num_layers\""},
      {"unknown dtype", [](Json& j) { j["layout"]["dtype"] = "float16"; }, "\"layout.dtype\""},
      {"no tokens", [](Json& j) { j["layout"]["tokens"] = 0; }, "\"layout.tokens\""},
      {"tp_size not dividing heads", [](Json& j) { j["layout"]["tp_size"] = 3; },
       "\"layout.tp_size\""},
      {"heads per rank wrong", [](Json& j) { j["layout"]["kv_heads_per_tp_rank"] = 4; },
       "\"layout.kv_heads_per_tp_rank\""},
      {"too many ranks", [](Json& j) { j["layout"]["cp_size"] = 4000; }, "\"layout.cp_size\""},
      {"truncated ranks", [](Json& j) { j["ranks"].erase(3); }, "\"ranks\" has 3 entries"},
      {"ranks out of order", [](Json& j) { std::swap(j["ranks"][0], j["ranks"][1]); },
       "\"ranks[0]\""},
      {"rank not an object", [](Json& j) { j["ranks"][2] = "rank"; }, "\"ranks[2]\""},
      {"tp_rank a string", [](Json& j) { j["ranks"][0]["tp_rank"] = "0"; }, "\"ranks[0].tp_rank\""},
      {"no ucx", [](Json& j) { j["ranks"][3].erase("ucx"); }, "\"ranks[3].ucx\" is missing"},
      {"no lease nonce", [](Json& j) { j.erase("lease_nonce"); }, "\"lease_nonce\" is missing"},
      {"lease nonce 0", [](Json& j) { j["lease_nonce"] = "0x00000000000000000000000000000000"; },
       "\"lease_nonce\" is 0"},
      {"lease nonce short", [](Json& j) { j["lease_nonce"] = "0x2a"; },
       "\"lease_nonce\" is \"0x2a\"; expected \"0x\" and 32 hex digits"},
      {"lease nonce not hex",
       [](Json& j) { j["lease_nonce"] = "0x0000000000005be1000000000000002g"; }, "\"lease_nonce\""},
      {"lease nonce a number", [](Json& j) { j["lease_nonce"] = 42; }, "\"lease_nonce\""},
      {"no lease key", [](Json& j) { j["ranks"][1]["ucx"].erase("lease_rkey"); },
       "\"ranks[1].ucx.lease_rkey\" is missing"},
      {"lease record unaligned",
       [](Json& j) { j["ranks"][2]["ucx"]["lease_address"] = "0x550000001008"; },
       "\"ranks[2].ucx.lease_address\""},
      {"run not a pair", [](Json& j) { j["ranks"][0]["positions"][0] = Json::array({1}); },
       "\"ranks[0].positions[0]\""},
      {"run reversed",
       [](Json& j) {
         j["ranks"][0]["positions"][0] = Json::array({5, 3});
       },
       "\"ranks[0].positions[0]\""},
      {"run negative",
       [](Json& j) {
         j["ranks"][0]["positions"][0] = Json::array({-1, 3});
       },
       "\"ranks[0].positions[0]\""},
      {"run past the tokens",
       [](Json& j) { SetPositions(j, 0, Json::parse("[[0, 11], [31, 42]]")); },
       "\"ranks[0].positions[1]\""},
      {"runs unsorted", [](Json& j) { SetPositions(j, 0, Json::parse("[[31, 41], [0, 11]]")); },
       "\"ranks[0].positions[1]\""},
      {"runs overlapping", [](Json& j) { SetPositions(j, 0, Json::parse("[[0, 11], [10, 41]]")); },
       "\"ranks[0].positions[1]\""},
      {"positions missing from every rank",
       [](Json& j) { SetPositions(j, 0, Json::parse("[[0, 11], [32, 41]]")); }, "missing"},
      {"positions held twice", [](Json& j) { SetPositions(j, 1, Json::parse("[[10, 31]]")); },
       "held twice"},
      {"coverage ends short",
       [](Json& j) { SetPositions(j, 2, Json::parse("[[0, 11], [31, 40]]")); }, "expected [0, 41)"},
      {"a block too few", [](Json& j) { j["ranks"][2]["blocks"].erase(0); }, "\"ranks[2].blocks\""},
      {"block outside the pool", [](Json& j) { j["ranks"][0]["blocks"][1] = 1000; },
       "\"ranks[0].blocks[1]\""},
      {"block negative", [](Json& j) { j["ranks"][0]["blocks"][0] = -1; },
       "\"ranks[0].blocks[0]\""},
      {"block repeated", [](Json& j) { j["ranks"][1]["blocks"][1] = j["ranks"][1]["blocks"][0]; },
       "\"ranks[1].blocks\" names block"},
      {"pool one byte short",
       [](Json& j) {
         Json& bytes = j["ranks"][0]["pool"]["bytes"];
         bytes = bytes.get<int64_t>() - 1;
       },
       "\"ranks[0].pool.bytes\""},
      {"pool strides overflow",
       [](Json& j) { j["ranks"][1]["pool"]["block_stride_bytes"] = int64_t{1} << 62; },
       "past int64"},
      {"pool offset negative", [](Json& j) { j["ranks"][1]["pool"]["v_offset_bytes"] = -8; },
       "\"ranks[1].pool.v_offset_bytes\""},
      {"pool stride below a block",
       [](Json& j) { j["ranks"][1]["pool"]["block_stride_bytes"] = 8; },
       "\"ranks[1].pool.block_stride_bytes\""},
      {"pool without blocks", [](Json& j) { j["ranks"][0]["pool"]["num_blocks"] = 0; },
       "\"ranks[0].pool.num_blocks\""},
      {"pool bytes a string", [](Json& j) { j["ranks"][0]["pool"]["bytes"] = "big"; },
       "\"ranks[0].pool.bytes\""},
      {"worker address not base64",
       [](Json& j) { j["ranks"][0]["ucx"]["worker_address"] = "not base64!"; },
       "\"ranks[0].ucx.worker_address\""},
      {"rkey without padding",
       [](Json& j) {
         std::string rkey = j["ranks"][1]["ucx"]["rkey"].get<std::string>();
         rkey.erase(rkey.find_last_not_of('=') + 1);
         j["ranks"][1]["ucx"]["rkey"] = rkey;
       },
       "\"ranks[1].ucx.rkey\""},
      {"empty rkey", [](Json& j) { j["ranks"][1]["ucx"]["rkey"] = ""; }, "\"ranks[1].ucx.rkey\""},
      {"address without 0x", [](Json& j) { j["ranks"][2]["ucx"]["pool_address"] = "7f00"; },
       "\"ranks[2].ucx.pool_address\""},
      {"address too long",
       [](Json& j) { j["ranks"][2]["ucx"]["pool_address"] = "0x10000000000000000"; },
       "\"ranks[2].ucx.pool_address\""},
      {"address a number", [](Json& j) { j["ranks"][2]["ucx"]["pool_address"] = 4096; },
       "\"ranks[2].ucx.pool_address\""},
      {"address wrapping",
       [](Json& j) { j["ranks"][2]["ucx"]["pool_address"] = "0xffffffffffffff00"; },
       "\"ranks[2].ucx.pool_address\""},
  };
}

TEST(KvHandle, RefusesForgedAndTruncatedHandlesNamingTheField) {
  const KvHandle h = MakeHandle({.tokens = 41, .shuffled_blocks = false});
  const Json good = Json::parse(ToJson(h).dump());
  ASSERT_TRUE(ParseKvHandle(good).ok());
  for (const Forgery& forgery : Forgeries()) {
    SCOPED_TRACE(forgery.what);
    Json forged = good;
    forgery.mutate(forged);
    const absl::StatusOr<KvHandle> parsed = ParseKvHandle(forged);
    ASSERT_FALSE(parsed.ok());
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Mentions(parsed.status(), "kv handle: "));
    EXPECT_TRUE(Mentions(parsed.status(), forgery.field));
  }
}

TEST(KvHandle, RefusesNonObjects) {
  for (const Json& v : {Json(), Json(3), Json("handle"), Json::array({1, 2})}) {
    const absl::StatusOr<KvHandle> parsed = ParseKvHandle(v);
    ASSERT_FALSE(parsed.ok());
    EXPECT_TRUE(Mentions(parsed.status(), "expected an object"));
  }
}

// Cut anywhere, the text either fails to parse as JSON or, once parsed, as a handle.
TEST(KvHandle, TruncatedTextNeverParses) {
  const std::string text = ToJson(MakeHandle({.tokens = 9})).dump();
  for (size_t cut = 0; cut < text.size(); cut += 7) {
    const absl::StatusOr<nlohmann::json> parsed_json = json::Parse(text.substr(0, cut));
    if (!parsed_json.ok()) continue;
    EXPECT_FALSE(ParseKvHandle(*parsed_json).ok()) << "cut at " << cut;
  }
}

// Every value anywhere in the handle replaced by values of every type: never a crash or an
// exception, and every refusal an InvalidArgument of the handle.
TEST(KvHandle, SurvivesEveryValueReplaced) {
  const Json good = Json::parse(ToJson(MakeHandle({.block_tokens = 4, .tokens = 9})).dump());
  const std::vector<Json> replacements = {Json(),
                                          Json(-1),
                                          Json(0),
                                          Json(int64_t{1} << 62),
                                          Json(UINT64_MAX),
                                          Json(1e300),
                                          Json("x"),
                                          Json::array(),
                                          Json::object(),
                                          Json(true),
                                          Json::array({Json::array()})};
  const Json flat = good.flatten();
  int refused = 0;
  for (const auto& [pointer, value] : flat.items()) {
    for (const Json& replacement : replacements) {
      Json forged = good;
      forged[Json::json_pointer(pointer)] = replacement;
      const absl::StatusOr<KvHandle> parsed = ParseKvHandle(forged);
      if (parsed.ok()) continue;  // e.g. a request id "x" is fine
      ++refused;
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << pointer;
      EXPECT_TRUE(Mentions(parsed.status(), "kv handle: ")) << pointer;
    }
  }
  EXPECT_GT(refused, 100);
}

// --- the pull plan -----------------------------------------------------------------------------

TEST(KvPullPlan, Tp2Cp2PrefillToDecodeTp1Tp2Tp4) {
  for (int64_t tokens : {41, 64, 3, 1}) {
    for (int block_tokens : {5, 16}) {
      for (bool shuffled : {true, false}) {
        SimulatePulls({.block_tokens = block_tokens, .tokens = tokens, .shuffled_blocks = shuffled},
                      {1, 2, 4});
        if (HasFailure()) return;
      }
    }
  }
}

// Head ranges that straddle source ranks: TP3 (2 heads each) to TP2 (3 heads each), in bf16.
TEST(KvPullPlan, Tp3Cp2PrefillToDecodeTp1Tp2Tp3Tp6Bf16) {
  for (int64_t tokens : {37, 50}) {
    SimulatePulls({.tp_size = 3,
                   .cp_size = 2,
                   .kv_heads = 6,
                   .head_dim = 4,
                   .dtype = KvDtype::kBfloat16,
                   .block_tokens = 6,
                   .tokens = tokens,
                   .seed = 7},
                  {1, 2, 3, 6});
    if (HasFailure()) return;
  }
}

TEST(KvPullPlan, Tp1Cp4PrefillToDecodeTp2) {
  SimulatePulls({.tp_size = 1, .cp_size = 4, .kv_heads = 2, .tokens = 45, .seed = 3}, {1, 2});
}

// Consecutive source blocks into a contiguous destination: one run per (source rank, layer, kind,
// position run) — merged across blocks; strided (a piece per row) when the TP sizes differ.
TEST(KvPullPlan, MergesContiguousCopies) {
  const Geometry g{.block_tokens = 5, .tokens = 41, .shuffled_blocks = false};
  const KvHandle h = MakeHandle(g);
  // CP rank 0 holds chunks 0 and 3 (2 runs), CP rank 1 chunks 1 and 2 (adjacent: 1 run).
  ASSERT_EQ(h.rank(0, 0).positions.size(), 2u);
  ASSERT_EQ(h.rank(0, 1).positions.size(), 1u);
  const int64_t runs_per_tp_rank = (2 + 1) * g.num_layers * 2;
  {
    const absl::StatusOr<KvPullPlan> same_tp =
        PlanKvPull(h, {.tp_size = 2, .tp_rank = 1, .layout = KvContiguousDestination{}});
    ASSERT_TRUE(same_tp.ok()) << same_tp.status();
    EXPECT_EQ(same_tp->runs.size(), static_cast<size_t>(runs_per_tp_rank));
    for (const KvCopyRun& run : same_tp->runs) {
      EXPECT_EQ(run.pieces, 1);
      EXPECT_EQ(run.src_tp_rank, 1);
    }
  }
  const absl::StatusOr<KvPullPlan> gather =
      PlanKvPull(h, {.tp_size = 1, .tp_rank = 0, .layout = KvContiguousDestination{}});
  ASSERT_TRUE(gather.ok()) << gather.status();
  EXPECT_EQ(gather->runs.size(), static_cast<size_t>(g.tp_size * runs_per_tp_rank));
  for (const KvCopyRun& run : gather->runs) {
    EXPECT_EQ(run.piece_bytes, 2 * g.head_dim * 4);  // a source row: 2 of the 4 heads
    EXPECT_EQ(run.src_stride_bytes, run.piece_bytes);
    EXPECT_EQ(run.dst_stride_bytes, 2 * run.piece_bytes);
    EXPECT_GE(run.pieces, 10);  // a whole position run: chunks of 10 or 11 tokens
  }
}

TEST(KvPullPlan, RefusesBadDestinations) {
  const KvHandle h = MakeHandle({.kv_heads = 4, .block_tokens = 5, .tokens = 41});
  const std::vector<int32_t> table = {3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10};  // 41 tokens by 4
  const KvCacheSpec spec{.num_layers = 2, .kv_heads = 4, .head_dim = 3, .block_tokens = 4};
  const KvPoolLayout pool = KvPoolLayout::OfKvCache(spec, 12);
  auto paged = [&](std::span<const int32_t> t, KvPoolLayout p, int block_tokens = 4) {
    return KvPullDestination{
        .tp_size = 1,
        .tp_rank = 0,
        .layout = KvPagedDestination{.block_tokens = block_tokens, .pool = p, .block_table = t}};
  };
  ASSERT_TRUE(PlanKvPull(h, paged(table, pool)).ok()) << PlanKvPull(h, paged(table, pool)).status();

  struct Refusal {
    std::string what;
    KvPullDestination dst;
    std::string mention;
  };
  KvPoolLayout small_pool = pool;
  small_pool.bytes -= 1;
  KvPoolLayout thin_blocks = pool;
  thin_blocks.block_stride_bytes = 4 * 12 * 4 - 4;
  const std::vector<int32_t> repeated = {3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 3};
  const std::vector<int32_t> outside = {3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 12};
  const std::vector<Refusal> refusals = {
      {"tp 3 of 4 heads", {.tp_size = 3, .layout = KvContiguousDestination{}}, "tp_size 3"},
      {"tp 8 of 4 heads", {.tp_size = 8, .layout = KvContiguousDestination{}}, "tp_size 8"},
      {"tp 0", {.tp_size = 0, .layout = KvContiguousDestination{}}, "tp_size 0"},
      {"rank outside tp",
       {.tp_size = 2, .tp_rank = 2, .layout = KvContiguousDestination{}},
       "tp_rank 2"},
      {"capacity below tokens",
       {.layout = KvContiguousDestination{.capacity_tokens = 40}},
       "capacity_tokens 40"},
      {"negative offset",
       {.layout = KvContiguousDestination{.v_offset_bytes = -4}},
       "non-negative"},
      {"capacity overflowing",
       {.layout = KvContiguousDestination{.capacity_tokens = int64_t{1} << 60}},
       "int64"},
      {"table too short", paged(std::span(table).first(10), pool), "block_table has 10 blocks"},
      {"table id repeated", paged(repeated, pool), "names block 3 twice"},
      {"table id outside the pool", paged(outside, pool), "block_table[10] is 12"},
      {"pool one byte short", paged(table, small_pool), "\"destination.pool.bytes\""},
      {"blocks thinner than B rows", paged(table, thin_blocks),
       "\"destination.pool.block_stride_bytes\""},
      {"block_tokens 0", paged(table, pool, 0), "block_tokens 0"},
  };
  for (const Refusal& r : refusals) {
    SCOPED_TRACE(r.what);
    const absl::StatusOr<KvPullPlan> plan = PlanKvPull(h, r.dst);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(Mentions(plan.status(), r.mention));
  }
}

TEST(KvPullPlan, RefusesAnInvalidHandle) {
  KvHandle h = MakeHandle({});
  h.ranks[1].blocks.pop_back();
  const absl::StatusOr<KvPullPlan> plan =
      PlanKvPull(h, {.tp_size = 1, .layout = KvContiguousDestination{}});
  ASSERT_FALSE(plan.ok());
  EXPECT_TRUE(Mentions(plan.status(), "\"ranks[1].blocks\""));
}

// What a lease record holds for a rank changes with everything a puller would be asked to read
// there, and with nothing else.
TEST(KvHandle, RankDigestCoversWhatARankIsAskedFor) {
  const KvHandle h = MakeHandle({.tokens = 41});
  const Sha256Digest d = KvRankDigest(h, 1);
  EXPECT_EQ(KvRankDigest(h, 1), d);
  EXPECT_NE(KvRankDigest(h, 0), d);  // another rank's part
  auto changed = [&](const std::function<void(KvHandle&)>& edit) {
    KvHandle e = h;
    edit(e);
    return KvRankDigest(e, 1) != d;
  };
  EXPECT_TRUE(changed([](KvHandle& e) { e.ranks[1].blocks[0] += 1; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.ranks[1].positions[0].length -= 1; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.ranks[1].pool.k_offset_bytes += 64; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.ranks[1].cp_rank = 0; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.request_id = "cmpl-43"; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.engine_id = "cpfill-other"; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.lease_nonce.lo ^= 1; }));
  EXPECT_TRUE(changed([](KvHandle& e) { e.layout.num_layers += 1; }));
  // Rank 1's transport is not part of it (world rank 0 fills it), nor another rank's blocks.
  EXPECT_FALSE(changed([](KvHandle& e) { e.ranks[1].transport = e.ranks[0].transport; }));
  EXPECT_FALSE(changed([](KvHandle& e) { e.ranks[2].blocks[0] += 1; }));
}

TEST(KvHandle, NoncesAreRandom128BitValues) {
  const KvNonce a = KvNonce::Random(), b = KvNonce::Random();
  EXPECT_FALSE(a.zero());
  EXPECT_NE(a, b);
  EXPECT_EQ(a.ToString().size(), 34u);
  EXPECT_EQ(KvNonce::Parse(a.ToString()), a);
  EXPECT_EQ(KvNonce::Parse("0X0000000000005BE1000000000000002A"),
            (KvNonce{.hi = 0x5be1, .lo = 0x2a}));
  EXPECT_FALSE(KvNonce::Parse("0x2a").has_value());
  EXPECT_FALSE(KvNonce::Parse("0x0000000000005be1000000000000002a0").has_value());
  EXPECT_FALSE(KvNonce::Parse("000000000000005be1000000000000002a").has_value());
  EXPECT_FALSE(KvNonce::Parse("0x0000000000005be100000000000000-a").has_value());
}

}  // namespace
}  // namespace cpfill::runtime
