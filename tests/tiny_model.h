// cpfill/tests/tiny_model.h — what the multi-rank model tests share: the `tiny` preset's
// geometry and deterministic prompts.
#pragma once

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/model/model_config.h"

namespace cpfill::testing {

inline runtime::ModelConfig Tiny() {
  auto c = runtime::LoadModelConfig("tiny");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// `n` token ids below `vocab`, a pure function of (n, salt).
inline std::vector<int32_t> Prompt(int64_t n, int vocab, uint64_t salt) {
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    ids.push_back(static_cast<int32_t>((i * 7919 + salt * 31) % vocab));
  }
  return ids;
}

}  // namespace cpfill::testing
