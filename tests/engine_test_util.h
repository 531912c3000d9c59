// cpfill/tests/engine_test_util.h — what the engine's multi-rank tests share: the tiny model on
// this rank's grid, the one-rank reference every answer must equal, and the driver that runs
// the clients on rank 0 beside every rank's loop.
#pragma once

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
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
#include "tests/mpi_test_main.h"

namespace cpfill::testing {

using runtime::Engine;
using runtime::EngineResult;

// The model on this rank's grid: TP2 x CP2 on 4 ranks, else TP1 x CP-all.
struct Rig {
  std::optional<parallel::ProcessGrid> grid;
  std::unique_ptr<runtime::LlamaModel> model;
};
inline Rig MakeRig(const runtime::ModelConfig& c, runtime::StepOptions options) {
  auto& mpi = testing::Mpi();
  const int tp = mpi.world_size() == 4 ? 2 : 1;
  auto grid = parallel::CreateProcessGrid(mpi, {.tp = tp, .ranks_per_node = tp});
  EXPECT_TRUE(grid.ok()) << grid.status();
  Rig rig;
  rig.grid = std::move(*grid);
  auto w = runtime::SyntheticWeights(c, 7, rig.grid->tp_rank, tp);
  EXPECT_TRUE(w.ok()) << w.status();
  auto model = runtime::cpu::CreateCpuModel(c, std::move(*w), *rig.grid->tp, *rig.grid->cp,
                                            *rig.grid->world, options);
  EXPECT_TRUE(model.ok()) << model.status();
  rig.model = std::move(*model);
  return rig;
}

// One-shot prefill of `tokens` on one rank (world rank 0), the reference every answer must equal.
class OneRank {
 public:
  explicit OneRank(const runtime::ModelConfig& c) {
    auto w = runtime::SyntheticWeights(c, 7, 0, 1);
    EXPECT_TRUE(w.ok());
    auto m = runtime::cpu::CreateCpuModel(c, std::move(*w), tp_, cp_, world_, {});
    EXPECT_TRUE(m.ok()) << m.status();
    model_ = std::move(*m);
  }
  // "" when `got` equals the one-shot prefill of `tokens`.
  std::string Check(const std::vector<int32_t>& tokens, const EngineResult& got) {
    auto want = model_->Prefill({{.tokens = tokens}}, nullptr, nullptr);
    if (!want.ok()) return want.status().ToString();
    const runtime::SequenceOutput& w = (*want)[0];
    if (w.first_token != got.first_token) {
      return "first token " + std::to_string(got.first_token) + ", want " +
             std::to_string(w.first_token);
    }
    if (w.logits.size() != got.logits.size()) return "logit count differs";
    for (size_t i = 0; i < w.logits.size(); ++i) {
      if (!(std::fabs(double(w.logits[i]) - got.logits[i]) <= 1e-3)) {
        return "logit " + std::to_string(i) + " differs";
      }
    }
    return "";
  }
  // Greedy generation by one-shot prefills of the whole sequence so far: `n` token ids.
  std::vector<int32_t> Greedy(std::vector<int32_t> tokens, int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      auto want = model_->Prefill({{.tokens = tokens}}, nullptr, nullptr);
      EXPECT_TRUE(want.ok()) << want.status();
      if (!want.ok()) break;
      out.push_back((*want)[0].first_token);
      tokens.push_back(out.back());
    }
    return out;
  }

 private:
  parallel::SelfCommunicator tp_{"tp"}, cp_{"cp"}, world_{"world"};
  std::unique_ptr<runtime::LlamaModel> model_;
};

// Every rank runs the loop; rank 0 also runs `clients` and then shuts the engine down.
inline absl::Status RunWith(Engine& engine, bool root, const std::function<void()>& clients) {
  std::thread driver;
  if (root) {
    driver = std::thread([&] {
      clients();
      engine.Shutdown();
    });
  }
  absl::Status s = engine.Run();
  if (driver.joinable()) driver.join();
  return s;
}

}  // namespace cpfill::testing
