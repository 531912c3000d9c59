// Multi-rank tests of the engine (runtime/serving/engine.h) on the `tiny` preset, TP2 x CP2 on 4
// ranks (TP1 x CP-all elsewhere): requests from 8 concurrent client threads on rank 0 — plain
// prompts, 3-turn sessions, bad ones — each equal to a one-shot prefill of the same tokens on one
// rank (a session turn to one prefill of the whole conversation so far); bad requests refused
// alone; sessions evicted when the KV cache is full and recomputed on their next turn; a shutdown
// that drains the queue. Run by CTest under mpirun.
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/grid.h"
#include "parallel/self_communicator.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/weights.h"
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

struct Asked {
  std::vector<int32_t> whole;  // what a one-shot prefill must see (a session: every turn so far)
  absl::StatusOr<EngineResult> result = absl::UnknownError("not answered");
  bool cached_expected = false;
};

TEST(Engine, ConcurrentClientsEqualOneShotPrefill) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {.max_batch_tokens = 600});
  const bool root = rig.grid->world_rank == 0;
  constexpr int kClients = 8;
  std::vector<std::vector<Asked>> asked(kClients);
  std::vector<int> refused(kClients, 0);
  auto clients = [&] {
    std::vector<std::thread> threads;
    for (int k = 0; k < kClients; ++k) {
      threads.emplace_back([&, k] {
        // Bad requests first: refused at once, nothing queued.
        if (!engine.Submit({.tokens = {}}).ok()) ++refused[k];
        if (!engine.Submit({.tokens = {1, c.vocab_size}}).ok()) ++refused[k];
        if (!engine.Submit({.tokens = Prompt(601, c.vocab_size, 1)}).ok()) ++refused[k];
        // Three plain prompts and a 3-turn session, interleaved; sessions wait for each turn.
        std::vector<int32_t> conversation;
        const std::string session = "client-" + std::to_string(k);
        for (int turn = 0; turn < 3; ++turn) {
          const auto plain = Prompt(1 + (k * 37 + turn * 91) % 250, c.vocab_size, 100 * k + turn);
          auto plain_reply = engine.Submit({.tokens = plain, .return_logits = true});
          const auto said = Prompt(5 + (k + turn) * 13, c.vocab_size, 1000 * k + turn);
          conversation.insert(conversation.end(), said.begin(), said.end());
          auto turn_reply =
              engine.Submit({.tokens = said, .session = session, .return_logits = true});
          Asked& p = asked[k].emplace_back(Asked{.whole = plain});
          p.result = plain_reply.ok() ? plain_reply->get() : plain_reply.status();
          Asked& t =
              asked[k].emplace_back(Asked{.whole = conversation, .cached_expected = turn > 0});
          t.result = turn_reply.ok() ? turn_reply->get() : turn_reply.status();
        }
      });
    }
    for (auto& t : threads) t.join();
  };
  ASSERT_TRUE(RunWith(engine, root, clients).ok());
  std::string error;
  if (root) {
    OneRank reference(c);
    for (int k = 0; k < kClients && error.empty(); ++k) {
      if (refused[k] != 3) error = "client " + std::to_string(k) + ": bad requests not refused";
      for (size_t i = 0; i < asked[k].size() && error.empty(); ++i) {
        const Asked& a = asked[k][i];
        if (!a.result.ok()) {
          error = a.result.status().ToString();
        } else if (a.cached_expected != (a.result->cached_tokens > 0)) {
          error = "cached tokens " + std::to_string(a.result->cached_tokens);
        } else {
          error = reference.Check(a.whole, *a.result);
        }
        if (!error.empty())
          error = "client " + std::to_string(k) + " request " + std::to_string(i) + ": " + error;
      }
    }
    const runtime::EngineStats s = engine.stats();
    if (error.empty() &&
        (s.requests_ok != kClients * 6 || s.requests_failed != 0 || s.waiting != 0)) {
      error = "stats: ok " + std::to_string(s.requests_ok) + ", failed " +
              std::to_string(s.requests_failed);
    }
    if (error.empty() && s.batches >= s.requests_ok) error = "no request was batched with another";
  }
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

TEST(Engine, FullCacheEvictsTheIdleSessionAndRecomputesItLater) {
  const runtime::ModelConfig c = Tiny();
  runtime::StepOptions options;
  options.kv_capacity_tokens = 160;  // per rank: one 200-token conversation, not two
  options.kv_block_tokens = 16;
  Rig rig = MakeRig(c, options);
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const int cp = rig.grid->cp_size;
  const auto a1 = Prompt(100 * cp, c.vocab_size, 1), b1 = Prompt(100 * cp, c.vocab_size, 2);
  const auto a2 = Prompt(7, c.vocab_size, 3);
  std::vector<absl::StatusOr<EngineResult>> got;
  absl::Status too_big = absl::OkStatus();
  auto clients = [&] {
    for (const auto& [tokens, session] :
         {std::pair{a1, "a"}, std::pair{b1, "b"}, std::pair{a2, "a"}}) {
      auto reply = engine.Submit({.tokens = tokens, .session = session, .return_logits = true});
      got.push_back(reply.ok() ? reply->get() : reply.status());
    }
    // Larger than the whole cache: refused on its own, after evicting what could be evicted.
    auto reply =
        engine.Submit({.tokens = Prompt(400 * cp, c.vocab_size, 4), .return_logits = true});
    too_big = reply.ok() ? reply->get().status() : reply.status();
  };
  ASSERT_TRUE(RunWith(engine, root, clients).ok());
  std::string error;
  if (root) {
    OneRank reference(c);
    std::vector<int32_t> a_whole = a1;
    a_whole.insert(a_whole.end(), a2.begin(), a2.end());
    const std::vector<std::vector<int32_t>> want = {a1, b1, a_whole};
    for (size_t i = 0; i < got.size() && error.empty(); ++i) {
      error = got[i].ok() ? reference.Check(want[i], *got[i]) : got[i].status().ToString();
    }
    if (error.empty() && !(got[2]->recomputed && got[2]->cached_tokens == 0)) {
      error = "the evicted session's turn was not recomputed";
    }
    if (error.empty() && !absl::IsResourceExhausted(too_big))
      error = "too big: " + too_big.ToString();
    if (error.empty() && engine.stats().evictions < 2) error = "fewer than two evictions";
  }
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

TEST(Engine, PromptsSubmittedTogetherShareOneBatchOrAreRefusedTogether) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {.max_queue = 4});
  const bool root = rig.grid->world_rank == 0;
  const std::vector<std::vector<int32_t>> prompts = {
      Prompt(40, c.vocab_size, 1), Prompt(9, c.vocab_size, 2), Prompt(77, c.vocab_size, 3)};
  std::vector<absl::StatusOr<EngineResult>> got;
  absl::Status one_bad = absl::OkStatus(), too_many = absl::OkStatus();
  auto clients = [&] {
    std::vector<EngineRequest> batch;
    for (const auto& p : prompts) batch.push_back({.tokens = p, .return_logits = true});
    auto replies = engine.SubmitAll(batch);
    if (replies.ok()) {
      for (auto& r : *replies) got.push_back(r.get());
    }
    batch[1].tokens = {1, c.vocab_size};  // one bad prompt refuses them all
    one_bad = engine.SubmitAll(batch).status();
    batch[1].tokens = prompts[1];
    const std::vector<EngineRequest> first_two(batch.begin(), batch.begin() + 2);
    batch.insert(batch.end(), first_two.begin(), first_two.end());  // 5 > max_queue
    too_many = engine.SubmitAll(batch).status();
  };
  ASSERT_TRUE(RunWith(engine, root, clients).ok());
  std::string error;
  if (root) {
    OneRank reference(c);
    if (got.size() != prompts.size()) error = "not every prompt was answered";
    for (size_t i = 0; i < got.size() && error.empty(); ++i) {
      error = got[i].ok() ? reference.Check(prompts[i], *got[i]) : got[i].status().ToString();
      if (error.empty() && got[i]->batch_requests != 3) {
        error = "prompt " + std::to_string(i) + " ran in a batch of " +
                std::to_string(got[i]->batch_requests);
      }
    }
    if (error.empty() && !absl::IsInvalidArgument(one_bad))
      error = "one bad: " + one_bad.ToString();
    if (error.empty() && !absl::IsUnavailable(too_many)) error = "too many: " + too_many.ToString();
    if (error.empty() && engine.stats().requests_ok != 3) error = "a refused prompt ran";
  }
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

TEST(Engine, EndSessionAndShutdownDrainTheQueue) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {.max_batch_tokens = 64});
  const bool root = rig.grid->world_rank == 0;
  std::vector<Engine::Reply> replies;
  absl::Status ended = absl::UnknownError(""), unknown = absl::OkStatus(), late = absl::OkStatus();
  auto clients = [&] {
    for (int i = 0; i < 20; ++i) {
      auto r =
          engine.Submit({.tokens = Prompt(30 + i, c.vocab_size, i), .session = i < 2 ? "s" : ""});
      if (r.ok()) replies.push_back(std::move(*r));
    }
    ended = engine.EndSession("s").get();
    unknown = engine.EndSession("nobody").get();
    engine.Shutdown();
    late = engine.Submit({.tokens = {1}}).status();
  };
  std::thread driver;
  if (root) driver = std::thread(clients);
  ASSERT_TRUE(engine.Run().ok());
  if (driver.joinable()) driver.join();
  std::string error;
  if (root) {
    for (auto& r : replies) {
      if (auto v = r.get(); !v.ok()) error = v.status().ToString();
    }
    if (replies.size() != 20) error = "not every request was queued";
    if (!ended.ok()) error = "EndSession: " + ended.ToString();
    if (!absl::IsNotFound(unknown)) error = "unknown session: " + unknown.ToString();
    if (!absl::IsFailedPrecondition(late)) error = "after shutdown: " + late.ToString();
    if (engine.stats().sessions != 0) error = "the session is still held";
  }
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

}  // namespace
}  // namespace cpfill
