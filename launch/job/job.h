// cpfill/launch/job/job.h — start-up and error policy shared by the distributed subcommands.
//
// Two kinds of failure, two policies:
//  * Bad input (flags, config, a grid that does not fit) is found identically by every rank
//    before any rank diverges: world rank 0 prints one message, every rank exits 2 cleanly.
//  * A failure while running (a peer timed out, a check could not be gathered, a file could not
//    be written) may be seen by one rank only: that rank prints it, naming itself, and aborts
//    the whole job at once, so no other rank waits for it.
//
//   FlagSet flags("prefill", "...");
//   flags.String("json", &json_file, "write the report as JSON to this file").Output();
//   return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
//     ...plan, run, report; job.Refuse(status) for a step's error...
//     return kExitOk;
//   });
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "launch/job/flags.h"
#include "nlohmann/json.hpp"
#include "parallel/grid.h"
#include "parallel/mpi_communicator.h"

namespace cpfill::launch {

// The process exit codes of every command: success, a failed check, bad input (flags, config; the
// same on every rank), a runtime failure.
inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitRuntimeError = 3;

struct JobFlags {
  int tp = 1;
  int ranks_per_node = 0;
  double timeout_s = 600;
  int threads = 0;  // per rank; 0 = host cores / ranks on the host
};

void AddJobFlags(FlagSet& flags, JobFlags* job_flags);

// Kernel threads per rank beyond this many per core of the host are refused: they only take
// turns on the cores, and a number the system cannot start would end the process where the
// pool is made (a thread the system refuses throws inside ThreadPool's constructor).
inline constexpr int kMaxThreadsPerCore = 8;

// The job's flags against this host, before MPI starts (the same on every rank of one host):
// InvalidArgument naming --threads above kMaxThreadsPerCore per core.
absl::Status CheckJobFlags(const JobFlags& job_flags);

// Whether this process can run `threads` more threads at once, now: it starts them (each waits
// for the last), then ends them. A thread the system refuses (ulimit -u or -v, a container's
// pids limit, memory a KV cache took) throws std::system_error where it is made, which inside a
// pool's constructor ends the process; what a command will start is tried here first.
// ResourceExhausted saying how many started, what limits them, and `remedy`, otherwise.
absl::Status CheckThreadsStart(int threads, const std::string& what, const std::string& remedy);
// CheckThreadsStart on every rank (each its own `threads`, 0: nothing to try), agreed over
// `world` (collective): every rank returns the same verdict, the lowest failing world rank's
// message naming it, so that Job::Refuse ends every rank with exit 2 and rank 0 prints it.
absl::Status CheckThreadsStartOnEveryRank(parallel::Communicator& world, int threads,
                                          const std::string& what, const std::string& remedy);

class Job;

// Bad flags, --help and malformed knobs, answered before any work: they are the same on every
// rank (same argv, mpirun -x), so the launcher's rank 0 alone prints (usage to stdout, the error
// to stderr) and no MPI is needed, which costs a launch nothing and cannot hang. Returns the exit
// code (0 after --help, 2 for bad input), or nullopt to go on. Commands without MPI use it too.
std::optional<int> AnswerFlagsFirst(const FlagSet& flags, const absl::Status& parsed);
// A command without MPI refusing its input: prints "cpfill: error: ..."; returns kExitBadInput.
int RefuseInput(const absl::Status& status);

// {name: value as text} of knobs::InEffect(), for reports (every --json, `cpfill env --json`).
nlohmann::ordered_json KnobsJson();

// A distributed command's work once its job has started: returns the exit code.
using JobBody = std::function<int(Job& job, parallel::ProcessGrid& grid)>;

// The start every distributed command shares, written once:
//  1. the job's flags (--tp, --ranks-per-node, --timeout-s, --threads) join `flags`, last;
//  2. argv[2..] is parsed; --help, bad flags (CheckJobFlags too) and malformed knobs are
//     answered before MPI starts (AnswerFlagsFirst);
//  3. MPI starts and the grid is built (one that does not fit the ranks: exit 2 on every rank);
//  4. every rank tries to start its kernel threads (CheckThreadsStart; one that cannot: exit 2
//     on every rank, naming --threads);
//  5. every output path the flags declare (FlagSet::Output) is tried (Job::CheckOutputs);
//  6. `body` runs, and its exit code is returned. A thread it cannot start or memory it cannot
//     get (std::system_error, std::bad_alloc thrown to here) ends the job as a runtime failure
//     naming the rank, not as an uncaught exception.
int RunJob(int argc, char** argv, FlagSet& flags, const JobBody& body);

class Job {
 public:
  // Starts MPI. Exits the process (code 3) if MPI itself cannot start.
  static std::unique_ptr<Job> Start(int* argc, char*** argv, const JobFlags& flags);
  // For a program that embeds cpfill (the C API): MPI as MpiRuntime::Embed (over `mpi_comm`, an
  // MPI_Comm*, or the world); a failure comes back instead of ending the process.
  static absl::StatusOr<std::unique_ptr<Job>> Embed(const JobFlags& flags, const void* mpi_comm);

  parallel::MpiRuntime& mpi() { return *mpi_; }
  bool is_root() const { return mpi_->world_rank() == 0; }
  int world_rank() const { return mpi_->world_rank(); }

  // Builds the process grid; config errors come back as InvalidArgument (same on every rank).
  absl::StatusOr<parallel::ProcessGrid> CreateGrid();
  // Worker threads for this rank's kernels (flag, or host cores shared among host ranks).
  int ThreadsPerRank(const parallel::ProcessGrid& grid) const;

  // The output files a command will write, {flag name, path} (empty paths skipped): world rank
  // 0 tries each (CheckWritable) before any work and every rank gets its verdict, so an
  // unwritable path is bad input (exit 2 on every rank), not a runtime failure at the end.
  // Returns kExitBadInput (the message printed on rank 0) or nullopt when all are writable.
  std::optional<int> CheckOutputs(const std::vector<std::pair<std::string, std::string>>& outputs);

  // Bad input, identical on every rank: rank 0 prints it; returns kExitBadInput.
  int ConfigError(const absl::Status& status);
  // A runtime failure: this rank prints it and the job ends on every rank.
  [[noreturn]] void Fail(const absl::Status& status);
  // Sorts a failed step by who can have seen it: InvalidArgument, FailedPrecondition,
  // NotFound (a missing input file) and ResourceExhausted (the KV capacity check is agreed by
  // all-reduce) come from checks every rank makes alike (ConfigError, returns kExitBadInput);
  // anything else is Fail (no return).
  int Refuse(const absl::Status& status);

  // Writes a --json report (call on the rank that built it) with "knobs": the environment's
  // knobs in effect, so a measurement records the switches it ran under. A failure to write
  // is a runtime failure (Fail).
  void WriteReport(const std::string& path, nlohmann::ordered_json report);

  // Runs `check` on world rank 0 only (it prints its findings) and gives every rank its
  // verdict: the --check of every command. A broadcast failure ends the job.
  bool VerdictFromRoot(parallel::Communicator& world, const std::function<bool()>& check);

  // printf on world rank 0 only, flushed (progress must show while work runs).
  template <typename... Args>
  void Print(const absl::FormatSpec<Args...>& format, const Args&... args) {
    if (!is_root()) return;
    std::fputs(absl::StrFormat(format, args...).c_str(), stdout);
    std::fflush(stdout);
  }

 private:
  std::unique_ptr<parallel::MpiRuntime> mpi_;
  JobFlags flags_;
};

}  // namespace cpfill::launch
