// Multi-rank tests of SparQ decode (PrefillRequest::sparq) through LlamaModel on the `tiny`
// preset, CPU backend: with k >= S SparQ is dense attention, so greedy tokens equal dense decode;
// at a small k the sharded model (TP1 x CP-all, and TP2 x CP2 on 4 ranks) gives one rank's
// tokens and logits within fp32 rounding, because parallel/sparq_cp.h selects the same global
// top-k on every CP rank. Run by CTest under mpirun with 1, 2 and 4 ranks.
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "parallel/grid.h"
#include "parallel/self_communicator.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/weights.h"
#include "tests/mpi_test_main.h"
#include "tests/tiny_model.h"

namespace cpfill {
namespace {

using attention::sparq::SparqConfig;
using runtime::PrefillRequest;

struct Generation {
  std::vector<std::vector<int32_t>> tokens;  // per sequence, generated (world rank 0)
  std::vector<std::vector<float>> logits;    // per sequence, every step's logits, concatenated
  std::string error;
};

// Two prompts (the second shorter than k + l, so it stays dense) prefilled densely, then `steps`
// greedy decode steps with `sparq`; every rank feeds rank 0's tokens.
Generation Generate(runtime::LlamaModel& m, parallel::Communicator& world,
                    std::optional<SparqConfig> sparq, int steps) {
  const runtime::ModelConfig c = testing::Tiny();
  Generation g{.tokens = {{}, {}}, .logits = {{}, {}}};
  std::vector<PrefillRequest> batch = {{.tokens = testing::Prompt(90, c.vocab_size, 1), .session = "a"},
                                       {.tokens = testing::Prompt(9, c.vocab_size, 2), .session = "b"}};
  auto out = m.Prefill(batch, nullptr, nullptr);
  if (!out.ok()) return {.error = std::string(out.status().message())};
  for (int step = 0; step < steps; ++step) {
    int32_t next[2] = {(*out)[0].first_token, (*out)[1].first_token};
    if (!world.Broadcast(next, sizeof(next), 0).ok()) return {.error = "broadcast"};
    for (int s = 0; s < 2; ++s) g.tokens[s].push_back(next[s]);
    out = m.Decode({{.tokens = {next[0]}, .session = "a", .sparq = sparq},
                    {.tokens = {next[1]}, .session = "b", .sparq = sparq}},
                   step, nullptr);
    if (!out.ok()) return {.error = std::string(out.status().message())};
    for (int s = 0; s < 2; ++s) {
      g.logits[s].insert(g.logits[s].end(), (*out)[s].logits.begin(), (*out)[s].logits.end());
    }
  }
  for (const char* name : {"a", "b"}) (void)m.EndSession(name);
  return g;
}

// One rank holding everything, on world rank 0 only.
Generation OneRank(std::optional<SparqConfig> sparq, int steps) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  const runtime::ModelConfig c = testing::Tiny();
  auto w = runtime::SyntheticWeights(c, 7, 0, 1);
  if (!w.ok()) return {.error = std::string(w.status().message())};
  auto model = runtime::cpu::CreateCpuModel(c, std::move(*w), tp, cp, world, {});
  if (!model.ok()) return {.error = std::string(model.status().message())};
  return Generate(**model, world, sparq, steps);
}

// "" when the tokens are equal and (with `logit_tol` >= 0) the logits within it.
std::string Compare(const Generation& a, const Generation& b, double logit_tol) {
  if (!a.error.empty() || !b.error.empty()) return a.error + " | " + b.error;
  for (int s = 0; s < 2; ++s) {
    if (a.tokens[s] != b.tokens[s]) return "sequence " + std::to_string(s) + ": tokens differ";
    if (logit_tol < 0) continue;
    if (a.logits[s].size() != b.logits[s].size()) return "logit counts differ";
    for (size_t i = 0; i < a.logits[s].size(); ++i) {
      const double d = std::fabs(double(a.logits[s][i]) - b.logits[s][i]);
      if (!(d <= logit_tol)) {
        return "sequence " + std::to_string(s) + ": logit " + std::to_string(i) + " differs by " +
               std::to_string(d);
      }
    }
  }
  return "";
}

void CheckGrid(int tp, std::optional<SparqConfig> sparq, std::optional<SparqConfig> reference,
               double logit_tol) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = testing::Tiny();
  if (mpi.world_size() % tp != 0 || c.num_kv_heads % tp != 0) GTEST_SKIP() << "TP" << tp;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = tp});
  ASSERT_TRUE(grid.ok()) << grid.status();
  auto w = runtime::SyntheticWeights(c, 7, grid->tp_rank, tp);
  ASSERT_TRUE(w.ok()) << w.status();
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, {});
  ASSERT_TRUE(model.ok()) << model.status();
  constexpr int kSteps = 12;
  const Generation got = Generate(**model, *grid->world, sparq, kSteps);
  std::string error = got.error;
  if (grid->world_rank == 0 && error.empty()) {
    error = Compare(got, OneRank(reference, kSteps), logit_tol);
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

// k >= S (90 prompt + 12 steps): every position is selected, alpha = 1: dense attention.
TEST(SparqDecode, KAtLeastTheLengthEqualsDenseDecode) {
  CheckGrid(1, SparqConfig{.r = 4, .k = 256, .local_window = 4}, std::nullopt, -1);
}

// A small k: 1, 2 and 4 CP ranks give one rank's SparQ tokens and logits.
TEST(SparqDecode, SmallKOverCpEqualsOneRank) {
  const SparqConfig sparq{.r = 4, .k = 16, .local_window = 4};
  CheckGrid(1, sparq, sparq, 1e-3);
}

TEST(SparqDecode, SmallKOverTp2TimesCpEqualsOneRank) {
  if (testing::Mpi().world_size() < 4) GTEST_SKIP() << "TP2 x CP2 needs 4 ranks";
  const SparqConfig sparq{.r = 4, .k = 16, .local_window = 4};
  CheckGrid(2, sparq, sparq, 1e-3);
}

// SparQ at a small k is not dense: the test above would pass for a model that ignored it.
TEST(SparqDecode, SmallKDiffersFromDense) {
  if (testing::Mpi().world_size() != 1) GTEST_SKIP() << "one rank suffices";
  const Generation sparq = OneRank(SparqConfig{.r = 2, .k = 8, .local_window = 2}, 12);
  const Generation dense = OneRank(std::nullopt, 12);
  ASSERT_TRUE(sparq.error.empty() && dense.error.empty()) << sparq.error << dense.error;
  EXPECT_NE(sparq.logits[0], dense.logits[0]);
  // Sequence b's first decode step holds 10 = k + l tokens: dense, so the same logits.
  const size_t vocab = static_cast<size_t>(testing::Tiny().vocab_size);
  EXPECT_TRUE(std::equal(dense.logits[1].begin(), dense.logits[1].begin() + vocab,
                         sparq.logits[1].begin()))
      << "a sequence of at most k + l tokens stays dense";
}

}  // namespace
}  // namespace cpfill
