// cpfill/tests/forked_decode.h — what the CPU and GPU model tests of prefix-batched decode share
// (the prefix cache): forks of one prompt decoded together, one collective step at a time.
//
//   ForkedDecode forks;
//   CPFILL_RETURN_IF_ERROR(forks.Fork(model, grid, "doc", doc, first_token, 6, vocab));
//   auto out = forks.Step(model, grid, step, &timings);   // forks.Whole(): each fork's tokens
//   auto asked = forks.Ask(model, grid, questions, &timings);  // a prefill of each fork's own
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "parallel/grid.h"
#include "runtime/model/llama_model.h"

namespace cpfill::testing {

class ForkedDecode {
 public:
  // Sessions "f0", "f1", ... forked from session `parent`, whose tokens are `prompt`, at its whole
  // prompt. Fork i's first token is `first_token` + i (so their own rows differ); `first_token`
  // counts on world rank 0 only, which feeds every step.
  absl::Status Fork(runtime::LlamaModel& m, const parallel::ProcessGrid& grid,
                    const std::string& parent, const std::vector<int32_t>& prompt,
                    int32_t first_token, int forks, int vocab) {
    seqs_.assign(forks, prompt);
    next_.assign(forks, 0);
    for (int i = 0; i < forks; ++i) {
      CPFILL_RETURN_IF_ERROR(m.ForkSession(parent, Name(i), static_cast<int64_t>(prompt.size())));
      if (grid.world_rank == 0) next_[i] = (first_token + i) % vocab;
    }
    return absl::OkStatus();
  }

  // One decode step of every fork, collective: rank 0's next tokens go to every rank, and its
  // outputs (greedy) choose the tokens of the step after.
  absl::StatusOr<std::vector<runtime::SequenceOutput>> Step(runtime::LlamaModel& m,
                                                            const parallel::ProcessGrid& grid,
                                                            int step, runtime::StepTimings* t) {
    CPFILL_RETURN_IF_ERROR(grid.world->Broadcast(next_.data(), next_.size() * sizeof(int32_t), 0));
    std::vector<runtime::PrefillRequest> batch;
    for (size_t i = 0; i < seqs_.size(); ++i) {
      seqs_[i].push_back(next_[i]);
      batch.push_back({.tokens = {next_[i]}, .session = Name(static_cast<int>(i))});
    }
    CPFILL_ASSIGN_OR_RETURN(auto out, m.Decode(batch, step, t));
    if (grid.world_rank == 0) {
      for (size_t i = 0; i < seqs_.size(); ++i) next_[i] = out[i].first_token;
    }
    return out;
  }

  // One prefill of every fork's own `questions[i]` after its prompt, in one batch (collective):
  // a prefill over cached rows, which reads them in place and batches the shared prompt
  //. Rank 0's outputs choose the tokens the next Step feeds.
  absl::StatusOr<std::vector<runtime::SequenceOutput>> Ask(
      runtime::LlamaModel& m, const parallel::ProcessGrid& grid,
      const std::vector<std::vector<int32_t>>& questions, runtime::StepTimings* t) {
    std::vector<runtime::PrefillRequest> batch;
    for (size_t i = 0; i < seqs_.size(); ++i) {
      seqs_[i].insert(seqs_[i].end(), questions[i].begin(), questions[i].end());
      batch.push_back({.tokens = questions[i], .session = Name(static_cast<int>(i))});
    }
    CPFILL_ASSIGN_OR_RETURN(auto out, m.Prefill(batch, t, nullptr));
    if (grid.world_rank == 0) {
      for (size_t i = 0; i < seqs_.size(); ++i) next_[i] = out[i].first_token;
    }
    return out;
  }
  // Every fork's whole tokens so far, as requests without a session (a one-rank reference).
  std::vector<runtime::PrefillRequest> Whole() const {
    std::vector<runtime::PrefillRequest> whole;
    for (const auto& s : seqs_) whole.push_back({.tokens = s});
    return whole;
  }

 private:
  static std::string Name(int i) { return absl::StrCat("f", i); }

  std::vector<std::vector<int32_t>> seqs_;
  std::vector<int32_t> next_;
};

}  // namespace cpfill::testing
