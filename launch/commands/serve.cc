// `cpfill serve`: the long-running prefill service. Every rank loads its share of the model and
// runs the engine loop; world rank 0 also serves HTTP (OpenAI-compatible /v1/completions with
// token ids, sessions, /health, /metrics). SIGTERM or SIGINT drains the queue and exits 0; what
// is still running after --drain-timeout-s is cancelled and answered 503.
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
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
#include "parallel/mpi_communicator.h"
#include "runtime/handoff/kv_handoff.h"
#include "runtime/serving/engine.h"

namespace cpfill::launch {
namespace {

struct ServeFlags {
  std::string host = "127.0.0.1", port_file, pid_file;
  int port = 8000;
  int http_threads = 64;
  std::string api_key, api_key_file;
  int max_connections = 512;
  int64_t max_body_bytes = kMaxBodyBytes;
  int64_t max_pending_bytes = 0;  // 0: kPendingBodies x max_body_bytes
  double header_timeout_s = 10, read_timeout_s = 30, keep_alive_s = 5, drain_timeout_s = 30;
  int keep_alive_requests = 100;
  bool log_json = false;
  std::string chat_template_renderer;
  double chat_render_timeout_s = 2;
  bool kv_handoff = false;
  double kv_lease_s = 30;
  int kv_max_leases = 1024;
  int64_t kv_staging_tokens = 0;
  bool kv_handoff_staging = false;
  EngineFlags engine;
};

// --max-pending-bytes left at 0: room for this many bodies of --max-body-bytes.
constexpr int64_t kPendingBodies = 4;

// The HTTP front's flags (README: Security).
void DefineHttpFlags(FlagSet& flags, ServeFlags* f) {
  flags.String("api-key", &f->api_key,
               "every route but /health and /metrics needs \"Authorization: Bearer KEY\" "
               "(401 otherwise); a key on the command line is visible to other users of the "
               "host: prefer --api-key-file or the environment's CPFILL_API_KEY");
  flags.String("api-key-file", &f->api_key_file,
               "read the API key from this file (its trailing line break dropped)");
  flags
      .Int("max-connections", &f->max_connections,
           "client connections held at once (waiting for a request, answered or kept alive); "
           "one more is answered 503 at once")
      .Within({1, 65536});
  flags
      .Int("max-body-bytes", &f->max_body_bytes,
           "the largest request body, fixed or chunked (413 past it, before it is read)")
      .Within({1, 1ll << 40});
  flags
      .Int("max-pending-bytes", &f->max_pending_bytes,
           "request body bytes held at once by requests being read or answered; 503 with "
           "Retry-After past it (0: 4 x --max-body-bytes)")
      .Within({0, 1ll << 42});
  flags
      .Double("header-timeout-s", &f->header_timeout_s,
              "seconds a request's line and headers have to arrive whole (408 after)")
      .Within(Range::LeftOpen(0, 3600));
  flags
      .Double("read-timeout-s", &f->read_timeout_s,
              "the longest pause, in seconds, within a request's body or in taking an answer")
      .Within(Range::LeftOpen(0, 3600));
  flags
      .Double("keep-alive-s", &f->keep_alive_s,
              "seconds an idle connection is kept for its next request")
      .Within(Range::LeftOpen(0, 3600));
  flags
      .Int("keep-alive-requests", &f->keep_alive_requests,
           "requests answered on one connection before it is closed")
      .Within({1, 1 << 20});
  flags
      .Double("drain-timeout-s", &f->drain_timeout_s,
              "after SIGTERM, seconds the queue has to drain; requests still running then are "
              "cancelled and answered 503")
      .Within(Range::LeftOpen(0, 86400));
}

// The front's options from the flags; the key from --api-key, --api-key-file or CPFILL_API_KEY.
// World rank 0 alone reads them (the others agree through ListenAgreed).
absl::StatusOr<HttpOptions> HttpOptionsFrom(const ServeFlags& f) {
  HttpOptions o;
  // Not a knob (base/knobs.h): knobs are recorded in reports, and a secret must not be.
  CPFILL_ASSIGN_OR_RETURN(o.api_key,
                          ApiKeyFrom(f.api_key, f.api_key_file, std::getenv("CPFILL_API_KEY")));
  const auto ms = [](double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1e3)); };
  o.threads = f.http_threads;
  o.max_connections = f.max_connections;
  o.max_body_bytes = static_cast<size_t>(f.max_body_bytes);
  o.max_pending_bytes = static_cast<size_t>(
      f.max_pending_bytes > 0 ? f.max_pending_bytes : kPendingBodies * f.max_body_bytes);
  CPFILL_CHECK_ARG(o.max_pending_bytes >= o.max_body_bytes, "--max-pending-bytes ",
                   f.max_pending_bytes, " is below --max-body-bytes ", f.max_body_bytes,
                   ": no body of the largest size could be taken");
  o.head_timeout = ms(f.header_timeout_s);
  o.read_timeout = ms(f.read_timeout_s);
  o.keep_alive_timeout = ms(f.keep_alive_s);
  o.keep_alive_requests = f.keep_alive_requests;
  o.max_prompt_tokens = f.engine.max_batch_tokens;
  o.chat_template_renderer = f.chat_template_renderer;
  o.chat_render_timeout = ms(f.chat_render_timeout_s);
  return o;
}

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
  DefineHttpFlags(flags, f);
  flags.String("chat-template-renderer", &f->chat_template_renderer,
               "serve /v1/chat/completions: rank 0 runs this command (through /bin/sh) as a "
               "co-process that renders conversations, one JSON line in and out, e.g. "
               "\"python3 launch/http/render_chat.py --model-dir DIR\" (launch/http/README.md)");
  flags
      .Double("chat-render-timeout-s", &f->chat_render_timeout_s,
              "longest one chat template rendering may take; past it the renderer is restarted "
              "and the request answered 503")
      .Within(Range::LeftOpen(0, 600));
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
      .Within(Range::LeftOpen(0, 86400))
      .Requires("kv-handoff");
  flags.Int("kv-max-leases", &f->kv_max_leases, "hand-offs held at once")
      .Within({1, 1 << 20})
      .Requires("kv-handoff");
  flags
      .Int("kv-staging-tokens", &f->kv_staging_tokens,
           "where UCX cannot read GPU memory, hand-offs are copied to pinned host memory: its "
           "size per rank in tokens (0: the KV cache's)")
      .Within({0, kMaxTokens})
      .Requires("kv-handoff");
  flags
      .Bool("kv-handoff-staging", &f->kv_handoff_staging,
            "stage hand-offs through host memory even where UCX could read the KV cache itself "
            "(tests; a GPU cache without a CUDA-capable UCX is staged anyway)")
      .Requires("kv-handoff");
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

// Async-signal-safe: one write to a non-blocking pipe (a full pipe already holds a stop), errno
// kept for the code the signal interrupted.
void OnStopSignal(int sig) {
  const int saved_errno = errno;
  const char byte = static_cast<char>(sig);
  [[maybe_unused]] ssize_t n = write(stop_pipe[1], &byte, 1);
  errno = saved_errno;
}

absl::Status InstallStopHandler() {
  if (pipe2(stop_pipe, O_CLOEXEC) != 0 ||
      fcntl(stop_pipe[1], F_SETFL, fcntl(stop_pipe[1], F_GETFL) | O_NONBLOCK) != 0) {
    return absl::InternalError("cannot make the signal pipe");
  }
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

// The signal number once one arrives, or -1 once `within` has passed (never, by default).
int WaitForStopSignal(std::chrono::milliseconds within = std::chrono::milliseconds::max()) {
  const auto deadline = within == std::chrono::milliseconds::max()
                            ? std::chrono::steady_clock::time_point::max()
                            : std::chrono::steady_clock::now() + within;
  for (;;) {
    int timeout_ms = -1;
    if (deadline != std::chrono::steady_clock::time_point::max()) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return -1;
      timeout_ms = static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
    }
    pollfd p{stop_pipe[0], POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) continue;  // EINTR, or the deadline (checked above)
    char byte = 0;
    if (read(stop_pipe[0], &byte, 1) == 1) return byte;
  }
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

// Rank 0: listens (unless its front could not be made: `made`), and tells every rank whether it
// could (collective).
absl::StatusOr<int> ListenAgreed(HttpFront* front, const absl::Status& made, const ServeFlags& f,
                                 parallel::Communicator& world) {
  absl::StatusOr<int> port = !made.ok()         ? absl::StatusOr<int>(made)
                             : front != nullptr ? front->Bind(f.host, f.port)
                                                : absl::StatusOr<int>(0);
  CPFILL_ASSIGN_OR_RETURN(bool all, parallel::AllRanksOk(world, port.ok()));
  if (!port.ok()) return port.status();
  if (!all) return absl::FailedPreconditionError("world rank 0 could not listen");
  return port;
}

// Rank 0: the HTTP front on its own thread, listening; a --port-file written. The log says
// whether an API key is needed (never the key).
std::thread StartFront(HttpFront& front, bool keyed, const ServeFlags& f, int port, Job& job,
                       const parallel::ProcessGrid& grid, ServeLog& log) {
  front.SetHealthy(true);
  std::thread http([&front] { front.Serve(); });
  log.Event("listening",
            {{"model", f.engine.model.name},
             {"host", f.host},
             {"port", port},
             {"layout", grid.Describe()},
             {"api_key", keyed}},
            absl::StrFormat("%s on http://%s:%d (%s); POST /v1/completions%s, GET /health, "
                            "/metrics, /v1/models, /v1/sessions; %s",
                            f.engine.model.name, f.host, port, grid.Describe(),
                            f.chat_template_renderer.empty() ? "" : ", /v1/chat/completions",
                            keyed ? "an API key is needed but for /health and /metrics"
                                  : "no API key is needed"));
  if (!keyed && f.host != "127.0.0.1" && f.host != "localhost" && f.host != "::1") {
    log.Event("unprotected", {{"host", f.host}},
              absl::StrFormat("warning: --host %s without an API key: anyone who reaches it "
                              "can use it (--api-key-file, or CPFILL_API_KEY)",
                              f.host));
  }
  if (!f.pid_file.empty()) std::ofstream(f.pid_file) << getpid() << "\n";
  if (!f.port_file.empty()) std::ofstream(f.port_file) << port << "\n";
  return http;
}

// The first SIGTERM or SIGINT on rank 0 starts the drain (see InstallStopHandler); once
// `drain_timeout` has passed, or at a second signal, what still runs is cancelled and answered
// 503 (HttpFront::ExpireDrain). The watcher is joined when the engine has stopped: a signal
// arriving after that must not reach the front, the engine or the log, which are gone by then.
class StopWatcher {
 public:
  StopWatcher(Job& job, HttpFront* front, runtime::Engine& engine, ServeLog& log,
              std::chrono::milliseconds drain_timeout) {
    if (absl::Status s = InstallStopHandler(); !s.ok()) job.Fail(s);
    thread_ = std::thread([front, &engine, &log, drain_timeout] {
      const int sig = WaitForStopSignal();
      if (sig == kWakeUp || front == nullptr) return;  // rank 0's broadcast ends other ranks
      log.Event("draining", {{"signal", sig}, {"drain_timeout_s", drain_timeout.count() / 1e3}},
                absl::StrFormat("signal %d: draining the queue (at most %g s), then exiting", sig,
                                drain_timeout.count() / 1e3));
      front->SetHealthy(false);
      engine.Shutdown();
      const int next = WaitForStopSignal(drain_timeout);
      if (next == kWakeUp) return;  // drained in time
      log.Event("drain_expired", {{"signal", next}},
                next < 0 ? "the drain's deadline passed: cancelling what still runs (503)"
                         : "a second signal: cancelling what still runs (503)");
      front->ExpireDrain();
    });
  }
  // Wakes the watcher (from either wait) and joins it.
  ~StopWatcher() {
    const char byte = kWakeUp;
    [[maybe_unused]] ssize_t n = write(stop_pipe[1], &byte, 1);
    thread_.join();
  }

 private:
  static constexpr char kWakeUp = 0;  // no signal has number 0
  std::thread thread_;
};

// After a fault, how long rank 0 waits for the open requests' answers (503, or a stream's error
// event and [DONE]) before it ends the job: within --timeout-s + 1 s of the fault.
constexpr std::chrono::milliseconds kAnswerWindow{1000};

// After a fault the job is ending: a launcher's SIGTERM (its abort sends one to every rank, then
// SIGKILL a second later) ends this process at once instead of asking for a drain.
void EndOnStopSignal() {
  std::signal(SIGTERM, SIG_DFL);
  std::signal(SIGINT, SIG_DFL);
}

// Another rank, after a fault: rank 0 ends the job once its clients have their answers. This
// rank's own abort, a moment later, only counts where rank 0 cannot (it is the rank at fault);
// once rank 0's process is gone (its abort) there is nothing to wait for: the launcher's
// SIGKILL would otherwise come a second later.
void WaitForRankZero() {
  const auto until =
      std::chrono::steady_clock::now() + kAnswerWindow + std::chrono::milliseconds(500);
  while (std::chrono::steady_clock::now() < until && !parallel::WorldRankDied(0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

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
  absl::Status made;
  bool keyed = false;
  if (job.is_root()) {
    absl::StatusOr<HttpOptions> options = HttpOptionsFrom(f);
    if (options.ok()) {
      keyed = !options->api_key.empty();
      const runtime::Tokenizer* tokenizer = (*host)->tokenizer ? &*(*host)->tokenizer : nullptr;
      front = std::make_unique<HttpFront>(engine, *(*host)->loaded.model, f.engine.model.name,
                                          tokenizer, *std::move(options));
    } else {
      made = options.status();
    }
  }
  auto port = ListenAgreed(front.get(), made, f, *grid.world);
  if (!port.ok()) return job.Refuse(port.status());
  std::thread http;
  if (front) http = StartFront(*front, keyed, f, *port, job, grid, log);
  absl::Status ran;
  {
    StopWatcher stop_watcher(
        job, front.get(), engine, log,
        std::chrono::milliseconds(static_cast<int64_t>(f.drain_timeout_s * 1e3)));
    // Run until rank 0 shuts down (or a rank fails: the job ends with its error).
    ran = engine.Run();
  }
  if (front) {
    if (!ran.ok()) front->WaitUntilAnswered(kAnswerWindow);
    front->Stop();
    http.join();
  } else if (!ran.ok()) {
    EndOnStopSignal();
    WaitForRankZero();
  }
  if (!ran.ok()) {
    EndOnStopSignal();
    job.Fail(ran);
  }
  log.Event("stopped", {}, "stopped");
  return kExitOk;
}

}  // namespace

int RunServeCommand(int argc, char** argv) {
  // Few malloc arenas, set before any thread starts: each thread that first allocates gets an
  // arena of its own (up to 8 per core), and what an arena keeps after malloc_trim stays for the
  // life of the process. Measured on rank 0 (tests/serve_adversary_test.py's burst, 16 worker
  // threads touched at once): +12.6 MiB (+17%) with glibc's default, +4.3 MiB (+6%) with 4.
  ::mallopt(M_ARENA_MAX, 4);
  ServeFlags f;
  FlagSet flags("serve",
                "a long-running prefill service: rank 0 serves HTTP (OpenAI-compatible "
                "completions with token ids, or text with a checkpoint's tokenizer; sessions, "
                "/health, /metrics), every rank prefills (under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
    // The front's threads (HttpFront::ThreadsFor), its Serve thread and the signal watcher:
    // tried with the engine's threads.
    f.engine.front_threads = HttpFront::ThreadsFor(f.http_threads) + 2;
    f.engine.front_threads_flag = "--http-threads";
    return Serve(f, flags, job, grid);
  });
}

}  // namespace cpfill::launch
