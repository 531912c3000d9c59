#include "launch/job/job.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/knobs.h"

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
  flags.Int("threads", &f->threads, "kernel threads per rank; 0 = host cores / host ranks")
      .Within({0, 4096});
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
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  std::unique_ptr<Job> job = Job::Start(&argc, &argv, job_flags);
  absl::StatusOr<parallel::ProcessGrid> grid = job->CreateGrid();
  if (!grid.ok()) return job->Refuse(grid.status());
  if (auto bad = job->CheckOutputs(flags.OutputPaths())) return *bad;
  return body(*job, *grid);
}

absl::StatusOr<parallel::ProcessGrid> Job::CreateGrid() {
  return parallel::CreateProcessGrid(*mpi_,
                                     {.tp = flags_.tp, .ranks_per_node = flags_.ranks_per_node});
}

int Job::ThreadsPerRank(const parallel::ProcessGrid& grid) const {
  if (flags_.threads > 0) return flags_.threads;
  const int cores = std::max(1u, std::thread::hardware_concurrency());
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
