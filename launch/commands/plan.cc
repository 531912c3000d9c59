// `cpfill plan`: predicts a cluster's time to first token, its breakdown, memory per GPU and the
// selector's choice per request from a device profile and a link profile, without MPI or a GPU
// (runtime/plan/cost_model.h has the model). --search ranks every TP x CP; --nodes 1..16 plans
// each node count (doubling), as the paper's Figure 6.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "runtime/model/model_config.h"
#include "runtime/plan/cost_model.h"

namespace cpfill::launch {
namespace {

namespace rp = runtime::plan;

struct PlanFlags {
  std::string model;
  int heads = 0, kv_heads = 0, head_dim = 0, layers = 0;  // 0: not given
  std::vector<int64_t> prompt_lens, cached_lens;
  int gpus_per_node = 8, tp = 0, cp = 0;
  std::string nodes = "1";
  std::string device_profile, link_profile, algo = "auto", rule = "alg5", json_file;
  bool search = false;
};

void DefineFlags(FlagSet& flags, PlanFlags* f) {
  flags.String("model", &f->model,
               "preset (tiny, llama3-8b, llama3-70b, llama3-405b) or a "
               "checkpoint directory with config.json; or --heads for attention only");
  flags.Int("heads", &f->heads, "attention only (no --model): query heads").Within({1, 65536});
  flags.Int("kv-heads", &f->kv_heads, "attention only: key/value heads (0: 1)").Within({1, 65536});
  flags.Int("head-dim", &f->head_dim, "attention only: head dimension (0: 128)").Within({1, 1024});
  flags.Int("layers", &f->layers, "layers to plan (0: the model's; attention only 1)")
      .Within({1, 100000});
  flags.IntList("prompt-lens", &f->prompt_lens, "new tokens of each request, comma separated", true)
      .Within({1, kMaxTokens});
  flags.IntList("cached-lens", &f->cached_lens, "tokens already cached per request [0]")
      .Within({0, kMaxTokens});
  flags.Int("gpus-per-node", &f->gpus_per_node, "GPUs (ranks) per node").Within({1, 4096});
  flags.String("nodes", &f->nodes, "node count: N, A..B (doubling: 1..16 = 1,2,4,8,16) or a list");
  flags
      .Int("tp", &f->tp,
           "tensor-parallel size (0: the largest power of two dividing the KV heads "
           "and a node's GPUs)")
      .Within({1, 1 << 20});
  flags.Int("cp", &f->cp, "context-parallel size (0: GPUs / TP)").Within({1, 1 << 20});
  flags.Bool("search", &f->search, "rank every TP x CP that covers the GPUs");
  flags.String("device-profile", &f->device_profile,
               "device profile JSON (cpfill calibrate --profile, or bench/plan/*.json)", true);
  flags.String("link-profile", &f->link_profile,
               "link profile JSON: links and which joins GPUs in a node and across nodes", true);
  flags.String("algo", &f->algo, "auto | pass-kv | pass-q (auto: the selector per request)");
  flags.String("rule", &f->rule, "selector rule: alg1 | alg5 | fitted (the paper's fit)");
  flags.String("json", &f->json_file, "write every prediction as JSON").Output();
}

// "4", "1..16" (doubling), "1,2,3".
absl::StatusOr<std::vector<int>> ParseNodes(const std::string& text) {
  std::vector<int> out;
  const std::vector<std::string> range = absl::StrSplit(text, "..");
  int a = 0, b = 0;
  if (range.size() == 2 && absl::SimpleAtoi(range[0], &a) && absl::SimpleAtoi(range[1], &b) &&
      a >= 1 && b >= a && b <= 65536) {
    for (int n = a; n <= b; n *= 2) out.push_back(n);
    return out;
  }
  for (const std::string& part : std::vector<std::string>(absl::StrSplit(text, ','))) {
    int n = 0;
    CPFILL_CHECK_ARG(absl::SimpleAtoi(part, &n) && n >= 1 && n <= 65536, "--nodes: '", text,
                     "' is not N, A..B or a list of positive counts");
    out.push_back(n);
  }
  return out;
}

absl::StatusOr<rp::PlanModel> ModelOf(const PlanFlags& f) {
  CPFILL_CHECK_ARG(f.model.empty() != (f.heads == 0),
                   "give one of --model (a model) or --heads (attention only)");
  rp::PlanModel m;
  if (!f.model.empty()) {
    CPFILL_CHECK_ARG(
        f.kv_heads == 0 && f.head_dim == 0,
        "--kv-heads and --head-dim go with --heads (attention only); --model has its own");
    absl::StatusOr<runtime::ModelConfig> c = runtime::LoadModelConfig(f.model);
    if (!c.ok()) return absl::InvalidArgumentError(absl::StrCat("--model: ", c.status().message()));
    m = rp::PlanModelOf(*c);
    if (f.layers > 0) m.layers = m.config->num_layers = f.layers;
    return m;
  }
  m.heads = f.heads;
  m.kv_heads = f.kv_heads > 0 ? f.kv_heads : 1;
  m.head_dim = f.head_dim > 0 ? f.head_dim : 128;
  m.layers = f.layers > 0 ? f.layers : 1;
  m.name = absl::StrFormat("attention %d:%d x %d", m.heads, m.kv_heads, m.head_dim);
  return m;
}

absl::StatusOr<rp::PlanInput> InputOf(const PlanFlags& f) {
  rp::PlanInput in;
  CPFILL_ASSIGN_OR_RETURN(in.model, ModelOf(f));
  CPFILL_CHECK_ARG(f.cached_lens.empty() || f.cached_lens.size() == f.prompt_lens.size(),
                   "--cached-lens: ", f.cached_lens.size(), " values for ", f.prompt_lens.size(),
                   " --prompt-lens");
  for (size_t i = 0; i < f.prompt_lens.size(); ++i) {
    in.requests.push_back({.new_tokens = f.prompt_lens[i],
                           .cached_tokens = f.cached_lens.empty() ? 0 : f.cached_lens[i]});
  }
  in.gpus_per_node = f.gpus_per_node;
  if (f.algo != "auto") {
    auto a = parallel::ParseRingAlgorithm(f.algo);
    CPFILL_CHECK_ARG(a.ok() && *a != parallel::RingAlgorithm::kAllGather, "--algo: '", f.algo,
                     "' is not auto, pass-kv or pass-q");
    in.algorithm = *a;
  }
  auto rule = parallel::ParseSelectorRule(f.rule);
  CPFILL_CHECK_ARG(rule.ok(), "--rule: '", f.rule, "' is not alg1, alg5 or fitted");
  in.rule = *rule;
  return in;
}

// TP for `gpus`: --tp, else the largest power of two dividing the KV heads and a node's GPUs.
absl::Status PickGrid(const PlanFlags& f, int nodes, rp::PlanInput* in) {
  in->nodes = nodes;
  const int gpus = f.gpus_per_node * nodes;
  int tp = f.tp;
  if (tp == 0) {
    tp = 1;
    while (in->model.kv_heads % (2 * tp) == 0 && f.gpus_per_node % (2 * tp) == 0) tp *= 2;
  }
  CPFILL_CHECK_ARG(gpus % tp == 0, "--tp ", tp, " does not divide the ", gpus, " GPUs of ", nodes,
                   " node(s) x --gpus-per-node ", f.gpus_per_node);
  in->tp = tp;
  in->cp = gpus / tp;
  CPFILL_CHECK_ARG(f.cp == 0 || f.cp == in->cp, "--cp ", f.cp, " x --tp ", tp,
                   " does not cover the ", gpus, " GPUs of ", nodes, " node(s) (CP would be ",
                   in->cp, ")");
  return absl::OkStatus();
}

std::string Ms(double s) { return absl::StrFormat("%.2f ms", s * 1e3); }
std::string GiB(int64_t b) { return absl::StrFormat("%.2f GiB", b / double(1 << 30)); }

void PrintPrediction(const rp::Prediction& p) {
  const rp::LayerCost& l = p.layer;
  std::printf("%s, %d node(s) x %d GPU(s): TP%d x CP%d (ring over %s, all-reduce over %s)\n",
              p.input.model.name.c_str(), p.input.nodes, p.input.gpus_per_node, p.input.tp,
              p.input.cp, p.ring_link.c_str(), p.tp_link.c_str());
  std::printf("  TTFT %s = %d layer(s) x %s + LM head %s\n", Ms(p.ttft_s).c_str(),
              p.input.model.layers, Ms(l.total_s()).c_str(), Ms(p.lm_head_s).c_str());
  std::printf("  per layer: GEMMs %s, all-reduce %s, attention %s, KV writes %s, elementwise %s\n",
              Ms(l.gemm_s).c_str(), Ms(l.all_reduce_s).c_str(), Ms(l.attention_s).c_str(),
              Ms(l.kv_write_s).c_str(), Ms(l.elementwise_s).c_str());
  for (const rp::RingCost& r : p.rings) {
    double wait = 0;
    for (const auto& rank : r.ranks)
      for (const auto& s : rank.steps) wait = std::max(wait, s.wait_s);
    std::printf(
        "  ring %s (%zu request(s)): %s per layer, largest exposed wait %s, all-to-all %s\n",
        std::string(parallel::RingAlgorithmName(r.algorithm)).c_str(), r.sequences.size(),
        Ms(r.total_s).c_str(), Ms(wait).c_str(), Ms(r.ranks[0].all_to_all_s).c_str());
  }
  for (size_t i = 0; i < p.selections.size(); ++i) {
    std::printf("  request %zu (T=%lld, P=%lld): %s; selector: %s\n", i,
                static_cast<long long>(p.input.requests[i].new_tokens),
                static_cast<long long>(p.input.requests[i].cached_tokens),
                std::string(parallel::RingAlgorithmName(p.algorithms[i])).c_str(),
                p.selections[i].reason.c_str());
  }
  if (p.input.model.config) std::printf("  decode step (TTIT) %s\n", Ms(p.decode_step_s).c_str());
  const rp::MemoryEstimate& m = p.memory;
  std::printf("  memory per GPU: weights %s + KV %s + activations %s = %s: %s\n",
              GiB(m.weight_bytes).c_str(), GiB(m.kv_bytes).c_str(), GiB(m.activation_bytes).c_str(),
              GiB(m.total_bytes()).c_str(), m.verdict.c_str());
}

void PrintSearch(const std::vector<rp::Prediction>& ranked) {
  std::printf("%d node(s): every TP x CP, fastest first\n", ranked.front().input.nodes);
  std::printf("  %4s %4s %4s %12s %12s %12s %10s  %s\n", "rank", "TP", "CP", "TTFT ms",
              "attention ms", "linear ms", "GiB/GPU", "memory");
  for (size_t i = 0; i < ranked.size(); ++i) {
    const rp::Prediction& p = ranked[i];
    const double layers = p.input.model.layers;
    std::printf("  %4zu %4d %4d %12.1f %12.1f %12.1f %10.2f  %s\n", i + 1, p.input.tp, p.input.cp,
                p.ttft_s * 1e3, layers * p.layer.attention_s * 1e3,
                layers * (p.layer.gemm_s + p.layer.all_reduce_s) * 1e3,
                p.memory.total_bytes() / double(1 << 30), p.memory.fits ? "fits" : "does not fit");
  }
}

// One grid's prediction, or (--search) every grid's, ranked.
absl::StatusOr<std::vector<rp::Prediction>> Predict(bool search, const rp::PlanInput& in,
                                                    const rp::DeviceProfile& device,
                                                    const rp::LinkProfile& links) {
  if (search) return rp::SearchGrids(in, device, links);
  CPFILL_ASSIGN_OR_RETURN(rp::Prediction p, rp::PredictPrefill(in, device, links));
  std::vector<rp::Prediction> one;
  one.push_back(std::move(p));
  return one;
}

int Plan(const PlanFlags& f) {
  if (!f.json_file.empty()) {
    if (absl::Status s = CheckWritable("json", f.json_file); !s.ok()) return RefuseInput(s);
  }
  auto in = InputOf(f);
  if (!in.ok()) return RefuseInput(in.status());
  auto nodes = ParseNodes(f.nodes);
  if (!nodes.ok()) return RefuseInput(nodes.status());
  auto device = rp::ReadDeviceProfile(f.device_profile);
  if (!device.ok())
    return RefuseInput(
        absl::InvalidArgumentError(absl::StrCat("--device-profile: ", device.status().message())));
  auto links = rp::ReadLinkProfile(f.link_profile);
  if (!links.ok())
    return RefuseInput(
        absl::InvalidArgumentError(absl::StrCat("--link-profile: ", links.status().message())));
  nlohmann::ordered_json report = {
      {"command", "plan"}, {"device_profile", device->ToJson()}, {"link_profile", links->ToJson()}};
  nlohmann::ordered_json& plans = report["plans"] = nlohmann::ordered_json::array();
  std::vector<std::string> assumptions;
  for (int n : *nodes) {
    if (absl::Status s = PickGrid(f, n, &*in); !s.ok() && !f.search) return RefuseInput(s);
    auto ranked = Predict(f.search, *in, *device, *links);
    if (!ranked.ok()) return RefuseInput(ranked.status());
    if (f.search) {
      PrintSearch(*ranked);
    } else {
      PrintPrediction(ranked->front());
    }
    nlohmann::ordered_json jn = nlohmann::ordered_json::array();
    for (const rp::Prediction& p : *ranked) jn.push_back(p.ToJson());
    plans.push_back({{"nodes", n}, {"ranked", std::move(jn)}});
    assumptions = ranked->front().assumptions;
  }
  std::printf("assumptions:\n");
  for (const std::string& a : assumptions) std::printf("  - %s\n", a.c_str());
  if (!f.json_file.empty()) {
    if (absl::Status s = json::WriteFile(f.json_file, report); !s.ok()) {
      std::fprintf(stderr, "cpfill: error: %s\n", std::string(s.message()).c_str());
      return kExitRuntimeError;
    }
  }
  return kExitOk;
}

}  // namespace

int RunPlanCommand(int argc, char** argv) {
  PlanFlags f;
  FlagSet flags("plan",
                "predict TTFT, its breakdown, memory per GPU and the selector's choices on a TP x "
                "CP grid from device and link profiles (no MPI, no GPU)");
  DefineFlags(flags, &f);
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  return Plan(f);
}

}  // namespace cpfill::launch
