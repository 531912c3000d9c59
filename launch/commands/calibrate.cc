// `cpfill calibrate`: measures this cluster for the selector. Times ring pass-KV and pass-Q on a
// grid of (T, P) with T + P fixed per context length (the paper's Table 4), measures the
// attention compute rate C and the ring bandwidth BW, fits the App. D rule
// h = a ln T + b ln(T/(T+P)) + c, prints each rule's choices and regret, and writes the JSON that
// `--fit` reads. `--profile F` writes the device and link profile `cpfill plan` reads
// (launch/job/device_profile.h) instead, or as well with --out.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "launch/commands/commands.h"
#include "launch/job/attention_job.h"
#include "launch/job/backend.h"
#include "launch/job/calibration.h"
#include "launch/job/device_profile.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/selector_flags.h"
#include "launch/job/synthetic_attention.h"
#include "parallel/ring_attention.h"
#include "parallel/selector.h"

namespace cpfill::launch {
namespace {

using parallel::RingAlgorithm;

struct CalibrateFlags {
  // Two totals: with T + P fixed, ln T and ln(T/(T+P)) move together and the fit cannot tell
  // a from b.
  CalibrationGrid g{.context_lens = {2048, 8192},
                    .miss_rates = {0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0}};
  std::string out = "cpfill-fit.json";
  std::string backend = "auto";
  std::string json_file;
  std::string profile;                  // --profile: the device profile `cpfill plan` reads
  std::vector<int64_t> profile_tokens;  // its causal squares [backend's defaults]
};

// GPU-sized grid defaults: the paper's Table 4 miss rates, at two context totals.
void UseGpuDefaults(CalibrateFlags& f, const FlagSet& flags) {
  if (!flags.IsSet("context-lens")) f.g.context_lens = {32768, 131072};
  if (!flags.IsSet("miss-rates")) {
    f.g.miss_rates = {0.01, 0.025, 0.0325, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
  }
  if (!flags.IsSet("heads")) f.g.heads = 16;
  if (!flags.IsSet("compute-tokens")) f.g.compute_tokens = 16384;
  if (!flags.IsSet("bandwidth-bytes")) f.g.bandwidth_bytes = int64_t{256} << 20;
}

void DefineFlags(FlagSet& flags, CalibrateFlags* f) {
  flags.Int("heads", &f->g.heads, "query heads of the model (all TP ranks together)")
      .Within({1, 65536});
  flags.Int("kv-heads", &f->g.kv_heads, "key/value heads of the model").Within({1, 65536});
  flags.Int("head-dim", &f->g.head_dim, "head dimension").Within({1, 1024});
  flags.IntList("context-lens", &f->g.context_lens, "T + P of the grid, comma separated")
      .Within({1, kMaxTokens});
  flags.DoubleList("miss-rates", &f->g.miss_rates, "T / (T + P) of the grid")
      .Within(Range::LeftOpen(0, 1));
  flags.Int("repeat", &f->g.repeat, "timed runs per point (median), after one warm-up")
      .Within({1, 1e6});
  flags.Int("compute-tokens", &f->g.compute_tokens, "square causal attention that measures C")
      .Within({1, kMaxTokens});
  flags.Int("bandwidth-bytes", &f->g.bandwidth_bytes, "ring message that measures BW")
      .Within({1, int64_t{1} << 40});
  flags
      .Double("elem-bytes", &f->g.elem_bytes,
              "bytes per element e the rules assume [the backend's: cpu 4, cuda 2]")
      .Within(Range::LeftOpen(0, 64));
  flags.String("out", &f->out, "calibration JSON to write (read by --fit)").Output();
  flags
      .String("json", &f->json_file,
              "write the grid's times, every rule's choices and regrets as JSON")
      .Output();
  flags
      .String("profile", &f->profile,
              "write a device profile for `cpfill plan` (attention and GEMM rates, memory "
              "bandwidth, the ring link); alone it skips the (T, P) grid, with --out it runs both")
      .Output();
  flags.IntList("profile-tokens", &f->profile_tokens,
                "causal squares the profile times [cpu 256,1024,2048,4096; cuda 2048,8192,32768]")
      .Within({1, 1 << 20});
  flags.String("backend", &f->backend,
               "auto | cpu | cuda | cuda-staged (auto: cuda when a GPU is visible; CUDA backends "
               "default to GPU-sized grids)");
}

absl::Status Validate(const CalibrateFlags& f, const parallel::ProcessGrid& grid) {
  CPFILL_CHECK_ARG(
      f.g.heads > 0 && f.g.kv_heads > 0 && f.g.head_dim > 0 && f.g.heads % f.g.kv_heads == 0,
      "--heads ", f.g.heads, " must be a positive multiple of --kv-heads ", f.g.kv_heads,
      " and --head-dim positive");
  CPFILL_CHECK_ARG(f.g.heads % grid.tp_size == 0 && f.g.kv_heads % grid.tp_size == 0,
                   "--heads and --kv-heads must divide by --tp ", grid.tp_size);
  CPFILL_CHECK_ARG(!f.g.context_lens.empty() && !f.g.miss_rates.empty(),
                   "--context-lens and --miss-rates must not be empty");
  for (int64_t c : f.g.context_lens) CPFILL_CHECK_ARG(c >= 1, "--context-lens: ", c, " < 1");
  for (double m : f.g.miss_rates) {
    CPFILL_CHECK_ARG(m > 0 && m <= 1, "--miss-rates: ", m, " is not in (0, 1]");
  }
  CPFILL_CHECK_ARG(f.profile_tokens.empty() || !f.profile.empty(),
                   "--profile-tokens goes with --profile");
  CPFILL_CHECK_ARG(f.g.repeat >= 1 && f.g.compute_tokens >= 1 && f.g.bandwidth_bytes >= 1,
                   "--repeat, --compute-tokens and --bandwidth-bytes must be positive");
  return absl::OkStatus();
}

// Prints each rule's regret and returns the regrets as JSON: {"all" | "<T+P>": {rule: regret}}.
// The fitted rule is judged here on the points it was fitted to (in-sample).
nlohmann::ordered_json ReportRegret(Job& job, const RuleEvaluation& e,
                                    const std::vector<parallel::CalibrationPoint>& points,
                                    std::vector<int64_t> totals) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  totals.push_back(0);  // 0: the whole grid
  for (int64_t total : totals) {
    std::vector<size_t> which;
    for (size_t i = 0; i < points.size(); ++i) {
      if (total == 0 || points[i].new_tokens + points[i].cached_tokens == total) which.push_back(i);
    }
    nlohmann::ordered_json per_rule = nlohmann::ordered_json::object();
    for (size_t r = 0; r < e.rules.size(); ++r) {
      const Regret g = RegretOn(points, e.picks_kv[r], which);
      if (g.count == 0) continue;
      const std::string rule(parallel::SelectorRuleName(e.rules[r]));
      per_rule[rule] = g.regret;
      job.Print("  %-6s regret %6.2f%% (%d of %d points not the faster) on %s\n", rule,
                100 * g.regret, g.wrong, g.count,
                total == 0 ? std::string("the whole grid") : absl::StrCat("T + P = ", total));
    }
    out[total == 0 ? std::string("all") : absl::StrCat(total)] = std::move(per_rule);
  }
  return out;
}

// Every rule's regret on the held-out half of the lengths, the fitted rule with a fit made on the
// other half; JSON {"points": n, "fit": {a, b, c}, rule: regret}, or null when that half is too
// few to fit.
nlohmann::ordered_json ReportHeldOut(Job& job,
                                     const std::vector<parallel::CalibrationPoint>& points,
                                     const parallel::SystemSpec& system,
                                     const parallel::ModelSpec& model, int cp_size) {
  auto held = EvaluateHeldOut(points, system, model, cp_size);
  if (!held.ok()) {
    job.Print("  held out: no fit (%s)\n", std::string(held.status().message()));
    return nullptr;
  }
  job.Print(
      "held out: fit on every other T (h = %.4f ln T + %.4f ln(T/(T+P)) + %.4f), "
      "judged on the %d others:\n",
      held->fitted.a, held->fitted.b, held->fitted.c, held->held_out.size());
  nlohmann::ordered_json out = {
      {"points", held->held_out.size()},
      {"fit", {{"a", held->fitted.a}, {"b", held->fitted.b}, {"c", held->fitted.c}}}};
  for (size_t r = 0; r < held->rules.rules.size(); ++r) {
    const Regret g = RegretOn(points, held->rules.picks_kv[r], held->held_out);
    const std::string rule(parallel::SelectorRuleName(held->rules.rules[r]));
    out[rule] = g.regret;
    job.Print("  %-6s regret %6.2f%% (%d of %d points not the faster)\n", rule, 100 * g.regret,
              g.wrong, g.count);
  }
  return out;
}

nlohmann::ordered_json ReportJson(const parallel::ProcessGrid& grid, const Backend& backend,
                                  const parallel::CalibrationFile& file, const RuleEvaluation& e) {
  nlohmann::ordered_json report = {{"grid", grid.Describe()}, {"backend", backend.name()},
                                   {"tflops", file.tflops},   {"gbps", file.gbps},
                                   {"a", file.fitted.a},      {"b", file.fitted.b},
                                   {"c", file.fitted.c}};
  nlohmann::ordered_json& jpoints = report["points"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < file.points.size(); ++i) {
    const parallel::CalibrationPoint& p = file.points[i];
    nlohmann::ordered_json jp = {{"new_tokens", p.new_tokens},
                                 {"cached_tokens", p.cached_tokens},
                                 {"pass_kv_ms", p.pass_kv_s * 1e3},
                                 {"pass_q_ms", p.pass_q_s * 1e3}};
    for (size_t r = 0; r < e.rules.size(); ++r) {
      jp["choice_" + std::string(parallel::SelectorRuleName(e.rules[r]))] =
          e.picks_kv[r][i] ? "pass-kv" : "pass-q";
    }
    jpoints.push_back(std::move(jp));
  }
  return report;
}

// What the plan settles before any timing, the same on every rank.
struct CalibratePlan {
  std::unique_ptr<Backend> backend;
  AttentionBatch one;  // one token: the model's heads per rank and the kernels' shape
};

// Plan: the backend and its grid defaults, the grid checked, its memory; every rank reaches the
// same verdict. Returns the exit code when the input is refused.
std::optional<int> Plan(CalibrateFlags& f, const FlagSet& flags, Job& job,
                        const parallel::ProcessGrid& grid, CalibratePlan* plan) {
  const int threads = job.ThreadsPerRank(grid);
  auto backend = Backend::Create(f.backend, grid, job.mpi().options(), threads);
  if (!backend.ok()) return job.Refuse(backend.status());
  plan->backend = *std::move(backend);
  const std::string& name = plan->backend->name();
  if (name == "cuda") UseGpuDefaults(f, flags);
  // e as the run's selector will assume it: fp32 on the CPU backend (SystemDefaults).
  if (!flags.IsSet("elem-bytes")) f.g.elem_bytes = SystemDefaults(name).elem_bytes;
  if (absl::Status s = Validate(f, grid); !s.ok()) return job.ConfigError(s);
  auto one = MakeAttentionBatch(
      {.new_lens = {1}, .heads = f.g.heads, .kv_heads = f.g.kv_heads, .head_dim = f.g.head_dim},
      grid);
  if (!one.ok()) return job.ConfigError(one.status());
  plan->one = *std::move(one);
  auto need = CalibrationMemory(f.g, grid, plan->backend->on_device());
  if (!need.ok()) return job.ConfigError(need.status());
  if (absl::Status s = CheckAttentionFits(
          *need, *plan->backend, *grid.world,
          "lower --context-lens, --compute-tokens or --bandwidth-bytes, or use more ranks");
      !s.ok()) {
    return job.Refuse(s);
  }
  return std::nullopt;
}

// What the runs measured: C and BW, and the grid's times.
struct Measured {
  parallel::SystemSpec system;
  std::vector<parallel::CalibrationPoint> points;
};

// Run: C and BW, then the grid, a line per point. A failure ends the job.
Measured Measure(Job& job, const CalibrateFlags& f, const parallel::ProcessGrid& grid,
                 const CalibratePlan& plan) {
  Measured m;
  auto system = MeasureSystem(*plan.backend, *grid.world, plan.one.shape, f.g);
  if (!system.ok()) job.Fail(system.status());
  m.system = *system;
  job.Print(
      "measured: C = %.4g TFLOP/s per rank (causal %d tokens), BW = %.4g GB/s per rank (ring "
      "message %d bytes)\n",
      m.system.tflops, f.g.compute_tokens, m.system.gbps, f.g.bandwidth_bytes);
  job.Print("\n%9s %9s %7s %13s %13s %8s\n", "T", "P", "miss", "pass-kv ms", "pass-q ms", "faster");
  auto points = TimeGrid(*plan.backend, grid, f.g, [&](const parallel::CalibrationPoint& p) {
    job.Print("%9d %9d %6.2f%% %13.3f %13.3f %8s\n", p.new_tokens, p.cached_tokens,
              100.0 * p.new_tokens / (p.new_tokens + p.cached_tokens), p.pass_kv_s * 1e3,
              p.pass_q_s * 1e3, p.pass_kv_s <= p.pass_q_s ? "pass-kv" : "pass-q");
  });
  if (!points.ok()) job.Fail(points.status());
  m.points = *std::move(points);
  return m;
}

// The calibration file: the measured C and BW, the points, the fitted coefficients (the paper's
// when the points cannot be fitted) and the ring they were made on.
parallel::CalibrationFile FitFile(Job& job, const CalibrateFlags& f,
                                  const parallel::ProcessGrid& grid, const CalibratePlan& plan,
                                  const Measured& m) {
  parallel::CalibrationFile file;
  file.tflops = m.system.tflops;
  file.gbps = m.system.gbps;
  file.elem_bytes = f.g.elem_bytes;
  file.points = m.points;
  auto fitted = parallel::FitCoefficients(m.points);
  if (fitted.ok()) {
    file.fitted = *fitted;
  } else {
    job.Print("fit: %s; keeping the paper's coefficients\n",
              std::string(fitted.status().message()));
  }
  file.fitted.source = absl::StrFormat("cpfill calibrate, %s", grid.Describe());
  file.made_on = RingContextOf(plan.backend->name(), grid);
  job.Print("\nfit: h = %.4f ln T + %.4f ln(T/(T+P)) + %.4f\n", file.fitted.a, file.fitted.b,
            file.fitted.c);
  return file;
}

// Report: the fit, every rule's regret, the JSON and the calibration file.
int Report(Job& job, const CalibrateFlags& f, const parallel::ProcessGrid& grid,
           const CalibratePlan& plan, const Measured& m) {
  const parallel::CalibrationFile file = FitFile(job, f, grid, plan, m);
  const parallel::ModelSpec& model = plan.one.model;
  const RuleEvaluation rules = EvaluateRules(m.points, m.system, model, grid.cp_size, file.fitted);
  nlohmann::ordered_json report = ReportJson(grid, *plan.backend, file, rules);
  report["made_on"] = file.made_on->ToJson();
  report["regret"] = ReportRegret(job, rules, m.points, f.g.context_lens);
  report["regret_held_out"] = ReportHeldOut(job, m.points, m.system, model, grid.cp_size);
  if (job.is_root() && !f.json_file.empty()) {
    job.WriteReport(f.json_file, std::move(report));
  }
  if (job.is_root()) {
    if (absl::Status s = parallel::WriteCalibrationFile(f.out, file); !s.ok()) job.Fail(s);
    job.Print("wrote %s (use with --fit)\n", f.out);
  }
  if (absl::Status s = grid.world->Barrier(); !s.ok()) job.Fail(s);
  return kExitOk;
}

// --profile: the device and link profile of this machine, written by rank 0.
void WriteProfile(Job& job, const CalibrateFlags& f, const parallel::ProcessGrid& grid,
                  const CalibratePlan& plan) {
  const bool cpu = plan.backend->name() == "cpu";
  ProfileOptions o{.attention_tokens = f.profile_tokens,
                   .gemm_rows = {16, 128, 1024, 4096},
                   .repeat = f.g.repeat,
                   .threads = job.ThreadsPerRank(grid),
                   .elem_bytes = f.g.elem_bytes};
  if (o.attention_tokens.empty()) {
    o.attention_tokens = cpu ? std::vector<int64_t>{256, 1024, 2048, 4096}
                             : std::vector<int64_t>{2048, 8192, 32768};
  }
  auto measured = MeasureDeviceProfile(*plan.backend, *grid.world, plan.one.shape, o);
  if (!measured.ok()) job.Fail(measured.status());
  for (const auto& r : measured->device.attention) {
    job.Print("profile: attention %.4g TFLOP/s at %.4g pairs per head\n", r.tflops, r.size);
  }
  for (const auto& r : measured->device.gemm) {
    job.Print("profile: GEMM %.4g TFLOP/s at %g rows\n", r.tflops, r.size);
  }
  job.Print("profile: memory %.4g GB/s\n", measured->device.memory_gbps);
  for (const auto& link : measured->links.links) {
    job.Print("profile: ring link %.4g GB/s, %.4g us\n", link.gbps, link.latency_us);
  }
  if (job.is_root()) {
    if (absl::Status s = json::WriteFile(f.profile, measured->ToJson()); !s.ok()) job.Fail(s);
    job.Print("wrote %s (use with cpfill plan --device-profile and --link-profile)\n", f.profile);
  }
}

// The command once its job has started: plan -> run -> report.
int Calibrate(CalibrateFlags& f, const FlagSet& flags, Job& job,
              const parallel::ProcessGrid& grid) {
  CalibratePlan plan;
  if (auto refused = Plan(f, flags, job, grid, &plan)) return *refused;
  job.Print("cpfill calibrate: %s; %d / %d heads per rank x %d; %s backend\n", grid.Describe(),
            plan.one.model.num_heads, plan.one.model.num_kv_heads, f.g.head_dim,
            plan.backend->Description());
  if (!f.profile.empty()) {
    WriteProfile(job, f, grid, plan);
    if (!flags.IsSet("out")) return kExitOk;  // the profile alone
  }
  const Measured measured = Measure(job, f, grid, plan);
  return Report(job, f, grid, plan, measured);
}

}  // namespace

int RunCalibrateCommand(int argc, char** argv) {
  CalibrateFlags f;
  FlagSet flags("calibrate",
                "time pass-KV and pass-Q on a (T, P) grid, measure C and BW, fit the selector "
                "(under mpirun)");
  DefineFlags(flags, &f);
  return RunJob(argc, argv, flags, [&](Job& job, parallel::ProcessGrid& grid) {
    return Calibrate(f, flags, job, grid);
  });
}

}  // namespace cpfill::launch
