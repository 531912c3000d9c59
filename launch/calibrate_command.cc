// `cpfill calibrate`: measures this cluster for the selector. Times ring pass-KV and pass-Q on a
// grid of (T, P) with T + P fixed per context length (the paper's Table 4), measures the
// attention compute rate C and the ring bandwidth BW, fits the App. D rule
// h = a ln T + b ln(T/(T+P)) + c, prints each rule's choices and regret, and writes the JSON that
// `--fit` reads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "launch/backend.h"
#include "launch/commands.h"
#include "launch/flags.h"
#include "launch/session.h"
#include "parallel/ring_attention.h"
#include "parallel/selector.h"
#include "runtime/synthetic_attention.h"

namespace cpfill::launch {
namespace {

using parallel::RingAlgorithm;
using Clock = std::chrono::steady_clock;

struct CalibrateFlags {
  int heads = 8;
  int kv_heads = 1;
  int head_dim = 128;
  // Two totals: with T + P fixed, ln T and ln(T/(T+P)) move together and the fit cannot tell
  // a from b.
  std::vector<int64_t> context_lens = {2048, 8192};
  std::vector<double> miss_rates = {0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0};
  int repeat = 3;
  int64_t compute_tokens = 2048;
  int64_t bandwidth_bytes = 64 << 20;
  double elem_bytes = 2;
  std::string out = "cpfill-fit.json";
  std::string backend = "auto";
  std::string json_file;
  SessionFlags session;
};

// GPU-sized grid defaults: the paper's Table 4 miss rates, at two context totals.
void UseGpuDefaults(CalibrateFlags& f, const FlagSet& flags) {
  if (!flags.IsSet("context-lens")) f.context_lens = {32768, 131072};
  if (!flags.IsSet("miss-rates")) {
    f.miss_rates = {0.01, 0.025, 0.0325, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  }
  if (!flags.IsSet("heads")) f.heads = 16;
  if (!flags.IsSet("compute-tokens")) f.compute_tokens = 16384;
  if (!flags.IsSet("bandwidth-bytes")) f.bandwidth_bytes = int64_t{256} << 20;
}

template <typename T>
T Median(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median over `repeat` runs (after one warm-up) of the slowest rank's time for one algorithm.
absl::StatusOr<double> TimeAlgorithm(parallel::ProcessGrid& grid, Runner& runner,
                                     RingAlgorithm algo, int repeat) {
  std::vector<double> times;
  for (int r = 0; r <= repeat; ++r) {
    CPFILL_RETURN_IF_ERROR(grid.world->Barrier());
    parallel::RingTimings t;
    CPFILL_RETURN_IF_ERROR(runner.Run(algo, &t, nullptr));
    double worst = t.total_s;
    CPFILL_RETURN_IF_ERROR(
        grid.world->AllReduce(&worst, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMax));
    if (r > 0) times.push_back(worst);  // run 0 sizes the buffers: a warm-up
  }
  return Median(times);
}

int Run(int argc, char** argv) {
  CalibrateFlags f;
  FlagSet flags("calibrate",
                "time pass-KV and pass-Q on a (T, P) grid, measure C and BW, fit the selector "
                "(under mpirun)");
  flags.Int("heads", &f.heads, "query heads of the model (all TP ranks together)");
  flags.Int("kv-heads", &f.kv_heads, "key/value heads of the model");
  flags.Int("head-dim", &f.head_dim, "head dimension");
  flags.IntList("context-lens", &f.context_lens, "T + P of the grid, comma separated");
  flags.DoubleList("miss-rates", &f.miss_rates, "T / (T + P) of the grid, in (0, 1]");
  flags.Int("repeat", &f.repeat, "timed runs per point (median), after one warm-up");
  flags.Int("compute-tokens", &f.compute_tokens, "square causal attention that measures C");
  flags.Int("bandwidth-bytes", &f.bandwidth_bytes, "ring message that measures BW");
  flags.Double("elem-bytes", &f.elem_bytes, "bytes per element e the rules assume");
  flags.String("out", &f.out, "calibration JSON to write (read by --fit)");
  flags.String("json", &f.json_file,
               "write the grid's times, every rule's choices and regrets as JSON");
  flags.String("backend", &f.backend,
               "auto | cpu | cuda | cuda-staged (auto: cuda when a GPU is visible; CUDA backends "
               "default to GPU-sized grids)");
  AddSessionFlags(flags, &f.session);
  const absl::Status parsed = flags.Parse(argc, argv, 2);
  Started started = Session::Begin(&argc, &argv, flags, parsed, f.session);
  if (started.exit_code) return *started.exit_code;
  Session* session = started.session.get();
  parallel::ProcessGrid& grid = *started.grid;
  const int threads = session->ThreadsPerRank(grid);
  auto backend_or = Backend::Create(f.backend, grid, session->mpi().options(), threads);
  if (!backend_or.ok()) return session->Refuse(backend_or.status());
  Backend& backend = **backend_or;
  if (backend.name() == "cuda") UseGpuDefaults(f, flags);
  auto validate = [&]() -> absl::Status {
    CPFILL_CHECK_ARG(f.heads > 0 && f.kv_heads > 0 && f.head_dim > 0 && f.heads % f.kv_heads == 0,
                     "--heads ", f.heads, " must be a positive multiple of --kv-heads ", f.kv_heads,
                     " and --head-dim positive");
    CPFILL_CHECK_ARG(f.heads % grid.tp_size == 0 && f.kv_heads % grid.tp_size == 0,
                     "--heads and --kv-heads must divide by --tp ", grid.tp_size);
    CPFILL_CHECK_ARG(!f.context_lens.empty() && !f.miss_rates.empty(),
                     "--context-lens and --miss-rates must not be empty");
    for (int64_t c : f.context_lens) CPFILL_CHECK_ARG(c >= 1, "--context-lens: ", c, " < 1");
    for (double m : f.miss_rates) {
      CPFILL_CHECK_ARG(m > 0 && m <= 1, "--miss-rates: ", m, " is not in (0, 1]");
    }
    CPFILL_CHECK_ARG(f.repeat >= 1 && f.compute_tokens >= 1 && f.bandwidth_bytes >= 1,
                     "--repeat, --compute-tokens and --bandwidth-bytes must be positive");
    return absl::OkStatus();
  };
  if (absl::Status s = validate(); !s.ok()) return session->ConfigError(s);

  const int hq = f.heads / grid.tp_size, hkv = f.kv_heads / grid.tp_size;
  const attention::AttentionShape shape{.num_heads = hq,
                                        .num_kv_heads = hkv,
                                        .head_dim = f.head_dim,
                                        .softmax_scale = 1.0f / std::sqrt(float(f.head_dim)),
                                        .causal = true};
  session->Print("cpfill calibrate: %s; %d / %d heads per rank x %d; %s backend\n", grid.Describe(),
                 hq, hkv, f.head_dim, backend.Description());

  // Step 1: C, the attention compute rate of one rank (all ranks at once, as in a real run).
  auto tflops_or = backend.MeasureTflops(shape, f.compute_tokens, f.repeat);
  if (!tflops_or.ok()) session->Fail(tflops_or.status());
  double tflops = *tflops_or;
  if (absl::Status s =
          grid.world->AllReduce(&tflops, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kSum);
      !s.ok()) {
    session->Fail(s);
  }
  tflops /= grid.world_size;
  // Step 2: BW, the ring bandwidth per rank (the slowest rank's).
  auto gbps_or = backend.MeasureRingGbps(f.bandwidth_bytes, f.repeat);
  if (!gbps_or.ok()) session->Fail(gbps_or.status());
  double gbps = *gbps_or;
  if (absl::Status s =
          grid.world->AllReduce(&gbps, 1, parallel::DataType::kFloat64, parallel::ReduceOp::kMin);
      !s.ok()) {
    session->Fail(s);
  }
  session->Print(
      "measured: C = %.4g TFLOP/s per rank (causal %d tokens), BW = %.4g GB/s per "
      "rank (ring message %d bytes)\n",
      tflops, f.compute_tokens, gbps, f.bandwidth_bytes);

  // Step 3: the (T, P) grid.
  std::vector<parallel::CalibrationPoint> points;
  session->Print("\n%9s %9s %7s %13s %13s %8s\n", "T", "P", "miss", "pass-kv ms", "pass-q ms",
                 "faster");
  for (int64_t ctx : f.context_lens) {
    for (double miss : f.miss_rates) {
      const int64_t t_new = std::clamp<int64_t>(std::llround(miss * ctx), 1, ctx);
      const std::vector<sharding::SequenceRequest> req = {
          {.new_tokens = t_new, .cached_tokens = ctx - t_new}};
      auto plan = sharding::PlanPrefill(req, grid.cp_size);
      if (!plan.ok()) session->Fail(plan.status());
      const runtime::SyntheticAttention batch{.sequences = req,
                                              .num_heads = f.heads,
                                              .num_kv_heads = f.kv_heads,
                                              .head_dim = f.head_dim};
      auto runner = backend.MakeRunner(
          *plan, shape, batch,
          runtime::HeadSlice::ForTpRank(f.heads, f.kv_heads, grid.tp_rank, grid.tp_size));
      if (!runner.ok()) session->Fail(runner.status());
      parallel::CalibrationPoint pt{.new_tokens = t_new, .cached_tokens = ctx - t_new};
      auto kv = TimeAlgorithm(grid, **runner, RingAlgorithm::kPassKV, f.repeat);
      if (!kv.ok()) session->Fail(kv.status());
      auto pq = TimeAlgorithm(grid, **runner, RingAlgorithm::kPassQ, f.repeat);
      if (!pq.ok()) session->Fail(pq.status());
      pt.pass_kv_s = *kv;
      pt.pass_q_s = *pq;
      points.push_back(pt);
      session->Print("%9d %9d %6.2f%% %13.3f %13.3f %8s\n", pt.new_tokens, pt.cached_tokens,
                     100.0 * t_new / ctx, pt.pass_kv_s * 1e3, pt.pass_q_s * 1e3,
                     pt.pass_kv_s <= pt.pass_q_s ? "pass-kv" : "pass-q");
    }
  }

  // Step 4: fit, and every rule's regret on this grid.
  parallel::CalibrationFile file;
  file.tflops = tflops;
  file.gbps = gbps;
  file.points = points;
  auto fitted = parallel::FitCoefficients(points);
  if (fitted.ok()) {
    file.fitted = *fitted;
  } else {
    session->Print("fit: %s; keeping the paper's coefficients\n",
                   std::string(fitted.status().message()));
  }
  file.fitted.source = absl::StrFormat("cpfill calibrate, %s", grid.Describe());
  session->Print("\nfit: h = %.4f ln T + %.4f ln(T/(T+P)) + %.4f\n", file.fitted.a, file.fitted.b,
                 file.fitted.c);
  // Every rule's choice per point, and its regret: the time of the rule's choices over the time
  // of the faster algorithm at every point, over the whole grid and per context length.
  const std::vector<parallel::SelectorRule> rules = {parallel::SelectorRule::kAlg1,
                                                     parallel::SelectorRule::kAlg5,
                                                     parallel::SelectorRule::kFitted};
  std::vector<std::vector<bool>> picks_kv(rules.size());
  for (size_t r = 0; r < rules.size(); ++r) {
    for (const auto& p : points) {
      auto sel = parallel::Select(
          {.system = {.tflops = tflops, .gbps = gbps > 0 ? gbps : 1e-9, .elem_bytes = f.elem_bytes},
           .model = {.num_heads = hq, .num_kv_heads = hkv, .head_dim = f.head_dim},
           .cp_size = grid.cp_size,
           .new_tokens = p.new_tokens,
           .cached_tokens = p.cached_tokens},
          rules[r], file.fitted);
      picks_kv[r].push_back(sel.ok() && sel->choice == RingAlgorithm::kPassKV);
    }
  }
  nlohmann::ordered_json report;
  report["grid"] = grid.Describe();
  report["backend"] = backend.name();
  report["tflops"] = tflops;
  report["gbps"] = gbps;
  report["a"] = file.fitted.a;
  report["b"] = file.fitted.b;
  report["c"] = file.fitted.c;
  nlohmann::ordered_json jpoints = nlohmann::ordered_json::array();
  for (size_t i = 0; i < points.size(); ++i) {
    nlohmann::ordered_json jp = {{"new_tokens", points[i].new_tokens},
                                 {"cached_tokens", points[i].cached_tokens},
                                 {"pass_kv_ms", points[i].pass_kv_s * 1e3},
                                 {"pass_q_ms", points[i].pass_q_s * 1e3}};
    for (size_t r = 0; r < rules.size(); ++r) {
      jp["choice_" + std::string(parallel::SelectorRuleName(rules[r]))] =
          picks_kv[r][i] ? "pass-kv" : "pass-q";
    }
    jpoints.push_back(std::move(jp));
  }
  report["points"] = std::move(jpoints);
  nlohmann::ordered_json jregret = nlohmann::ordered_json::object();
  std::vector<int64_t> totals = f.context_lens;
  totals.push_back(0);  // 0: the whole grid
  for (int64_t total : totals) {
    nlohmann::ordered_json per_rule = nlohmann::ordered_json::object();
    for (size_t r = 0; r < rules.size(); ++r) {
      double best = 0, chosen = 0;
      int wrong = 0, count = 0;
      for (size_t i = 0; i < points.size(); ++i) {
        const auto& p = points[i];
        if (total != 0 && p.new_tokens + p.cached_tokens != total) continue;
        best += std::min(p.pass_kv_s, p.pass_q_s);
        chosen += picks_kv[r][i] ? p.pass_kv_s : p.pass_q_s;
        wrong += picks_kv[r][i] != (p.pass_kv_s <= p.pass_q_s);
        ++count;
      }
      if (best <= 0) continue;
      const double regret = chosen / best - 1;
      per_rule[std::string(parallel::SelectorRuleName(rules[r]))] = regret;
      session->Print("  %-6s regret %6.2f%% (%d of %d points not the faster) on %s\n",
                     parallel::SelectorRuleName(rules[r]), 100 * regret, wrong, count,
                     total == 0 ? std::string("the whole grid") : absl::StrCat("T + P = ", total));
    }
    jregret[total == 0 ? std::string("all") : absl::StrCat(total)] = std::move(per_rule);
  }
  report["regret"] = std::move(jregret);
  if (session->is_root() && !f.json_file.empty()) {
    session->WriteReport(f.json_file, std::move(report));
  }
  if (session->is_root()) {
    if (absl::Status s = parallel::WriteCalibrationFile(f.out, file); !s.ok()) session->Fail(s);
    session->Print("wrote %s (use with --fit)\n", f.out);
  }
  if (absl::Status s = grid.world->Barrier(); !s.ok()) session->Fail(s);
  return kExitOk;
}

}  // namespace

int RunCalibrateCommand(int argc, char** argv) { return Run(argc, argv); }

}  // namespace cpfill::launch
