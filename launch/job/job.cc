#include "launch/job/job.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::launch {

void AddJobFlags(FlagSet& flags, JobFlags* f) {
  flags.Int("tp", &f->tp, "tensor-parallel group size; divides the ranks per node")
      .Within({1, 65536});
  flags
      .Int("ranks-per-node", &f->ranks_per_node,
           "cut each host into emulated nodes of R ranks (also CPFILL_RANKS_PER_NODE); "
           "0 = one node per host")
      .Within({0, 1 << 20});
  flags
      .Double("timeout-s", &f->timeout_s,
              "deadline of every distributed wait, seconds; a peer silent for longer ends the "
              "job with an error")
      .Within(Range::LeftOpen(0, 1e6));
  flags
      .Int("threads", &f->threads,
           absl::StrCat("kernel threads per rank, at most ", kMaxThreadsPerCore,
                        " per core of the host; 0 = host cores / host ranks"))
      .Within({0, 4096});
}

namespace {

int HostCores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

}  // namespace

absl::Status CheckJobFlags(const JobFlags& f) {
  const int64_t most = int64_t{kMaxThreadsPerCore} * HostCores();
  CPFILL_CHECK_ARG(f.threads <= most, "--threads ", f.threads, ": more than ", kMaxThreadsPerCore,
                   " per core of this host's ", HostCores(), " cores (at most ", most,
                   "; 0 shares the host's cores among its ranks)");
  return absl::OkStatus();
}

absl::Status CheckThreadsStart(int threads, const std::string& what, const std::string& remedy) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::vector<std::thread> started;
  std::string refused;
  try {
    started.reserve(static_cast<size_t>(std::max(0, threads)));
    for (int i = 0; i < threads; ++i) {
      started.emplace_back([&] {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return release; });
      });
    }
  } catch (const std::system_error& e) {
    refused = e.what();
  } catch (const std::bad_alloc& e) {
    refused = e.what();
  }
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  for (std::thread& t : started) t.join();
  if (refused.empty()) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      what, ": the system let this process start only ", started.size(), " of ", threads,
      " threads at once (", refused,
      "; the limits are ulimit -u and -v, a container's pids limit, and free memory); ", remedy));
}

absl::Status CheckThreadsStartOnEveryRank(parallel::Communicator& world, int threads,
                                          const std::string& what, const std::string& remedy) {
  const absl::Status mine =
      threads > 0 ? CheckThreadsStart(threads, what, remedy) : absl::OkStatus();
  CPFILL_ASSIGN_OR_RETURN(
      std::vector<std::string> refusals,
      parallel::AllGatherText(world, mine.ok() ? std::string() : std::string(mine.message())));
  for (size_t r = 0; r < refusals.size(); ++r) {
    if (!refusals[r].empty()) {
      return absl::ResourceExhaustedError(absl::StrCat("world rank ", r, ": ", refusals[r]));
    }
  }
  return absl::OkStatus();
}

namespace {

parallel::CommOptions CommOptionsFrom(const JobFlags& flags) {
  parallel::CommOptions options;
  const double timeout_s = flags.timeout_s > 0 ? flags.timeout_s : 600;
  options.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return options;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Job>> Job::Embed(const JobFlags& flags, const void* mpi_comm) {
  auto mpi = parallel::MpiRuntime::Embed(mpi_comm, CommOptionsFrom(flags));
  if (!mpi.ok()) return mpi.status();
  std::unique_ptr<Job> s(new Job());
  s->mpi_ = std::move(*mpi);
  s->flags_ = flags;
  return s;
}

std::unique_ptr<Job> Job::Start(int* argc, char*** argv, const JobFlags& flags) {
  auto mpi = parallel::MpiRuntime::Create(argc, argv, CommOptionsFrom(flags));
  if (!mpi.ok()) {
    std::fprintf(stderr, "cpfill: cannot start MPI: %s\n", mpi.status().ToString().c_str());
    std::exit(kExitRuntimeError);
  }
  std::unique_ptr<Job> s(new Job());
  s->mpi_ = std::move(*mpi);
  s->flags_ = flags;
  return s;
}

namespace {

// How long a rank other than 0 lingers before exiting on bad input (see AnswerFlagsFirst).
constexpr std::chrono::seconds kRefusalGrace{10};

// The world rank the launcher gave this process (mpirun, srun --mpi=pmix), or 0 alone: known
// before MPI starts, so a refusal found in the arguments prints once without any communication.
int LaunchRank() {
  for (std::string_view knob : {knobs::kLaunchRankOmpi, knobs::kLaunchRankPmix}) {
    if (const int64_t rank = knobs::Int(knob); rank >= 0) return static_cast<int>(rank);
  }
  return 0;
}

}  // namespace

std::optional<int> AnswerFlagsFirst(const FlagSet& flags, const absl::Status& parsed) {
  absl::Status refusal = parsed;
  if (refusal.ok() && !flags.help()) refusal = knobs::Validate();
  if (refusal.ok() && !flags.help()) return std::nullopt;
  if (LaunchRank() == 0) {
    if (!refusal.ok()) return RefuseInput(refusal);
    std::fputs(flags.Usage().c_str(), stdout);
    std::fflush(stdout);
  } else if (!refusal.ok()) {
    // mpirun tears the job down at the first non-zero exit: a rank that left at once could take
    // rank 0 with it before rank 0 (started later on a loaded host) has printed the only message.
    // Rank 0's own exit 2 ends this wait in the usual case; the bound keeps it from hanging
    // under a launcher that does not kill the rest.
    std::this_thread::sleep_for(kRefusalGrace);
  }
  return refusal.ok() ? kExitOk : kExitBadInput;
}

int RefuseInput(const absl::Status& status) {
  std::fprintf(stderr, "cpfill: error: %s\n", std::string(status.message()).c_str());
  std::fflush(stderr);
  return kExitBadInput;
}

int RunJob(int argc, char** argv, FlagSet& flags, const JobBody& body) {
  JobFlags job_flags;
  AddJobFlags(flags, &job_flags);
  absl::Status parsed = flags.Parse(argc, argv, 2);
  if (parsed.ok() && !flags.help()) parsed = CheckJobFlags(job_flags);
  if (auto done = AnswerFlagsFirst(flags, parsed)) return *done;
  std::unique_ptr<Job> job = Job::Start(&argc, &argv, job_flags);
  absl::StatusOr<parallel::ProcessGrid> grid = job->CreateGrid();
  if (!grid.ok()) return job->Refuse(grid.status());
  // The kernel pool starts later, inside a constructor that cannot report a refused thread.
  const int threads = job->ThreadsPerRank(*grid);
  if (absl::Status s = CheckThreadsStartOnEveryRank(
          *grid->world, threads,
          job_flags.threads > 0
              ? absl::StrCat("--threads ", threads)
              : absl::StrCat("the kernel pool's ", threads, " threads (--threads 0: the cores)"),
          "lower --threads");
      !s.ok()) {
    return job->Refuse(s);
  }
  if (auto bad = job->CheckOutputs(flags.OutputPaths())) return *bad;
  // What the checks above could not foresee (a thread or memory refused later, on this rank's
  // main thread) still ends the job with a message naming the rank (Fail), not an abort on an
  // uncaught exception.
  try {
    return body(*job, *grid);
  } catch (const std::system_error& e) {
    job->Fail(absl::ResourceExhaustedError(
        absl::StrCat("the system refused a resource (a thread, a file): ", e.what())));
  } catch (const std::bad_alloc& e) {
    job->Fail(absl::ResourceExhaustedError(absl::StrCat("out of memory (", e.what(), ")")));
  }
}

absl::StatusOr<parallel::ProcessGrid> Job::CreateGrid() {
  return parallel::CreateProcessGrid(*mpi_,
                                     {.tp = flags_.tp, .ranks_per_node = flags_.ranks_per_node});
}

int Job::ThreadsPerRank(const parallel::ProcessGrid& grid) const {
  if (flags_.threads > 0) return flags_.threads;
  const int cores = HostCores();
  // The cores are shared by every rank on the host, which may hold several (emulated) nodes:
  // The launcher says how many ranks it started here; the node size is the fallback.
  int host_ranks = grid.ranks_per_node;
  host_ranks = std::max(host_ranks, static_cast<int>(knobs::LocalRanks()));
  return std::max(1, cores / std::max(1, host_ranks));
}

void Job::WriteReport(const std::string& path, nlohmann::ordered_json report) {
  report["knobs"] = KnobsJson();
  if (absl::Status s = json::WriteFile(path, report); !s.ok()) {
    Fail(absl::Status(s.code(), absl::StrCat("--json: ", s.message())));
  }
}

nlohmann::ordered_json KnobsJson() {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& [name, value] : knobs::InEffect()) out[name] = value;
  return out;
}

bool Job::VerdictFromRoot(parallel::Communicator& world, const std::function<bool()>& check) {
  int32_t verdict = 1;
  if (is_root()) verdict = check() ? 1 : 0;
  if (absl::Status s = world.Broadcast(&verdict, sizeof(verdict), 0); !s.ok()) Fail(s);
  return verdict == 1;
}

std::optional<int> Job::CheckOutputs(
    const std::vector<std::pair<std::string, std::string>>& outputs) {
  absl::Status verdict = absl::OkStatus();
  if (is_root()) {
    for (const auto& [flag, path] : outputs) {
      if (path.empty()) continue;
      verdict = CheckWritable(flag, path);
      if (!verdict.ok()) break;
    }
  }
  int32_t ok = verdict.ok() ? 1 : 0;
  if (absl::Status s = mpi_->World()->Broadcast(&ok, sizeof(ok), 0); !s.ok()) Fail(s);
  if (ok == 1) return std::nullopt;
  return ConfigError(verdict);  // only rank 0 prints, and only it has the message
}

int Job::ConfigError(const absl::Status& status) {
  return is_root() ? RefuseInput(status) : kExitBadInput;
}

int Job::Refuse(const absl::Status& status) {
  if (absl::IsInvalidArgument(status) || absl::IsFailedPrecondition(status) ||
      absl::IsResourceExhausted(status) || absl::IsNotFound(status)) {
    return ConfigError(status);
  }
  Fail(status);
}

void Job::Fail(const absl::Status& status) { mpi_->Abort(kExitRuntimeError, status.ToString()); }

}  // namespace cpfill::launch
