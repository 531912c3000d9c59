// The C API (cpfill.h) on communicators the embedding program passes: a job of 5 ranks started
// by the program itself (MPI_Init_thread) splits MPI_COMM_WORLD into a group of 4 that runs one
// engine as TP2 x CP2 and a group of 1 that runs another alone. Both answer the same prompts and
// a two-turn session; the 4-rank engine must equal the single-rank one (first tokens; logits
// within 1e-3). The program talks over MPI_COMM_WORLD while the engines run, and MPI stays the
// program's: cpfill must not finalize it.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "launch/embed/cpfill.h"

namespace {

constexpr int kGroupA = 4;   // world ranks 0..3: TP2 x CP2; world rank 4: one rank
constexpr int kPrompts = 5;  // three prompts, then a session's two turns
const int kLens[kPrompts] = {300, 77, 1000, 300, 50};

std::vector<int32_t> Prompt(int i, int n, int64_t vocab) {
  std::vector<int32_t> ids(n);
  for (int j = 0; j < n; ++j) ids[j] = static_cast<int32_t>((int64_t{i} * 7919 + j * 31) % vocab);
  return ids;
}

struct Answer {
  int32_t first_token = -1;
  int64_t cached_tokens = -1;
  std::vector<float> logits;
};

// Rank 0 of an engine: the three prompts together, then the session's turns in order.
std::vector<Answer> Ask(cpfill_engine* e) {
  const int64_t vocab = cpfill_engine_vocab_size(e);
  std::vector<Answer> answers(kPrompts);
  std::vector<cpfill_request*> reqs(kPrompts, nullptr);
  auto finish = [&](int i) {
    cpfill_result res;
    EXPECT_EQ(cpfill_request_wait(reqs[i], 60.0), CPFILL_OK) << cpfill_last_error();
    ASSERT_EQ(cpfill_request_result(reqs[i], &res), CPFILL_OK) << cpfill_last_error();
    answers[i] = {res.first_token, res.cached_tokens,
                  std::vector<float>(res.logits, res.logits + res.vocab_size)};
    cpfill_request_free(reqs[i]);
  };
  for (int i = 0; i < kPrompts; ++i) {
    const bool session = i >= 3;
    std::vector<int32_t> ids = Prompt(i == 3 ? 0 : i == 4 ? 1 : i, kLens[i], vocab);
    EXPECT_EQ(cpfill_submit(e, ids.data(), ids.size(), session ? "chat" : nullptr, &reqs[i]),
              CPFILL_OK)
        << cpfill_last_error();
    if (session) finish(i);  // a turn waits for the one before it
  }
  for (int i = 0; i < 3; ++i) finish(i);
  EXPECT_EQ(cpfill_session_end(e, "chat"), CPFILL_OK) << cpfill_last_error();
  return answers;
}

std::vector<const char*> Flags(bool group_a) {
  std::vector<const char*> f = {
      "--model", "tiny",        "--backend", "cpu", "--threads", "1", "--kv-capacity-tokens",
      "8192",    "--timeout-s", "60"};
  if (group_a) {
    f.insert(f.end(), {"--tp", "2", "--ranks-per-node", "2"});
  } else {
    f.insert(f.end(), {"--tp", "1", "--ranks-per-node", "1"});
  }
  return f;
}

// The single-rank engine's answers go to world rank 0 over the program's own MPI_COMM_WORLD.
void SendAnswers(const std::vector<Answer>& answers, int to) {
  for (const Answer& a : answers) {
    int64_t head[2] = {a.first_token, a.cached_tokens};
    MPI_Send(head, 2, MPI_INT64_T, to, 0, MPI_COMM_WORLD);
    MPI_Send(a.logits.data(), static_cast<int>(a.logits.size()), MPI_FLOAT, to, 1, MPI_COMM_WORLD);
  }
}

std::vector<Answer> ReceiveAnswers(int from, int64_t vocab) {
  std::vector<Answer> answers(kPrompts);
  for (Answer& a : answers) {
    int64_t head[2];
    MPI_Recv(head, 2, MPI_INT64_T, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    a.first_token = static_cast<int32_t>(head[0]);
    a.cached_tokens = head[1];
    a.logits.resize(vocab);
    MPI_Recv(a.logits.data(), static_cast<int>(vocab), MPI_FLOAT, from, 1, MPI_COMM_WORLD,
             MPI_STATUS_IGNORE);
  }
  return answers;
}

TEST(EmbedOnProgramCommunicator, SplitGroupsRunTheirOwnEnginesAndAgree) {
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  ASSERT_EQ(world_size, kGroupA + 1) << "run under mpirun -np " << kGroupA + 1;
  const bool group_a = world_rank < kGroupA;
  MPI_Comm group = MPI_COMM_NULL;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, group_a ? 0 : 1, world_rank, &group), MPI_SUCCESS);

  std::vector<const char*> flags = Flags(group_a);
  cpfill_engine* e = nullptr;
  ASSERT_EQ(cpfill_engine_create(static_cast<int>(flags.size()), flags.data(), &group, &e),
            CPFILL_OK)
      << cpfill_last_error();
  int group_rank = -1;
  MPI_Comm_rank(group, &group_rank);
  EXPECT_EQ(cpfill_engine_rank(e), group_rank);
  EXPECT_EQ(cpfill_engine_size(e), group_a ? kGroupA : 1);
  const int64_t vocab = cpfill_engine_vocab_size(e);

  std::vector<Answer> mine;
  if (cpfill_engine_rank(e) == 0) {
    mine = Ask(e);
    EXPECT_EQ(cpfill_engine_shutdown(e), CPFILL_OK) << cpfill_last_error();
  } else {
    EXPECT_EQ(cpfill_engine_run(e), CPFILL_OK) << cpfill_last_error();
  }
  cpfill_engine_destroy(e);

  // MPI is still the program's, and so is MPI_COMM_WORLD.
  int finalized = 1;
  MPI_Finalized(&finalized);
  EXPECT_EQ(finalized, 0) << "cpfill finalized MPI that the program had started";
  if (world_rank == kGroupA) SendAnswers(mine, 0);
  if (world_rank == 0) {
    const std::vector<Answer> single = ReceiveAnswers(kGroupA, vocab);
    ASSERT_EQ(mine.size(), single.size());
    for (int i = 0; i < kPrompts; ++i) {
      SCOPED_TRACE("prompt " + std::to_string(i));
      EXPECT_EQ(mine[i].first_token, single[i].first_token);
      EXPECT_EQ(mine[i].cached_tokens, single[i].cached_tokens);
      ASSERT_EQ(mine[i].logits.size(), static_cast<size_t>(vocab));
      double worst = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        worst = std::fmax(worst, std::fabs(double(mine[i].logits[v]) - single[i].logits[v]));
      }
      EXPECT_LE(worst, 1e-3);
    }
    EXPECT_EQ(mine[4].cached_tokens, kLens[3]) << "the second turn did not reuse the first's KV";
  }
  MPI_Comm_free(&group);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int ok = RUN_ALL_TESTS() == 0 ? 1 : 0;
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("[ mpi ] %s\n", all_ok ? "every rank passed" : "a rank failed");
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
