#include "runtime/model/prefill_batch.h"

#include <chrono>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

// A batch of `n` one-token requests, each starting session "s<i>".
std::vector<PrefillRequest> OneTokenSessions(int n) {
  std::vector<PrefillRequest> batch(n);
  for (int i = 0; i < n; ++i) batch[i] = {.tokens = {i % 1000}, .session = "s" + std::to_string(i)};
  return batch;
}

TEST(SessionAfter, EqualsTheSequencesEntryOfKvLayoutAfter) {
  auto config = LoadModelConfig("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  std::vector<PrefillRequest> batch = OneTokenSessions(3);
  batch[0].tokens.assign(301, 1);
  batch[1].tokens.assign(17, 2);
  auto b = PlanBatch(*config, batch, /*cp_size=*/3, /*cp_rank=*/1,
                     [](const std::string&) -> const SessionLayout* { return nullptr; });
  ASSERT_TRUE(b.ok()) << b.status();
  const sharding::KvLayout after = b->plan.KvLayoutAfter();
  for (int s = 0; s < 3; ++s) {
    const SessionLayout got = SessionAfter(*b, s);
    EXPECT_EQ(got.tokens, static_cast<int64_t>(batch[s].tokens.size()));
    ASSERT_EQ(got.layout.runs.size(), 3u);
    for (int r = 0; r < 3; ++r) {
      ASSERT_EQ(got.layout.runs[r].size(), 1u);
      EXPECT_EQ(got.layout.runs[r][0], after.runs[r][s]) << "rank " << r << " seq " << s;
    }
  }
}

// The model's planning around the layers for 100,000 one-token prompts, each opening a session
// (PlanBatch, the last-position rows, every session's layout after the batch) stays
// near-linear: SessionAfter used to rebuild the whole batch's layout per call, O(S^2). The bound
// is generous on purpose; bench/plan_bench.cc measures the real cost.
TEST(PlanBatch, HundredThousandOneTokenSessionsPlanQuickly) {
  constexpr int kSeqs = 100000, kCp = 4;
  auto config = LoadModelConfig("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  const std::vector<PrefillRequest> batch = OneTokenSessions(kSeqs);
  const auto start = std::chrono::steady_clock::now();
  auto b = PlanBatch(*config, batch, kCp, /*cp_rank=*/0,
                     [](const std::string&) -> const SessionLayout* { return nullptr; });
  ASSERT_TRUE(b.ok()) << b.status();
  const auto rows = LastPositionRows(*b);
  std::vector<SessionLayout> sessions;
  for (int s = 0; s < kSeqs; ++s) sessions.push_back(SessionAfter(*b, s));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  // CP rank 0 holds every one-token prompt: one last-position row each, in order.
  ASSERT_EQ(rows.size(), static_cast<size_t>(kSeqs));
  EXPECT_EQ(rows.back(), (std::pair<int, int64_t>{kSeqs - 1, kSeqs - 1}));
  EXPECT_EQ(b->local_ids[kSeqs - 1], (kSeqs - 1) % 1000);
  EXPECT_EQ(sessions.back().layout.runs[0][0], (std::vector<sharding::PositionRun>{{0, 1}}));
  EXPECT_TRUE(sessions.back().layout.runs[1][0].empty());
}

}  // namespace
}  // namespace cpfill::runtime
