#include "tests/mpi_test_main.h"

#include <chrono>
#include <cstdio>

#include "gtest/gtest.h"

namespace cpfill::testing {
namespace {
parallel::MpiRuntime* g_mpi = nullptr;
}  // namespace

parallel::MpiRuntime& Mpi() { return *g_mpi; }

}  // namespace cpfill::testing

int main(int argc, char** argv) {
  // A short deadline: a test that leaves a rank behind fails in a minute instead of hanging.
  auto mpi =
      cpfill::parallel::MpiRuntime::Create(&argc, &argv, {.timeout = std::chrono::seconds(120)});
  if (!mpi.ok()) {
    std::fprintf(stderr, "cannot start MPI: %s\n", mpi.status().ToString().c_str());
    return 2;
  }
  cpfill::testing::g_mpi = mpi->get();
  ::testing::InitGoogleTest(&argc, argv);
  if ((*mpi)->world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  auto world = (*mpi)->World();
  auto all_ok = cpfill::parallel::AllRanksOk(*world, rc == 0);
  if (!all_ok.ok()) (*mpi)->Abort(1, all_ok.status().ToString());
  if ((*mpi)->world_rank() == 0) {
    std::printf("[ mpi ] %d rank(s): %s\n", (*mpi)->world_size(),
                *all_ok ? "every rank passed" : "a rank failed");
  }
  world.reset();
  mpi->reset();
  return *all_ok ? 0 : 1;
}
