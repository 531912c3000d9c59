#include "runtime/serving/step_wire.h"

#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

StepPlan Sample() {
  StepPlan p;
  p.kind = StepPlan::kPrefill;
  p.step = 12345678901ull;
  p.end_sessions = {"a", std::string("\x01gen-3")};
  p.batch.push_back({.tokens = {1, 2, 3}, .session = "chat"});
  p.batch.push_back(
      {.tokens = {9},
       .session = "",
       .draw = TokenDraw{.params = {.temperature = 0.7, .top_k = 5, .top_p = 0.9, .seed = 42},
                         .step = 3},
       .sparq = attention::sparq::SparqConfig{.r = 16, .k = 64, .local_window = 8}});
  p.publish.push_back(
      {.kv_name = "\x01kv-1", .request_id = "kv-1", .slot = 2, .nonce = {.hi = 5, .lo = 7}});
  p.forks.push_back({.parent = "\x01pfx-1", .child = "chat", .tokens = 64});
  p.keeps.push_back({.parent = "chat", .child = "\x01pfx-2", .tokens = 3});
  return p;
}

TEST(StepWire, RoundTripsEveryField) {
  const StepPlan p = Sample();
  absl::StatusOr<StepPlan> q = StepFromWire(StepToWire(p));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->kind, p.kind);
  EXPECT_EQ(q->step, p.step);
  EXPECT_EQ(q->end_sessions, p.end_sessions);
  ASSERT_EQ(q->batch.size(), 2u);
  EXPECT_EQ(q->batch[0].tokens, p.batch[0].tokens);
  EXPECT_EQ(q->batch[0].session, "chat");
  EXPECT_FALSE(q->batch[0].draw.has_value());
  ASSERT_TRUE(q->batch[1].draw.has_value());
  EXPECT_EQ(q->batch[1].draw->params.temperature, 0.7);
  EXPECT_EQ(q->batch[1].draw->params.top_k, 5);
  EXPECT_EQ(q->batch[1].draw->params.top_p, 0.9);
  EXPECT_EQ(q->batch[1].draw->params.seed, 42u);
  EXPECT_EQ(q->batch[1].draw->step, 3u);
  EXPECT_FALSE(q->batch[0].sparq.has_value());
  ASSERT_TRUE(q->batch[1].sparq.has_value());
  EXPECT_EQ(q->batch[1].sparq->r, 16);
  EXPECT_EQ(q->batch[1].sparq->k, 64);
  EXPECT_EQ(q->batch[1].sparq->local_window, 8);
  EXPECT_FALSE(q->batch[1].sparq->oracle);
  ASSERT_EQ(q->publish.size(), 1u);
  EXPECT_EQ(q->publish[0].kv_name, p.publish[0].kv_name);
  EXPECT_EQ(q->publish[0].request_id, "kv-1");
  EXPECT_EQ(q->publish[0].slot, 2u);
  EXPECT_EQ(q->publish[0].nonce, (KvNonce{.hi = 5, .lo = 7}));
  ASSERT_EQ(q->forks.size(), 1u);
  EXPECT_EQ(q->forks[0].parent, p.forks[0].parent);
  EXPECT_EQ(q->forks[0].tokens, 64u);
  ASSERT_EQ(q->keeps.size(), 1u);
  EXPECT_EQ(q->keeps[0].child, p.keeps[0].child);
}

TEST(StepWire, RefusesEveryTruncationAndTrailingBytes) {
  const std::vector<char> bytes = StepToWire(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<char> cut(bytes.begin(), bytes.begin() + n);
    EXPECT_TRUE(absl::IsInternal(StepFromWire(cut).status())) << n;
  }
  std::vector<char> longer = bytes;
  longer.push_back(0);
  EXPECT_TRUE(absl::IsInternal(StepFromWire(longer).status()));
  std::vector<char> bad_kind = bytes;
  bad_kind[0] = 9;
  EXPECT_TRUE(absl::IsInternal(StepFromWire(bad_kind).status()));
}

}  // namespace
}  // namespace cpfill::runtime
