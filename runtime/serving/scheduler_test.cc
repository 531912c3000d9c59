// The scheduler alone, in the manner of vLLM's scheduler tests: hand-made requests, a fake KV
// cache (what evicting a name would free) and a fake executor that either runs a plan or
// refuses it as a full KV cache would. No MPI, no model, no clock but the one the test gives.
#include "runtime/serving/scheduler.h"

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/kv/kv_cache.h"

namespace cpfill::runtime {
namespace {

using std::chrono::seconds;
using Clock = Scheduler::Clock;

class FakeKv : public KvOccupancy {
 public:
  int64_t BlocksOnlyIn(const std::string& name) const override {
    auto it = only.find(name);
    return it == only.end() ? 1 : it->second;
  }
  std::map<std::string, int64_t> only;  // names not listed free one block
};

std::vector<int32_t> Ids(int n, int first = 1) {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) ids.push_back(first + i);
  return ids;
}

EngineRequest Prompt(int n, std::string session = "", int max_tokens = 1, int first = 1) {
  return {.tokens = Ids(n, first), .session = std::move(session), .max_tokens = max_tokens};
}

class SchedulerTest : public ::testing::Test {
 protected:
  SchedulerOptions Options() {
    return {.max_batch_tokens = 64,
            .prefix_cache = false,
            .vocab_size = 1000,
            .max_positions = 4096,
            .block_tokens = 4};
  }
  void Make(SchedulerOptions o) { s_ = std::make_unique<Scheduler>(std::move(o), kv_); }

  std::vector<Scheduler::Reply> Submit(std::vector<EngineRequest> requests) {
    for (const EngineRequest& r : requests) EXPECT_TRUE(s_->Check(r).ok());
    auto replies = s_->Submit(std::move(requests), now_);
    EXPECT_TRUE(replies.ok()) << replies.status();
    return std::move(*replies);
  }
  Scheduler::Reply SubmitOne(EngineRequest r) { return std::move(Submit({std::move(r)})[0]); }

  // Every item's next token is `token`; the step took one second.
  StepOutcome Ran(const StepPlan& plan, int32_t token = 7) {
    StepOutcome o;
    o.tokens.resize(plan.items.size());
    for (SampledToken& t : o.tokens) t.id = token;
    o.logits.resize(plan.items.size());
    o.timings.algorithms.resize(plan.items.size());
    o.timings.selections.resize(plan.items.size());
    o.seconds = 1;
    for (const StepPlan::Publish& p : plan.publish) o.published[p.kv_name] = KvHandle{};
    return o;
  }
  StepOutcome Refused(absl::Status why = KvCacheFullError("full")) {
    StepOutcome o;
    o.status = why;
    return o;
  }
  // Plans a step, runs it, answers it.
  StepPlan RunStep(int32_t token = 7) {
    StepPlan plan = s_->Plan(now_);
    Done(plan, Ran(plan, token));
    return plan;
  }
  void Done(StepPlan& plan, StepOutcome outcome) {
    now_ += seconds(1);
    if (plan.kind == StepPlan::kPrefill) s_->PrefillDone(plan, std::move(outcome), now_);
    if (plan.kind == StepPlan::kDecode) s_->DecodeDone(plan, std::move(outcome), now_);
    if (plan.kind == StepPlan::kEndSessions) s_->SessionsEnded(plan);
  }

  static bool Ready(const Scheduler::Reply& r) {
    return r.wait_for(seconds(0)) == std::future_status::ready;
  }

  FakeKv kv_;
  Clock::time_point now_ = Clock::time_point() + seconds(100);
  std::unique_ptr<Scheduler> s_;
};

TEST_F(SchedulerTest, BatchesFirstComeFirstServedUpToTheTokenBudget) {
  SchedulerOptions o = Options();
  o.max_batch_tokens = 10;
  Make(o);
  auto replies = Submit({Prompt(4, "", 1, 1), Prompt(4, "", 1, 11), Prompt(4, "", 1, 21)});
  StepPlan first = s_->Plan(now_);
  ASSERT_EQ(first.kind, StepPlan::kPrefill);
  ASSERT_EQ(first.batch.size(), 2u);  // 8 tokens; a third would make 12
  EXPECT_EQ(first.batch[0].tokens, Ids(4, 1));
  EXPECT_EQ(first.batch[1].tokens, Ids(4, 11));
  Done(first, Ran(first));
  EXPECT_TRUE(Ready(replies[0]) && Ready(replies[1]));
  EXPECT_FALSE(Ready(replies[2]));
  StepPlan second = RunStep();
  ASSERT_EQ(second.batch.size(), 1u);
  EXPECT_EQ(second.batch[0].tokens, Ids(4, 21));
  auto r = replies[2].get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->first_token, 7);
  EXPECT_EQ(r->finish_reason, "length");
  EXPECT_EQ(s_->stats().batches, 2);
}

TEST_F(SchedulerTest, ASessionsTurnsRunOneABatchInOrder) {
  Make(Options());
  auto turn1 = SubmitOne(Prompt(3, "chat", 1, 1));
  auto turn2 = SubmitOne(Prompt(2, "chat", 1, 50));
  auto other = SubmitOne(Prompt(5, "", 1, 100));
  StepPlan first = RunStep();
  ASSERT_EQ(first.batch.size(), 2u);  // turn 1 and the other request; turn 2 waits
  EXPECT_EQ(first.batch[0].session, "chat");
  EXPECT_EQ(first.batch[1].tokens, Ids(5, 100));
  StepPlan second = RunStep();
  ASSERT_EQ(second.batch.size(), 1u);
  EXPECT_EQ(second.batch[0].tokens, Ids(2, 50));  // only the new turn: the cache holds turn 1
  auto r = turn2.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, 3);
  EXPECT_EQ(s_->sessions(), std::vector<std::string>{"chat"});
}

TEST_F(SchedulerTest, PrefillBatchesAndDecodeStepsAlternate) {
  Make(Options());
  auto gen = SubmitOne(Prompt(4, "", 3));
  EXPECT_EQ(RunStep().kind, StepPlan::kPrefill);
  auto late = SubmitOne(Prompt(4, "", 1, 30));
  StepPlan decode = s_->Plan(now_);
  EXPECT_EQ(decode.kind, StepPlan::kDecode);  // the generation goes on before the new prompt
  ASSERT_EQ(decode.batch.size(), 1u);
  EXPECT_EQ(decode.batch[0].tokens, std::vector<int32_t>{7});
  EXPECT_EQ(s_->stats().running, 1);
  Done(decode, Ran(decode, 8));
  EXPECT_EQ(RunStep().kind, StepPlan::kPrefill);
  EXPECT_TRUE(Ready(late));
  StepPlan last = RunStep(9);
  EXPECT_EQ(last.kind, StepPlan::kDecode);
  EXPECT_EQ(last.step, 1u);  // PlanDecode's offset moves every step
  auto r = gen.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->token_ids(), (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(r->finish_reason, "length");
  EXPECT_EQ(s_->stats().generation_tokens, 4);  // three and the late prompt's one
}

TEST_F(SchedulerTest, AFullCacheEvictsTheLeastRecentlyUsedIdleSession) {
  Make(Options());
  SubmitOne(Prompt(3, "a"));
  RunStep();
  SubmitOne(Prompt(3, "b", 1, 10));
  RunStep();
  auto c = SubmitOne(Prompt(3, "c", 1, 20));
  StepPlan refused = s_->Plan(now_);
  Done(refused, Refused());
  EXPECT_EQ(s_->stats().evictions, 1);
  StepPlan retry = s_->Plan(now_);
  EXPECT_EQ(retry.end_sessions, std::vector<std::string>{"a"});  // dropped on every rank first
  ASSERT_EQ(retry.batch.size(), 1u);
  EXPECT_EQ(retry.batch[0].session, "c");
  Done(retry, Ran(retry));
  EXPECT_TRUE(c.get().ok());
  // a's next turn prefills its whole history again.
  auto again = SubmitOne(Prompt(2, "a", 1, 40));
  StepPlan turn = RunStep();
  std::vector<int32_t> history = Ids(3, 1);
  history.insert(history.end(), {40, 41});
  EXPECT_EQ(turn.batch[0].tokens, history);
  auto r = again.get();
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->recomputed);
  EXPECT_EQ(r->cached_tokens, 0);
}

TEST_F(SchedulerTest, AFullCacheWithNothingToEvictFailsTheRequestAlone) {
  Make(Options());
  auto a = SubmitOne(Prompt(3));
  StepPlan plan = s_->Plan(now_);
  Done(plan, Refused());
  auto r = a.get();
  EXPECT_TRUE(IsKvCacheFull(r.status())) << r.status();
  EXPECT_EQ(s_->stats().requests_failed, 1);
}

TEST_F(SchedulerTest, ABatchRefusedAsAWholeRetriesOneRequestAtATime) {
  Make(Options());
  auto good = SubmitOne(Prompt(3));
  auto bad = SubmitOne(Prompt(3, "", 1, 100));
  StepPlan both = s_->Plan(now_);
  ASSERT_EQ(both.batch.size(), 2u);
  Done(both, Refused(absl::InvalidArgumentError("the model refuses")));
  StepPlan one = s_->Plan(now_);
  ASSERT_EQ(one.batch.size(), 1u);
  Done(one, Ran(one));
  StepPlan other = s_->Plan(now_);
  ASSERT_EQ(other.batch.size(), 1u);
  Done(other, Refused(absl::InvalidArgumentError("token 100 is bad")));
  EXPECT_TRUE(good.get().ok());
  EXPECT_EQ(bad.get().status().message(), "token 100 is bad");
}

TEST_F(SchedulerTest, AFullDecodeStepPreemptsTheNewestGenerationByRecompute) {
  Make(Options());
  auto older = SubmitOne(Prompt(3, "", 5, 1));
  auto newer = SubmitOne(Prompt(3, "", 5, 10));
  StepPlan prefill = RunStep();
  ASSERT_EQ(prefill.batch.size(), 2u);
  const std::string newer_kv = prefill.batch[1].session;
  StepPlan decode = s_->Plan(now_);
  ASSERT_EQ(decode.kind, StepPlan::kDecode);
  Done(decode, Refused());
  EXPECT_EQ(s_->stats().preemptions, 1);
  // The newer one is queued again with what it had made, its KV dropped with the next step.
  StepPlan recompute = s_->Plan(now_);
  ASSERT_EQ(recompute.kind, StepPlan::kPrefill);
  EXPECT_EQ(recompute.end_sessions, std::vector<std::string>{newer_kv});
  ASSERT_EQ(recompute.batch.size(), 1u);
  std::vector<int32_t> again = Ids(3, 10);
  again.push_back(7);
  EXPECT_EQ(recompute.batch[0].tokens, again);
  Done(recompute, Ran(recompute, 8));
  for (int i = 0; i < 8 && !(Ready(older) && Ready(newer)); ++i) RunStep(9);
  auto r = newer.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->preemptions, 1);
  EXPECT_EQ(r->token_ids(), (std::vector<int32_t>{7, 8, 9, 9, 9}));
  EXPECT_EQ(older.get()->token_ids(), (std::vector<int32_t>{7, 9, 9, 9, 9}));
}

TEST_F(SchedulerTest, LeasesAreNeverEvictedAndEndByNonceOrExpiry) {
  Make(Options());
  s_->EnableLeases(2, std::chrono::seconds(30));
  auto published = SubmitOne({.tokens = Ids(3), .publish_kv = true});
  StepPlan plan = RunStep();
  ASSERT_EQ(plan.publish.size(), 1u);
  const StepPlan::Publish lease = plan.publish[0];
  auto r = published.get();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->kv_lease_s, 30);
  // A full cache with only the lease holding KV: the new request fails, the lease stays.
  auto refused = SubmitOne(Prompt(3, "", 1, 10));
  StepPlan full = s_->Plan(now_);
  Done(full, Refused());
  EXPECT_TRUE(IsKvCacheFull(refused.get().status()));
  EXPECT_EQ(s_->stats().kv_leases, 1);
  EXPECT_TRUE(absl::IsNotFound(s_->ReleaseKv(lease.request_id, "0xdead")));
  EXPECT_TRUE(absl::IsNotFound(s_->ReleaseKv("kv-999", lease.nonce.ToString())));
  auto renewed = s_->RenewKv(lease.request_id, lease.nonce.ToString(), now_);
  ASSERT_TRUE(renewed.ok());
  // Expired 30 s after the renewal: dropped with the next step.
  now_ += seconds(31);
  StepPlan idle = s_->Plan(now_);
  EXPECT_EQ(idle.kind, StepPlan::kHeartbeat);
  EXPECT_EQ(idle.end_sessions, std::vector<std::string>{lease.kv_name});
  EXPECT_EQ(s_->stats().kv_leases, 0);
  EXPECT_EQ(s_->stats().kv_leases_expired, 1);
}

TEST_F(SchedulerTest, AReleasedLeaseIsDroppedAndItsSlotReused) {
  Make(Options());
  s_->EnableLeases(1, std::chrono::seconds(30));
  SubmitOne({.tokens = Ids(3), .publish_kv = true});
  StepPlan plan = RunStep();
  const StepPlan::Publish lease = plan.publish[0];
  auto second = SubmitOne({.tokens = Ids(3, 9), .publish_kv = true});
  StepPlan none = s_->Plan(now_);  // every slot held: answered at once, not batched
  EXPECT_TRUE(none.batch.empty());
  EXPECT_TRUE(absl::IsUnavailable(second.get().status()));
  ASSERT_TRUE(s_->ReleaseKv(lease.request_id, lease.nonce.ToString()).ok());
  EXPECT_EQ(s_->Plan(now_).end_sessions, std::vector<std::string>{lease.kv_name});
  SubmitOne({.tokens = Ids(3, 20), .publish_kv = true});
  StepPlan next = RunStep();
  ASSERT_EQ(next.publish.size(), 1u);
  EXPECT_EQ(next.publish[0].slot, lease.slot);
  EXPECT_NE(next.publish[0].nonce, lease.nonce);
}

TEST_F(SchedulerTest, APromptForksTheLongestCachedPrefix) {
  SchedulerOptions o = Options();
  o.prefix_cache = true;
  Make(o);
  SubmitOne(Prompt(9));  // blocks of 4: two full blocks kept as an entry
  StepPlan first = RunStep();
  EXPECT_TRUE(first.forks.empty());
  EXPECT_EQ(s_->stats().prefix_entries, 1);
  std::vector<int32_t> shared = Ids(8);
  shared.insert(shared.end(), {500, 501, 502});
  auto second = SubmitOne({.tokens = shared});
  StepPlan plan = RunStep();
  ASSERT_EQ(plan.forks.size(), 1u);
  EXPECT_EQ(plan.forks[0].tokens, 8u);
  EXPECT_EQ(plan.forks[0].child, plan.batch[0].session);
  EXPECT_EQ(plan.batch[0].tokens, (std::vector<int32_t>{500, 501, 502}));
  EXPECT_EQ(second.get()->cached_tokens, 8);
  EXPECT_EQ(s_->stats().prefix_hits, 1);
}

TEST_F(SchedulerTest, SamplesOfOnePromptPrefillItOnce) {
  SchedulerOptions o = Options();
  o.prefix_cache = true;
  Make(o);
  auto replies = Submit({Prompt(9), Prompt(9)});
  StepPlan first = RunStep();
  ASSERT_EQ(first.batch.size(), 1u);  // the second waits for the first's entry
  StepPlan second = RunStep();
  ASSERT_EQ(second.forks.size(), 1u);
  EXPECT_EQ(second.batch[0].tokens, std::vector<int32_t>{9});
  EXPECT_EQ(replies[1].get()->cached_tokens, 8);
}

TEST_F(SchedulerTest, AFullCacheDropsAPrefixEntryBeforeASession) {
  SchedulerOptions o = Options();
  o.prefix_cache = true;
  Make(o);
  SubmitOne(Prompt(3, "idle"));
  RunStep();
  SubmitOne(Prompt(9, "", 1, 100));
  StepPlan entry = RunStep();
  const std::string name = entry.batch[0].session;
  auto c = SubmitOne(Prompt(5, "", 1, 300));
  StepPlan refused = s_->Plan(now_);
  Done(refused, Refused());
  EXPECT_EQ(s_->stats().prefix_evictions, 1);
  EXPECT_EQ(s_->stats().evictions, 0);
  EXPECT_EQ(s_->Plan(now_).end_sessions, std::vector<std::string>{name});
}

TEST_F(SchedulerTest, ASessionEndWaitsForTheRequestsBeforeIt) {
  Make(Options());
  auto turn = SubmitOne(Prompt(3, "chat"));
  std::future<absl::Status> ended = s_->EndSession("chat");
  std::future<absl::Status> unknown = s_->EndSession("nobody");
  EXPECT_EQ(RunStep().kind, StepPlan::kPrefill);
  StepPlan end = RunStep();
  EXPECT_EQ(end.kind, StepPlan::kEndSessions);
  EXPECT_EQ(end.end_sessions, std::vector<std::string>{"chat"});
  EXPECT_TRUE(ended.get().ok());
  RunStep();
  EXPECT_TRUE(absl::IsNotFound(unknown.get()));
  EXPECT_TRUE(s_->sessions().empty());
  EXPECT_TRUE(absl::IsNotFound(s_->EndSession("\x01gen-0").get()));  // the engine's own KV
}

TEST_F(SchedulerTest, RefusesWhatNoBatchCouldRunAndAFullQueue) {
  SchedulerOptions o = Options();
  o.max_queue = 2;
  Make(o);
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check(Prompt(0))));
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check(Prompt(65))));             // > max_batch_tokens
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check(Prompt(3, "", 1, 999))));  // id 1000
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check(Prompt(3, "a\nb"))));
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check(Prompt(3, "", 4095))));  // positions
  EXPECT_TRUE(absl::IsInvalidArgument(s_->Check({.tokens = Ids(3), .publish_kv = true})));
  Submit({Prompt(3), Prompt(3)});
  EXPECT_TRUE(absl::IsUnavailable(s_->Submit({Prompt(3)}, now_).status()));
  s_->Shutdown();
  EXPECT_TRUE(absl::IsFailedPrecondition(s_->Submit({Prompt(3)}, now_).status()));
  RunStep();
  EXPECT_EQ(s_->Plan(now_).kind, StepPlan::kShutdown);
}

TEST_F(SchedulerTest, TimesComeFromTheClockItIsGiven) {
  Make(Options());
  auto gen = SubmitOne(Prompt(3, "", 3));
  now_ += seconds(5);  // queued 5 s, the prefill takes 1 s
  RunStep();
  RunStep();
  RunStep();
  auto r = gen.get();
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(r->queue_s, 5);
  EXPECT_DOUBLE_EQ(r->prefill_s, 1);
  EXPECT_DOUBLE_EQ(r->decode_s, 2);
  EXPECT_DOUBLE_EQ(r->tpot_s(), 1);
}

TEST_F(SchedulerTest, AFaultAnswersEveryRequestHeld) {
  Make(Options());
  auto running = SubmitOne(Prompt(3, "", 4));
  RunStep();
  auto waiting = SubmitOne(Prompt(3, "", 1, 10));
  StepPlan plan = s_->Plan(now_);
  s_->FailAll(plan, absl::DeadlineExceededError("world rank 2 did not answer"));
  EXPECT_TRUE(absl::IsDeadlineExceeded(running.get().status()));
  EXPECT_TRUE(absl::IsDeadlineExceeded(waiting.get().status()));
  EXPECT_EQ(s_->Plan(now_).kind, StepPlan::kShutdown);
}

}  // namespace
}  // namespace cpfill::runtime
