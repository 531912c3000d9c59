// The whole model on the CUDA backend against the fp32 CPU model on one rank: a two-turn session
// (its KV kept in the device KvCache, the second turn a partial prefill on top) and a request
// without a session in one batch; the KV blocks follow the sessions; forks of one prompt decoded
// together (prefix-batched). Skips without a GPU. Run under mpirun with one rank per GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "gtest/gtest.h"
#include "parallel/cuda/nccl_communicator.h"
#include "parallel/grid.h"
#include "parallel/self_communicator.h"
#include "runtime/model/cpu/cpu_backend.h"
#include "runtime/model/cuda/cuda_backend.h"
#include "runtime/model/llama_model.h"
#include "runtime/model/weights.h"
#include "tests/forked_decode.h"
#include "tests/mpi_test_main.h"
#include "tests/tiny_model.h"

namespace cpfill {
namespace {

// The tests below check prefix batching's numerics on the GPU with the tiny model, whose shared
// prefixes spare far fewer K/V reads than a GPU level costs (attention::kGpuTreeCosts): make
// every shared block a root, before anything reads the knob.
[[maybe_unused]] const bool kEveryRoot = [] {
  return setenv("CPFILL_PREFIX_TREE", "always", 1) == 0;
}();

using runtime::PrefillRequest;

using testing::Prompt;

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n >= testing::Mpi().world_size();
}

// bf16 against fp32: logits within 3% of their scale, first tokens equal but at a near tie.
std::string CompareBf16(const std::vector<runtime::SequenceOutput>& gpu,
                        const std::vector<runtime::SequenceOutput>& ref) {
  if (gpu.size() != ref.size()) return "different sequence counts";
  double diff = 0, scale = 0;
  for (size_t s = 0; s < ref.size(); ++s) {
    for (size_t i = 0; i < ref[s].logits.size(); ++i) {
      const double d = std::fabs(double(gpu[s].logits[i]) - ref[s].logits[i]);
      diff = std::isnan(d) ? INFINITY : std::max(diff, d);
      scale = std::max(scale, std::fabs(double(ref[s].logits[i])));
    }
  }
  if (!(diff <= 3e-2 * std::max(1.0, scale))) {
    return "max logit difference " + std::to_string(diff) + " at scale " + std::to_string(scale);
  }
  for (size_t s = 0; s < ref.size(); ++s) {
    if (gpu[s].first_token == ref[s].first_token) continue;
    std::vector<float> top = ref[s].logits;
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<>());
    if (top[0] - top[1] > 2 * diff) return "sequence " + std::to_string(s) + ": first token";
  }
  return "";
}

// The tiny model on the CUDA backend, TP1 x CP over every rank, its KV cache of `capacity`
// tokens in blocks of 32; the weights stay for a CPU reference. The model is declared last, so
// it goes before the communicators it uses.
struct GpuModel {
  runtime::ModelConfig config;
  parallel::ProcessGrid grid;
  parallel::NcclGrid nccl;
  runtime::ModelWeights weights;
  std::unique_ptr<runtime::LlamaModel> model;
};
absl::StatusOr<std::unique_ptr<GpuModel>> MakeGpuModel(int64_t capacity,
                                                       runtime::StepOptions options = {}) {
  auto& mpi = testing::Mpi();
  auto g = std::make_unique<GpuModel>();
  CPFILL_ASSIGN_OR_RETURN(g->config, runtime::LoadModelConfig("tiny"));
  CPFILL_ASSIGN_OR_RETURN(g->grid, parallel::CreateProcessGrid(mpi, {.tp = 1}));
  CPFILL_ASSIGN_OR_RETURN(g->nccl, parallel::CreateNcclGrid(g->grid, mpi.options()));
  CPFILL_ASSIGN_OR_RETURN(g->weights, runtime::SyntheticWeights(g->config, 7, 0, 1));
  CPFILL_ASSIGN_OR_RETURN(auto backend,
                          runtime::cuda::MakeCudaBackend(g->config, g->weights, g->nccl));
  options.kv_capacity_tokens = capacity;
  options.kv_block_tokens = 32;
  CPFILL_ASSIGN_OR_RETURN(g->model, runtime::LlamaModel::Create(g->config, std::move(backend),
                                                                *g->grid.world, options));
  return g;
}

// "" when each `got[i]` equals the CPU model's one-rank prefill of `batches[i]` (bf16
// tolerance); the weights move into that model. World rank 0 only.
std::string CompareWithCpu(const runtime::ModelConfig& c, runtime::ModelWeights* w,
                           const std::vector<std::vector<runtime::PrefillRequest>>& batches,
                           const std::vector<const std::vector<runtime::SequenceOutput>*>& got) {
  parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
  runtime::StepOptions options;
  options.threads = 0;
  auto ref = runtime::cpu::CreateCpuModel(c, std::move(*w), tp, cp, world, options);
  if (!ref.ok()) return ref.status().ToString();
  for (size_t i = 0; i < batches.size(); ++i) {
    auto want = (*ref)->Prefill(batches[i], nullptr, nullptr);
    if (!want.ok()) return want.status().ToString();
    if (std::string e = CompareBf16(*got[i], *want); !e.empty()) {
      return absl::StrCat("batch ", i, ": ", e);
    }
  }
  return "";
}

TEST(LlamaCuda, TwoTurnSessionEqualsOneFullPrefillOnTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device for every rank";
  auto made = MakeGpuModel(2048);
  ASSERT_TRUE(made.ok()) << made.status();
  const runtime::ModelConfig* c = &(*made)->config;
  const parallel::ProcessGrid* grid = &(*made)->grid;
  runtime::ModelWeights* w = &(*made)->weights;
  runtime::LlamaModel& m = *(*made)->model;

  const std::vector<int32_t> whole = Prompt(377, c->vocab_size, 9);
  const std::vector<int32_t> first(whole.begin(), whole.begin() + 300),
      second(whole.begin() + 300, whole.end());
  const std::vector<int32_t> other = Prompt(40, c->vocab_size, 4);
  ASSERT_TRUE(m.Prefill({{.tokens = first, .session = "a"}}, nullptr, nullptr).ok());
  auto turn2 = m.Prefill({{.tokens = second, .session = "a"}, {.tokens = other}}, nullptr, nullptr);
  ASSERT_TRUE(turn2.ok()) << turn2.status();
  EXPECT_GT(m.kv_usage().blocks_used, 0);
  ASSERT_TRUE(m.EndSession("a").ok());
  EXPECT_EQ(m.kv_usage().blocks_used, 0);

  std::string error;
  if (grid->world_rank == 0) {
    error = CompareWithCpu(*c, w, {{{.tokens = whole}, {.tokens = other}}}, {&*turn2});
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

// Forks of one prompt decoded together on the GPU (n samples): the decode kernel reads
// the shared blocks once for all of them (prefix-batched), and each step equals the CPU model's
// prefill of every whole sequence. On one GPU and on CP2.
TEST(LlamaCuda, ForksDecodedTogetherEqualTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device for every rank";
  auto made = MakeGpuModel(4096);
  ASSERT_TRUE(made.ok()) << made.status();
  const runtime::ModelConfig* c = &(*made)->config;
  const parallel::ProcessGrid* grid = &(*made)->grid;
  runtime::ModelWeights* w = &(*made)->weights;
  runtime::LlamaModel& m = *(*made)->model;

  constexpr int kForks = 8, kSteps = 2;
  const std::vector<int32_t> doc = Prompt(400, c->vocab_size, 11);
  auto out = m.Prefill({{.tokens = doc, .session = "doc"}}, nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  testing::ForkedDecode forks;
  ASSERT_TRUE(forks.Fork(m, *grid, "doc", doc, (*out)[0].first_token, kForks, c->vocab_size).ok());
  int64_t batched = 0;
  for (int step = 0; step < kSteps; ++step) {
    runtime::StepTimings t;
    out = forks.Step(m, *grid, step, &t);
    ASSERT_TRUE(out.ok()) << out.status();
    batched += t.prefix_batch.sequences;
  }
  std::string error = batched > 0 ? "" : "no decode step batched the forks";
  if (grid->world_rank == 0 && error.empty()) {
    error = CompareWithCpu(*c, w, {forks.Whole()}, {&*out});
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

// Questions about one cached document prefilled in one batch on the GPU: the prefill
// reads the cache in place, gathers the document's shared blocks once and runs every question
// against them as one root on the prefill kernels; the outputs, and a decode step after, equal
// the CPU model's prefill of each whole sequence. On one GPU and on CP2 (pass-Q).
TEST(LlamaCuda, QuestionsAboutACachedDocumentEqualTheCpu) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device for every rank";
  runtime::StepOptions options;
  options.auto_algorithm = false;
  options.algorithm = parallel::RingAlgorithm::kPassQ;
  auto made = MakeGpuModel(8192, options);
  ASSERT_TRUE(made.ok()) << made.status();
  const runtime::ModelConfig* c = &(*made)->config;
  const parallel::ProcessGrid* grid = &(*made)->grid;
  runtime::ModelWeights* w = &(*made)->weights;
  runtime::LlamaModel& m = *(*made)->model;

  constexpr int kQuestions = 6;
  const std::vector<int32_t> doc = Prompt(1000, c->vocab_size, 13);
  auto out = m.Prefill({{.tokens = doc, .session = "doc"}}, nullptr, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  testing::ForkedDecode forks;
  ASSERT_TRUE(forks.Fork(m, *grid, "doc", doc, 0, kQuestions, c->vocab_size).ok());
  std::vector<std::vector<int32_t>> questions;
  for (int i = 0; i < kQuestions; ++i) questions.push_back(Prompt(30 + 19 * i, c->vocab_size, i));
  runtime::StepTimings t;
  out = forks.Ask(m, *grid, questions, &t);
  ASSERT_TRUE(out.ok()) << out.status();
  std::string error =
      t.prefix_batch.sequences >= kQuestions ? "" : "the questions were not batched";
  std::vector<runtime::SequenceOutput> asked = *out;
  std::vector<runtime::PrefillRequest> asked_whole = forks.Whole();
  out = forks.Step(m, *grid, 0, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  if (grid->world_rank == 0 && error.empty()) {
    // Batch 0: the questions' prefill; batch 1: the decode step after them.
    error = CompareWithCpu(*c, w, {asked_whole, forks.Whole()}, {&asked, &*out});
  }
  auto agreed = parallel::AllRanksOk(*grid->world, error.empty());
  ASSERT_TRUE(agreed.ok());
  EXPECT_TRUE(*agreed) << error;
}

}  // namespace
}  // namespace cpfill
