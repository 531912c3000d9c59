// cpfill/tests/mpi_test_main.h — main() for GoogleTest binaries that run under mpirun.
//
// Starts MPI (through parallel::MpiRuntime, so waits have deadlines), lets only world rank 0
// print, runs the tests on every rank, and agrees on one verdict: every rank exits 0 only if
// every rank passed, so CTest sees the same result whichever rank failed.
#pragma once

#include "parallel/mpi_communicator.h"

namespace cpfill::testing {

// The process's MPI runtime, valid inside tests.
parallel::MpiRuntime& Mpi();

}  // namespace cpfill::testing
