// `cpfill kv-pull`: a stand-in decode worker on the command line. Asks a running
// `cpfill serve --kv-handoff` to prefill a prompt for remote decode (or takes a handle it was
// given), pulls the request's KV over UCX into a destination of its own layout and decode TP rank,
// releases the lease, and with --model checks the KV against a single-rank fp32 prefill of the
// same prompt. Prints bytes, time and GB/s. No MPI.
//
//   cpfill kv-pull --url http://127.0.0.1:8000 --prompt-tokens 512 --model tiny --layers 2
//   cpfill kv-pull --url ... --prompt-tokens 512 --decode-tp 2 --decode-tp-rank 1 --layout paged
//   cpfill kv-pull --handle-in h.json --no-release      # a handle from elsewhere (fault tests)
//
// Exit codes: 0 pulled (and matched); 1 the KV does not match the reference; 2 bad input (flags,
// a malformed or forged handle, a request the server refused); 3 the pull failed (the server is
// gone, the lease ended, a deadline passed).
#include "launch/job/kv_pull.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/http/http_api.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/model_setup.h"
#include "runtime/handoff/kv_puller.h"
#include "runtime/model/model_config.h"

namespace cpfill::launch {
namespace {

struct KvPullArgs {
  std::string url, tokens, layout = "contiguous", model, handle_in, handle_out, json, dump;
  int64_t prompt_tokens = 0, prompt_seed = 1, seed = 1;
  int layers = 0, decode_tp = 1, decode_tp_rank = 0, block_tokens = 16, dst_cuda_device = -1;
  int pulls = 1, reference_threads = 0;
  bool bit_exact = false;
  double timeout_s = 60, tolerance = 0;
  bool no_release = false, exit_mid_pull = false, release_only = false;
  std::string api_key, api_key_file;  // resolved into api_key by Check
};

void DefineFlags(FlagSet& flags, KvPullArgs* a) {
  flags.String("url", &a->url, "the prefill server, e.g. http://127.0.0.1:8000");
  flags.Int("prompt-tokens", &a->prompt_tokens, "prefill a random prompt of this many tokens")
      .Within({0, kMaxTokens});
  flags.Int("prompt-seed", &a->prompt_seed, "seed of the random prompt").Within(Range::AtLeast(0));
  flags.String("tokens", &a->tokens, "instead: a JSON file, a list of lists of ids (the first)");
  flags.String("handle-in", &a->handle_in,
               "pull this handle (a JSON file: kv_transfer_params) instead of asking for one");
  flags.String("handle-out", &a->handle_out, "also write the handle received here");
  flags.String("api-key", &a->api_key,
               "the server's API key (sent as Authorization: Bearer); visible to other users of "
               "the host: prefer --api-key-file or the environment's CPFILL_API_KEY");
  flags.String("api-key-file", &a->api_key_file, "instead of --api-key: a file holding the key");
  flags.Int("decode-tp", &a->decode_tp, "the decode worker's TP size").Within({1, 4096});
  flags.Int("decode-tp-rank", &a->decode_tp_rank, "this puller's decode TP rank").Within({0, 4095});
  flags.String("layout", &a->layout, "contiguous | paged: the destination's layout");
  flags.Int("dst-block-tokens", &a->block_tokens, "paged: tokens per destination block")
      .Within({1, 4096});
  flags
      .Int("dst-cuda-device", &a->dst_cuda_device,
           "pull into this GPU's memory instead of host memory (needs a UCX with a CUDA "
           "transport; -1: host)")
      .Within({-1, 1024});
  flags.String("model", &a->model,
               "verify against a single-rank fp32 prefill of this model (as the server's "
               "--model, --layers, --seed)");
  flags.Int("layers", &a->layers, "with --model: its first K layers (0: all)").Within({0, 1e6});
  flags.Int("seed", &a->seed, "with --model: the seed of synthetic weights")
      .Within(Range::AtLeast(0));
  flags
      .Int("reference-threads", &a->reference_threads,
           "with --model: threads of the one-rank reference (0: every core); the CPU kernels' "
           "rounding depends on it")
      .Within({0, 4096});
  flags.Bool("bit-exact", &a->bit_exact,
             "with --model: pass only when every element equals the reference bit for bit (a "
             "one-rank CPU server whose --threads is --reference-threads)");
  flags
      .Double("tolerance", &a->tolerance,
              "largest |difference| allowed, relative to max(1, largest |reference|) (0: 1e-4 "
              "for float32 KV, 3e-2 for bfloat16)")
      .Within({0, 1});
  flags.Double("timeout-s", &a->timeout_s, "deadline of the request and of the pull")
      .Within(Range::LeftOpen(0, 86400));
  flags
      .Int("pulls", &a->pulls,
           "pull the KV this many times before releasing it, on one connection: the first "
           "includes connecting to each prefill rank, the later ones are a long-lived decode "
           "worker's steady state (each is reported; the check reads the last)")
      .Within({1, 1000});
  flags.Bool("no-release", &a->no_release, "leave the lease to expire (fault tests)");
  flags.Bool("release-only", &a->release_only,
             "with --handle-in: end the lease without pulling (a decode worker that no longer "
             "needs the KV)");
  flags.Bool("exit-mid-pull", &a->exit_mid_pull,
             "exit with code 3 after the first prefill rank's part, without a release (fault "
             "tests: a decode worker that dies mid-transfer)");
  flags.String("json", &a->json, "write the figures and the verdict here as JSON");
  flags.String("dump", &a->dump,
               "write the pulled KV here as raw little-endian float32 [2 (K, V)][layers][tokens]"
               "[this rank's KV heads][head_dim], whatever the layout and dtype");
}

absl::Status CheckArgs(const KvPullArgs& a) {
  const int sources = (a.prompt_tokens > 0) + !a.tokens.empty() + !a.handle_in.empty();
  CPFILL_CHECK_ARG(sources == 1, "give one of --prompt-tokens, --tokens, --handle-in");
  CPFILL_CHECK_ARG(!a.url.empty() || !a.handle_in.empty(), "--url is required to ask for a handle");
  CPFILL_CHECK_ARG(a.layout == "contiguous" || a.layout == "paged", "--layout is \"", a.layout,
                   "\"; expected contiguous or paged");
  CPFILL_CHECK_ARG(!a.release_only || (!a.handle_in.empty() && !a.no_release),
                   "--release-only needs --handle-in (and not --no-release)");
  CPFILL_CHECK_ARG(a.handle_in.empty() || a.model.empty(),
                   "--model verifies a prompt this command sent; --handle-in has none");
  if (!a.model.empty()) {  // before the server is asked anything
    CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, runtime::LoadModelConfig(a.model));
    CPFILL_CHECK_ARG(a.layers <= config.num_layers, "--layers ", a.layers, ": the model has only ",
                     config.num_layers);
  }
  if (!a.json.empty()) CPFILL_RETURN_IF_ERROR(CheckWritable("json", a.json));
  if (!a.handle_out.empty()) CPFILL_RETURN_IF_ERROR(CheckWritable("handle-out", a.handle_out));
  if (!a.dump.empty()) CPFILL_RETURN_IF_ERROR(CheckWritable("dump", a.dump));
  return absl::OkStatus();
}

// The prompt to prefill: random ids in the served vocabulary, or the file's first list.
absl::StatusOr<std::vector<int32_t>> PromptOf(const KvPullArgs& a) {
  if (!a.tokens.empty()) {
    CPFILL_ASSIGN_OR_RETURN(auto batch, ReadTokensFile(a.tokens));
    return batch[0].tokens;
  }
  CPFILL_ASSIGN_OR_RETURN(int64_t vocab, ServedVocabulary(a.url, a.timeout_s, a.api_key));
  std::mt19937_64 rng(static_cast<uint64_t>(a.prompt_seed));
  std::vector<int32_t> ids(static_cast<size_t>(a.prompt_tokens));
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

absl::StatusOr<runtime::KvHandle> HandleOf(const KvPullArgs& a, const std::vector<int32_t>& ids) {
  if (a.handle_in.empty()) return RequestHandoff(a.url, ids, a.timeout_s, a.api_key);
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(a.handle_in));
  return runtime::ParseKvHandle(v);
}

absl::StatusOr<KvComparison> Verify(const KvPullArgs& a, const std::vector<int32_t>& ids,
                                    const PulledKv& kv) {
  CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, runtime::LoadModelConfig(a.model));
  CPFILL_CHECK_ARG(a.layers <= config.num_layers, "--layers ", a.layers, ": the model has only ",
                   config.num_layers);
  if (a.layers > 0) config.num_layers = a.layers;
  CPFILL_CHECK_ARG(config.num_layers == kv.layout.num_layers &&
                       config.num_kv_heads == kv.layout.kv_heads &&
                       config.head_dim == kv.layout.head_dim,
                   "--model with --layers ", config.num_layers, " is not the served model (",
                   kv.layout.num_layers, " layers, ", kv.layout.kv_heads, " KV heads of ",
                   kv.layout.head_dim, ")");
  CPFILL_ASSIGN_OR_RETURN(runtime::ModelWeights weights,
                          MakeWeights(config, a.model, static_cast<uint64_t>(a.seed), 0, 1));
  CPFILL_ASSIGN_OR_RETURN(ReferenceKv ref,
                          ComputeReferenceKv(config, std::move(weights), ids, a.reference_threads));
  const double tolerance = a.tolerance > 0                                 ? a.tolerance
                           : kv.layout.dtype == runtime::KvDtype::kFloat32 ? 1e-4
                                                                           : 3e-2;
  KvComparison c = CompareKv(kv, ref, tolerance);
  if (a.bit_exact) c.pass = c.differing == 0;
  return c;
}

absl::Status WriteDump(const PulledKv& kv, const std::string& path) {
  std::vector<float> values;
  const runtime::KvHandleLayout& l = kv.layout;
  for (int kind = 0; kind < 2; ++kind) {
    for (int layer = 0; layer < l.num_layers; ++layer) {
      for (int64_t t = 0; t < l.tokens; ++t) {
        for (int h = 0; h < kv.kv_heads_per_rank; ++h) {
          for (int d = 0; d < l.head_dim; ++d) values.push_back(kv.At(layer, kind, t, h, d));
        }
      }
    }
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  CPFILL_CHECK_ARG(f != nullptr, "--dump: cannot open ", path);
  const size_t wrote = std::fwrite(values.data(), sizeof(float), values.size(), f);
  const bool closed = std::fclose(f) == 0;
  CPFILL_CHECK_ARG(wrote == values.size() && closed, "--dump: cannot write ", path);
  return absl::OkStatus();
}

int ExitCodeFor(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsNotFound(s) ? kExitBadInput : kExitRuntimeError;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "cpfill: error: %s\n", std::string(s.message()).c_str());
  return ExitCodeFor(s);
}

// Steps: the prompt and its handle, the destination, the pull (with progress), the release, the
// check, the report.
// The memory pulled into. Owned by Run and declared before the puller, so that it outlives the
// release and the puller itself: a get abandoned at a deadline may still land while the worker is
// progressed (parallel/ucx_transport.h).
struct Destination {
  std::optional<PulledKv> kv;
  std::unique_ptr<DeviceDestination> device;
};

int PullAndCheck(const KvPullArgs& a, const std::vector<int32_t>& ids,
                 const runtime::KvHandle& handle, runtime::KvPuller& puller, Destination& dst);

// A lease this command asked for is released however the pull ends (unless --no-release): a
// refused destination or a failed pull must not pin the server's memory until the lease expires.
int Run(const KvPullArgs& a) {
  std::vector<int32_t> ids;
  if (a.handle_in.empty()) {
    absl::StatusOr<std::vector<int32_t>> prompt = PromptOf(a);
    if (!prompt.ok()) return Fail(prompt.status());
    ids = *std::move(prompt);
  }
  absl::StatusOr<runtime::KvHandle> handle = HandleOf(a, ids);
  if (!handle.ok()) return Fail(handle.status());
  Destination dst;
  auto puller = runtime::KvPuller::Create(
      {.name = absl::StrCat("kv-pull decode tp ", a.decode_tp_rank, "/", a.decode_tp)});
  if (!puller.ok()) return Fail(puller.status());
  if (a.release_only) {
    const absl::Status released =
        (*puller)->Release(*handle, parallel::UcxDeadlineIn(std::chrono::seconds(5)));
    if (!released.ok()) return Fail(released);
    std::printf("released %s (unacknowledged)\n", handle->request_id.c_str());
    return kExitOk;
  }
  const int code = PullAndCheck(a, ids, *handle, **puller, dst);
  if (!a.no_release && (code == kExitOk || code == kExitCheckFailed || a.handle_in.empty())) {
    const absl::Status released =
        (*puller)->Release(*handle, parallel::UcxDeadlineIn(std::chrono::seconds(5)));
    if (!released.ok()) {
      const int release_code = Fail(released);
      return code != kExitOk ? code : release_code;  // an earlier verdict stands
    }
  }
  return code;
}

// One pull's line and JSON (`index` of --pulls, from 1).
nlohmann::ordered_json ReportPull(const KvPullArgs& a, const runtime::KvHandle& handle,
                                  const runtime::KvPullStats& s, bool on_device, int index) {
  std::printf(
      "pull %d/%d of %s request %s: %.3f MB from %d prefill ranks in %.3f ms (%.2f GB/s; "
      "the gets alone %.3f ms, %.2f GB/s), %lld gets, decode tp %d/%d, %s, into %s\n",
      index, a.pulls, handle.engine_id.c_str(), handle.request_id.c_str(), s.bytes / 1e6,
      s.source_ranks, s.seconds * 1e3, s.gb_per_s(), s.get_seconds * 1e3, s.get_gb_per_s(),
      static_cast<long long>(s.gets), a.decode_tp_rank, a.decode_tp, a.layout.c_str(),
      on_device ? absl::StrCat("GPU ", a.dst_cuda_device).c_str() : "host memory");
  return {{"bytes", s.bytes},
          {"seconds", s.seconds},
          {"gb_per_s", s.gb_per_s()},
          {"get_seconds", s.get_seconds},
          {"get_gb_per_s", s.get_gb_per_s()},
          {"gets", s.gets},
          {"source_ranks", s.source_ranks}};
}

// --model: the check against one fp32 rank, printed and added to `report`; false on a mismatch.
absl::StatusOr<bool> CheckAndReport(const KvPullArgs& a, const std::vector<int32_t>& ids,
                                    const PulledKv& kv, nlohmann::ordered_json& report) {
  CPFILL_ASSIGN_OR_RETURN(KvComparison c, Verify(a, ids, kv));
  std::printf(
      "verify against one fp32 rank: max |diff| %.3g (allowed %.3g), %lld of %lld "
      "elements not bit-identical: %s\n",
      c.max_abs_diff, c.allowed, static_cast<long long>(c.differing),
      static_cast<long long>(c.elements), c.pass ? "PASS" : "FAIL");
  report["verify"] = {{"max_abs_diff", c.max_abs_diff},
                      {"allowed", c.allowed},
                      {"elements", c.elements},
                      {"not_bit_identical", c.differing},
                      {"pass", c.pass}};
  return c.pass;
}

// Progress after each prefill rank; --exit-mid-pull dies after the first.
void ShowProgress(const KvPullArgs& a, const runtime::KvPullStats& s) {
  std::fprintf(stderr, "cpfill kv-pull: %d/%d prefill ranks, %.1f MB\n", s.source_ranks,
               s.total_source_ranks, s.bytes / 1e6);
  if (a.exit_mid_pull) {
    std::fprintf(stderr, "cpfill kv-pull: --exit-mid-pull: exiting without a release\n");
    std::fflush(stderr);
    _exit(kExitRuntimeError);
  }
}

int PullAndCheck(const KvPullArgs& a, const std::vector<int32_t>& ids,
                 const runtime::KvHandle& handle, runtime::KvPuller& puller, Destination& dst) {
  if (!a.handle_out.empty()) {
    if (absl::Status s = json::WriteFile(a.handle_out, runtime::ToJson(handle)); !s.ok()) {
      return Fail(s);
    }
  }
  absl::StatusOr<PulledKv> made_kv =
      MakeDestination(handle.layout, {.tp_size = a.decode_tp,
                                      .tp_rank = a.decode_tp_rank,
                                      .paged = a.layout == "paged",
                                      .block_tokens = a.block_tokens});
  if (!made_kv.ok()) return Fail(made_kv.status());
  dst.kv.emplace(*std::move(made_kv));
  std::optional<PulledKv>& kv = dst.kv;
  std::unique_ptr<DeviceDestination>& device = dst.device;
  if (a.dst_cuda_device >= 0) {
    if (!puller.transport().supports_cuda_memory()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--dst-cuda-device: the loaded UCX (", parallel::UcxTransport::LibraryVersion(),
          ") has no CUDA transport to write GPU memory with")));
    }
    auto made = DeviceDestination::Create(a.dst_cuda_device, kv->bytes.size());
    if (!made.ok()) return Fail(made.status());
    device = *std::move(made);
  }
  void* const into = device ? device->data() : kv->bytes.data();
  const auto deadline =
      parallel::UcxDeadlineIn(std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1e3)));
  nlohmann::ordered_json report = {{"engine_id", handle.engine_id},
                                   {"request_id", handle.request_id},
                                   {"tokens", handle.layout.tokens},
                                   {"decode_tp", a.decode_tp},
                                   {"decode_tp_rank", a.decode_tp_rank},
                                   {"layout", a.layout},
                                   {"destination", device ? "cuda" : "host"},
                                   {"ucx", parallel::UcxTransport::LibraryVersion()},
                                   {"released", !a.no_release},
                                   {"pulls", nlohmann::ordered_json::array()}};
  for (int i = 1; i <= a.pulls; ++i) {
    absl::StatusOr<runtime::KvPullStats> stats =
        puller.Pull(handle, kv->destination, into, kv->bytes.size(), deadline,
                    [&a](const runtime::KvPullStats& s) { ShowProgress(a, s); });
    if (!stats.ok()) return Fail(stats.status());
    report["pulls"].push_back(ReportPull(a, handle, *stats, device != nullptr, i));
  }
  if (device) {
    if (absl::Status s = device->CopyTo(kv->bytes); !s.ok()) return Fail(s);
  }
  if (!a.dump.empty()) {
    if (absl::Status s = WriteDump(*kv, a.dump); !s.ok()) return Fail(s);
  }
  int code = kExitOk;
  if (!a.model.empty()) {
    absl::StatusOr<bool> pass = CheckAndReport(a, ids, *kv, report);
    if (!pass.ok()) return Fail(pass.status());
    if (!*pass) code = kExitCheckFailed;
  }
  if (!a.json.empty()) {
    if (absl::Status s = json::WriteFile(a.json, report); !s.ok()) return Fail(s);
  }
  return code;
}

}  // namespace

int RunKvPullCommand(int argc, char** argv) {
  KvPullArgs a;
  FlagSet flags("kv-pull",
                "a stand-in decode worker: pull a request's KV from `cpfill serve --kv-handoff` "
                "over UCX into its own layout and decode TP rank, release it, and check it "
                "against a single-rank prefill (no MPI)");
  DefineFlags(flags, &a);
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  if (absl::Status s = CheckArgs(a); !s.ok()) return RefuseInput(s);
  // The key is a secret, not a knob: read here, never recorded in a report.
  absl::StatusOr<std::string> key =
      ApiKeyFrom(a.api_key, a.api_key_file, std::getenv("CPFILL_API_KEY"));
  if (!key.ok()) return RefuseInput(key.status());
  a.api_key = *std::move(key);
  return Run(a);
}

}  // namespace cpfill::launch
