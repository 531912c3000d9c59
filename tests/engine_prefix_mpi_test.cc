// Multi-rank tests of the engine's prefix cache (runtime/serving/engine.h, prefix_index.h) on
// the `tiny` preset: one rank, TP1 x CP2, TP2 x CP2. Requests that share a document reuse its KV
// (cached_tokens) and each still equals a one-shot prefill on one rank, and the same engine
// without the cache to float rounding on one rank; prompts submitted together that share a prefix
// prefill it once; n greedy samples of one prompt equal one rank's generation; sessions start
// from a cached system prompt and continue their own KV; a full KV cache evicts entries first and
// every answer stays right; --no-prefix-cache reuses nothing. Run by CTest under mpirun.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/serving/engine.h"
#include "tests/engine_test_util.h"
#include "tests/mpi_test_main.h"
#include "tests/tiny_model.h"

namespace cpfill {
namespace {

using runtime::Engine;
using runtime::EngineRequest;
using runtime::EngineResult;
using testing::MakeRig;
using testing::OneRank;
using testing::Prompt;
using testing::Rig;
using testing::RunWith;
using testing::Tiny;

constexpr int kBlock = 16;

runtime::StepOptions Options(int64_t capacity_tokens) {
  runtime::StepOptions o;
  o.kv_block_tokens = kBlock;
  o.kv_capacity_tokens = capacity_tokens;
  return o;
}

std::vector<int32_t> Join(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Submits every request of `waves` (each wave together, after the one before is answered) and
// returns the answers in order.
std::vector<absl::StatusOr<EngineResult>> Ask(
    Engine& engine, const std::vector<std::vector<EngineRequest>>& waves) {
  std::vector<absl::StatusOr<EngineResult>> got;
  for (const auto& wave : waves) {
    auto replies = engine.SubmitAll(wave);
    if (!replies.ok()) {
      got.insert(got.end(), wave.size(), replies.status());
      continue;
    }
    for (auto& reply : *replies) got.push_back(reply.get());
  }
  return got;
}

// "" when every answer equals one rank's one-shot prefill of its whole tokens.
std::string CheckAll(const runtime::ModelConfig& c, const std::vector<std::vector<int32_t>>& whole,
                     const std::vector<absl::StatusOr<EngineResult>>& got) {
  OneRank reference(c);
  for (size_t i = 0; i < got.size(); ++i) {
    std::string e = got[i].ok() ? reference.Check(whole[i], *got[i]) : got[i].status().ToString();
    if (!e.empty()) return "request " + std::to_string(i) + ": " + e;
  }
  return "";
}

void ExpectAgreed(const Rig& rig, const std::string& error) {
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << rig.grid->Describe() << ": " << error;
}

// A 300-token document and twelve questions about it: the first request prefills it, the rest
// (one wave, so they share batches) fork it. On one rank the answers equal the engine without the
// cache to float rounding (1e-5).
TEST(EnginePrefix, QuestionsAboutOneDocumentReuseItsKv) {
  const runtime::ModelConfig c = Tiny();
  const std::vector<int32_t> doc = Prompt(300, c.vocab_size, 1);
  std::vector<std::vector<int32_t>> whole = {Join(doc, Prompt(9, c.vocab_size, 2))};
  std::vector<std::vector<EngineRequest>> waves = {{{.tokens = whole[0], .return_logits = true}},
                                                   {}};
  for (int q = 0; q < 12; ++q) {
    whole.push_back(Join(doc, Prompt(3 + 7 * q, c.vocab_size, 10 + q)));
    waves[1].push_back({.tokens = whole.back(), .return_logits = true});
  }
  std::vector<absl::StatusOr<EngineResult>> with, without;
  runtime::EngineStats stats;
  for (const bool cache : {true, false}) {
    Rig rig = MakeRig(c, Options(4096));
    Engine engine(*rig.model, *rig.grid->world, {.prefix_cache = cache});
    const bool root = rig.grid->world_rank == 0;
    ASSERT_TRUE(RunWith(engine, root, [&] { (cache ? with : without) = Ask(engine, waves); }).ok());
    if (cache && root) stats = engine.stats();
  }
  Rig rig = MakeRig(c, Options(4096));
  std::string error;
  if (rig.grid->world_rank == 0) {
    error = CheckAll(c, whole, with);
    for (size_t i = 1; i < with.size() && error.empty(); ++i) {
      if (with[i]->cached_tokens < 288) {
        error = "question " + std::to_string(i) + " reused " +
                std::to_string(with[i]->cached_tokens) + " tokens, not the document's 288";
      }
    }
    for (size_t i = 0; i < without.size() && error.empty(); ++i) {
      if (!without[i].ok() || without[i]->cached_tokens != 0) error = "the cache was off";
    }
    if (error.empty() && (stats.prefix_hits != 12 || stats.prefix_queries != 13 ||
                          stats.prefix_hit_tokens < 12 * 288 || stats.prefix_entries < 1)) {
      error = "stats: hits " + std::to_string(stats.prefix_hits) + " of " +
              std::to_string(stats.prefix_queries) + ", tokens " +
              std::to_string(stats.prefix_hit_tokens);
    }
    // One rank reads the cached document in place: the questions that share a batch attend to
    // it as one root (prefix-batched prefill).
    if (error.empty() && rig.grid->world->size() == 1 && stats.prefix_batched_key_rows == 0) {
      error = "no prefill batch read the document once for several questions";
    }
    // One rank: the same rows through the same kernels; only OpenBLAS's sgemm rounds a row by
    // where it falls in its M blocking (a batch of other sizes does that too), at float ulps.
    for (size_t i = 0; i < with.size() && error.empty() && rig.grid->world->size() == 1; ++i) {
      const std::vector<float>& a = with[i]->logits;
      const std::vector<float>& b = without[i]->logits;
      for (size_t j = 0; j < a.size() && error.empty(); ++j) {
        if (!(std::fabs(a[j] - b[j]) <= 1e-5f)) {
          error = "question " + std::to_string(i) + ": logit " + std::to_string(j) + " is " +
                  std::to_string(a[j]) + " with the cache, " + std::to_string(b[j]) + " without";
        }
      }
    }
  }
  ExpectAgreed(rig, error);
}

// With batch-invariant GEMMs (StepOptions::batch_invariant) on one rank, a question after the
// cached document gives the logits of the same prompt prefilled whole, bit for bit, and so do
// greedy generations decoded beside other sequences.
TEST(EnginePrefix, BatchInvariantReuseIsBitExactOnOneRank) {
  if (testing::Mpi().world_size() != 1) GTEST_SKIP() << "bit-exact on one rank only";
  const runtime::ModelConfig c = Tiny();
  const std::vector<int32_t> doc = Prompt(300, c.vocab_size, 1);
  std::vector<std::vector<EngineRequest>> waves = {
      {{.tokens = Join(doc, Prompt(9, c.vocab_size, 2)), .max_tokens = 3, .return_logits = true}},
      {}};
  for (int q = 0; q < 4; ++q) {
    waves[1].push_back({.tokens = Join(doc, Prompt(3 + 7 * q, c.vocab_size, 10 + q)),
                        .max_tokens = 3,
                        .return_logits = true});
  }
  std::vector<absl::StatusOr<EngineResult>> with, without;
  runtime::StepOptions options = Options(4096);
  options.batch_invariant = true;
  for (const bool cache : {true, false}) {
    Rig rig = MakeRig(c, options);
    Engine engine(*rig.model, *rig.grid->world, {.prefix_cache = cache});
    ASSERT_TRUE(RunWith(engine, true, [&] { (cache ? with : without) = Ask(engine, waves); }).ok());
  }
  for (size_t i = 0; i < with.size(); ++i) {
    ASSERT_TRUE(with[i].ok() && without[i].ok()) << "request " << i;
    EXPECT_EQ(with[i]->cached_tokens > 0, i > 0) << "request " << i;
    EXPECT_EQ(without[i]->cached_tokens, 0) << "request " << i;
    const std::vector<float>& a = with[i]->logits;
    const std::vector<float>& b = without[i]->logits;
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
        << "request " << i << ": the first token's logits differ";
    EXPECT_EQ(with[i]->token_ids(), without[i]->token_ids()) << "request " << i;
  }
}

// Prompts submitted together that share a prefix the cache does not hold: the first prefills
// it, the others wait one batch and fork it. Four greedy samples of one prompt each generate what
// one rank generates.
TEST(EnginePrefix, ABatchSharingAPrefixPrefillsItOnce) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, Options(4096));
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const std::vector<int32_t> system = Prompt(100, c.vocab_size, 3),
                             sampled = Prompt(70, c.vocab_size, 4);
  std::vector<std::vector<int32_t>> whole;
  std::vector<EngineRequest> wave;
  for (int i = 0; i < 5; ++i) {
    whole.push_back(Join(system, Prompt(5 + i, c.vocab_size, 20 + i)));
    wave.push_back({.tokens = whole.back(), .return_logits = true});
  }
  for (int i = 0; i < 4; ++i) {
    whole.push_back(sampled);
    wave.push_back({.tokens = sampled, .max_tokens = 6, .ignore_eos = true, .return_logits = true});
  }
  std::vector<absl::StatusOr<EngineResult>> got;
  ASSERT_TRUE(RunWith(engine, root, [&] { got = Ask(engine, {wave}); }).ok());
  std::string error;
  if (root) {
    error = CheckAll(c, whole, got);
    const std::vector<int64_t> want_cached = {0, 100, 100, 100, 100, 0, 69, 69, 69};
    for (size_t i = 0; i < got.size() && error.empty(); ++i) {
      if (got[i]->cached_tokens != want_cached[i]) {
        error = "request " + std::to_string(i) + " reused " +
                std::to_string(got[i]->cached_tokens) + ", want " + std::to_string(want_cached[i]);
      }
    }
    const std::vector<int32_t> greedy = OneRank(c).Greedy(sampled, 6);
    for (size_t i = 5; i < got.size() && error.empty(); ++i) {
      if (got[i]->token_ids() != greedy) error = "sample " + std::to_string(i) + " differs";
    }
  }
  ExpectAgreed(rig, error);
}

// Two chat sessions whose first turns start with a system prompt that a request without a session
// left in the cache: each first turn forks it (into the session's own KV), and each second turn
// continues that KV; every answer equals one rank's prefill of the whole conversation.
TEST(EnginePrefix, SessionsStartFromACachedSystemPrompt) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, Options(4096));
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const std::vector<int32_t> system = Prompt(130, c.vocab_size, 7);
  std::vector<std::vector<int32_t>> whole = {Join(system, Prompt(4, c.vocab_size, 8))};
  std::vector<std::vector<EngineRequest>> waves = {{{.tokens = whole[0], .return_logits = true}}};
  for (const char* name : {"a", "b"}) {
    const std::vector<int32_t> turn1 = Join(system, Prompt(11, c.vocab_size, name[0])),
                               turn2 = Prompt(6, c.vocab_size, name[0] + 1);
    whole.push_back(turn1);
    whole.push_back(Join(turn1, turn2));
    waves.push_back({{.tokens = turn1, .session = name, .return_logits = true}});
    waves.push_back({{.tokens = turn2, .session = name, .return_logits = true}});
  }
  std::vector<absl::StatusOr<EngineResult>> got;
  ASSERT_TRUE(RunWith(engine, root, [&] { got = Ask(engine, waves); }).ok());
  std::string error;
  if (root) {
    error = CheckAll(c, whole, got);
    for (size_t i : {1, 3}) {  // first turns: the system prompt from the cache
      if (error.empty() && got[i]->cached_tokens < 128) {
        error = "first turn " + std::to_string(i) + " reused " +
                std::to_string(got[i]->cached_tokens) + " tokens";
      }
    }
    for (size_t i : {2, 4}) {  // second turns: the session's own KV
      if (error.empty() && got[i]->cached_tokens != static_cast<int64_t>(whole[i - 1].size())) {
        error = "second turn " + std::to_string(i) + " reused " +
                std::to_string(got[i]->cached_tokens) + " tokens";
      }
    }
  }
  ExpectAgreed(rig, error);
}

// A cache that holds about two documents: kept prompts fill it, later ones evict the least
// recently used entries, a session's turn after them still finds its own KV, and every answer
// equals one rank's.
TEST(EnginePrefix, AFullCacheEvictsEntriesFirst) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, Options(192));
  const int cp = rig.grid->cp_size;
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const std::vector<int32_t> chat1 = Prompt(40 * cp, c.vocab_size, 5),
                             chat2 = Prompt(9, c.vocab_size, 6);
  std::vector<std::vector<int32_t>> whole = {chat1};
  std::vector<std::vector<EngineRequest>> waves = {
      {{.tokens = chat1, .session = "chat", .return_logits = true}}};
  for (int d = 0; d < 6; ++d) {
    whole.push_back(Prompt(120 * cp, c.vocab_size, 30 + d));
    waves.push_back({{.tokens = whole.back(), .return_logits = true}});
  }
  whole.push_back(Join(chat1, chat2));
  waves.push_back({{.tokens = chat2, .session = "chat", .return_logits = true}});
  std::vector<absl::StatusOr<EngineResult>> got;
  ASSERT_TRUE(RunWith(engine, root, [&] { got = Ask(engine, waves); }).ok());
  std::string error;
  if (root) {
    error = CheckAll(c, whole, got);
    const runtime::EngineStats s = engine.stats();
    if (error.empty() && s.prefix_evictions < 3) error = "entries were not evicted";
    if (error.empty() && (got.back()->recomputed || got.back()->cached_tokens != 40 * cp)) {
      error = "the session lost its KV to the prefix cache";
    }
  }
  ExpectAgreed(rig, error);
}

}  // namespace
}  // namespace cpfill
