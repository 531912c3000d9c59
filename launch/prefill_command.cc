// `cpfill prefill`: whole-model prefill of a Llama-3 family model (TP inside nodes, CP across),
// reporting the first token of every sequence and the time to first token with its breakdown;
// --check compares with a one-rank run of the same model.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/json_io.h"
#include "base/random.h"
#include "base/status.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/selector_flags.h"
#include "launch/session.h"
#include "parallel/self_communicator.h"
#include "runtime/llama_model.h"
#include "runtime/model_config.h"
#include "runtime/safetensors.h"
#include "runtime/weights.h"
#if CPFILL_HAVE_CUDA
#include "parallel/cuda/nccl_communicator.h"
#include "runtime/cuda/llama_model_cuda.h"
#endif

namespace cpfill::launch {
namespace {

struct PrefillFlags {
  std::string model;
  std::vector<int64_t> prompt_lens;
  std::string tokens_file;
  int layers = 0;
  SelectorFlags selector;
  bool check = false;
  double tolerance = 1e-3;
  std::string json_file;
  std::string logits_file;
  int64_t seed = 1;
  int64_t kv_capacity_tokens = int64_t{1} << 24;
  double peak_tflops = 0;
  std::string backend = "auto";
  int repeat = 1;
  SessionFlags session;
};

// Synthetic prompts: token ids from the seed, the same on every rank.
std::vector<runtime::PrefillRequest> SyntheticPrompts(const std::vector<int64_t>& lens, int vocab,
                                                      uint64_t seed) {
  std::vector<runtime::PrefillRequest> out;
  for (size_t s = 0; s < lens.size(); ++s) {
    runtime::PrefillRequest r;
    for (int64_t i = 0; i < lens[s]; ++i) {
      r.tokens.push_back(static_cast<int32_t>(Mix64(Mix64(seed ^ 0x70ull) ^ (s << 40) ^ i) %
                                              static_cast<uint64_t>(vocab)));
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<std::vector<runtime::PrefillRequest>> ReadTokensFile(const std::string& path) {
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json v, json::ReadFile(path));
  CPFILL_CHECK_ARG(v.is_array() && !v.empty(), path,
                   ": --tokens wants a JSON list of lists of token ids");
  std::vector<runtime::PrefillRequest> out;
  for (size_t s = 0; s < v.size(); ++s) {
    const nlohmann::json& seq = v[s];
    CPFILL_CHECK_ARG(seq.is_array(), path, ": sequence ", s, " is not a list");
    runtime::PrefillRequest r;
    for (const nlohmann::json& id : seq) {
      const std::optional<int64_t> token = json::AsInt64(id);
      CPFILL_CHECK_ARG(token.has_value() && *token >= std::numeric_limits<int32_t>::min() &&
                           *token <= std::numeric_limits<int32_t>::max(),
                       path, ": sequence ", s, " holds ", json::Show(id),
                       ", which is not an integer token id (int32)");
      r.tokens.push_back(static_cast<int32_t>(*token));
    }
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<runtime::ModelWeights> MakeWeights(const runtime::ModelConfig& config,
                                                  const PrefillFlags& f, int tp_rank, int tp) {
  if (runtime::IsPreset(f.model)) {
    return runtime::SyntheticWeights(config, static_cast<uint64_t>(f.seed), tp_rank, tp);
  }
  return runtime::LoadWeights(config, f.model, tp_rank, tp);
}

std::string Ms(double s) { return absl::StrFormat("%.1f", s * 1e3); }

int Run(int argc, char** argv) {
  PrefillFlags f;
  FlagSet flags("prefill",
                "prefill a Llama-3 family model with TP inside nodes and CP across them; prints "
                "the first token per sequence and the time to first token (under mpirun)");
  flags.String("model", &f.model,
               "a preset (tiny, llama3-8b, llama3-70b, llama3-405b; synthetic weights) or a "
               "Hugging Face checkpoint directory (config.json + safetensors)",
               true);
  flags.IntList("prompt-lens", &f.prompt_lens, "synthetic prompts of these lengths");
  flags.String("tokens", &f.tokens_file,
               "a JSON list of lists of token ids (instead of "
               "--prompt-lens)");
  flags.Int("layers", &f.layers, "run only the first K layers (0: all)");
  AddSelectorFlags(flags, &f.selector);
  flags.Bool("check", &f.check,
             "compare last-position logits and first tokens with a one-rank run");
  flags.Double("tolerance", &f.tolerance, "max abs logit difference --check accepts");
  flags.String("json", &f.json_file, "write the report as JSON to this file");
  flags.String("save-logits", &f.logits_file,
               "write the last-position logits [sequences, vocab] and first tokens as "
               "safetensors");
  flags.Int("seed", &f.seed, "seed of synthetic weights and prompts");
  flags.Int("kv-capacity-tokens", &f.kv_capacity_tokens,
            "KV cache capacity per rank, in tokens (every layer's K and V)");
  flags.Double("peak-tflops", &f.peak_tflops,
               "peak dense TFLOP/s of one rank, for model FLOPs utilisation (0: not shown)");
  flags.Int("repeat", &f.repeat,
            "timed prefills of the batch after one untimed warm-up when > 1 (median reported)");
  flags.String("backend", &f.backend,
               "auto | cpu | cuda (auto: cuda when every rank sees a GPU); cuda computes in "
               "bf16 and --check compares with the fp32 CPU model at a relative tolerance");
  AddSessionFlags(flags, &f.session);
  const absl::Status parsed = flags.Parse(argc, argv, 2);
  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session* session = started.session.get();
  parallel::ProcessGrid& grid = *started.grid;
  // Every rank must see a GPU for the CUDA model; agreed before anything else starts.
  auto backend_name = ResolveBackendName(f.backend, {"cpu", "cuda"}, *grid.world);
  if (!backend_name.ok()) return session->Refuse(backend_name.status());
  f.backend = *backend_name;
  const bool cuda = f.backend == "cuda";

  // ---- configuration, the same verdict on every rank --------------------------------------
  auto config_or = runtime::LoadModelConfig(f.model);
  if (!config_or.ok()) return session->ConfigError(config_or.status());
  runtime::ModelConfig config = *config_or;
  if (f.layers < 0) {
    return session->ConfigError(absl::InvalidArgumentError("--layers must be >= 0"));
  }
  if (f.layers > 0) config.num_layers = std::min(config.num_layers, f.layers);
  if (absl::Status s = config.ValidateForTp(grid.tp_size); !s.ok()) {
    return session->ConfigError(s);
  }
  if (f.prompt_lens.empty() == f.tokens_file.empty()) {
    return session->ConfigError(
        absl::InvalidArgumentError("give exactly one of --prompt-lens and --tokens"));
  }
  std::vector<runtime::PrefillRequest> batch;
  if (!f.tokens_file.empty()) {
    auto read = ReadTokensFile(f.tokens_file);
    if (!read.ok()) return session->ConfigError(read.status());
    batch = std::move(*read);
  } else {
    for (int64_t n : f.prompt_lens) {
      if (n <= 0) {
        return session->ConfigError(absl::InvalidArgumentError(
            absl::StrCat("--prompt-lens: every prompt needs at least one token, got ", n)));
      }
    }
    batch = SyntheticPrompts(f.prompt_lens, config.vocab_size, static_cast<uint64_t>(f.seed));
  }
  auto choice = ResolveSelector(f.selector, flags);
  if (!choice.ok()) return session->Refuse(choice.status());
  runtime::PrefillOptions options;
  options.auto_algorithm = choice->auto_algorithm;
  options.algorithm = choice->algorithm;
  options.rule = choice->rule;
  options.system = choice->system;
  options.fitted = choice->fitted;
  options.kv_capacity_tokens = f.kv_capacity_tokens;
  options.threads = session->ThreadsPerRank(grid);

  // Weights: each rank reads its own slice, so a bad file may show on some ranks only; they
  // agree on the verdict, and each failing rank names what it found.
  auto weights = MakeWeights(config, f, grid.tp_rank, grid.tp_size);
  if (auto ok = parallel::AllRanksOk(*grid.world, weights.ok()); !ok.ok() || !*ok) {
    if (!ok.ok()) session->Fail(ok.status());
    if (!weights.ok()) {
      std::fprintf(stderr, "cpfill: error on world rank %d: %s\n", grid.world_rank,
                   std::string(weights.status().message()).c_str());
    }
    return kExitBadInput;
  }
  std::unique_ptr<runtime::PrefillModel> model;
#if CPFILL_HAVE_CUDA
  parallel::NcclGrid nccl;  // outlives the model below
  if (cuda) {
    auto nccl_or = parallel::CreateNcclGrid(grid, session->mpi().options());
    if (!nccl_or.ok()) return session->Refuse(nccl_or.status());
    nccl = std::move(*nccl_or);
    auto m = runtime::cuda::LlamaModelCuda::Create(config, *weights, nccl, *grid.world, options);
    if (!m.ok()) return session->Refuse(m.status());
    model = std::move(*m);
    *weights = runtime::ModelWeights{};  // on the GPU now: free the host's fp32 copy
  }
#endif
  if (!cuda) {
    auto m = runtime::LlamaModel::Create(config, std::move(*weights), *grid.tp, *grid.cp,
                                         *grid.world, options);
    if (!m.ok()) return session->Refuse(m.status());
    model = std::move(*m);
  }

  int64_t total_tokens = 0;
  for (const auto& r : batch) total_tokens += r.tokens.size();
  session->Print(
      "cpfill prefill: %s (%d layers, hidden %d, %d/%d heads, %.3g B parameters), "
      "%d sequence(s), %d tokens\n",
      config.name, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
      config.ParameterCount() / 1e9, batch.size(), total_tokens);
  session->Print("grid: %s; %s backend, %d thread(s) per rank\n", grid.Describe(),
                 cuda ? "CUDA (bf16, cuBLASLt, device ring on NCCL)" : "CPU (fp32)",
                 options.threads);

  // ---- the prefill ----------------------------------------------------------------------
  runtime::PrefillTimings t;
  auto progress = [&](int layer) {
    if (config.num_layers >= 8 && (layer + 1) % std::max(1, config.num_layers / 8) == 0) {
      session->Print("  layer %d/%d done\n", layer + 1, config.num_layers);
    }
  };
  if (f.repeat < 1) {
    return session->ConfigError(absl::InvalidArgumentError("--repeat must be >= 1"));
  }
  // With --repeat > 1 a warm-up run goes first (library handles, lazily loaded kernels), and the
  // median of the timed runs is reported; the batch holds no session, so runs are identical.
  absl::StatusOr<std::vector<runtime::SequenceOutput>> out;
  std::vector<double> times;
  for (int r = (f.repeat > 1 ? -1 : 0); r < f.repeat; ++r) {
    out =
        model->Prefill(batch, &t, r == f.repeat - 1 ? std::function<void(int)>(progress) : nullptr);
    if (!out.ok()) return session->Refuse(out.status());
    double slowest_run = t.total_s;
    if (absl::Status s = grid.world->AllReduce(&slowest_run, 1, parallel::DataType::kFloat64,
                                               parallel::ReduceOp::kMax);
        !s.ok()) {
      session->Fail(s);
    }
    if (r >= 0) times.push_back(slowest_run);
  }
  std::sort(times.begin(), times.end());
  const double slowest = times[times.size() / 2];
  session->Print("selector (%s): %s\n", parallel::SelectorRuleName(options.rule),
                 t.selection.reason);
  session->Print("algorithm: %s\n", parallel::RingAlgorithmName(t.algorithm));
  for (size_t s = 0; s < out->size(); ++s) {
    session->Print("sequence %d: %d tokens, first token %d\n", s, batch[s].tokens.size(),
                   (*out)[s].first_token);
  }
  session->Print(
      "TTFT %s ms (slowest rank, median of %d run(s)); world rank 0, last run: GEMMs %s, "
      "attention ring %s, all-reduce %s, LM head %s, embedding %s, other %s ms\n",
      Ms(slowest), f.repeat, Ms(t.gemm_s), Ms(t.attention_s), Ms(t.allreduce_s), Ms(t.lm_head_s),
      Ms(t.embed_s), Ms(t.other_s));
  session->Print("%.0f tokens/s; %.3g model TFLOP, %.3g TFLOP/s per rank", total_tokens / slowest,
                 t.model_flops / 1e12, t.model_flops / slowest / grid.world_size / 1e12);
  if (f.peak_tflops > 0) {
    session->Print(", MFU %.1f%%",
                   100 * t.model_flops / slowest / grid.world_size / (f.peak_tflops * 1e12));
  }
  session->Print("\n");

  // ---- check against one rank -----------------------------------------------------------
  double max_diff = 0;
  int token_mismatches = 0;
  bool pass = true;
  if (cuda && !flags.IsSet("tolerance")) f.tolerance = 3e-2;  // relative, for bf16
  if (f.check) {
    int32_t verdict = 1;
    if (session->is_root()) {
      session->Print("check: prefilling the same batch on one rank (CPU, fp32)...\n");
      parallel::SelfCommunicator tp("tp"), cp("cp"), world("world");
      auto ref_weights = MakeWeights(config, f, 0, 1);
      if (!ref_weights.ok()) session->Fail(ref_weights.status());
      runtime::PrefillOptions ref_options = options;
      ref_options.threads = 0;  // every core: the other ranks wait
      auto ref =
          runtime::LlamaModel::Create(config, std::move(*ref_weights), tp, cp, world, ref_options);
      if (!ref.ok()) session->Fail(ref.status());
      runtime::PrefillTimings rt;
      auto ref_out = (*ref)->Prefill(batch, &rt, nullptr);
      if (!ref_out.ok()) session->Fail(ref_out.status());
      for (size_t s = 0; s < out->size(); ++s) {
        const auto& a = (*out)[s].logits;
        const auto& b = (*ref_out)[s].logits;
        for (size_t i = 0; i < a.size(); ++i) {
          const double d = std::fabs(double(a[i]) - b[i]);
          max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
        }
        token_mismatches += (*out)[s].first_token != (*ref_out)[s].first_token;
      }
      // bf16: the tolerance is relative to the logits' scale, and a first token may differ only
      // where the reference's top two logits are closer than the error measured.
      double scale = 0;
      for (const auto& o : *ref_out) {
        for (float v : o.logits) scale = std::max(scale, std::fabs(double(v)));
      }
      const double allowed = cuda ? f.tolerance * std::max(1.0, scale) : f.tolerance;
      int near_ties = 0;
      if (cuda) {
        for (size_t s = 0; s < out->size(); ++s) {
          if ((*out)[s].first_token == (*ref_out)[s].first_token) continue;
          std::vector<float> sorted = (*ref_out)[s].logits;
          std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
          if (sorted[0] - sorted[1] <= 2 * max_diff) ++near_ties;
        }
      }
      pass = max_diff <= allowed && token_mismatches - near_ties == 0;
      verdict = pass ? 1 : 0;
      session->Print(
          "check: max |logits - logits_1rank| = %.3g, first-token mismatches %d "
          "(tolerance %g): %s\n",
          max_diff, token_mismatches, f.tolerance, pass ? "PASS" : "FAIL");
    }
    if (absl::Status s = grid.world->Broadcast(&verdict, sizeof(verdict), 0); !s.ok()) {
      session->Fail(s);
    }
    pass = verdict == 1;
  }
  if (session->is_root() && !f.logits_file.empty()) {
    std::vector<float> logits;
    std::vector<int32_t> first;
    for (const auto& o : *out) {
      logits.insert(logits.end(), o.logits.begin(), o.logits.end());
      first.push_back(o.first_token);
    }
    runtime::SafetensorsWriter w;
    const int64_t n = static_cast<int64_t>(out->size());
    absl::Status s = w.Add("logits", runtime::DType::kF32, {n, config.vocab_size}, logits.data());
    if (s.ok()) s = w.Add("first_tokens", runtime::DType::kI32, {n}, first.data());
    if (s.ok()) s = w.Write(f.logits_file);
    if (!s.ok()) session->Fail(s);
    session->Print("saved logits to %s\n", f.logits_file);
  }
  if (session->is_root() && !f.json_file.empty()) {
    nlohmann::ordered_json seqs = nlohmann::ordered_json::array();
    for (size_t s = 0; s < out->size(); ++s) {
      seqs.push_back({{"tokens", static_cast<int64_t>(batch[s].tokens.size())},
                      {"first_token", (*out)[s].first_token}});
    }
    nlohmann::ordered_json report = {{"command", "prefill"},
                                     {"model", config.name},
                                     {"layers", config.num_layers},
                                     {"world_size", grid.world_size},
                                     {"tp", grid.tp_size},
                                     {"cp", grid.cp_size},
                                     {"backend", f.backend},
                                     {"algorithm", parallel::RingAlgorithmName(t.algorithm)},
                                     {"sequences", std::move(seqs)},
                                     {"ttft_ms", slowest * 1e3},
                                     {"gemm_ms", t.gemm_s * 1e3},
                                     {"attention_ms", t.attention_s * 1e3},
                                     {"allreduce_ms", t.allreduce_s * 1e3},
                                     {"lm_head_ms", t.lm_head_s * 1e3},
                                     {"other_ms", (t.other_s + t.embed_s) * 1e3},
                                     {"tokens_per_s", total_tokens / slowest},
                                     {"model_tflop", t.model_flops / 1e12}};
    if (f.check) {
      report["check"] = {{"max_abs_logit_diff", max_diff},
                         {"first_token_mismatches", token_mismatches},
                         {"pass", pass}};
    }
    session->WriteReport(f.json_file, std::move(report));
  }
  return f.check && !pass ? kExitCheckFailed : kExitOk;
}

}  // namespace

int RunPrefillCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
