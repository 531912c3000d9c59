// cpfill/parallel/mpi_communicator.h — MPI host-memory Communicator and the MPI runtime.
//
// MpiRuntime owns MPI for the process: MPI_Init_thread in Create(), a progress thread, and
// MPI_Finalize (or MPI_Abort) at the end. Every MPI call after start-up runs on the progress
// thread, which posts non-blocking operations and polls them with MPI_Test until they complete
// or their deadline passes. That is what makes ring exchanges progress while the caller computes
// (Open MPI has no asynchronous progress of its own for shared-memory transfers) and what gives
// every wait a deadline: even a blocking call (MPI_Comm_split) is waited on with a timeout.
//
//   CPFILL_ASSIGN_OR_RETURN(auto mpi, MpiRuntime::Create(&argc, &argv, options));
//   std::unique_ptr<Communicator> world = mpi->World();
//   ...
//   mpi->Abort(1, "message");   // on an error that other ranks may not see: ends every rank
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"

namespace cpfill::parallel {

namespace internal {
class ProgressEngine;
}

// The census of late ranks for waits outside MPI (NCCL): while a rank waits in `what`, a census
// another rank takes reports it as communicating; CensusOfWorld() asks every world rank where it
// is (bounded) and returns the sentence that names the late ones ("" before MPI starts).
void NoteWaitOutsideMpi(std::string what);
void EndWaitOutsideMpi();
std::string CensusOfWorld(std::chrono::milliseconds timeout);

// Every world rank's progress thread answers within `wait` (a liveness probe: answered also
// while the rank computes, not by a rank that is dead or stopped). OK on one rank and before MPI
// starts; Unavailable naming the ranks that did not answer.
absl::Status WorldAnswers();

// Whether world rank `world_rank`'s process is known to be gone: only a rank on this host (same
// kernel and pid namespace) can be known so; false for any other, and before MPI starts. Every
// pending MPI operation fails at once (Unavailable, "world rank N died") when a rank on this host
// dies, instead of at its deadline.
bool WorldRankDied(int world_rank);

class MpiRuntime {
 public:
  static absl::StatusOr<std::unique_ptr<MpiRuntime>> Create(int* argc, char*** argv,
                                                            CommOptions options);
  // For a program that embeds cpfill: `mpi_comm` points at the MPI_Comm whose ranks form the job
  // (nullptr: MPI_COMM_WORLD). MPI is started here when the program has not (and finalized at the
  // end); a program that started it must have asked for MPI_THREAD_MULTIPLE, since its threads
  // and cpfill's progress thread may call MPI at once. The communicator is duplicated: cpfill's
  // traffic never mixes with the program's.
  static absl::StatusOr<std::unique_ptr<MpiRuntime>> Embed(const void* mpi_comm,
                                                           CommOptions options);
  ~MpiRuntime();  // stops the progress thread; finalizes MPI if it started it

  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }
  const CommOptions& options() const { return options_; }

  // A communicator over the job's ranks (MPI_COMM_WORLD, or the embedding program's).
  std::unique_ptr<Communicator> World();

  // Collective over `parent`: ranks with the same color form a group ordered by key (as
  // MPI_Comm_split), waited on with the deadline. `name` labels the group in messages.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(Communicator& parent, int color, int key,
                                                      std::string name);
  // Ranks of `parent` that share memory with this one (MPI_Comm_split_type SHARED).
  absl::StatusOr<std::unique_ptr<Communicator>> SplitShared(Communicator& parent, std::string name);

  // Ends every rank of the job at once: prints `message` (with this rank) to stderr, then
  // MPI_Abort(code). For errors other ranks may not know of (a timeout, a failed check).
  [[noreturn]] void Abort(int code, const std::string& message);

 private:
  MpiRuntime() = default;
  struct JobComm;  // the job's ranks: a duplicate this runtime owns
  absl::Status StartOn(const JobComm& comm, CommOptions options);
  bool finalize_ = true;  // MPI was started here
  std::unique_ptr<JobComm> job_;
  int world_rank_ = 0;
  int world_size_ = 1;
  CommOptions options_;
  std::unique_ptr<internal::ProgressEngine> engine_;
};

}  // namespace cpfill::parallel
