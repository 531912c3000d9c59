// Multi-rank tests of whole-model prefill on the `tiny` preset: every TP x CP grid that 4 ranks
// make equals one rank; a two-turn session (partial prefill on the persistent KV cache) equals
// one full prefill of the whole prompt; a batch that does not fit the KV capacity is refused on
// every rank and changes nothing; a session's exported KV hand-off handle, pulled with memcpy,
// gives one rank's KV. Run by CTest under mpirun with 4 ranks (and 2, 3 where the grid allows).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "gtest/gtest.h"
#include "parallel/grid.h"
#include "parallel/self_communicator.h"
#include "runtime/handoff/kv_export.h"
#include "runtime/handoff/kv_handle.h"
#include "runtime/handoff/kv_pull_plan.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/model_config.h"
#include "runtime/model/sampling.h"
#include "runtime/model/weights.h"
#include "tests/forked_decode.h"
#include "tests/mpi_test_main.h"
#include "tests/tiny_model.h"

namespace cpfill {
namespace {

using runtime::PrefillRequest;

using testing::Prompt;
using testing::Tiny;

// One-rank reference on world rank 0 (SelfCommunicators), for the same batch.
std::vector<runtime::SequenceOutput> OneRank(
    const runtime::ModelConfig& c, const std::vector<std::vector<PrefillRequest>>& turns) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  auto w = runtime::SyntheticWeights(c, 7, 0, 1);
  EXPECT_TRUE(w.ok()) << w.status();
  auto model = runtime::cpu::CreateCpuModel(c, std::move(*w), tp, cp, world, {});
  EXPECT_TRUE(model.ok()) << model.status();
  std::vector<runtime::SequenceOutput> out;
  for (const auto& batch : turns) {
    auto o = (*model)->Prefill(batch, nullptr, nullptr);
    EXPECT_TRUE(o.ok()) << o.status();
    if (o.ok()) out = *o;
  }
  return out;
}

// OneRank of one batch of plain prompts (tokens only), remembered by their tokens: the fork tests
// check the prefix-batched and the per-sequence paths against the same sequences, and the
// reference, not the ranks' work, was most of their time.
std::vector<runtime::SequenceOutput> OneRankOfPrompts(const runtime::ModelConfig& c,
                                                      const std::vector<PrefillRequest>& batch) {
  static std::map<std::vector<std::vector<int32_t>>, std::vector<runtime::SequenceOutput>> known;
  std::vector<std::vector<int32_t>> key;
  for (const PrefillRequest& r : batch) {
    EXPECT_TRUE(r.session.empty()) << "OneRankOfPrompts takes plain prompts";
    key.push_back(r.tokens);
  }
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(std::move(key), OneRank(c, {batch})).first;
  return it->second;
}

// Compares on world rank 0; returns "" when equal within fp32 tolerance.
std::string Compare(const std::vector<runtime::SequenceOutput>& a,
                    const std::vector<runtime::SequenceOutput>& b) {
  if (a.size() != b.size()) return "different sequence counts";
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].first_token != b[s].first_token) {
      return "sequence " + std::to_string(s) + ": first token " + std::to_string(a[s].first_token) +
             " vs " + std::to_string(b[s].first_token);
    }
    for (size_t i = 0; i < a[s].logits.size(); ++i) {
      const double d = std::fabs(double(a[s].logits[i]) - b[s].logits[i]);
      if (!(d <= 1e-3)) {
        return "sequence " + std::to_string(s) + ": logit " + std::to_string(i) + " differs by " +
               std::to_string(d);
      }
    }
  }
  return "";
}

// The tiny model on a TP1 x CP-all grid of every rank (the grid outlives the model).
struct CpModel {
  parallel::ProcessGrid grid;
  std::unique_ptr<runtime::LlamaModel> model;
};
absl::StatusOr<CpModel> MakeCpModel(const runtime::StepOptions& options) {
  CpModel m;
  CPFILL_ASSIGN_OR_RETURN(m.grid, parallel::CreateProcessGrid(testing::Mpi(), {.tp = 1}));
  CPFILL_ASSIGN_OR_RETURN(auto w, runtime::SyntheticWeights(Tiny(), 7, 0, 1));
  CPFILL_ASSIGN_OR_RETURN(m.model,
                          runtime::cpu::CreateCpuModel(Tiny(), std::move(w), *m.grid.tp, *m.grid.cp,
                                                       *m.grid.world, options));
  return m;
}

void CheckGrid(int tp, int ranks_per_node, runtime::StepOptions options) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  if (mpi.world_size() % tp != 0 || c.num_kv_heads % tp != 0) GTEST_SKIP() << "TP" << tp;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = ranks_per_node});
  ASSERT_TRUE(grid.ok()) << grid.status();
  auto w = runtime::SyntheticWeights(c, 7, grid->tp_rank, tp);
  ASSERT_TRUE(w.ok()) << w.status();
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, options);
  ASSERT_TRUE(model.ok()) << model.status();
  // Uneven prompts: one that does not divide by 2N, one of a single token.
  const std::vector<PrefillRequest> batch = {{.tokens = Prompt(301, c.vocab_size, 1)},
                                             {.tokens = Prompt(1, c.vocab_size, 2)},
                                             {.tokens = Prompt(64, c.vocab_size, 3)}};
  auto out = (*model)->Prefill(batch, nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  std::string error;
  if (grid->world_rank == 0) error = Compare(*out, OneRank(c, {batch}));
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << grid->Describe() << ": " << error;
}

TEST(LlamaPrefill, Tp1CpAllEqualsOneRank) { CheckGrid(1, 0, {}); }
TEST(LlamaPrefill, Tp2TimesCpEqualsOneRank) { CheckGrid(2, 2, {}); }
TEST(LlamaPrefill, TpAllCp1EqualsOneRank) {
  auto& mpi = testing::Mpi();
  if (mpi.world_size() > 4) GTEST_SKIP();
  CheckGrid(mpi.world_size(), 0, {});
}
TEST(LlamaPrefill, PassQEqualsOneRank) {
  runtime::StepOptions o;
  o.auto_algorithm = false;
  o.algorithm = parallel::RingAlgorithm::kPassQ;
  CheckGrid(1, 0, o);
}

// Tokens drawn where the logits are (PrefillRequest::draw: on the rank holding the last
// position, the TP group's vocabulary slices all-gathered) are the host's draws from the logits
// gathered to rank 0, for greedy, temperature, top-k and top-p; in a batch that mixes both, the
// requests without a draw still get their logits.
TEST(LlamaPrefill, TokensDrawnInPlaceEqualTheHostsDrawsFromTheLogits) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  const int tp = mpi.world_size() % 2 == 0 ? 2 : 1;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = tp});
  ASSERT_TRUE(grid.ok()) << grid.status();
  auto w = runtime::SyntheticWeights(c, 7, grid->tp_rank, tp);
  ASSERT_TRUE(w.ok()) << w.status();
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, {});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<runtime::SamplingParams> params = {
      {},
      {.temperature = 1.0, .seed = 3},
      {.temperature = 0.7, .top_k = 5, .seed = 4},
      {.temperature = 1.3, .top_p = 0.8, .seed = 5},
      {.temperature = 1.0, .top_k = 40, .top_p = 0.95, .seed = 6},
      {.temperature = 2.0, .top_p = 0.3, .seed = 7}};
  std::vector<PrefillRequest> plain, drawn, mixed;
  for (size_t i = 0; i < params.size(); ++i) {
    plain.push_back({.tokens = Prompt(40 + 17 * i, c.vocab_size, 50 + i)});
    drawn.push_back(plain.back());
    drawn.back().draw = runtime::TokenDraw{.params = params[i], .step = 9 + i};
    mixed.push_back(i % 2 == 0 ? drawn.back() : plain.back());
  }
  auto logits = (*model)->Prefill(plain, nullptr, nullptr);
  auto tokens = (*model)->Prefill(drawn, nullptr, nullptr);
  auto both = (*model)->Prefill(mixed, nullptr, nullptr);
  ASSERT_TRUE(logits.ok() && tokens.ok() && both.ok());
  std::string error;
  for (size_t i = 0; grid->world_rank == 0 && i < params.size() && error.empty(); ++i) {
    const int32_t want = runtime::SampleToken((*logits)[i].logits, params[i], 9 + i).id;
    const bool has_draw = i % 2 == 0;
    if ((*tokens)[i].first_token != want || !(*tokens)[i].logits.empty()) {
      error = absl::StrCat("request ", i, ": drew ", (*tokens)[i].first_token, ", the host draws ",
                           want);
    } else if (has_draw ? (*both)[i].first_token != want || !(*both)[i].logits.empty()
                        : (*both)[i].logits != (*logits)[i].logits) {
      error = absl::StrCat("request ", i, " of the mixed batch differs");
    }
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << grid->Describe() << ": " << error;
}

TEST(LlamaPrefill, TwoTurnSessionEqualsOneFullPrefill) {
  const runtime::ModelConfig c = Tiny();
  auto made = MakeCpModel({});
  ASSERT_TRUE(made.ok()) << made.status();
  const parallel::ProcessGrid* grid = &made->grid;
  std::unique_ptr<runtime::LlamaModel>* model = &made->model;
  const std::vector<int32_t> whole = Prompt(377, c.vocab_size, 9);
  const std::vector<int32_t> first(whole.begin(), whole.begin() + 300),
      second(whole.begin() + 300, whole.end());
  // Turn 1 (full prefill) and turn 2 (partial prefill of 77 tokens after 300 cached), beside a
  // sequence without a session.
  ASSERT_TRUE((*model)->Prefill({{.tokens = first, .session = "a"}}, nullptr, nullptr).ok());
  auto turn2 = (*model)->Prefill(
      {{.tokens = second, .session = "a"}, {.tokens = Prompt(40, c.vocab_size, 4)}}, nullptr,
      nullptr);
  ASSERT_TRUE(turn2.ok()) << turn2.status();
  std::string error;
  if (grid->world_rank == 0) {
    error =
        Compare(*turn2, OneRank(c, {{{.tokens = whole}, {.tokens = Prompt(40, c.vocab_size, 4)}}}));
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

// A forked session (the prefix cache's groundwork): the fork shares the parent's first tokens' KV
// blocks on every rank; its next turn, and the parent's, each equal one rank's prefill of the whole
// conversation. The fork point falls inside the parent's second turn, and inside a block.
TEST(LlamaPrefill, ForkedSessionContinuesLikeOneFullPrefill) {
  const runtime::ModelConfig c = Tiny();
  runtime::StepOptions options;
  options.kv_block_tokens = 16;
  options.kv_capacity_tokens = 2048;
  auto made = MakeCpModel(options);
  ASSERT_TRUE(made.ok()) << made.status();
  const parallel::ProcessGrid& grid = made->grid;
  runtime::LlamaModel& m = *made->model;
  const std::vector<int32_t> doc = Prompt(350, c.vocab_size, 21);
  const std::vector<int32_t> head(doc.begin(), doc.begin() + 300),
      tail(doc.begin() + 300, doc.end());
  ASSERT_TRUE(m.Prefill({{.tokens = head, .session = "doc"}}, nullptr, nullptr).ok());
  ASSERT_TRUE(m.Prefill({{.tokens = tail, .session = "doc"}}, nullptr, nullptr).ok());
  const int64_t used_before = m.kv_usage().blocks_used;
  constexpr int64_t kPrefix = 323;
  ASSERT_TRUE(m.ForkSession("doc", "q1", kPrefix).ok());
  EXPECT_GT(m.kv_usage().blocks_shared, 0);
  EXPECT_LE(m.kv_usage().blocks_used, used_before + 1);  // at most the copied partial block
  // Refusals change nothing.
  EXPECT_EQ(m.ForkSession("nope", "q2", 10).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m.ForkSession("doc", "q1", 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.ForkSession("doc", "q2", 351).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.ForkSession("doc", "q2", 0).code(), absl::StatusCode::kInvalidArgument);
  // The fork and the parent go on in one batch, beside a request without a session.
  const std::vector<int32_t> question = Prompt(41, c.vocab_size, 22),
                             more = Prompt(17, c.vocab_size, 23),
                             other = Prompt(60, c.vocab_size, 24);
  auto out = m.Prefill({{.tokens = question, .session = "q1"},
                        {.tokens = more, .session = "doc"},
                        {.tokens = other}},
                       nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  std::vector<int32_t> forked(doc.begin(), doc.begin() + kPrefix), whole = doc;
  forked.insert(forked.end(), question.begin(), question.end());
  whole.insert(whole.end(), more.begin(), more.end());
  std::string error;
  if (grid.world_rank == 0) {
    error = Compare(*out, OneRank(c, {{{.tokens = forked}, {.tokens = whole}, {.tokens = other}}}));
  }
  auto agreed = parallel::AllRanksOk(*grid.world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << grid.Describe() << ": " << error;
  // Ending the parent leaves the fork's shared blocks to the fork.
  ASSERT_TRUE(m.EndSession("doc").ok());
  ASSERT_TRUE(
      m.Prefill({{.tokens = Prompt(5, c.vocab_size, 25), .session = "q1"}}, nullptr, nullptr).ok());
  ASSERT_TRUE(m.EndSession("q1").ok());
  EXPECT_EQ(m.kv_usage().blocks_used, 0);
}

// Per-request selection: in one batch, short follow-ups after long cached contexts run pass-Q
// and new prompts pass-KV, each its own fused ring, in an order that interleaves them (the
// model groups them and gives the outputs back in request order); equal to one rank.
TEST(LlamaPrefill, MixedBatchRunsEachSequencesOwnChoice) {
  const runtime::ModelConfig c = Tiny();
  auto made = MakeCpModel({});
  ASSERT_TRUE(made.ok()) << made.status();
  const parallel::ProcessGrid* grid = &made->grid;
  std::unique_ptr<runtime::LlamaModel>* model = &made->model;
  const std::vector<int32_t> a = Prompt(402, c.vocab_size, 11), b = Prompt(301, c.vocab_size, 12);
  const auto head = [](const std::vector<int32_t>& v, size_t n) {
    return std::vector<int32_t>(v.begin(), v.begin() + n);
  };
  const auto tail = [](const std::vector<int32_t>& v, size_t n) {
    return std::vector<int32_t>(v.end() - n, v.end());
  };
  ASSERT_TRUE((*model)
                  ->Prefill({{.tokens = head(a, 400), .session = "a"},
                             {.tokens = head(b, 300), .session = "b"}},
                            nullptr, nullptr)
                  .ok());
  const std::vector<PrefillRequest> batch = {{.tokens = Prompt(200, c.vocab_size, 13)},
                                             {.tokens = tail(a, 2), .session = "a"},
                                             {.tokens = Prompt(50, c.vocab_size, 14)},
                                             {.tokens = tail(b, 1), .session = "b"}};
  runtime::StepTimings t;
  auto out = (*model)->Prefill(batch, &t, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  // The host's share of the step: its planning and enqueueing, both within the step's time.
  EXPECT_GT(t.host_plan_s, 0);
  EXPECT_GT(t.host_enqueue_s, 0);
  EXPECT_LE(t.host_plan_s + t.host_enqueue_s, t.total_s);
  using parallel::RingAlgorithm;
  ASSERT_EQ(t.selections.size(), 4u);
  if (grid->cp_size > 1) {
    // The default system (800 TFLOP/s, 50 GB/s) and Alg. 5: a full prefill's miss rate of 1 is
    // at the tiny model's 2 N_KV / N_H; 2 new tokens after 400 are far below both thresholds.
    const std::vector<RingAlgorithm> want = {RingAlgorithm::kPassKV, RingAlgorithm::kPassQ,
                                             RingAlgorithm::kPassKV, RingAlgorithm::kPassQ};
    EXPECT_EQ(t.algorithms, want);
    for (int s = 0; s < 4; ++s) EXPECT_EQ(t.selections[s].choice, want[s]) << s;
    EXPECT_EQ(t.rings, 2);
  }
  std::string error;
  if (grid->world_rank == 0) {
    error = Compare(*out, OneRank(c, {{{.tokens = Prompt(200, c.vocab_size, 13)},
                                       {.tokens = a},
                                       {.tokens = Prompt(50, c.vocab_size, 14)},
                                       {.tokens = b}}}));
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

TEST(LlamaPrefill, OverCapacityIsRefusedEverywhereAndChangesNothing) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = 1});
  ASSERT_TRUE(grid.ok());
  auto w = runtime::SyntheticWeights(c, 7, 0, 1);
  ASSERT_TRUE(w.ok());
  runtime::StepOptions options;
  options.kv_capacity_tokens = 100;  // token slots per rank
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, options);
  ASSERT_TRUE(model.ok());
  ASSERT_TRUE(
      (*model)
          ->Prefill({{.tokens = Prompt(40, c.vocab_size, 1), .session = "s"}}, nullptr, nullptr)
          .ok());
  const int64_t held = (*model)->kv_tokens_held();
  auto refused = (*model)->Prefill({{.tokens = Prompt(1000, c.vocab_size, 2), .session = "s"}},
                                   nullptr, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("capacity"), std::string::npos);
  EXPECT_EQ((*model)->kv_tokens_held(), held);  // nothing changed
  auto bad = (*model)->Prefill({{.tokens = {c.vocab_size + 5}}}, nullptr, nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  // The session still continues.
  EXPECT_TRUE(
      (*model)
          ->Prefill({{.tokens = Prompt(10, c.vocab_size, 3), .session = "s"}}, nullptr, nullptr)
          .ok());
}

// The KV cache holds blocks only for sessions: a request without one gives its blocks back, a
// session keeps them until it ends, and a refused batch leaves the figures as they were.
TEST(LlamaPrefill, KvBlocksFollowSessions) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = 1});
  ASSERT_TRUE(grid.ok());
  auto w = runtime::SyntheticWeights(c, 7, 0, 1);
  ASSERT_TRUE(w.ok());
  runtime::StepOptions options;
  options.kv_capacity_tokens = 1024;
  options.kv_block_tokens = 16;
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, options);
  ASSERT_TRUE(model.ok()) << model.status();
  runtime::LlamaModel& m = **model;
  EXPECT_EQ(m.kv_usage().blocks_total, 1024 / 16);
  ASSERT_TRUE(m.Prefill({{.tokens = Prompt(200, c.vocab_size, 1)}}, nullptr, nullptr).ok());
  EXPECT_EQ(m.kv_usage().blocks_used, 0) << "a request without a session keeps nothing";
  ASSERT_TRUE(
      m.Prefill({{.tokens = Prompt(200, c.vocab_size, 1), .session = "a"}}, nullptr, nullptr).ok());
  const runtime::KvUsage after_a = m.kv_usage();
  EXPECT_GT(after_a.blocks_used, 0);
  EXPECT_EQ(after_a.tokens_held, m.kv_tokens_held());
  // Too large for what is left: refused on every rank, nothing changes.
  auto refused =
      m.Prefill({{.tokens = Prompt(5000, c.vocab_size, 2), .session = "b"}}, nullptr, nullptr);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(m.kv_usage().blocks_used, after_a.blocks_used);
  EXPECT_EQ(m.EndSession("b").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(m.EndSession("a").ok());
  EXPECT_EQ(m.kv_usage().blocks_used, 0);
  EXPECT_EQ(m.kv_tokens_held(), 0);
}

// Decode (Alg. 4): two sessions prefilled, then greedy decode steps as one batch, each step's
// logits equal to one rank's prefill of the whole sequence so far; the new tokens' KV spreads
// over the CP ranks (no rank more than one row ahead per sequence); a decode step of an unknown
// session or of two tokens is refused and changes nothing.
TEST(LlamaModel, DecodeStepsEqualOneRankPrefillOfTheWholeSequence) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  const int tp = mpi.world_size() == 4 ? 2 : 1;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = tp});
  ASSERT_TRUE(grid.ok()) << grid.status();
  auto w = runtime::SyntheticWeights(c, 7, grid->tp_rank, tp);
  ASSERT_TRUE(w.ok());
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, {});
  ASSERT_TRUE(model.ok()) << model.status();
  runtime::LlamaModel& m = **model;
  std::vector<std::vector<int32_t>> seqs = {Prompt(37, c.vocab_size, 1),
                                            Prompt(5, c.vocab_size, 2)};
  std::vector<PrefillRequest> batch = {{.tokens = seqs[0], .session = "a"},
                                       {.tokens = seqs[1], .session = "b"}};
  auto out = m.Prefill(batch, nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  const int64_t held_before = m.kv_tokens_held();
  constexpr int kSteps = 9;
  std::string error;
  for (int step = 0; step < kSteps && error.empty(); ++step) {
    // Rank 0 has the logits; every rank must feed the same tokens.
    int32_t next[2] = {(*out)[0].first_token, (*out)[1].first_token};
    ASSERT_TRUE(grid->world->Broadcast(next, sizeof(next), 0).ok());
    for (int s = 0; s < 2; ++s) seqs[s].push_back(next[s]);
    runtime::StepTimings t;
    out = m.Decode({{.tokens = {next[0]}, .session = "a"}, {.tokens = {next[1]}, .session = "b"}},
                   step, &t);
    ASSERT_TRUE(out.ok()) << out.status();
    if (grid->cp_size > 1) {
      EXPECT_EQ(t.algorithms,
                std::vector<parallel::RingAlgorithm>(2, parallel::RingAlgorithm::kPassQ));
    }
    if (grid->world_rank == 0) {
      error = Compare(*out, OneRank(c, {{{.tokens = seqs[0]}, {.tokens = seqs[1]}}}));
      if (!error.empty()) error = "step " + std::to_string(step) + ": " + error;
    }
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
  // 2 x kSteps new rows over the CP ranks: each rank got its share, give or take one per sequence.
  const int64_t grew = m.kv_tokens_held() - held_before;
  const int64_t share = 2 * kSteps / grid->cp_size;
  EXPECT_GE(grew, share - 2);
  EXPECT_LE(grew, share + 2);
  // Refused alike on every rank, nothing changed.
  const int64_t held = m.kv_tokens_held();
  EXPECT_EQ(m.Decode({{.tokens = {1}, .session = "nobody"}}, 0, nullptr).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(m.Decode({{.tokens = {1, 2}, .session = "a"}}, 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.kv_tokens_held(), held);
}

// Forks of one prompt decoded together (n samples): on every rank their queries meet the
// prompt's shared blocks as one root (prefix-batched decode), and every step equals one
// rank's prefill of each whole sequence; with prefix batching off nothing is batched and the
// results are the same.
TEST(LlamaModel, DecodeOfForksBatchesTheirSharedPrompt) {
  const runtime::ModelConfig c = Tiny();
  constexpr int kForks = 6, kSteps = 4;
  for (bool batched : {true, false}) {
    SCOPED_TRACE(batched ? "prefix-batched" : "per sequence");
    runtime::StepOptions options;
    options.kv_block_tokens = 16;
    options.kv_capacity_tokens = 4096;
    options.prefix_batching = batched;
    auto made = MakeCpModel(options);
    ASSERT_TRUE(made.ok()) << made.status();
    const parallel::ProcessGrid& grid = made->grid;
    runtime::LlamaModel& m = *made->model;
    const std::vector<int32_t> doc = Prompt(300, c.vocab_size, 31);
    auto out = m.Prefill({{.tokens = doc, .session = "doc"}}, nullptr, nullptr);
    ASSERT_TRUE(out.ok()) << out.status();
    testing::ForkedDecode forks;
    ASSERT_TRUE(forks.Fork(m, grid, "doc", doc, (*out)[0].first_token, kForks, c.vocab_size).ok());
    std::string error;
    // Every rank runs every step (a collective), whatever it found.
    for (int step = 0; step < kSteps; ++step) {
      runtime::StepTimings t;
      out = forks.Step(m, grid, step, &t);
      ASSERT_TRUE(out.ok()) << out.status();
      if (error.empty() && (batched ? t.prefix_batch.sequences == 0 : t.prefix_batch.roots != 0)) {
        error = "step " + std::to_string(step) + ": " + std::to_string(t.prefix_batch.roots) +
                " roots on world rank " + std::to_string(grid.world_rank);
      }
      if (grid.world_rank == 0) {
        const std::string differs = Compare(*out, OneRankOfPrompts(c, forks.Whole()));
        if (error.empty() && !differs.empty())
          error = "step " + std::to_string(step) + ": " + differs;
      }
    }
    auto agreed = parallel::AllRanksOk(*grid.world, error.empty());
    ASSERT_TRUE(agreed.ok());
    EXPECT_TRUE(*agreed) << grid.Describe() << ": " << error;
  }
}

// Questions about one cached document, prefilled in one batch: on one rank and on
// pass-Q rings the prefill reads the cache in place, gathers the document's shared blocks once
// and attends every question to them as one root; outputs, and the decode steps after, equal
// one rank's prefill of each whole sequence. Prefix batching off: the per-sequence copy.
TEST(LlamaModel, QuestionsAboutACachedDocumentPrefillTogether) {
  const runtime::ModelConfig c = Tiny();
  constexpr int kQuestions = 5, kSteps = 2;
  for (bool batched : {true, false}) {
    SCOPED_TRACE(batched ? "prefix-batched" : "per sequence");
    runtime::StepOptions options;
    options.kv_block_tokens = 16;
    options.kv_capacity_tokens = 4096;
    options.prefix_batching = batched;
    options.auto_algorithm = false;  // pass-Q: the KV stays, so it is read in place
    options.algorithm = parallel::RingAlgorithm::kPassQ;
    auto made = MakeCpModel(options);
    ASSERT_TRUE(made.ok()) << made.status();
    const parallel::ProcessGrid& grid = made->grid;
    runtime::LlamaModel& m = *made->model;
    const std::vector<int32_t> doc = Prompt(300, c.vocab_size, 37);
    auto out = m.Prefill({{.tokens = doc, .session = "doc"}}, nullptr, nullptr);
    ASSERT_TRUE(out.ok()) << out.status();
    testing::ForkedDecode forks;
    ASSERT_TRUE(forks.Fork(m, grid, "doc", doc, 0, kQuestions, c.vocab_size).ok());
    std::vector<std::vector<int32_t>> questions;
    for (int i = 0; i < kQuestions; ++i) {
      questions.push_back(Prompt(40 + 7 * i, c.vocab_size, 50 + i));  // > 4 rows a rank on CP4
    }
    std::string error;
    runtime::StepTimings t;
    out = forks.Ask(m, grid, questions, &t);
    ASSERT_TRUE(out.ok()) << out.status();
    if (batched ? t.prefix_batch.sequences < kQuestions : t.prefix_batch.roots != 0) {
      error = std::to_string(t.prefix_batch.roots) + " roots over " +
              std::to_string(t.prefix_batch.sequences) + " sequences on world rank " +
              std::to_string(grid.world_rank);
    }
    if (grid.world_rank == 0 && error.empty())
      error = Compare(*out, OneRankOfPrompts(c, forks.Whole()));
    // Every rank runs every step (a collective), whatever it found.
    for (int step = 0; step < kSteps; ++step) {
      out = forks.Step(m, grid, step, nullptr);
      ASSERT_TRUE(out.ok()) << out.status();
      if (grid.world_rank != 0 || !error.empty()) continue;
      error = Compare(*out, OneRankOfPrompts(c, forks.Whole()));
      if (!error.empty()) error = "decode step " + std::to_string(step) + ": " + error;
    }
    auto agreed = parallel::AllRanksOk(*grid.world, error.empty());
    ASSERT_TRUE(agreed.ok());
    EXPECT_TRUE(*agreed) << grid.Describe() << ": " << error;
  }
}

// Forks of two documents that continue one system prompt, asked in one batch, interleaved as they
// arrived: the model orders each document's forks side by side, so on every rank the batch is a
// tree (Hydragen's hierarchical case): the system prompt one root under all 5 forks, each
// document one under its own (3 + 2). Every answer equals one rank's prefill of its whole
// sequence.
TEST(LlamaModel, ForksOfTwoDocumentsUnderOneSystemPromptAreATree) {
  const runtime::ModelConfig c = Tiny();
  runtime::StepOptions options;
  options.kv_block_tokens = 16;
  options.kv_capacity_tokens = 4096;
  options.auto_algorithm = false;
  options.algorithm = parallel::RingAlgorithm::kPassQ;
  auto made = MakeCpModel(options);
  ASSERT_TRUE(made.ok()) << made.status();
  runtime::LlamaModel& m = *made->model;
  // 128 tokens: whole blocks of 16 on every rank up to CP4 (2N chunks of 16).
  const std::vector<int32_t> system = Prompt(128, c.vocab_size, 40);
  const std::vector<int32_t> docs[2] = {Prompt(260, c.vocab_size, 41),
                                        Prompt(200, c.vocab_size, 42)};
  ASSERT_TRUE(m.Prefill({{.tokens = system, .session = "system"}}, nullptr, nullptr).ok());
  for (int d = 0; d < 2; ++d) {
    const std::string doc = "doc" + std::to_string(d);
    ASSERT_TRUE(m.ForkSession("system", doc, static_cast<int64_t>(system.size())).ok());
    ASSERT_TRUE(m.Prefill({{.tokens = docs[d], .session = doc}}, nullptr, nullptr).ok());
  }
  const int of_doc[5] = {0, 1, 0, 1, 0};
  std::vector<PrefillRequest> batch;
  std::vector<PrefillRequest> whole;
  for (int i = 0; i < 5; ++i) {
    const std::string name = "q" + std::to_string(i);
    const std::vector<int32_t>& doc = docs[of_doc[i]];
    ASSERT_TRUE(m.ForkSession("doc" + std::to_string(of_doc[i]), name,
                              static_cast<int64_t>(system.size() + doc.size()))
                    .ok());
    batch.push_back({.tokens = Prompt(40 + 5 * i, c.vocab_size, 60 + i), .session = name});
    whole.push_back({.tokens = system});
    whole.back().tokens.insert(whole.back().tokens.end(), doc.begin(), doc.end());
    whole.back().tokens.insert(whole.back().tokens.end(), batch.back().tokens.begin(),
                               batch.back().tokens.end());
  }
  runtime::StepTimings t;
  auto out = m.Prefill(batch, &t, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  // Counts sum over layers and pass-Q's steps: each step, 3 roots over 5 + 3 + 2 forks.
  const int64_t steps = int64_t{c.num_layers} * made->grid.cp_size;
  std::string error;
  if (t.prefix_batch.roots != 3 * steps || t.prefix_batch.sequences != 10 * steps) {
    error = std::to_string(t.prefix_batch.roots) + " roots over " +
            std::to_string(t.prefix_batch.sequences) + " sequences in " + std::to_string(steps) +
            " steps";
  }
  if (made->grid.world_rank == 0 && error.empty()) error = Compare(*out, OneRank(c, {whole}));
  auto agreed = parallel::AllRanksOk(*made->grid.world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << made->grid.Describe() << ": " << error;
}

// --- The KV hand-off: a session's handle from its sharded KV ---------------------------------

// Every rank's whole KV pool (fp32 on the CPU backend, small for the tiny model) on every rank,
// and which world rank is each (tp_rank, cp_rank): what a memcpy puller on rank 0 reads.
struct GatheredPools {
  int64_t pool_bytes = 0;
  std::vector<char> bytes;         // world rank r's pool at [r * pool_bytes, (r + 1) * pool_bytes)
  std::vector<int> world_rank_of;  // [tp_rank * cp_size + cp_rank]
};

absl::StatusOr<GatheredPools> GatherPools(const parallel::ProcessGrid& grid,
                                          const runtime::KvCache& kv) {
  GatheredPools pools;
  pools.pool_bytes = runtime::KvPoolLayout::OfKvCache(kv.spec(), kv.num_blocks()).bytes;
  pools.bytes.resize(pools.pool_bytes * grid.world_size);
  CPFILL_RETURN_IF_ERROR(
      grid.world->AllGather(kv.BlockAddress(0, 0, 0), pools.pool_bytes, pools.bytes.data()));
  const int32_t mine[2] = {grid.tp_rank, grid.cp_rank};
  std::vector<int32_t> all(2 * grid.world_size);
  CPFILL_RETURN_IF_ERROR(grid.world->AllGather(mine, sizeof(mine), all.data()));
  pools.world_rank_of.assign(grid.world_size, -1);
  for (int r = 0; r < grid.world_size; ++r) {
    pools.world_rank_of[all[2 * r] * grid.cp_size + all[2 * r + 1]] = r;
  }
  return pools;
}

// The KV of `tokens` as one rank computes it in one prefill: [kind][layer][position][kv head][dim]
// floats, read out of its KvCache's blocks by the session's block table (not through a handle).
absl::StatusOr<std::vector<float>> OneRankKv(const runtime::ModelConfig& c,
                                             const runtime::StepOptions& options,
                                             const std::vector<int32_t>& tokens) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  CPFILL_ASSIGN_OR_RETURN(auto w, runtime::SyntheticWeights(c, 7, 0, 1));
  CPFILL_ASSIGN_OR_RETURN(auto model,
                          runtime::cpu::CreateCpuModel(c, std::move(w), tp, cp, world, options));
  CPFILL_RETURN_IF_ERROR(
      model->Prefill({{.tokens = tokens, .session = "ref"}}, nullptr, nullptr).status());
  // One rank holds positions [0, T) as rows [0, T) of the session's sequence (fp32).
  const std::optional<runtime::KvCache::SeqId> seq = model->SessionSequence("ref");
  if (!seq) return absl::InternalError("the one-rank model lost its session");
  const int64_t T = static_cast<int64_t>(tokens.size()), row = c.num_kv_heads * c.head_dim;
  const runtime::KvCache& kv = model->kv_cache();
  const std::span<const int32_t> blocks = kv.BlockTable(*seq);
  const int bt = kv.spec().block_tokens;
  std::vector<float> out(2 * c.num_layers * T * row);
  for (int kind = 0; kind < 2; ++kind) {
    for (int l = 0; l < c.num_layers; ++l) {
      for (int64_t t = 0; t < T; ++t) {
        const char* src =
            kv.BlockAddress(l, kind, blocks[t / bt]) + (t % bt) * row * int64_t{sizeof(float)};
        std::memcpy(&out[((kind * c.num_layers + l) * T + t) * row], src, row * sizeof(float));
      }
    }
  }
  return out;
}

// Runs `plan` with memcpy from the gathered pools into `dst`; every piece bounds-checked.
std::string RunPull(const runtime::KvPullPlan& plan, const runtime::KvHandle& h,
                    const GatheredPools& pools, std::vector<char>& dst) {
  for (const runtime::KvCopyRun& run : plan.runs) {
    const int world_rank =
        pools.world_rank_of[run.src_tp_rank * h.layout.cp_size + run.src_cp_rank];
    const char* pool = pools.bytes.data() + world_rank * pools.pool_bytes;
    for (int64_t i = 0; i < run.pieces; ++i) {
      const int64_t src = run.src_offset_bytes + i * run.src_stride_bytes;
      const int64_t to = run.dst_offset_bytes + i * run.dst_stride_bytes;
      if (src < 0 || src + run.piece_bytes > pools.pool_bytes || to < 0 ||
          to + run.piece_bytes > static_cast<int64_t>(dst.size())) {
        return "a run reads or writes outside its memory";
      }
      std::memcpy(dst.data() + to, pool + src, run.piece_bytes);
    }
  }
  return "";
}

// Decode rank `dst_rank` of `dst_tp`'s contiguous K and V (K then V, each [layer][t][its heads]
// [dim]) against the one-rank KV: within the logits' fp32 tolerance (1e-3, relative above 1),
// every element written (the NaN poison fails the comparison). Both sides are rows of
// (kind, layer, position) in the same order; a destination row is a slice of a one-rank row.
std::string CompareWithOneRank(const std::vector<char>& dst, const std::vector<float>& one_rank,
                               const runtime::KvHandleLayout& l, int dst_tp, int dst_rank) {
  const int64_t T = l.tokens;
  const int64_t dst_row = int64_t{l.kv_heads / dst_tp} * l.head_dim;
  const int64_t one_rank_row = int64_t{l.kv_heads} * l.head_dim;
  std::vector<float> got(dst.size() / sizeof(float));
  std::memcpy(got.data(), dst.data(), dst.size());
  for (int64_t row = 0; row < 2 * l.num_layers * T; ++row) {
    for (int64_t e = 0; e < dst_row; ++e) {
      const double a = got[row * dst_row + e];
      const double b = one_rank[row * one_rank_row + dst_rank * dst_row + e];
      if (!(std::fabs(a - b) <= 1e-3 * std::max(1.0, std::fabs(b)))) {
        return absl::StrCat(
            "decode TP", dst_tp, " rank ", dst_rank, ": ", row < l.num_layers * T ? "K" : "V",
            " of layer ", row / T % l.num_layers, ", position ", row % T, ", head ", e / l.head_dim,
            ", dim ", e % l.head_dim, " is ", a, ", one rank has ", b);
      }
    }
  }
  return "";
}

// On world rank 0: every rank of decode TP1 and TP2 pulls into a NaN-poisoned contiguous
// destination with memcpy; "" when each equals the one-rank KV.
std::string PullAndCompare(runtime::KvHandle h, const GatheredPools& pools,
                           const std::vector<float>& one_rank) {
  if (h.layout.dtype != runtime::KvDtype::kFloat32) return "the CPU backend's KV is not fp32";
  // Stand-ins for the UCX fields the server fills with --kv-handoff: the plan does not read them.
  for (runtime::KvRankShard& shard : h.ranks) {
    shard.transport = {.worker_address = "in-process",
                       .rkey = "memcpy",
                       .lease_rkey = "none",
                       .lease_address = 64};
  }
  h.lease_nonce = {.lo = 1};
  for (int dst_tp : {1, 2}) {
    for (int dst_rank = 0; dst_rank < dst_tp; ++dst_rank) {
      const int64_t kind_bytes = int64_t{h.layout.num_layers} * h.layout.tokens *
                                 (h.layout.kv_heads / dst_tp) * h.layout.head_dim * sizeof(float);
      const runtime::KvPullDestination spec{
          .tp_size = dst_tp,
          .tp_rank = dst_rank,
          .layout = runtime::KvContiguousDestination{.v_offset_bytes = kind_bytes}};
      absl::StatusOr<runtime::KvPullPlan> plan = runtime::PlanKvPull(h, spec);
      if (!plan.ok()) return std::string(plan.status().message());
      if (plan->total_bytes() != 2 * kind_bytes) return "the plan does not cover the KV";
      std::vector<float> poison(2 * kind_bytes / sizeof(float),
                                std::numeric_limits<float>::quiet_NaN());
      std::vector<char> dst(2 * kind_bytes);
      std::memcpy(dst.data(), poison.data(), dst.size());
      std::string error = RunPull(*plan, h, pools, dst);
      if (error.empty()) error = CompareWithOneRank(dst, one_rank, h.layout, dst_tp, dst_rank);
      if (!error.empty()) return error;
    }
  }
  return "";
}

// Greedy decode steps of session `name`: each step's token (rank 0's argmax, broadcast) joins
// `tokens`.
void DecodeSteps(const parallel::ProcessGrid& grid, runtime::LlamaModel& m, const std::string& name,
                 int32_t first, int steps, std::vector<int32_t>& tokens) {
  int32_t next = first;
  for (int step = 0; step < steps; ++step) {
    ASSERT_TRUE(grid.world->Broadcast(&next, sizeof(next), 0).ok());
    tokens.push_back(next);
    auto out = m.Decode({{.tokens = {next}, .session = name}}, step, nullptr);
    ASSERT_TRUE(out.ok()) << out.status();
    next = (*out)[0].first_token;
  }
}

// The KV hand-off's handle from real sharded KV: a session of two turns (lengths that do not
// divide by the blocks or by 2N, blocks interleaved with another session's) and two decode steps
// on CP2 (np 2) or TP2 x CP2 (np 4), exported on every rank (the same handle everywhere), pulled
// on rank 0 from every rank's pool into decode TP1 and TP2: the KV of a one-rank prefill of the
// same tokens. Unknown sessions, bad ids and a session some ranks lack fail alike on every rank.
TEST(LlamaModel, ExportedKvHandlePullsTheOneRankKv) {
  auto& mpi = testing::Mpi();
  const runtime::ModelConfig c = Tiny();
  const int tp = mpi.world_size() == 4 ? 2 : 1;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = tp});
  ASSERT_TRUE(grid.ok()) << grid.status();
  auto w = runtime::SyntheticWeights(c, 7, grid->tp_rank, tp);
  ASSERT_TRUE(w.ok());
  runtime::StepOptions options;
  options.kv_capacity_tokens = 512;  // per rank: small pools to gather
  options.kv_block_tokens = 16;
  auto model =
      runtime::cpu::CreateCpuModel(c, std::move(*w), *grid->tp, *grid->cp, *grid->world, options);
  ASSERT_TRUE(model.ok()) << model.status();
  runtime::LlamaModel& m = **model;
  // Another session's turns before and between the session's, so its blocks are neither first
  // in the pool nor consecutive.
  const auto other_turn = [&](int64_t n) {
    return m.Prefill({{.tokens = Prompt(n, c.vocab_size, 20), .session = "other"}}, nullptr,
                     nullptr);
  };
  ASSERT_TRUE(other_turn(70).ok());
  std::vector<int32_t> tokens = Prompt(301, c.vocab_size, 21);
  ASSERT_TRUE(m.Prefill({{.tokens = tokens, .session = "s"}}, nullptr, nullptr).ok());
  ASSERT_TRUE(other_turn(90).ok());
  const std::vector<int32_t> turn2 = Prompt(45, c.vocab_size, 22);
  tokens.insert(tokens.end(), turn2.begin(), turn2.end());
  auto out = m.Prefill({{.tokens = turn2, .session = "s"}}, nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  DecodeSteps(*grid, m, "s", (*out)[0].first_token, 2, tokens);

  EXPECT_EQ(ExportSessionKv(m, "nobody", {"e", "r"}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ExportSessionKv(m, "s", {"", "r"}).status().code(), absl::StatusCode::kInvalidArgument);
  auto handle = ExportSessionKv(m, "s", {"cpfill-test", "cmpl-1"});
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_EQ(handle->layout.tokens, static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(handle->layout.tp_size, grid->tp_size);
  EXPECT_EQ(handle->layout.cp_size, grid->cp_size);
  auto texts = parallel::AllGatherText(*grid->world, ToJson(*handle).dump());
  ASSERT_TRUE(texts.ok());
  for (const std::string& text : *texts) EXPECT_EQ(text, (*texts)[0]) << "handles differ";

  auto pools = GatherPools(*grid, m.kv_cache());
  ASSERT_TRUE(pools.ok()) << pools.status();
  std::string error;
  if (grid->world_rank == 0) {
    auto one_rank = OneRankKv(c, options, tokens);
    error = one_rank.ok() ? PullAndCompare(*handle, *pools, *one_rank)
                          : std::string(one_rank.status().message());
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << grid->Describe() << ": " << error;

  // A session that only some ranks know (ended on rank 0 alone): the same error on every rank.
  if (grid->world_rank == 0) {
    EXPECT_TRUE(m.EndSession("other").ok());
  }
  EXPECT_EQ(ExportSessionKv(m, "other", {"e", "r"}).status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace cpfill
