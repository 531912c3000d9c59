// `cpfill serve`: the long-running prefill service. Every rank loads its share of the model and
// runs the engine loop; world rank 0 also serves HTTP (OpenAI-compatible /v1/completions with
// token ids, sessions, /health, /metrics). SIGTERM or SIGINT drains the queue and exits 0.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/http_server.h"
#include "launch/model_setup.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "runtime/engine.h"
#include "runtime/model_config.h"

namespace cpfill::launch {
namespace {

struct ServeFlags {
  std::string model, backend = "auto", host = "127.0.0.1", port_file;
  int port = 8000;
  int layers = 0;
  int64_t seed = 1;
  int64_t max_batch_tokens = 131072;
  int max_queue = 1024;
  int64_t kv_capacity_tokens = 0;
  double kv_memory_fraction = 0;
  int kv_block_tokens = 64;
  SelectorFlags selector;
  SessionFlags session;
};

void DefineFlags(FlagSet& flags, ServeFlags* f) {
  flags.String("model", &f->model,
               "a preset (tiny, llama3-8b, llama3-70b, llama3-405b; synthetic weights) or a "
               "Hugging Face checkpoint directory",
               true);
  flags.String("host", &f->host, "address rank 0 listens on");
  flags.Int("port", &f->port, "port rank 0 listens on (0: a free one, printed)").Within({0, 65535});
  flags.String("port-file", &f->port_file, "also write the port to this file once listening");
  flags.Int("layers", &f->layers, "run only the first K layers (0: all)").Within({0, 1e6});
  flags.Int("seed", &f->seed, "seed of synthetic weights").Within(Range::AtLeast(0));
  flags.Int("max-batch-tokens", &f->max_batch_tokens, "new tokens in one fused batch")
      .Within({1, kMaxTokens});
  flags.Int("max-queue", &f->max_queue, "prompts waiting before requests get 503")
      .Within({1, 1e7});
  flags
      .Int("kv-capacity-tokens", &f->kv_capacity_tokens,
           "KV cache capacity per rank, in tokens, allocated at start-up (0: "
           "--kv-memory-fraction, else half the free memory)")
      .Within({0, kMaxTokens});
  flags
      .Double("kv-memory-fraction", &f->kv_memory_fraction,
              "instead of --kv-capacity-tokens: this fraction of the rank's free memory")
      .Within(Range::LeftOpen(0, 1));
  flags.Int("kv-block-tokens", &f->kv_block_tokens, "tokens per KV cache block").Within({16, 256});
  flags.String("backend", &f->backend, "auto | cpu | cuda (auto: cuda when every rank sees a GPU)");
  AddSelectorFlags(flags, &f->selector);
  AddSessionFlags(flags, &f->session);
}

// The model, cut to --layers, checked against the grid: bad input, the same on every rank.
absl::StatusOr<runtime::ModelConfig> ModelFor(const ServeFlags& f, int tp_size) {
  CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, runtime::LoadModelConfig(f.model));
  CPFILL_CHECK_ARG(f.layers <= config.num_layers, "--layers ", f.layers, ": the model has only ",
                   config.num_layers, " layers");
  if (f.layers > 0) config.num_layers = f.layers;
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp_size));
  return config;
}

runtime::PrefillOptions OptionsFrom(const ServeFlags& f, const SelectorChoice& choice,
                                    int threads) {
  runtime::PrefillOptions o = ModelOptions(choice);
  o.kv_capacity_tokens = f.kv_capacity_tokens;
  o.kv_memory_fraction = f.kv_capacity_tokens == 0 && f.kv_memory_fraction == 0
                             ? 0.5
                             : f.kv_memory_fraction;
  o.kv_block_tokens = f.kv_block_tokens;
  o.threads = threads;
  return o;
}

// SIGTERM and SIGINT: the handler only writes the signal number to a pipe (async-signal-safe;
// a mask would not do, libraries start threads of their own before main); one thread reads it.
// On rank 0 the first starts the drain; elsewhere they are ignored, since rank 0's shutdown
// broadcast ends every rank once the queue is empty.
int stop_pipe[2] = {-1, -1};

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

// Rank 0: listens, and tells every rank whether it could (collective).
absl::StatusOr<int> ListenAgreed(HttpFront* front, const ServeFlags& f,
                                 parallel::Communicator& world) {
  absl::StatusOr<int> port = front != nullptr ? front->Bind(f.host, f.port) : absl::StatusOr<int>(0);
  CPFILL_ASSIGN_OR_RETURN(bool all, parallel::AllRanksOk(world, port.ok()));
  if (!port.ok()) return port.status();
  if (!all) return absl::FailedPreconditionError("world rank 0 could not listen");
  return port;
}

int Run(int argc, char** argv) {
  ServeFlags f;
  FlagSet flags("serve",
                "a long-running prefill service: rank 0 serves HTTP (OpenAI-compatible "
                "completions with token ids, sessions, /health, /metrics), every rank prefills "
                "(under mpirun)");
  DefineFlags(flags, &f);
  const absl::Status parsed = flags.Parse(argc, argv, 2);
  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session& session = *started.session;
  parallel::ProcessGrid& grid = *started.grid;
  if (auto bad = session.CheckOutputs({{"port-file", f.port_file}})) return *bad;

  // The model and the engine, as `prefill` builds them.
  auto backend = ResolveBackendName(f.backend, {"cpu", "cuda"}, *grid.world);
  if (!backend.ok()) return session.Refuse(backend.status());
  f.backend = *backend;
  auto config = ModelFor(f, grid.tp_size);
  if (!config.ok()) return session.ConfigError(config.status());
  auto choice = ResolveSelector(f.selector, flags);
  if (!choice.ok()) return session.Refuse(choice.status());
  const runtime::PrefillOptions options = OptionsFrom(f, *choice, session.ThreadsPerRank(grid));
  auto weights = LoadWeightsAgreed(*config, f.model, static_cast<uint64_t>(f.seed), grid);
  if (!weights.ok()) {  // the lowest failing rank speaks for all
    if (!absl::IsAborted(weights.status())) {
      std::fprintf(stderr, "cpfill: error on world rank %d: %s\n", grid.world_rank,
                   std::string(weights.status().message()).c_str());
    }
    return kExitBadInput;
  }
  auto loaded =
      BuildModel(*config, std::move(*weights), f.backend, grid, session.mpi().options(), options);
  if (!loaded.ok()) return session.Refuse(loaded.status());
  runtime::EngineOptions engine_options{.max_batch_tokens = f.max_batch_tokens,
                                        .max_queue = f.max_queue};
  const auto deadline = session.mpi().options().timeout;
  engine_options.heartbeat = std::min<std::chrono::milliseconds>(
      std::chrono::milliseconds(1000),
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline) / 4);
  engine_options.on_batch = [&](int requests, int64_t tokens, int64_t cached,
                                parallel::RingAlgorithm algo, double s) {
    session.Print("batch: %d request(s), %d new + %d cached tokens, %s, %.1f ms\n", requests,
                  tokens, cached, parallel::RingAlgorithmName(algo), s * 1e3);
  };
  runtime::Engine engine(*loaded->model, *grid.world, engine_options);

  // Rank 0 listens; every rank learns whether it could.
  std::unique_ptr<HttpFront> front;
  if (session.is_root()) front = std::make_unique<HttpFront>(engine, *loaded->model, f.model);
  auto port = ListenAgreed(front.get(), f, *grid.world);
  if (!port.ok()) return session.Refuse(port.status());
  std::thread http, signals;
  if (front) {
    front->SetHealthy(true);
    http = std::thread([&] { front->Serve(); });
    session.Print("cpfill serve: %s on http://%s:%d (%s); POST /v1/completions, GET /health, "
                  "/metrics, /v1/models, /v1/sessions\n",
                  f.model, f.host, *port, grid.Describe());
    if (!f.port_file.empty()) std::ofstream(f.port_file) << *port << "\n";
  }
  if (absl::Status s = InstallStopHandler(); !s.ok()) session.Fail(s);
  signals = std::thread([&, root = session.is_root()] {
    const int sig = WaitForStopSignal();
    if (!root) return;  // rank 0 drains and its shutdown broadcast ends this rank
    session.Print("cpfill serve: signal %d: draining the queue, then exiting\n", sig);
    front->SetHealthy(false);
    engine.Shutdown();
  });
  signals.detach();  // ends with the process; a second signal is not waited for

  // Run until rank 0 shuts down (or a rank fails: the job ends with its error).
  const absl::Status ran = engine.Run();
  if (front) {
    front->Stop();
    http.join();
  }
  if (!ran.ok()) session.Fail(ran);
  session.Print("cpfill serve: stopped\n");
  return kExitOk;
}

}  // namespace

int RunServeCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
