// `cpfill serve`: the long-running prefill service. Every rank loads its share of the model and
// runs the engine loop; world rank 0 also serves HTTP (OpenAI-compatible /v1/completions with
// token ids, sessions, /health, /metrics). SIGTERM or SIGINT drains the queue and exits 0.
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "base/wall_clock.h"
#include "launch/commands/commands.h"
#include "launch/http/http_server.h"
#include "launch/job/engine_host.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "nlohmann/json.hpp"
#include "runtime/handoff/kv_handoff.h"
#include "runtime/serving/engine.h"

namespace cpfill::launch {
namespace {

struct ServeFlags {
  std::string host = "127.0.0.1", port_file, pid_file;
  int port = 8000;
  int http_threads = 64;
  bool log_json = false;
  bool kv_handoff = false;
  double kv_lease_s = 30;
  int kv_max_leases = 1024;
  int64_t kv_staging_tokens = 0;
  bool kv_handoff_staging = false;
  EngineFlags engine;
};

void DefineFlags(FlagSet& flags, ServeFlags* f) {
  AddEngineFlags(flags, &f->engine);
  flags.String("host", &f->host, "address rank 0 listens on");
  flags.Int("port", &f->port, "port rank 0 listens on (0: a free one, printed)").Within({0, 65535});
  flags.String("port-file", &f->port_file, "also write the port to this file once listening")
      .Output();
  flags
      .String("pid-file", &f->pid_file,
              "also write rank 0's process id to this file once listening (SIGTERM to it "
              "drains the queue and every rank exits 0; Open MPI's mpirun, signalled itself, "
              "exits 1 and kills the ranks after a few seconds)")
      .Output();
  flags
      .Int("http-threads", &f->http_threads,
           "HTTP requests answered at once (each holds a thread until its prefill ends)")
      .Within({1, 4096});
  flags.Bool("log-json", &f->log_json,
             "log one JSON object per line (start, each batch, stop) instead of text");
  flags.Bool("kv-handoff", &f->kv_handoff,
             "serve KV hand-offs to decode workers over UCX: a completion with "
             "kv_transfer_params {\"do_remote_decode\": true} keeps its KV under a lease and "
             "returns its handle (README: the KV hand-off)");
  flags
      .Double("kv-lease-s", &f->kv_lease_s,
              "seconds a hand-off's KV is held unless released first (renewable: POST "
              "/v1/kv/{id}/renew)")
      .Within(Range::LeftOpen(0, 86400));
  flags.Int("kv-max-leases", &f->kv_max_leases, "hand-offs held at once").Within({1, 1 << 20});
  flags
      .Int("kv-staging-tokens", &f->kv_staging_tokens,
           "where UCX cannot read GPU memory, hand-offs are copied to pinned host memory: its "
           "size per rank in tokens (0: the KV cache's)")
      .Within({0, kMaxTokens});
  flags.Bool("kv-handoff-staging", &f->kv_handoff_staging,
             "stage hand-offs through host memory even where UCX could read the KV cache itself "
             "(tests; a GPU cache without a CUDA-capable UCX is staged anyway)");
}

// Rank 0's log: a line of text per event, or with --log-json one JSON object per line (with
// "event" and a Unix "time") for log collectors.
class ServeLog {
 public:
  ServeLog(Job& job, bool json) : job_(job), json_(json) {}

  void Event(const std::string& event, nlohmann::ordered_json fields, const std::string& text) {
    if (!json_) {
      job_.Print("cpfill serve: %s\n", text);
      return;
    }
    nlohmann::ordered_json line = {{"event", event}, {"time", UnixSecondsNow()}};
    line.update(fields);
    job_.Print("%s\n", JsonText(line));
  }

  // `name`: the ring algorithm, or each request's when they differ (parallel::AlgorithmsName).
  void Batch(int requests, int64_t tokens, int64_t cached, const std::string& name, double s) {
    Event("batch",
          {{"requests", requests},
           {"new_tokens", tokens},
           {"cached_tokens", cached},
           {"algorithm", name},
           {"ms", s * 1e3}},
          absl::StrFormat("batch: %d request(s), %d new + %d cached tokens, %s, %.1f ms", requests,
                          tokens, cached, name, s * 1e3));
  }

 private:
  Job& job_;
  const bool json_;
};

// SIGTERM and SIGINT: the handler only writes the signal number to a pipe (async-signal-safe;
// a mask would not do, libraries start threads of their own before main); one thread reads it.
// On rank 0 the first starts the drain; elsewhere they are ignored, since rank 0's shutdown
// broadcast ends every rank once the queue is empty.
int stop_pipe[2] = {-1, -1};

// "cpfill-" and 16 hex digits from the system's entropy.
std::string RandomEngineId() {
  std::random_device device;
  const uint64_t bits = (uint64_t{device()} << 32) ^ device();
  return absl::StrCat("cpfill-", absl::Hex(bits, absl::kZeroPad16));
}

void OnStopSignal(int sig) {
  const char byte = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = write(stop_pipe[1], &byte, 1);
}

absl::Status InstallStopHandler() {
  if (pipe(stop_pipe) != 0) return absl::InternalError("cannot make the signal pipe");
  struct sigaction action {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGINT}) {
    if (sigaction(sig, &action, nullptr) != 0) {
      return absl::InternalError("cannot install the signal handler");
    }
  }
  return absl::OkStatus();
}

// The signal number once one arrives (blocks).
int WaitForStopSignal() {
  char byte = 0;
  while (read(stop_pipe[0], &byte, 1) != 1) {
  }
  return byte;
}

// Every rank, with --kv-handoff: the pool registered with UCX, every rank's reach gathered, the
// engine told; the engine id drawn on rank 0 so that a handle of an earlier server is refused.
absl::StatusOr<std::unique_ptr<runtime::KvHandoff>> StartKvHandoff(
    const ServeFlags& f, EngineHost& host, const parallel::ProcessGrid& grid, ServeLog& log) {
  runtime::Engine& engine = *host.engine;
  runtime::KvHandoffOptions options{
      .max_leases = f.kv_max_leases,
      .staging_tokens = f.kv_staging_tokens,
      .force_staging = f.kv_handoff_staging,
      .on_release =
          [&engine, &log](const std::string& payload) {
            if (absl::Status s = engine.ReleaseKvMessage(payload); !s.ok()) {
              log.Event("kv_release_ignored", {{"reason", s.message()}},
                        absl::StrCat("KV release ignored: ", s.message()));
            }
          },
      .on_note =
          [&log](const std::string& note) {
            log.Event("kv_message_ignored", {{"reason", note}},
                      absl::StrCat("KV hand-off: ", note));
          }};
  CPFILL_ASSIGN_OR_RETURN(auto handoff,
                          runtime::KvHandoff::Create(host.loaded.model->kv_cache(), *grid.world,
                                                     {.tp_rank = grid.tp_rank,
                                                      .tp_size = grid.tp_size,
                                                      .cp_rank = grid.cp_rank,
                                                      .cp_size = grid.cp_size},
                                                     std::move(options)));
  CPFILL_ASSIGN_OR_RETURN(std::vector<std::string> ids,
                          parallel::AllGatherText(*grid.world, RandomEngineId()));
  engine.AttachKvHandoff(handoff.get(), ids[0],
                         std::chrono::milliseconds(static_cast<int64_t>(f.kv_lease_s * 1e3)));
  log.Event("kv_handoff", {{"engine_id", ids[0]}, {"transport", handoff->description()}},
            absl::StrFormat("KV hand-off on (engine %s): %s, leases of %g s", ids[0],
                            handoff->description(), f.kv_lease_s));
  return handoff;
}

// Rank 0: listens, and tells every rank whether it could (collective).
absl::StatusOr<int> ListenAgreed(HttpFront* front, const ServeFlags& f,
                                 parallel::Communicator& world) {
  absl::StatusOr<int> port =
      front != nullptr ? front->Bind(f.host, f.port) : absl::StatusOr<int>(0);
  CPFILL_ASSIGN_OR_RETURN(bool all, parallel::AllRanksOk(world, port.ok()));
  if (!port.ok()) return port.status();
  if (!all) return absl::FailedPreconditionError("world rank 0 could not listen");
  return port;
}

// Rank 0: the HTTP front on its own thread, listening; a --port-file written.
std::thread StartFront(HttpFront& front, const ServeFlags& f, int port, Job& job,
                       const parallel::ProcessGrid& grid, ServeLog& log) {
  front.SetHealthy(true);
  std::thread http([&front] { front.Serve(); });
  log.Event("listening",
            {{"model", f.engine.model.name},
             {"host", f.host},
             {"port", port},
             {"layout", grid.Describe()}},
            absl::StrFormat("%s on http://%s:%d (%s); POST /v1/completions, GET /health, "
                            "/metrics, /v1/models, /v1/sessions",
                            f.engine.model.name, f.host, port, grid.Describe()));
  if (!f.pid_file.empty()) std::ofstream(f.pid_file) << getpid() << "\n";
  if (!f.port_file.empty()) std::ofstream(f.port_file) << port << "\n";
  return http;
}

// The first SIGTERM or SIGINT on rank 0 starts the drain (see InstallStopHandler). The watcher
// is joined when the engine has stopped: a signal arriving after that must not reach the front,
// the engine or the log, which are gone by then.
class StopWatcher {
 public:
  StopWatcher(Job& job, HttpFront* front, runtime::Engine& engine, ServeLog& log) {
    if (absl::Status s = InstallStopHandler(); !s.ok()) job.Fail(s);
    thread_ = std::thread([front, &engine, &log] {
      const int sig = WaitForStopSignal();
      if (sig == kWakeUp || front == nullptr) return;  // rank 0's broadcast ends other ranks
      log.Event("draining", {{"signal", sig}},
                absl::StrFormat("signal %d: draining the queue, then exiting", sig));
      front->SetHealthy(false);
      engine.Shutdown();
    });
  }
  // Wakes the watcher if no signal came (a second signal is not waited for) and joins it.
  ~StopWatcher() {
    const char byte = kWakeUp;
    [[maybe_unused]] ssize_t n = write(stop_pipe[1], &byte, 1);
    thread_.join();
  }

 private:
  static constexpr char kWakeUp = 0;  // no signal has number 0
  std::thread thread_;
};

// The command once its job has started: the engine (and its KV hand-off), rank 0's HTTP front,
// the engine's loop until rank 0 drains and stops.
int Serve(const ServeFlags& f, const FlagSet& flags, Job& job, const parallel::ProcessGrid& grid) {
  ServeLog log(job, f.log_json);

  runtime::EngineOptions engine_options;
  engine_options.on_batch = [&log](int requests, int64_t tokens, int64_t cached,
                                   const std::string& algo,
                                   double s) { log.Batch(requests, tokens, cached, algo, s); };
  auto host = BuildEngineHost(f.engine, flags, job, grid, engine_options);
  if (!host.ok()) return job.Refuse(host.status());
  runtime::Engine& engine = *(*host)->engine;
  // Declared after the host: unregistered before the KV cache it registered goes.
  std::unique_ptr<runtime::KvHandoff> handoff;
  if (f.kv_handoff) {
    auto started_handoff = StartKvHandoff(f, **host, grid, log);
    if (!started_handoff.ok()) return job.Refuse(started_handoff.status());
    handoff = *std::move(started_handoff);
  }

  // Rank 0 listens; every rank learns whether it could.
  std::unique_ptr<HttpFront> front;
  if (job.is_root()) {
    const runtime::Tokenizer* tokenizer = (*host)->tokenizer ? &*(*host)->tokenizer : nullptr;
    front = std::make_unique<HttpFront>(engine, *(*host)->loaded.model, f.engine.model.name,
                                        tokenizer, f.http_threads);
  }
  auto port = ListenAgreed(front.get(), f, *grid.world);
  if (!port.ok()) return job.Refuse(port.status());
  std::thread http;
  if (front) http = StartFront(*front, f, *port, job, grid, log);
  absl::Status ran;
  {
    StopWatcher stop_watcher(job, front.get(), engine, log);
    // Run until rank 0 shuts down (or a rank fails: the job ends with its error).
    ran = engine.Run();
  }
  if (front) {
    front->Stop();
    http.join();
  }
  if (!ran.ok()) job.Fail(ran);
  log.Event("stopped", {}, "stopped");
  return kExitOk;
}

}  // namespace

int RunServeCommand(int argc, char** argv) {
  ServeFlags f;
  FlagSet flags("serve",
                "a long-running prefill service: rank 0 serves HTTP (OpenAI-compatible "
                "completions with token ids, or text with a checkpoint's tokenizer; sessions, "
                "/health, /metrics), every rank prefills (under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags,
                [&](Job& job, parallel::ProcessGrid& grid) { return Serve(f, flags, job, grid); });
}

}  // namespace cpfill::launch
