#include "parallel/mpi_communicator.h"

#include <fcntl.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace cpfill {
namespace parallel::internal {
class ProgressEngine;
}
namespace {
std::atomic<int> g_world_rank{-1};
std::atomic<parallel::internal::ProgressEngine*> g_engine{nullptr};  // while an MpiRuntime lives
}  // namespace

namespace internal {
absl::Status MpiCallError(int code, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {0};
  int len = 0;
  MPI_Error_string(code, text, &len);
  return absl::InternalError(absl::StrCat("MPI call ", call, " failed on world rank ",
                                          g_world_rank.load(), ": ", text, " (", file, ":", line,
                                          ")"));
}
}  // namespace internal

namespace parallel {

size_t DataTypeSize(DataType type) {
  switch (type) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kFloat64:
    case DataType::kInt64:
      return 8;
  }
  return 0;
}

absl::StatusOr<bool> AllRanksOk(Communicator& comm, bool ok) {
  int32_t verdict = ok ? 1 : 0;
  CPFILL_RETURN_IF_ERROR(comm.AllReduce(&verdict, 1, DataType::kInt32, ReduceOp::kMin));
  return verdict == 1;
}

absl::StatusOr<std::vector<std::string>> AllGatherText(Communicator& comm,
                                                       const std::string& text) {
  const int n = comm.size();
  const int64_t mine = static_cast<int64_t>(text.size());
  std::vector<int64_t> lengths(n);
  CPFILL_RETURN_IF_ERROR(comm.AllGather(&mine, sizeof(mine), lengths.data()));
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  std::string padded = text;
  padded.resize(static_cast<size_t>(longest));
  std::string all(static_cast<size_t>(longest * n), '\0');
  if (longest > 0) CPFILL_RETURN_IF_ERROR(comm.AllGather(padded.data(), longest, all.data()));
  std::vector<std::string> out(n);
  for (int r = 0; r < n; ++r) out[r] = all.substr(static_cast<size_t>(r * longest), lengths[r]);
  return out;
}

namespace internal {

using Clock = std::chrono::steady_clock;

struct OpResult {
  absl::Status status;
  double transfer_s = 0;
};

// Posts requests on the progress thread. Returns an MPI error code (MPI_SUCCESS when posted).
using StartFn = std::function<int(std::vector<MPI_Request>* requests)>;

// What a rank tells a census: where it is in its communication (fixed size: one message).
struct CensusReply {
  int64_t ops_started = 0;
  double waiting_s = -1;  // how long its oldest pending operation has waited; -1: none pending
  double idle_s = 0;      // with none pending: since its last operation ended
  char what[200] = {0};   // the pending operation, or the last one
};

// Where a rank's process lives, gathered once at start-up: a silent rank on this rank's own
// kernel and pid namespace can be looked at (/proc) to tell a death from a stop.
struct PeerProcess {
  uint64_t kernel = 0;  // hash of the host name, boot id and pid namespace
  int64_t pid = 0;
};

PeerProcess ThisProcess() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::getline(std::ifstream("/proc/sys/kernel/random/boot_id"), boot_id);
  struct stat ns {};
  const uint64_t pid_ns = stat("/proc/self/ns/pid", &ns) == 0 ? uint64_t{ns.st_ino} : 0;
  // Without the boot id two hosts could match (a shared host name, and every host's initial
  // pid namespace has the same inode): then nobody's /proc is trusted (kernel 0: unknown).
  if (boot_id.empty() || pid_ns == 0) return {0, static_cast<int64_t>(getpid())};
  // std::hash, not absl::Hash: the same on every process of one build (absl::Hash is salted).
  const uint64_t kernel = std::hash<std::string>{}(absl::StrCat(host, "/", boot_id, "/", pid_ns));
  return {kernel, static_cast<int64_t>(getpid())};
}

// What /proc says of a process on this host.
enum class Fate { kUnknown, kRunning, kStopped, kDied };

Fate FateOf(const PeerProcess& peer, uint64_t this_kernel) {
  if (this_kernel == 0 || peer.kernel != this_kernel || peer.pid <= 0) return Fate::kUnknown;
  // Only a missing entry means gone: EMFILE (a server near its fd limit), ENOMEM or EACCES say
  // nothing of the peer, and a false "died" would end the whole job.
  const int fd = open(absl::StrCat("/proc/", peer.pid, "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH ? Fate::kDied : Fate::kUnknown;
  char buf[1024];
  const ssize_t n = read(fd, buf, sizeof(buf));
  const int read_errno = errno;
  close(fd);
  if (n < 0) return read_errno == ESRCH ? Fate::kDied : Fate::kUnknown;
  if (n == 0) return Fate::kDied;
  const std::string stat(buf, static_cast<size_t>(n));
  const size_t paren = stat.rfind(')');
  const char state = paren != std::string::npos && paren + 2 < stat.size() ? stat[paren + 2] : '?';
  if (state == 'Z' || state == 'X') return Fate::kDied;  // a zombie until its launcher reaps it
  if (state == 'T' || state == 't') return Fate::kStopped;
  return Fate::kRunning;
}

// One MPI thread for the whole process (see the header for why). Operations are started in the
// order submitted, so every rank posts its collectives in the same order as its caller did.
//
// The census: when an operation misses its deadline, this rank asks every other world rank, on a
// communicator of its own, where it is (an ask each, a CensusReply back), and waits a short,
// bounded time for the answers. Every progress thread keeps an ask posted and answers at once,
// also while its rank's main thread computes or is stuck elsewhere; a rank that is dead or
// stopped does not answer. The deadline message then says which ranks are late and why.
class ProgressEngine {
 public:
  // `peers`: every world rank's process (PeerProcess), indexed by world rank.
  ProgressEngine(MPI_Comm census, std::vector<PeerProcess> peers)
      : census_(census),
        peers_(std::move(peers)),
        this_kernel_(ThisProcess().kernel),
        thread_([this] { Loop(); }) {}
  ~ProgressEngine() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    // The progress thread is gone: this thread may make the last MPI calls.
    if (ask_req_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&ask_req_);
      MPI_Request_free(&ask_req_);
    }
    MPI_Comm_free(&census_);
  }

  void NoteWait(std::string what) {
    std::lock_guard<std::mutex> lock(wait_mu_);
    outside_wait_.emplace(std::move(what), Clock::now());
  }
  void EndWait() {
    std::lock_guard<std::mutex> lock(wait_mu_);
    outside_wait_.reset();
  }
  // The census from any thread: it runs on the progress thread, as every MPI call does.
  std::string CensusNow(std::chrono::milliseconds timeout) {
    auto text = std::make_shared<std::string>();
    auto done = Submit(
        "census of the world",
        [this, text](std::vector<MPI_Request>*) {
          *text = Census(active_, nullptr, kCensusWait);
          return MPI_SUCCESS;
        },
        timeout);
    if (done.wait_for(timeout + kCensusWait) != std::future_status::ready) return "";
    return *text;
  }

  // The ranks that did not answer an ask within kCensusWait, each with what became of it
  // (Silence), from any thread; on the progress thread. Nullopt when the probe itself could not
  // run in time.
  std::optional<std::vector<std::pair<int, std::string>>> SilentRanks() {
    auto silent = std::make_shared<std::vector<std::pair<int, std::string>>>();
    auto done = Submit(
        "liveness probe of the world",
        [this, silent](std::vector<MPI_Request>*) {
          const std::vector<std::optional<CensusReply>> got = Ask(active_, kCensusWait);
          for (size_t p = 0; p < got.size(); ++p) {
            if (!got[p]) silent->emplace_back(static_cast<int>(p), Silence(static_cast<int>(p)));
          }
          return MPI_SUCCESS;
        },
        kCensusWait * 2);
    if (done.wait_for(kCensusWait * 3) != std::future_status::ready) return std::nullopt;
    return *silent;
  }

  // From any thread: peers_ and this_kernel_ do not change.
  bool Died(int p) const {
    return p >= 0 && p < static_cast<int>(peers_.size()) &&
           FateOf(peers_[p], this_kernel_) == Fate::kDied;
  }

  std::future<OpResult> Submit(std::string description, StartFn start,
                               std::chrono::milliseconds timeout) {
    auto op = std::make_unique<Op>();
    op->description = std::move(description);
    op->start = std::move(start);
    op->timeout = timeout;
    std::future<OpResult> result = op->done.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(op));
    }
    cv_.notify_all();
    return result;
  }

 private:
  struct Op {
    std::string description;
    StartFn start;
    std::chrono::milliseconds timeout;
    Clock::time_point started;
    std::vector<MPI_Request> requests;
    std::promise<OpResult> done;
    std::optional<std::string> census;  // taken CensusWaitFor(timeout) before the deadline
  };

  void Loop() {
    std::vector<std::unique_ptr<Op>>& active = active_;
    int idle_polls = 0;
    while (true) {
      std::deque<std::unique_ptr<Op>> incoming;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (active.empty()) {
          // Idle: wake now and then to answer census asks.
          cv_.wait_for(lock, kIdlePoll, [&] { return stop_ || !queue_.empty(); });
        } else if (idle_polls > 64) {
          // Nothing completed for a while: back off, so four ranks on two cores leave the
          // compute threads their cycles; a new submission wakes us at once.
          const auto nap = std::chrono::microseconds(std::min(200, 5 * (idle_polls - 64)));
          cv_.wait_for(lock, nap, [&] { return stop_ || !queue_.empty(); });
        }
        if (stop_ && queue_.empty() && active.empty()) return;
        incoming.swap(queue_);
      }
      ServeAsks(active);
      WatchPeers();
      for (auto& op : incoming) {
        ++ops_started_;
        op->started = Clock::now();
        const int rc = op->start(&op->requests);
        if (rc != MPI_SUCCESS) {
          op->done.set_value(
              {cpfill::internal::MpiCallError(rc, op->description.c_str(), __FILE__, __LINE__)});
          continue;
        }
        active.push_back(std::move(op));
      }
      bool progressed = false;
      for (auto it = active.begin(); it != active.end();) {
        Op& op = **it;
        int flag = 1;
        int rc = MPI_SUCCESS;
        if (!op.requests.empty()) {
          rc = MPI_Testall(static_cast<int>(op.requests.size()), op.requests.data(), &flag,
                           MPI_STATUSES_IGNORE);
        }
        const auto now = Clock::now();
        const double elapsed = std::chrono::duration<double>(now - op.started).count();
        if (rc != MPI_SUCCESS) {
          op.done.set_value(
              {cpfill::internal::MpiCallError(rc, op.description.c_str(), __FILE__, __LINE__),
               elapsed});
        } else if (flag) {
          op.done.set_value({absl::OkStatus(), elapsed});
        } else if (!died_.empty()) {
          // A peer's process is gone: no operation of this job can be trusted to complete. The
          // requests are abandoned, as at a deadline.
          op.done.set_value({absl::UnavailableError(absl::StrCat(
                                 died_, "; world rank ", g_world_rank.load(), " was in ",
                                 op.description, " for ", absl::StrFormat("%.1f", elapsed), " s")),
                             elapsed});
        } else if (!op.census && now - op.started > op.timeout - CensusWaitFor(op.timeout)) {
          // The census is asked before the deadline, so that the job ends at the deadline and
          // not a census later (a rank's progress thread answers at once unless it is gone).
          op.census = Census(active, &op, CensusWaitFor(op.timeout));
          ++it;
          continue;
        } else if (now - op.started > op.timeout) {
          // MPI cannot cancel a collective; the requests are abandoned and the caller ends the
          // job, which is the only safe continuation.
          op.done.set_value(
              {absl::DeadlineExceededError(absl::StrCat(
                   "world rank ", g_world_rank.load(), ": ", op.description,
                   " did not complete within ", std::chrono::duration<double>(op.timeout).count(),
                   " s (a peer is dead, stuck or much slower; raise --timeout-s "
                   "if it is only slow). ",
                   op.census.value_or(""))),
               elapsed});
        } else {
          ++it;
          continue;
        }
        progressed = true;
        last_ended_ = Clock::now();
        last_what_ = op.description;
        it = active.erase(it);
      }
      idle_polls = progressed ? 0 : idle_polls + 1;
      if (!progressed && idle_polls <= 64) std::this_thread::yield();
    }
  }

  static constexpr std::chrono::milliseconds kIdlePoll{20};
  static constexpr std::chrono::milliseconds kCensusWait{2000};
  static constexpr std::chrono::milliseconds kPeerWatchEvery{100};

  // An operation's census: at most kCensusWait, and a quarter of its deadline, so that it
  // starts late enough to mean something.
  static std::chrono::milliseconds CensusWaitFor(std::chrono::milliseconds timeout) {
    return std::min(kCensusWait, timeout / 4);
  }

  // What became of a rank that did not answer a census, as far as this host can tell.
  std::string Silence(int p) const {
    const Fate fate =
        p < static_cast<int>(peers_.size()) ? FateOf(peers_[p], this_kernel_) : Fate::kUnknown;
    switch (fate) {
      case Fate::kDied:
        return absl::StrCat("world rank ", p, " died (its process ", peers_[p].pid, " is gone)");
      case Fate::kStopped:
        return absl::StrCat("world rank ", p, " stopped answering (process ", peers_[p].pid,
                            " is stopped by a signal)");
      default:
        return absl::StrCat("world rank ", p, " stopped answering (dead, stopped or cut off)");
    }
  }

  // Every kPeerWatchEvery: a rank on this host whose process is gone ends every operation at
  // once (died_), instead of at its deadline; its launcher ends the job soon after. Every rank
  // found gone in one look is named: which went first (the fault, or a rank that ended the job
  // on seeing it) cannot be told apart.
  void WatchPeers() {
    if (!died_.empty() || Clock::now() - peers_watched_ < kPeerWatchEvery) return;
    peers_watched_ = Clock::now();
    std::vector<std::string> gone;
    for (size_t p = 0; p < peers_.size(); ++p) {
      if (static_cast<int>(p) == g_world_rank.load()) continue;
      if (FateOf(peers_[p], this_kernel_) == Fate::kDied) gone.push_back(Silence(p));
    }
    died_ = absl::StrJoin(gone, "; ");
  }
  enum CensusTag : int { kTagAsk = 21, kTagReply = 22 };

  // This rank's answer: its oldest pending operation (the one it waits in), or its last one.
  CensusReply Describe(const std::vector<std::unique_ptr<Op>>& active) const {
    CensusReply r;
    r.ops_started = ops_started_;
    const auto now = Clock::now();
    std::string what = last_what_;
    std::optional<std::pair<std::string, Clock::time_point>> outside;
    {
      std::lock_guard<std::mutex> lock(wait_mu_);
      outside = outside_wait_;
    }
    if (!active.empty()) {
      r.waiting_s = std::chrono::duration<double>(now - active.front()->started).count();
      what = active.front()->description;
    } else if (outside) {  // a wait outside MPI (NCCL) counts as communication too
      r.waiting_s = std::chrono::duration<double>(now - outside->second).count();
      what = outside->first;
    } else {
      r.idle_s = std::chrono::duration<double>(now - last_ended_).count();
    }
    std::snprintf(r.what, sizeof(r.what), "%s", what.c_str());
    return r;
  }

  // Answers every ask that has arrived, and keeps one ask posted.
  void ServeAsks(const std::vector<std::unique_ptr<Op>>& active) {
    while (true) {
      if (ask_req_ == MPI_REQUEST_NULL) {
        if (MPI_Irecv(&ask_buf_, 1, MPI_INT64_T, MPI_ANY_SOURCE, kTagAsk, census_, &ask_req_) !=
            MPI_SUCCESS) {
          return;
        }
      }
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&ask_req_, &flag, &st) != MPI_SUCCESS || !flag) break;
      ask_req_ = MPI_REQUEST_NULL;
      replies_.push_back(std::make_unique<CensusReply>(Describe(active)));
      MPI_Request r;
      MPI_Isend(replies_.back().get(), sizeof(CensusReply), MPI_BYTE, st.MPI_SOURCE, kTagReply,
                census_, &r);
      MPI_Request_free(&r);  // the reply buffer lives as long as the engine
    }
  }

  // Every other rank's answer, or nothing from one that did not answer within `wait`.
  std::vector<std::optional<CensusReply>> Ask(const std::vector<std::unique_ptr<Op>>& active,
                                              std::chrono::milliseconds wait) {
    int me = 0, n = 1;
    MPI_Comm_rank(census_, &me);
    MPI_Comm_size(census_, &n);
    std::vector<CensusReply> got(n);
    std::vector<MPI_Request> asks(n, MPI_REQUEST_NULL), answers(n, MPI_REQUEST_NULL);
    // The ask's buffer must outlive a send that a dead peer never receives: the engine keeps it.
    asks_sent_.push_back(std::make_unique<int64_t>(ops_started_));
    const int64_t* ask = asks_sent_.back().get();
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      MPI_Irecv(&got[p], sizeof(CensusReply), MPI_BYTE, p, kTagReply, census_, &answers[p]);
      MPI_Isend(ask, 1, MPI_INT64_T, p, kTagAsk, census_, &asks[p]);
    }
    std::vector<bool> answered(n, false);
    const auto until = Clock::now() + wait;
    int missing = n - 1;
    // A rank found dead meanwhile will not answer: the operations end at once (died_).
    while (missing > 0 && Clock::now() < until && died_.empty()) {
      ServeAsks(active);
      WatchPeers();
      for (int p = 0; p < n; ++p) {
        if (p == me || answered[p]) continue;
        int flag = 0;
        MPI_Test(&answers[p], &flag, MPI_STATUS_IGNORE);
        if (flag) answered[p] = true, --missing;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    for (int p = 0; p < n; ++p) {
      if (answers[p] != MPI_REQUEST_NULL) {
        MPI_Cancel(&answers[p]);
        MPI_Request_free(&answers[p]);
      }
      if (asks[p] != MPI_REQUEST_NULL) MPI_Request_free(&asks[p]);
    }
    std::vector<std::optional<CensusReply>> replies(n);
    for (int p = 0; p < n; ++p) {
      if (p == me) replies[p] = Describe(active);
      if (answered[p]) replies[p] = got[p];
    }
    return replies;
  }

  // Asks every other rank where it is; waits `wait` at most; names who is late.
  std::string Census(const std::vector<std::unique_ptr<Op>>& active, const Op* late_op,
                     std::chrono::milliseconds wait) {
    const std::vector<std::optional<CensusReply>> got = Ask(active, wait);
    const int n = static_cast<int>(got.size());
    int me = 0;
    MPI_Comm_rank(census_, &me);
    if (n == 1) return "";
    std::string out = absl::StrCat("Census of the ", n, " world ranks (",
                                   absl::StrFormat("%g", wait.count() / 1e3), " s for answers):");
    std::vector<int> late;
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      if (!got[p]) {
        late.push_back(p);
        absl::StrAppend(&out, " ", Silence(p), ";");
      } else if (got[p]->waiting_s < 0) {
        late.push_back(p);
        absl::StrAppendFormat(&out,
                              " world rank %d is in no communication (busy or stuck elsewhere "
                              "for %.1f s; its last: %s);",
                              p, got[p]->idle_s, got[p]->what);
      } else {
        absl::StrAppendFormat(&out, " world rank %d waits in %s (%.1f s);", p, got[p]->what,
                              got[p]->waiting_s);
      }
    }
    if (late.empty()) {
      absl::StrAppend(&out, " every rank is communicating: a peer of ",
                      late_op ? late_op->description : "this wait",
                      " is in another operation (a mismatch) or much slower");
    } else {
      absl::StrAppend(&out, " late: world rank(s) ", absl::StrJoin(late, ", "), ".");
    }
    return out;
  }

  MPI_Comm census_;
  const std::vector<PeerProcess> peers_;
  const uint64_t this_kernel_;
  std::string died_;  // a peer found dead (Silence); the progress thread's alone
  Clock::time_point peers_watched_ = Clock::now();
  std::vector<std::unique_ptr<Op>> active_;  // the progress thread's alone
  mutable std::mutex wait_mu_;
  std::optional<std::pair<std::string, Clock::time_point>> outside_wait_;  // under wait_mu_
  MPI_Request ask_req_ = MPI_REQUEST_NULL;
  int64_t ask_buf_ = 0;
  std::vector<std::unique_ptr<CensusReply>> replies_;
  std::vector<std::unique_ptr<int64_t>> asks_sent_;
  int64_t ops_started_ = 0;
  Clock::time_point last_ended_ = Clock::now();
  std::string last_what_ = "none yet";
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Op>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace internal

namespace {

using internal::OpResult;
using internal::ProgressEngine;

// MPI counts are int: large messages travel as several pieces of at most this many bytes.
constexpr size_t kMaxPieceBytes = size_t{1} << 30;

int PostSend(const void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
             std::vector<MPI_Request>* reqs) {
  const char* p = static_cast<const char*>(buf);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += kMaxPieceBytes) {
    const int n = static_cast<int>(std::min(kMaxPieceBytes, bytes - off));
    MPI_Request r;
    const int rc = MPI_Isend(p + off, n, MPI_BYTE, peer, tag, comm, &r);
    if (rc != MPI_SUCCESS) return rc;
    reqs->push_back(r);
    if (bytes == 0) break;
  }
  return MPI_SUCCESS;
}

int PostRecv(void* buf, size_t bytes, int peer, int tag, MPI_Comm comm,
             std::vector<MPI_Request>* reqs) {
  char* p = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes || (bytes == 0 && off == 0); off += kMaxPieceBytes) {
    const int n = static_cast<int>(std::min(kMaxPieceBytes, bytes - off));
    MPI_Request r;
    const int rc = MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, comm, &r);
    if (rc != MPI_SUCCESS) return rc;
    reqs->push_back(r);
    if (bytes == 0) break;
  }
  return MPI_SUCCESS;
}

MPI_Datatype ToMpi(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return MPI_FLOAT;
    case DataType::kFloat64:
      return MPI_DOUBLE;
    case DataType::kInt32:
      return MPI_INT32_T;
    case DataType::kInt64:
      return MPI_INT64_T;
  }
  return MPI_BYTE;
}

MPI_Op ToMpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  return MPI_SUM;
}

enum Tag : int { kTagRing = 11, kTagAllToAll = 12, kTagAllGather = 13 };

// Waits for an engine result. The engine enforces the deadline for non-blocking operations; the
// extra margin here catches a progress thread stuck inside a blocking MPI call.
absl::Status Await(std::future<OpResult>& result, std::chrono::milliseconds timeout,
                   const std::string& description, double* transfer_s = nullptr) {
  if (result.wait_for(timeout + std::chrono::seconds(5)) != std::future_status::ready) {
    return absl::DeadlineExceededError(absl::StrCat(
        "world rank ", g_world_rank.load(), ": ", description, " did not complete within ",
        std::chrono::duration<double>(timeout).count(), " s (blocked inside MPI)"));
  }
  OpResult r = result.get();
  if (transfer_s) *transfer_s = r.transfer_s;
  return r.status;
}

class MpiExchange : public PendingExchange {
 public:
  MpiExchange(std::future<OpResult> result, std::chrono::milliseconds timeout,
              std::string description)
      : result_(std::move(result)), timeout_(timeout), description_(std::move(description)) {}
  ~MpiExchange() override {
    // The buffers belong to the caller: never let them go while MPI may still write them.
    if (!waited_ && result_.valid()) (void)Wait();
  }
  absl::Status Wait() override {
    waited_ = true;
    return Await(result_, timeout_, description_, &transfer_s_);
  }
  double transfer_s() const override { return transfer_s_; }

 private:
  std::future<OpResult> result_;
  std::chrono::milliseconds timeout_;
  std::string description_;
  double transfer_s_ = 0;
  bool waited_ = false;
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned, std::string name, ProgressEngine* engine,
                  CommOptions options)
      : comm_(comm), owned_(owned), name_(std::move(name)), engine_(engine), options_(options) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    if (owned_) {
      MPI_Comm comm = comm_;
      // MPI_Comm_free is local (no peer to wait for); run it on the MPI thread.
      auto done = engine_->Submit(
          "free communicator",
          [comm](std::vector<MPI_Request>*) mutable { return MPI_Comm_free(&comm); },
          options_.timeout);
      done.wait();
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  MPI_Comm comm() const { return comm_; }

  absl::StatusOr<std::unique_ptr<PendingExchange>> StartRingExchange(const void* send, void* recv,
                                                                     size_t bytes) override {
    const int next = next_rank(), prev = prev_rank();
    std::string what =
        absl::StrCat("ring exchange on ", name_, " (rank ", rank_, " of ", size_, "): send ", bytes,
                     " bytes to rank ", next, ", receive ", bytes, " bytes from rank ", prev);
    MPI_Comm comm = comm_;
    auto result = engine_->Submit(
        what,
        [=](std::vector<MPI_Request>* reqs) {
          const int rc = PostRecv(recv, bytes, prev, kTagRing, comm, reqs);
          return rc != MPI_SUCCESS ? rc : PostSend(send, bytes, next, kTagRing, comm, reqs);
        },
        options_.timeout);
    return std::make_unique<MpiExchange>(std::move(result), options_.timeout, std::move(what));
  }

  absl::Status AllToAll(const void* send, std::span<const size_t> send_bytes,
                        std::span<const size_t> send_offsets, void* recv,
                        std::span<const size_t> recv_bytes,
                        std::span<const size_t> recv_offsets) override {
    const size_t n = static_cast<size_t>(size_);
    CPFILL_CHECK_ARG(send_bytes.size() == n && send_offsets.size() == n && recv_bytes.size() == n &&
                         recv_offsets.size() == n,
                     "all-to-all on ", name_, ": size arrays must have ", n, " entries");
    size_t total_send = 0, total_recv = 0;
    for (size_t p = 0; p < n; ++p) total_send += send_bytes[p], total_recv += recv_bytes[p];
    const std::string what =
        absl::StrCat("all-to-all on ", name_, " (rank ", rank_, " of ", size_, "): send ",
                     total_send, " bytes, receive ", total_recv, " bytes");
    // Self copy first (no message needed); then one receive and one send per peer.
    if (send_bytes[rank_] > 0) {
      CPFILL_CHECK_ARG(send_bytes[rank_] == recv_bytes[rank_], "all-to-all on ", name_,
                       ": self block sizes differ");
      std::memmove(static_cast<char*>(recv) + recv_offsets[rank_],
                   static_cast<const char*>(send) + send_offsets[rank_], send_bytes[rank_]);
    }
    std::vector<size_t> sb(send_bytes.begin(), send_bytes.end()),
        so(send_offsets.begin(), send_offsets.end()), rb(recv_bytes.begin(), recv_bytes.end()),
        ro(recv_offsets.begin(), recv_offsets.end());
    MPI_Comm comm = comm_;
    const int me = rank_, np = size_;
    auto result = engine_->Submit(
        what,
        [=](std::vector<MPI_Request>* reqs) {
          for (int p = 0; p < np; ++p) {
            if (p == me || rb[p] == 0) continue;
            const int rc =
                PostRecv(static_cast<char*>(recv) + ro[p], rb[p], p, kTagAllToAll, comm, reqs);
            if (rc != MPI_SUCCESS) return rc;
          }
          for (int p = 0; p < np; ++p) {
            if (p == me || sb[p] == 0) continue;
            const int rc = PostSend(static_cast<const char*>(send) + so[p], sb[p], p, kTagAllToAll,
                                    comm, reqs);
            if (rc != MPI_SUCCESS) return rc;
          }
          return MPI_SUCCESS;
        },
        options_.timeout);
    return Await(result, options_.timeout, what);
  }

  absl::Status AllGather(const void* send, size_t bytes, void* recv) override {
    std::vector<size_t> sb(size_, bytes), so(size_, 0), rb(size_, bytes), ro(size_);
    for (int p = 0; p < size_; ++p) ro[p] = static_cast<size_t>(p) * bytes;
    return AllToAll(send, sb, so, recv, rb, ro);
  }

  absl::Status AllReduce(void* data, size_t count, DataType type, ReduceOp op) override {
    CPFILL_CHECK_ARG(count <= static_cast<size_t>(INT32_MAX), "all-reduce of ", count,
                     " elements is larger than one MPI call takes");
    const std::string what = absl::StrCat("all-reduce on ", name_, " (rank ", rank_, " of ", size_,
                                          "): ", count * DataTypeSize(type), " bytes");
    MPI_Comm comm = comm_;
    auto result = engine_->Submit(
        what,
        [=](std::vector<MPI_Request>* reqs) {
          MPI_Request r;
          const int rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), ToMpi(type),
                                        ToMpi(op), comm, &r);
          if (rc == MPI_SUCCESS) reqs->push_back(r);
          return rc;
        },
        options_.timeout);
    return Await(result, options_.timeout, what);
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    CPFILL_CHECK_ARG(root >= 0 && root < size_, "broadcast root ", root, " outside ", name_);
    const std::string what = absl::StrCat("broadcast on ", name_, " (rank ", rank_, " of ", size_,
                                          ") of ", bytes, " bytes from rank ", root);
    MPI_Comm comm = comm_;
    auto result = engine_->Submit(
        what,
        [=](std::vector<MPI_Request>* reqs) {
          char* p = static_cast<char*>(data);
          for (size_t off = 0; off < bytes; off += kMaxPieceBytes) {
            MPI_Request r;
            const int rc =
                MPI_Ibcast(p + off, static_cast<int>(std::min(kMaxPieceBytes, bytes - off)),
                           MPI_BYTE, root, comm, &r);
            if (rc != MPI_SUCCESS) return rc;
            reqs->push_back(r);
          }
          return MPI_SUCCESS;
        },
        options_.timeout);
    return Await(result, options_.timeout, what);
  }

  absl::Status Barrier() override {
    const std::string what =
        absl::StrCat("barrier on ", name_, " (rank ", rank_, " of ", size_, ")");
    MPI_Comm comm = comm_;
    auto result = engine_->Submit(
        what,
        [=](std::vector<MPI_Request>* reqs) {
          MPI_Request r;
          const int rc = MPI_Ibarrier(comm, &r);
          if (rc == MPI_SUCCESS) reqs->push_back(r);
          return rc;
        },
        options_.timeout);
    return Await(result, options_.timeout, what);
  }

 private:
  MPI_Comm comm_;
  bool owned_;
  std::string name_;
  ProgressEngine* engine_;
  CommOptions options_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

struct MpiRuntime::JobComm {
  MPI_Comm comm = MPI_COMM_NULL;
};

absl::StatusOr<std::unique_ptr<MpiRuntime>> MpiRuntime::Create(int* argc, char*** argv,
                                                               CommOptions options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  CPFILL_CHECK_ARG(!initialized, "MPI is already initialized in this process");
  int provided = 0;
  // MULTIPLE lets Abort() run from any thread; the progress thread alone makes MPI calls
  // otherwise, which needs SERIALIZED at least.
  CPFILL_MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  if (provided < MPI_THREAD_SERIALIZED) {
    MPI_Finalize();
    return absl::FailedPreconditionError(
        "this MPI library provides no thread support (need MPI_THREAD_SERIALIZED or better)");
  }
  std::unique_ptr<MpiRuntime> rt(new MpiRuntime());
  CPFILL_RETURN_IF_ERROR(rt->StartOn({MPI_COMM_WORLD}, options));
  return rt;
}

absl::StatusOr<std::unique_ptr<MpiRuntime>> MpiRuntime::Embed(const void* mpi_comm,
                                                              CommOptions options) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  CPFILL_CHECK_ARG(!finalized, "MPI was finalized already in this process");
  CPFILL_CHECK_ARG(initialized || mpi_comm == nullptr,
                   "a communicator was passed but MPI is not initialized");
  std::unique_ptr<MpiRuntime> rt(new MpiRuntime());
  rt->finalize_ = !initialized;
  int provided = 0;
  if (!initialized) {
    CPFILL_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_MULTIPLE) {
    return absl::FailedPreconditionError(
        absl::StrCat("MPI runs at thread level ", provided,
                     "; cpfill's progress thread and the program's "
                     "threads need MPI_THREAD_MULTIPLE (",
                     MPI_THREAD_MULTIPLE, ") from MPI_Init_thread"));
  }
  const MPI_Comm comm =
      mpi_comm == nullptr ? MPI_COMM_WORLD : *static_cast<const MPI_Comm*>(mpi_comm);
  CPFILL_RETURN_IF_ERROR(rt->StartOn({comm}, options));
  return rt;
}

absl::Status MpiRuntime::StartOn(const JobComm& comm, CommOptions options) {
  job_ = std::make_unique<JobComm>();
  CPFILL_MPI_CHECK(MPI_Comm_dup(comm.comm, &job_->comm));
  MPI_Comm_set_errhandler(job_->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(job_->comm, &world_rank_);
  MPI_Comm_size(job_->comm, &world_size_);
  g_world_rank = world_rank_;
  options_ = options;
  // The census of late ranks talks on a communicator of its own, apart from the job's traffic.
  MPI_Comm census = MPI_COMM_NULL;
  CPFILL_MPI_CHECK(MPI_Comm_dup(job_->comm, &census));
  MPI_Comm_set_errhandler(census, MPI_ERRORS_RETURN);
  // Blocking, like the dups above: the progress thread that gives later calls a deadline does
  // not run yet.
  std::vector<internal::PeerProcess> peers(static_cast<size_t>(world_size_));
  const internal::PeerProcess mine = internal::ThisProcess();
  CPFILL_MPI_CHECK(
      MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, peers.data(), sizeof(mine), MPI_BYTE, census));
  engine_ = std::make_unique<internal::ProgressEngine>(census, std::move(peers));
  g_engine = engine_.get();
  return absl::OkStatus();
}

MpiRuntime::~MpiRuntime() {
  g_engine = nullptr;
  engine_.reset();  // joins the progress thread: no MPI call runs past this point
  if (job_ && job_->comm != MPI_COMM_NULL) MPI_Comm_free(&job_->comm);
  if (finalize_) MPI_Finalize();
}

std::unique_ptr<Communicator> MpiRuntime::World() {
  return std::make_unique<MpiCommunicator>(job_->comm, /*owned=*/false, "world", engine_.get(),
                                           options_);
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiRuntime::Split(Communicator& parent, int color,
                                                                int key, std::string name) {
  auto* mpi_parent = dynamic_cast<MpiCommunicator*>(&parent);
  CPFILL_CHECK_ARG(mpi_parent != nullptr, "Split needs an MPI communicator");
  MPI_Comm parent_comm = mpi_parent->comm();
  auto out = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  const std::string what = absl::StrCat("split of ", parent.name(), " into ", name);
  // MPI_Comm_split is blocking; it runs on the progress thread and is waited on with a deadline.
  auto result = engine_->Submit(
      what,
      [=](std::vector<MPI_Request>*) { return MPI_Comm_split(parent_comm, color, key, out.get()); },
      options_.timeout);
  CPFILL_RETURN_IF_ERROR(Await(result, options_.timeout, what));
  MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(
      *out, /*owned=*/true, std::move(name), engine_.get(), options_));
}

absl::StatusOr<std::unique_ptr<Communicator>> MpiRuntime::SplitShared(Communicator& parent,
                                                                      std::string name) {
  auto* mpi_parent = dynamic_cast<MpiCommunicator*>(&parent);
  CPFILL_CHECK_ARG(mpi_parent != nullptr, "SplitShared needs an MPI communicator");
  MPI_Comm parent_comm = mpi_parent->comm();
  const int key = parent.rank();
  auto out = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  const std::string what = absl::StrCat("shared-memory split of ", parent.name());
  auto result = engine_->Submit(
      what,
      [=](std::vector<MPI_Request>*) {
        return MPI_Comm_split_type(parent_comm, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL,
                                   out.get());
      },
      options_.timeout);
  CPFILL_RETURN_IF_ERROR(Await(result, options_.timeout, what));
  MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(
      *out, /*owned=*/true, std::move(name), engine_.get(), options_));
}

void NoteWaitOutsideMpi(std::string what) {
  if (auto* e = g_engine.load()) e->NoteWait(std::move(what));
}

void EndWaitOutsideMpi() {
  if (auto* e = g_engine.load()) e->EndWait();
}

absl::Status WorldAnswers() {
  auto* e = g_engine.load();
  if (e == nullptr) return absl::OkStatus();
  const auto silent = e->SilentRanks();
  if (!silent) return absl::UnavailableError("the liveness probe of the world did not complete");
  if (silent->empty()) return absl::OkStatus();
  std::vector<int> ranks;
  std::vector<std::string> fates;
  for (const auto& [rank, fate] : *silent) ranks.push_back(rank), fates.push_back(fate);
  return absl::UnavailableError(absl::StrCat("world rank(s) ", absl::StrJoin(ranks, ", "),
                                             " did not answer: ", absl::StrJoin(fates, "; ")));
}

bool WorldRankDied(int world_rank) {
  auto* e = g_engine.load();
  return e != nullptr && e->Died(world_rank);
}

std::string CensusOfWorld(std::chrono::milliseconds timeout) {
  auto* e = g_engine.load();
  return e == nullptr ? "" : e->CensusNow(timeout);
}

void MpiRuntime::Abort(int code, const std::string& message) {
  std::fprintf(stderr, "cpfill: error on world rank %d: %s\n", world_rank_, message.c_str());
  std::fflush(stderr);
  // A rank on this host is gone: its launcher ends the job already, and an exit without
  // MPI_Finalize ends it as well. MPI_Abort would wait on the launcher (Open MPI's help message
  // about a second) while the launcher's SIGKILL comes.
  for (int p = 0; engine_ != nullptr && p < world_size_; ++p) {
    if (p != world_rank_ && engine_->Died(p)) std::_Exit(code);
  }
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; this keeps [[noreturn]] honest
}

}  // namespace parallel
}  // namespace cpfill
