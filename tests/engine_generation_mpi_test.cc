// Multi-rank tests of generation in the engine (runtime/serving/engine.h) on the `tiny` preset, TP2
// x CP2 on 4 ranks (TP1 x CP-all elsewhere): greedy generations from concurrent clients,
// interleaved with prefill-only requests, each equal to one rank's greedy generation by whole
// prefills; a session whose second turn continues after the generated tokens; stop ids and
// streaming; seeded sampling that repeats; a KV cache too small for every generation at once
// (preemption and recompute, results unchanged); max_running.
#include <string>
#include <thread>
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
using runtime::GeneratedToken;
using testing::MakeRig;
using testing::OneRank;
using testing::Prompt;
using testing::Rig;
using testing::RunWith;
using testing::Tiny;

std::string Show(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// Every rank agrees on rank 0's verdict.
void Agree(const Rig& rig, const std::string& error) {
  auto agreed = parallel::AllRanksOk(*rig.grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

struct Job {
  std::vector<int32_t> prompt;
  int max_tokens;
  absl::StatusOr<EngineResult> result = absl::UnknownError("not answered");
};

// Runs `jobs` from `clients` threads against `engine` on rank 0; checks each against one rank's
// greedy generation. "" when all equal.
std::string RunGreedy(Engine& engine, const Rig& rig, std::vector<Job>& jobs, int clients) {
  const bool root = rig.grid->world_rank == 0;
  auto run = [&] {
    std::vector<std::thread> threads;
    for (int k = 0; k < clients; ++k) {
      threads.emplace_back([&, k] {
        for (size_t j = k; j < jobs.size(); j += clients) {
          auto reply = engine.Submit({.tokens = jobs[j].prompt, .max_tokens = jobs[j].max_tokens});
          jobs[j].result = reply.ok() ? reply->get() : reply.status();
        }
      });
    }
    for (auto& t : threads) t.join();
  };
  if (!RunWith(engine, root, run).ok()) return "the loop failed";
  if (!root) return "";
  OneRank reference(testing::Tiny());
  for (size_t j = 0; j < jobs.size(); ++j) {
    const Job& job = jobs[j];
    if (!job.result.ok()) return "job " + std::to_string(j) + ": " + job.result.status().ToString();
    const std::vector<int32_t> want = reference.Greedy(job.prompt, job.max_tokens);
    if (job.result->token_ids() != want) {
      return "job " + std::to_string(j) + ": generated " + Show(job.result->token_ids()) +
             ", want " + Show(want);
    }
    if (job.result->finish_reason != "length") return "finish reason " + job.result->finish_reason;
  }
  return "";
}

TEST(EngineGeneration, GreedyFromConcurrentClientsEqualsOneRank) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {.max_batch_tokens = 512});
  std::vector<Job> jobs;
  for (int j = 0; j < 12; ++j) {
    jobs.push_back({Prompt(3 + 29 * j, c.vocab_size, j), j % 3 == 0 ? 1 : 2 + j % 7});
  }
  const std::string error = RunGreedy(engine, rig, jobs, 4);
  std::string stats;
  if (error.empty() && rig.grid->world_rank == 0) {
    const runtime::EngineStats s = engine.stats();
    if (s.requests_ok != 12 || s.running != 0 || s.decode_steps == 0) stats = "stats wrong";
    if (s.generation_tokens < 12) stats = "generation tokens not counted";
  }
  Agree(rig, error + stats);
}

TEST(EngineGeneration, SessionTurnContinuesAfterTheGeneratedTokens) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const auto a = Prompt(41, c.vocab_size, 1), b = Prompt(6, c.vocab_size, 2);
  absl::StatusOr<EngineResult> t1 = absl::UnknownError(""), t2 = t1, t3 = t1;
  ASSERT_TRUE(RunWith(engine, root, [&] {
                t1 = engine.Submit({.tokens = a, .session = "s", .max_tokens = 5})->get();
                t2 = engine.Submit({.tokens = b, .session = "s", .max_tokens = 4})->get();
                t3 = engine.Submit({.tokens = b, .session = "s", .return_logits = true})
                         ->get();  // prefill only: no token kept
              }).ok());
  std::string error;
  if (root) {
    OneRank reference(c);
    if (!t1.ok() || !t2.ok() || !t3.ok()) {
      error = "a turn failed";
    } else {
      std::vector<int32_t> whole = a;
      const auto g1 = reference.Greedy(whole, 5);
      whole.insert(whole.end(), g1.begin(), g1.end());
      whole.insert(whole.end(), b.begin(), b.end());
      const auto g2 = reference.Greedy(whole, 4);
      if (t1->token_ids() != g1) error = "turn 1: " + Show(t1->token_ids()) + "want " + Show(g1);
      if (t2->token_ids() != g2) error = "turn 2: " + Show(t2->token_ids()) + "want " + Show(g2);
      // Turn 2 reused all but turn 1's last token (whose KV was written with turn 2).
      if (t2->cached_tokens != 41 + 5 - 1)
        error = "turn 2 cached " + std::to_string(t2->cached_tokens);
      whole.insert(whole.end(), g2.begin(), g2.end());
      whole.insert(whole.end(), b.begin(), b.end());
      if (error.empty()) error = reference.Check(whole, *t3);
    }
  }
  Agree(rig, error);
}

TEST(EngineGeneration, StopIdsStreamingAndSeededSampling) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  const auto prompt = Prompt(23, c.vocab_size, 5);
  absl::StatusOr<EngineResult> greedy = absl::UnknownError(""), stopped = greedy, s1 = greedy,
                               s2 = greedy, s3 = greedy;
  std::vector<GeneratedToken> streamed;
  ASSERT_TRUE(RunWith(engine, root, [&] {
                greedy = engine.Submit({.tokens = prompt, .max_tokens = 8})->get();
                if (!greedy.ok()) return;
                EngineRequest stop{
                    .tokens = prompt, .max_tokens = 8, .stop_ids = {greedy->tokens[3].id}};
                stop.on_token = [&](const GeneratedToken& t) { streamed.push_back(t); };
                stopped = engine.Submit(stop)->get();
                const runtime::SamplingParams hot{.temperature = 1.5, .top_p = 0.95, .seed = 77};
                s1 = engine.Submit({.tokens = prompt, .max_tokens = 12, .sampling = hot})->get();
                s2 = engine.Submit({.tokens = prompt, .max_tokens = 12, .sampling = hot})->get();
                auto other = hot;
                other.seed = 78;
                s3 = engine.Submit({.tokens = prompt, .max_tokens = 12, .sampling = other})->get();
              }).ok());
  std::string error;
  if (root) {
    if (!greedy.ok() || !stopped.ok() || !s1.ok() || !s2.ok() || !s3.ok()) {
      error = "a request failed";
    } else {
      const auto g = greedy->token_ids();
      // The stop id may occur before index 3; generation ends at its first occurrence.
      const size_t first = std::find(g.begin(), g.end(), g[3]) - g.begin();
      const std::vector<int32_t> want(g.begin(), g.begin() + first + 1);
      if (stopped->token_ids() != want || stopped->finish_reason != "stop") {
        error = "stop: " + Show(stopped->token_ids()) + stopped->finish_reason;
      }
      if (streamed.size() != want.size()) error = "streamed " + std::to_string(streamed.size());
      for (size_t i = 0; i < streamed.size() && error.empty(); ++i) {
        if (streamed[i].index != int(i) || streamed[i].token.id != want[i] ||
            (streamed[i].finish_reason == "stop") != (i + 1 == want.size())) {
          error = "stream token " + std::to_string(i) + " wrong";
        }
      }
      if (s1->token_ids() != s2->token_ids())
        error = "the same seed gave " + Show(s1->token_ids()) + "and " + Show(s2->token_ids());
      if (s1->token_ids() == s3->token_ids()) error = "another seed gave the same 12 tokens";
    }
  }
  Agree(rig, error);
}

TEST(EngineGeneration, FullKvCachePreemptsAndRecomputesWithTheSameResults) {
  const runtime::ModelConfig c = Tiny();
  runtime::StepOptions options;
  options.kv_capacity_tokens = 64;  // per rank: not every generation's KV at once
  options.kv_block_tokens = 16;
  Rig rig = MakeRig(c, options);
  Engine engine(*rig.model, *rig.grid->world, {.max_running = 3});
  std::vector<Job> jobs;
  for (int j = 0; j < 6; ++j) jobs.push_back({Prompt(20 + 4 * j, c.vocab_size, 40 + j), 30});
  const std::string error = RunGreedy(engine, rig, jobs, 6);
  std::string stats;
  if (error.empty() && rig.grid->world_rank == 0 && engine.stats().preemptions == 0) {
    stats = "nothing was preempted: the test does not test preemption";
  }
  Agree(rig, error + stats);
}

TEST(EngineGeneration, BadGenerationRequestsAreRefusedAtOnce) {
  const runtime::ModelConfig c = Tiny();
  Rig rig = MakeRig(c, {});
  Engine engine(*rig.model, *rig.grid->world, {});
  const bool root = rig.grid->world_rank == 0;
  std::vector<absl::Status> got;
  ASSERT_TRUE(
      RunWith(engine, root, [&] {
        const auto p = Prompt(10, c.vocab_size, 1);
        got.push_back(engine.Submit({.tokens = p, .max_tokens = 0}).status());
        got.push_back(
            engine.Submit({.tokens = p, .max_tokens = static_cast<int>(c.max_position_embeddings)})
                .status());
        got.push_back(
            engine.Submit({.tokens = p, .max_tokens = 2, .sampling = {.top_p = 0}}).status());
        got.push_back(engine.Submit({.tokens = p, .max_tokens = 2, .stop_ids = {-1}}).status());
        got.push_back(engine.Submit({.tokens = p, .session = "a\nb"}).status());
      }).ok());
  std::string error;
  for (size_t i = 0; root && i < got.size(); ++i) {
    if (!absl::IsInvalidArgument(got[i]))
      error += "case " + std::to_string(i) + ": " + got[i].ToString() + "; ";
  }
  Agree(rig, error);
}

}  // namespace
}  // namespace cpfill
