// KvCache on host storage: every test checks the cache against a plain per-sequence copy of the
// rows it was given (random data, read-back buffers poisoned with NaN first).
#include "runtime/kv/kv_cache.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// `st`'s message contains `text`.
::testing::AssertionResult Mentions(const absl::Status& st, const std::string& text) {
  if (std::string(st.message()).find(text) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "'" << st.message() << "' does not mention '" << text << "'";
}

KvCacheSpec SmallSpec(int block_tokens, int64_t capacity_tokens) {
  return {.num_layers = 3,
          .kv_heads = 2,
          .head_dim = 8,
          .block_tokens = block_tokens,
          .capacity_tokens = capacity_tokens,
          .dtype = KvDtype::kFloat32};
}

// Forwards to a host storage, counting calls and runs (batching and run merging are visible).
class CountingStorage final : public KvStorage {
 public:
  CountingStorage(int* calls, int64_t* runs) : calls_(calls), runs_(runs) {}
  absl::Status Allocate(int64_t bytes) override { return host_->Allocate(bytes); }
  char* base() const override { return host_->base(); }
  bool on_device() const override { return false; }
  absl::Status CopyRuns(std::span<const CopyRun> runs) override {
    ++*calls_;
    *runs_ += static_cast<int64_t>(runs.size());
    return host_->CopyRuns(runs);
  }

 private:
  std::unique_ptr<KvStorage> host_ = MakeHostKvStorage();
  int* calls_;
  int64_t* runs_;
};

// Records the size asked for and touches nothing: geometry far larger than this machine.
class FakeStorage final : public KvStorage {
 public:
  explicit FakeStorage(int64_t* allocated) : allocated_(allocated) {}
  absl::Status Allocate(int64_t bytes) override {
    *allocated_ = bytes;
    return absl::OkStatus();
  }
  char* base() const override { return nullptr; }
  bool on_device() const override { return false; }
  absl::Status CopyRuns(std::span<const CopyRun>) override { return absl::OkStatus(); }

 private:
  int64_t* allocated_;
};

// A KvCache and, beside it, the rows every sequence should hold (per layer, K and V).
class Mirror {
 public:
  Mirror(const KvCacheSpec& spec, uint64_t seed) : rng_(seed) {
    auto kv = KvCache::Create(spec, MakeHostKvStorage());
    EXPECT_TRUE(kv.ok()) << kv.status();
    kv_ = std::move(*kv);
    row_floats_ = spec.kv_heads * spec.head_dim;
  }
  KvCache& kv() { return *kv_; }

  // Reserve, Append and Write `tokens` new random rows of `seq` in every layer.
  absl::Status Extend(KvCache::SeqId seq, int64_t tokens) {
    const int64_t begin = kv_->length(seq);
    if (absl::Status st = kv_->Reserve(seq, begin + tokens); !st.ok()) return st;
    if (absl::Status st = kv_->Append(seq, tokens); !st.ok()) return st;
    for (int l = 0; l < kv_->spec().num_layers; ++l) {
      std::vector<float> k = Random(tokens), v = Random(tokens);
      KvCache::Rows rows[] = {{seq, begin, tokens, k.data(), v.data()}};
      if (absl::Status st = kv_->Write(l, rows); !st.ok()) return st;
      Truth(seq, l, 0).insert(Truth(seq, l, 0).end(), k.begin(), k.end());
      Truth(seq, l, 1).insert(Truth(seq, l, 1).end(), v.begin(), v.end());
    }
    return absl::OkStatus();
  }

  // Every layer of `seq` read back in one call per layer, from `begin` to the end, equals the
  // mirror bit for bit.
  void Verify(KvCache::SeqId seq, int64_t begin = 0) {
    const int64_t n = kv_->length(seq) - begin;
    ASSERT_EQ(kv_->length(seq), static_cast<int64_t>(Truth(seq, 0, 0).size()) / row_floats_);
    for (int l = 0; l < kv_->spec().num_layers; ++l) {
      std::vector<float> k(n * row_floats_, kNaN), v(n * row_floats_, kNaN);
      KvCache::Rows rows[] = {{seq, begin, n, k.data(), v.data()}};
      ASSERT_TRUE(kv_->Read(l, rows).ok());
      EXPECT_EQ(0, std::memcmp(k.data(), Truth(seq, l, 0).data() + begin * row_floats_,
                               k.size() * sizeof(float)))
          << "K of sequence " << seq << " layer " << l;
      EXPECT_EQ(0, std::memcmp(v.data(), Truth(seq, l, 1).data() + begin * row_floats_,
                               v.size() * sizeof(float)))
          << "V of sequence " << seq << " layer " << l;
    }
  }

  void MirrorFork(KvCache::SeqId parent, KvCache::SeqId child, int64_t prefix) {
    for (int l = 0; l < kv_->spec().num_layers; ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        const std::vector<float>& p = Truth(parent, l, kind);
        Truth(child, l, kind).assign(p.begin(), p.begin() + prefix * row_floats_);
      }
    }
  }
  void MirrorTruncate(KvCache::SeqId seq, int64_t tokens) {
    for (int l = 0; l < kv_->spec().num_layers; ++l) {
      for (int kind = 0; kind < 2; ++kind) Truth(seq, l, kind).resize(tokens * row_floats_);
    }
  }
  void MirrorRelease(KvCache::SeqId seq) {
    for (auto it = truth_.begin(); it != truth_.end();) {
      it = std::get<0>(it->first) == seq ? truth_.erase(it) : std::next(it);
    }
  }

  std::vector<float> Random(int64_t tokens) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<float> x(tokens * row_floats_);
    for (float& f : x) f = u(rng_);
    return x;
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::vector<float>& Truth(KvCache::SeqId seq, int layer, int kind) {
    return truth_[{seq, layer, kind}];
  }

  std::mt19937_64 rng_;
  std::unique_ptr<KvCache> kv_;
  int64_t row_floats_ = 0;
  std::map<std::tuple<KvCache::SeqId, int, int>, std::vector<float>> truth_;
};

class KvCacheBlocks : public ::testing::TestWithParam<int> {};

TEST_P(KvCacheBlocks, RoundTripsAcrossBlockBoundaries) {
  const int bt = GetParam();
  Mirror m(SmallSpec(bt, 8 * 1024), 1000 + bt);
  // Odd lengths, written in chunks that start and end anywhere in a block.
  const int64_t lengths[] = {1, bt - 1, bt, bt + 1, 3 * bt + 7, 1031};
  KvCache::SeqId seq = 1;
  for (int64_t len : lengths) {
    for (int64_t done = 0; done < len;) {
      const int64_t chunk =
          std::min<int64_t>(len - done, 1 + static_cast<int64_t>(m.rng()() % (bt + 13)));
      ASSERT_TRUE(m.Extend(seq, chunk).ok());
      done += chunk;
    }
    EXPECT_EQ(m.kv().length(seq), len);
    EXPECT_EQ(static_cast<int64_t>(m.kv().BlockTable(seq).size()), (len + bt - 1) / bt);
    m.Verify(seq);
    m.Verify(seq, len / 2);  // a read starting inside a block
    ++seq;
  }
}

INSTANTIATE_TEST_SUITE_P(BlockTokens, KvCacheBlocks, ::testing::Values(16, 64, 256));

TEST(KvCache, ManySequencesInterleaved) {
  const int bt = 16;
  Mirror m(SmallSpec(bt, 64 * 1024), 7);
  constexpr int kSeqs = 24;
  std::vector<int64_t> lengths(kSeqs, 0);
  for (int step = 0; step < 400; ++step) {
    const int s = static_cast<int>(m.rng()() % kSeqs);
    const int64_t chunk = 1 + static_cast<int64_t>(m.rng()() % 40);
    ASSERT_TRUE(m.Extend(s, chunk).ok());
    lengths[s] += chunk;
  }
  std::set<int32_t> seen;
  int64_t blocks = 0, tokens = 0;
  for (int s = 0; s < kSeqs; ++s) {
    m.Verify(s);
    for (int32_t b : m.kv().BlockTable(s)) {
      EXPECT_TRUE(seen.insert(b).second) << "block " << b << " in two tables";
      EXPECT_EQ(m.kv().refcount(b), 1);
    }
    blocks += static_cast<int64_t>(m.kv().BlockTable(s).size());
    tokens += lengths[s];
  }
  const KvUsage u = m.kv().usage();
  EXPECT_EQ(u.blocks_used, blocks);
  EXPECT_EQ(u.tokens_held, tokens);
  EXPECT_EQ(u.sequences, kSeqs);
  EXPECT_EQ(u.blocks_shared, 0);
}

TEST(KvCache, BatchedWriteAndReadOfSeveralSequencesInOneCall) {
  int calls = 0;
  int64_t runs = 0;
  const int bt = 16;
  auto kv = KvCache::Create(SmallSpec(bt, 1024), std::make_unique<CountingStorage>(&calls, &runs));
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int64_t row = 16, len_a = 4 * bt, len_b = 37, n = (len_a + len_b) * row;
  // Sequence 1's rows, then sequence 2's, in one K and one V buffer.
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> k(n), v(n);
  for (auto* x : {&k, &v}) {
    for (float& f : *x) f = u(rng);
  }
  ASSERT_TRUE((*kv)->Reserve(1, len_a).ok());
  ASSERT_TRUE((*kv)->Reserve(2, len_b).ok());
  ASSERT_TRUE((*kv)->Append(1, len_a).ok());
  ASSERT_TRUE((*kv)->Append(2, len_b).ok());
  calls = 0, runs = 0;
  KvCache::Rows rows[] = {{1, 0, len_a, k.data(), v.data()},
                          {2, 0, len_b, k.data() + len_a * row, v.data() + len_a * row}};
  ASSERT_TRUE((*kv)->Write(1, rows).ok());
  EXPECT_EQ(calls, 1);
  // A fresh pool hands out consecutive blocks, and the buffers are consecutive too: the seven
  // blocks of both sequences merge into one run per kind.
  EXPECT_EQ(runs, 2);

  // Read back in the other order: sequence 2 first in the output.
  std::vector<float> out_k(n, kNaN), out_v(n, kNaN);
  KvCache::Rows back[] = {{2, 0, len_b, out_k.data(), out_v.data()},
                          {1, 0, len_a, out_k.data() + len_b * row, out_v.data() + len_b * row}};
  calls = 0, runs = 0;
  ASSERT_TRUE((*kv)->Read(1, back).ok());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(runs, 4);
  for (auto [out, in] : {std::pair{&out_k, &k}, std::pair{&out_v, &v}}) {
    EXPECT_EQ(0, std::memcmp(out->data(), in->data() + len_a * row, len_b * row * 4));
    EXPECT_EQ(0, std::memcmp(out->data() + len_b * row, in->data(), len_a * row * 4));
  }
  // The other layers were not touched by any of it.
  std::vector<float> other(len_a * row, kNaN);
  KvCache::Rows other_rows[] = {{1, 0, len_a, other.data(), other.data()}};
  ASSERT_TRUE((*kv)->Read(0, other_rows).ok());
  EXPECT_NE(0, std::memcmp(other.data(), k.data(), 64 * 4));
}

TEST(KvCache, PoolLayoutIsAsDocumented) {
  const KvCacheSpec spec = SmallSpec(16, 100);  // 7 blocks
  auto kv = KvCache::Create(spec, MakeHostKvStorage());
  ASSERT_TRUE(kv.ok());
  const int64_t nb = 7, bb = spec.block_bytes();
  EXPECT_EQ((*kv)->num_blocks(), nb);
  EXPECT_EQ((*kv)->spec().capacity_tokens, nb * 16);
  char* base = (*kv)->BlockAddress(0, 0, 0);
  ASSERT_NE(base, nullptr);
  for (int l = 0; l < 3; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      for (int32_t b = 0; b < nb; ++b) {
        EXPECT_EQ((*kv)->BlockAddress(l, kind, b) - base, ((l * 2 + kind) * nb + b) * bb);
      }
    }
  }
  EXPECT_EQ((*kv)->BlockAddress(3, 0, 0), nullptr);
  EXPECT_EQ((*kv)->BlockAddress(0, 2, 0), nullptr);
  EXPECT_EQ((*kv)->BlockAddress(0, 0, 7), nullptr);
  // Token 20 of a sequence (block 1 of its table, row 4) lands where the layout says.
  ASSERT_TRUE((*kv)->Reserve(9, 21).ok());
  ASSERT_TRUE((*kv)->Append(9, 21).ok());
  std::vector<float> k(16), v(16);
  for (int i = 0; i < 16; ++i) k[i] = 1.5f + i, v[i] = -2.5f - i;
  KvCache::Rows rows[] = {{9, 20, 1, k.data(), v.data()}};
  ASSERT_TRUE((*kv)->Write(2, rows).ok());
  const int32_t block = (*kv)->BlockTable(9)[1];
  EXPECT_EQ(0, std::memcmp((*kv)->BlockAddress(2, 0, block) + 4 * spec.row_bytes(), k.data(), 64));
  EXPECT_EQ(0, std::memcmp((*kv)->BlockAddress(2, 1, block) + 4 * spec.row_bytes(), v.data(), 64));
}

TEST(KvCache, ReserveFailsCleanlyWhenFull) {
  const KvCacheSpec spec = SmallSpec(16, 10 * 16);
  Mirror m(spec, 11);
  const int64_t per_block = 2 * 3 * spec.block_bytes();
  ASSERT_TRUE(m.Extend(1, 8 * 16 - 3).ok());  // 8 blocks
  const KvUsage before = m.kv().usage();
  const std::vector<int32_t> table(m.kv().BlockTable(1).begin(), m.kv().BlockTable(1).end());

  EXPECT_EQ(m.kv().BlocksNeeded(2, 3 * 16), 3);
  absl::Status st = m.kv().Reserve(2, 3 * 16);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(st, "sequence 2"));
  EXPECT_TRUE(Mentions(st, absl::StrCat(3 * 16, " tokens")));
  EXPECT_TRUE(Mentions(st, absl::StrCat(3 * per_block, " bytes")));
  EXPECT_TRUE(Mentions(st, absl::StrCat(2 * per_block, " bytes")));
  EXPECT_FALSE(m.kv().Contains(2));
  // Marked as the cache being full (what eviction can cure), unlike other shortfalls.
  EXPECT_TRUE(IsKvCacheFull(st));
  EXPECT_FALSE(IsKvCacheFull(absl::ResourceExhaustedError("activations: 5 GiB needed")));

  // Growing a sequence past the pool fails the same way and leaves it as it was.
  EXPECT_EQ(m.kv().BlocksNeeded(1, 11 * 16), 3);
  EXPECT_EQ(m.kv().Reserve(1, 11 * 16).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m.kv().reserved(1), 8 * 16 - 3);
  EXPECT_TRUE(std::equal(table.begin(), table.end(), m.kv().BlockTable(1).begin(),
                         m.kv().BlockTable(1).end()));
  const KvUsage after = m.kv().usage();
  EXPECT_EQ(after.blocks_used, before.blocks_used);
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(m.kv().free_blocks(), 2);
  m.Verify(1);

  // What is free still serves: exactly the remaining two blocks.
  EXPECT_EQ(m.kv().BlocksNeeded(2, 2 * 16), 2);
  ASSERT_TRUE(m.Extend(2, 2 * 16).ok());
  EXPECT_EQ(m.kv().free_blocks(), 0);
  EXPECT_EQ(m.kv().Reserve(3, 1).code(), absl::StatusCode::kResourceExhausted);
  // Inside its last block a sequence still grows with the pool empty.
  EXPECT_EQ(m.kv().BlocksNeeded(1, 8 * 16), 0);
  ASSERT_TRUE(m.Extend(1, 3).ok());
  m.Verify(1);
  m.Verify(2);
}

TEST(KvCache, ReleaseReturnsBlocks) {
  Mirror m(SmallSpec(16, 20 * 16), 5);
  ASSERT_TRUE(m.Extend(1, 70).ok());
  ASSERT_TRUE(m.Extend(2, 33).ok());
  EXPECT_EQ(m.kv().free_blocks(), 20 - 5 - 3);
  const int32_t last_of_1 = m.kv().BlockTable(1).back();
  m.kv().Release(1);
  m.MirrorRelease(1);
  EXPECT_FALSE(m.kv().Contains(1));
  EXPECT_EQ(m.kv().length(1), 0);
  EXPECT_TRUE(m.kv().BlockTable(1).empty());
  EXPECT_EQ(m.kv().free_blocks(), 20 - 3);
  EXPECT_EQ(m.kv().refcount(last_of_1), 0);
  m.kv().Release(1);  // unknown: no-op
  m.kv().Release(12345);
  EXPECT_EQ(m.kv().free_blocks(), 20 - 3);
  m.Verify(2);
  // The lowest free ids first: a new sequence's blocks are ascending and consecutive where the
  // pool has room, though sequence 1's freed blocks (0 to 4, then 2's are 5 to 7) came back in
  // its order.
  EXPECT_EQ(last_of_1, 4);
  ASSERT_TRUE(m.kv().Reserve(3, 5 * 16).ok());
  const std::vector<int32_t> want = {0, 1, 2, 3, 4};
  EXPECT_EQ(std::vector<int32_t>(m.kv().BlockTable(3).begin(), m.kv().BlockTable(3).end()), want);
  m.kv().Release(2);
  m.kv().Release(3);
  EXPECT_EQ(m.kv().free_blocks(), 20);
  EXPECT_EQ(m.kv().usage().blocks_used, 0);
  EXPECT_EQ(m.kv().usage().sequences, 0);
}

TEST(KvCache, TruncateRollsBack) {
  Mirror m(SmallSpec(16, 20 * 16), 9);
  ASSERT_TRUE(m.Extend(1, 40).ok());
  // A "failed prefill": reserve and append 50 more, then roll back.
  ASSERT_TRUE(m.kv().Reserve(1, 90).ok());
  ASSERT_TRUE(m.kv().Append(1, 50).ok());
  EXPECT_EQ(m.kv().BlockTable(1).size(), 6u);
  ASSERT_TRUE(m.kv().Truncate(1, 40).ok());
  EXPECT_EQ(m.kv().length(1), 40);
  EXPECT_EQ(m.kv().reserved(1), 40);
  EXPECT_EQ(m.kv().BlockTable(1).size(), 3u);
  EXPECT_EQ(m.kv().free_blocks(), 17);
  m.Verify(1);
  EXPECT_EQ(m.kv().Append(1, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.kv().Truncate(1, 41).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Truncate(1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Truncate(2, 0).code(), absl::StatusCode::kInvalidArgument);
  // Continues after the rollback; then to a block boundary and to nothing.
  ASSERT_TRUE(m.Extend(1, 25).ok());
  m.Verify(1);
  ASSERT_TRUE(m.kv().Truncate(1, 32).ok());
  m.MirrorTruncate(1, 32);
  EXPECT_EQ(m.kv().BlockTable(1).size(), 2u);
  m.Verify(1);
  ASSERT_TRUE(m.kv().Truncate(1, 0).ok());
  m.MirrorTruncate(1, 0);
  EXPECT_TRUE(m.kv().Contains(1));
  EXPECT_EQ(m.kv().free_blocks(), 20);
}

TEST(KvCache, ForkSharesFullBlocksAndCopiesThePartialOne) {
  const int bt = 16;
  Mirror m(SmallSpec(bt, 20 * bt), 21);
  ASSERT_TRUE(m.Extend(1, 2 * bt + 8).ok());  // 2 full blocks and 8 rows
  const std::vector<int32_t> parent(m.kv().BlockTable(1).begin(), m.kv().BlockTable(1).end());
  ASSERT_TRUE(m.kv().Fork(1, 2, 2 * bt + 8).ok());
  m.MirrorFork(1, 2, 2 * bt + 8);
  const std::span<const int32_t> child = m.kv().BlockTable(2);
  ASSERT_EQ(child.size(), 3u);
  EXPECT_EQ(child[0], parent[0]);
  EXPECT_EQ(child[1], parent[1]);
  EXPECT_NE(child[2], parent[2]);
  EXPECT_EQ(m.kv().refcount(parent[0]), 2);
  EXPECT_EQ(m.kv().refcount(parent[2]), 1);
  KvUsage u = m.kv().usage();
  EXPECT_EQ(u.blocks_shared, 2);
  EXPECT_EQ(u.blocks_used, 4);
  EXPECT_EQ(u.tokens_held, 2 * (2 * bt + 8));
  m.Verify(2);

  // Both continue on their own rows; neither sees the other's.
  ASSERT_TRUE(m.Extend(2, 20).ok());
  ASSERT_TRUE(m.Extend(1, 5).ok());
  m.Verify(1);
  m.Verify(2);

  m.kv().Release(1);
  m.MirrorRelease(1);
  EXPECT_EQ(m.kv().usage().blocks_shared, 0);
  EXPECT_EQ(m.kv().refcount(parent[0]), 1);
  m.Verify(2);
  m.kv().Release(2);
  EXPECT_EQ(m.kv().free_blocks(), 20);
}

TEST(KvCache, ForkAtABlockBoundaryCopiesNothing) {
  const int bt = 16;
  Mirror m(SmallSpec(bt, 4 * bt), 22);
  ASSERT_TRUE(m.Extend(1, 4 * bt).ok());  // the pool is full
  ASSERT_TRUE(m.kv().Fork(1, 2, 2 * bt).ok());
  m.MirrorFork(1, 2, 2 * bt);
  EXPECT_EQ(m.kv().free_blocks(), 0);
  EXPECT_EQ(m.kv().usage().blocks_shared, 2);
  m.Verify(2);
  // A partial prefix needs a block the pool does not have: refused, nothing changed.
  absl::Status st = m.kv().Fork(1, 3, 2 * bt + 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_FALSE(m.kv().Contains(3));
  EXPECT_EQ(m.kv().usage().blocks_shared, 2);
  // Fork of nothing, and the argument errors.
  ASSERT_TRUE(m.kv().Fork(1, 4, 0).ok());
  EXPECT_TRUE(m.kv().BlockTable(4).empty());
  EXPECT_EQ(m.kv().Fork(1, 2, 1).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m.kv().Fork(99, 5, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Fork(1, 5, 4 * bt + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Fork(1, 5, -1).code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvCache, SharedBlocksAreNeverWritten) {
  const int bt = 16;
  Mirror m(SmallSpec(bt, 10 * bt), 23);
  ASSERT_TRUE(m.Extend(1, 3 * bt).ok());
  ASSERT_TRUE(m.kv().Fork(1, 2, 2 * bt).ok());
  m.MirrorFork(1, 2, 2 * bt);
  // Overwriting rows the child shares with its parent is refused.
  std::vector<float> k = m.Random(4), v = m.Random(4);
  KvCache::Rows rows[] = {{2, 3, 4, k.data(), v.data()}};
  absl::Status st = m.kv().Write(0, rows);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Mentions(st, "shared by 2"));

  // Truncated into its shared prefix, the child's last block is partial and shared: the next
  // Reserve copies it (one block more), so the new rows never reach the parent.
  ASSERT_TRUE(m.kv().Truncate(2, bt + 5).ok());
  m.MirrorTruncate(2, bt + 5);
  const int32_t shared = m.kv().BlockTable(2)[1];
  EXPECT_EQ(m.kv().BlocksNeeded(2, bt + 9), 1);
  const int64_t free_before = m.kv().free_blocks();
  ASSERT_TRUE(m.Extend(2, 4).ok());
  EXPECT_EQ(m.kv().free_blocks(), free_before - 1);
  EXPECT_NE(m.kv().BlockTable(2)[1], shared);
  EXPECT_EQ(m.kv().BlockTable(2)[0], m.kv().BlockTable(1)[0]);
  EXPECT_EQ(m.kv().refcount(shared), 1);
  m.Verify(1);
  m.Verify(2);
}

TEST(KvCache, BadCallsAreRefusedBeforeAnyCopy) {
  Mirror m(SmallSpec(16, 10 * 16), 31);
  ASSERT_TRUE(m.Extend(1, 20).ok());
  ASSERT_TRUE(m.kv().Reserve(2, 30).ok());
  std::vector<float> k(64 * 16, kNaN), v(64 * 16, kNaN), out(64 * 16, kNaN);
  const auto code = [&](bool write, int layer, KvCache::Rows bad) {
    // A good entry first: it must not be copied either.
    KvCache::Rows rows[] = {{1, 0, 4, out.data(), out.data()}, bad};
    return (write ? m.kv().Write(layer, rows) : m.kv().Read(layer, rows)).code();
  };
  using absl::StatusCode;
  EXPECT_EQ(code(false, 0, {7, 0, 1, k.data(), v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, 3, {1, 0, 1, k.data(), v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, -1, {1, 0, 1, k.data(), v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, 0, {1, -1, 1, k.data(), v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, 0, {1, 0, -1, k.data(), v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, 0, {1, 0, 1, nullptr, v.data()}), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(false, 0, {1, 15, 6, k.data(), v.data()}), StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(false, 0, {2, 0, 1, k.data(), v.data()}), StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(true, 0, {2, 25, 6, k.data(), v.data()}), StatusCode::kFailedPrecondition);
  EXPECT_EQ(code(false, 0, {1, 0, std::numeric_limits<int64_t>::max(), k.data(), v.data()}),
            StatusCode::kFailedPrecondition);
  for (float f : out) ASSERT_TRUE(std::isnan(f)) << "a refused call copied rows";
  // Rows within the reserved tokens may be written before they are appended.
  KvCache::Rows ahead[] = {{2, 0, 30, k.data(), v.data()}};
  EXPECT_TRUE(m.kv().Write(0, ahead).ok());
  EXPECT_EQ(m.kv().Append(7, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Append(1, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv().Reserve(1, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.kv().Write(0, {}).ok());
  m.Verify(1);
}

TEST(KvCache, UsageFigures) {
  const KvCacheSpec spec = SmallSpec(16, 10 * 16);
  Mirror m(spec, 41);
  const int64_t per_block = 2 * spec.num_layers * spec.block_bytes();
  EXPECT_EQ(spec.row_bytes(), 2 * 8 * 4);
  EXPECT_EQ(spec.block_bytes(), 16 * 64);
  EXPECT_EQ(spec.bytes_per_token(), 2 * 3 * 64);
  KvUsage u = m.kv().usage();
  EXPECT_EQ(u.blocks_total, 10);
  EXPECT_EQ(u.bytes_total, 10 * per_block);
  EXPECT_EQ(u.usage_ratio(), 0.0);
  ASSERT_TRUE(m.Extend(1, 17).ok());
  ASSERT_TRUE(m.Extend(2, 3).ok());
  ASSERT_TRUE(m.kv().Fork(1, 3, 16).ok());
  u = m.kv().usage();
  EXPECT_EQ(u.blocks_used, 3);
  EXPECT_EQ(u.blocks_shared, 1);
  EXPECT_EQ(u.tokens_held, 17 + 3 + 16);
  EXPECT_EQ(u.bytes_used, 3 * per_block);
  EXPECT_EQ(u.sequences, 3);
  EXPECT_DOUBLE_EQ(u.usage_ratio(), 0.3);
  EXPECT_FALSE(m.kv().on_device());
  EXPECT_EQ(KvUsage{}.usage_ratio(), 0.0);
}

TEST(KvCache, CapacityFromMemory) {
  const KvCacheSpec spec = SmallSpec(64, 0);
  // A block's K and V of every layer, and its bookkeeping.
  const int64_t per_block = 2 * spec.num_layers * spec.block_bytes() + HostBytesPerBlock(spec);
  auto cap = CapacityFromMemory(spec, 1.0, 10 * per_block + per_block - 1);
  ASSERT_TRUE(cap.ok()) << cap.status();
  EXPECT_EQ(*cap, 10 * 64);
  cap = CapacityFromMemory(spec, 0.5, 10 * per_block);
  ASSERT_TRUE(cap.ok());
  EXPECT_EQ(*cap, 5 * 64);
  cap = CapacityFromMemory(spec, 0.5, per_block);
  ASSERT_TRUE(cap.ok());
  EXPECT_EQ(*cap, 0);
  cap = CapacityFromMemory(spec, 1.0, std::numeric_limits<int64_t>::max());
  ASSERT_TRUE(cap.ok());
  EXPECT_EQ(*cap, int64_t{std::numeric_limits<int32_t>::max()} * 64);  // block ids are int32
  for (double bad : {0.0, -0.25, 1.0001, std::nan("")}) {
    EXPECT_EQ(CapacityFromMemory(spec, bad, per_block).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(CapacityFromMemory(spec, 0.5, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CapacityFromMemory(SmallSpec(8, 0), 0.5, 1 << 30).status().code(),
            absl::StatusCode::kInvalidArgument);

  // The pool made from that capacity fits in the fraction.
  const int64_t free_bytes = 12345 * per_block / 7;
  cap = CapacityFromMemory(spec, 0.9, free_bytes);
  ASSERT_TRUE(cap.ok());
  int64_t allocated = 0;
  KvCacheSpec sized = spec;
  sized.capacity_tokens = *cap;
  ASSERT_TRUE(KvCache::Create(sized, std::make_unique<FakeStorage>(&allocated)).ok());
  EXPECT_LE(allocated, 0.9 * free_bytes);
  // Each block also costs its host bookkeeping and one sequence's V sums (HostBytesPerBlock).
  EXPECT_GT((*cap / spec.block_tokens + 1) * per_block, 0.9 * free_bytes);
}

TEST(KvCache, BadSpecsAreRefused) {
  const auto create = [](KvCacheSpec spec) {
    return KvCache::Create(spec, MakeHostKvStorage()).status();
  };
  const KvCacheSpec good = SmallSpec(16, 64);
  ASSERT_TRUE(create(good).ok());
  EXPECT_EQ(KvCache::Create(good, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::pair<std::string, KvCacheSpec>> bad;
  const auto with = [&](std::string name, auto edit) {
    KvCacheSpec s = good;
    edit(s);
    bad.push_back({std::move(name), s});
  };
  with("block_tokens 15", [](KvCacheSpec& s) { s.block_tokens = 15; });
  with("block_tokens 257", [](KvCacheSpec& s) { s.block_tokens = 257; });
  with("layers 0", [](KvCacheSpec& s) { s.num_layers = 0; });
  with("kv_heads -1", [](KvCacheSpec& s) { s.kv_heads = -1; });
  with("head_dim 0", [](KvCacheSpec& s) { s.head_dim = 0; });
  with("capacity 0", [](KvCacheSpec& s) { s.capacity_tokens = 0; });
  with("capacity -5", [](KvCacheSpec& s) { s.capacity_tokens = -5; });
  with("dtype 7", [](KvCacheSpec& s) { s.dtype = static_cast<KvDtype>(7); });
  with("row overflows", [](KvCacheSpec& s) {
    s.kv_heads = INT_MAX;
    s.head_dim = INT_MAX;
  });
  with("block overflows", [](KvCacheSpec& s) {
    s.kv_heads = INT_MAX;
    s.head_dim = 1 << 20;
    s.num_layers = 1 << 10;
    s.block_tokens = 256;
  });
  with("pool overflows", [](KvCacheSpec& s) {
    s.num_layers = 126;
    s.kv_heads = 1 << 16;
    s.head_dim = 256;
    s.capacity_tokens = int64_t{1} << 34;  // 2^30 blocks of 2^38 bytes
  });
  with("block ids overflow int32", [](KvCacheSpec& s) { s.capacity_tokens = int64_t{1} << 40; });
  for (const auto& [name, spec] : bad) {
    const absl::Status st = create(spec);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name << ": " << st;
  }
}

// Llama-3-405B on one rank (126 layers, 8 KV heads x 128, bf16) with a 1M-token sequence: the
// sizes pass 2^31 many times over, and every figure must stay exact.
TEST(KvCache, MillionTokenSequenceOf126LayersDoesNotOverflow) {
  const KvCacheSpec spec{.num_layers = 126,
                         .kv_heads = 8,
                         .head_dim = 128,
                         .block_tokens = 64,
                         .capacity_tokens = (int64_t{1} << 20) + 100,
                         .dtype = KvDtype::kBfloat16};
  int64_t allocated = 0;
  auto kv = KvCache::Create(spec, std::make_unique<FakeStorage>(&allocated));
  ASSERT_TRUE(kv.ok()) << kv.status();
  const int64_t blocks = ((int64_t{1} << 20) + 100 + 63) / 64;
  const int64_t per_token = 2 * 126 * 8 * 128 * 2;
  EXPECT_EQ(spec.bytes_per_token(), per_token);
  EXPECT_EQ(allocated, blocks * 64 * per_token);
  EXPECT_GT(allocated, int64_t{1} << 38);
  const int64_t million = int64_t{1} << 20;
  ASSERT_TRUE((*kv)->Reserve(1, million).ok());
  ASSERT_TRUE((*kv)->Append(1, million).ok());
  EXPECT_EQ((*kv)->BlockTable(1).size(), static_cast<size_t>(million / 64));
  const KvUsage u = (*kv)->usage();
  EXPECT_EQ(u.bytes_used, million * per_token);
  EXPECT_EQ(u.bytes_total, allocated);
  EXPECT_EQ(u.tokens_held, million);
  EXPECT_EQ((*kv)->BlocksNeeded(2, million), million / 64);
  const absl::Status st = (*kv)->Reserve(2, million);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Mentions(st, absl::StrCat(million * per_token, " bytes")));
  EXPECT_EQ((*kv)->Reserve(3, std::numeric_limits<int64_t>::max()).code(),
            absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace cpfill::runtime
