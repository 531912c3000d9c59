#include "launch/job/selector_flags.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/knobs.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::launch {
namespace {

// The CPU backend's C and BW per rank, measured 2026-11-23 on the 2-core development VM (AMD
// EPYC), 2 ranks of one kernel thread, `cpfill calibrate --backend cpu --context-lens 2048`:
// C 0.032-0.040 TFLOP/s, BW 1.11-1.21 GB/s (MPI shared memory, 64 MiB messages) over 3 runs. A
// host with more cores per rank computes faster: calibrate it (--fit) or pass --tflops.
constexpr double kCpuTflops = 0.035;
constexpr double kCpuGbps = 1.15;

std::string Show(double x) { return absl::StrFormat("%g", x); }

}  // namespace

void AddSelectorFlags(FlagSet& flags, SelectorFlags* sf) {
  flags.String("algo", &sf->algo, "auto | pass-kv | pass-q | all-gather");
  flags.String("rule", &sf->rule,
               "selector rule for --algo auto: alg1 | alg5 | fitted [fitted with --fit, else "
               "alg5]");
  flags.String("fit", &sf->fit_file,
               "calibration JSON from 'cpfill calibrate' (a, b, c; C, BW); refused when made on "
               "another backend, CP or TP size, node count or link");
  flags.Bool("fit-rescale", &sf->fit_rescale,
             "use a --fit made on another ring, its boundary moved by the ratio of the eq. 2 "
             "thresholds (N*C/BW of this run over the fit's)");
  flags
      .Double("tflops", &sf->tflops,
              "selector: attention compute per rank C, TFLOP/s; 0 = the fit's, else the "
              "backend's default (cpu " +
                  Show(SystemDefaults("cpu").tflops) + ", cuda " +
                  Show(SystemDefaults("cuda").tflops) + ")")
      .Within({0, 1e9});
  flags
      .Double("gbps", &sf->gbps,
              "selector: ring bandwidth per rank BW, GB/s (bytes); 0 = the fit's, else the "
              "backend's default (cpu " +
                  Show(SystemDefaults("cpu").gbps) + ", cuda " + Show(SystemDefaults("cuda").gbps) +
                  ")")
      .Within({0, 1e9});
  flags
      .Double("elem-bytes", &sf->elem_bytes,
              "selector: bytes per element e; 0 = the backend's (cpu 4, cuda 2)")
      .Within({0, 64});
}

parallel::SystemSpec SystemDefaults(std::string_view backend) {
  // CPU: measured (kCpuTflops). CUDA: C measured, BW assumed (selector_flags.h).
  if (backend == "cpu") return {.tflops = kCpuTflops, .gbps = kCpuGbps, .elem_bytes = 4};
  return {.tflops = 600, .gbps = 50, .elem_bytes = 2};
}

parallel::RingContext RingContextOf(std::string_view backend, const parallel::ProcessGrid& grid) {
  std::string link = backend == "cuda" ? "nccl" : "mpi";
  if (backend == "cuda-staged") link += " staged through host memory";
  absl::StrAppend(&link, grid.num_nodes > 1 ? " across nodes" : " within a node");
  if (backend == "cuda") {
    for (std::string_view knob :
         {knobs::kNcclP2pDisable, knobs::kNcclShmDisable, knobs::kNcclNet}) {
      if (knobs::IsSet(knob)) absl::StrAppend(&link, ", ", Sv(knob), "=", knobs::Text(knob));
    }
  }
  return {.backend = std::string(backend),
          .cp_size = grid.cp_size,
          .tp_size = grid.tp_size,
          .num_nodes = grid.num_nodes,
          .link = std::move(link)};
}

namespace {

// `status` with the flag it came from in front, so the message names what to change.
absl::Status ForFlag(const char* flag, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("--", flag, ": ", status.message()));
}

// --tflops, --gbps and --elem-bytes, where given (not 0), over `system`.
parallel::SystemSpec WithFlags(parallel::SystemSpec system, const SelectorFlags& sf) {
  if (sf.tflops > 0) system.tflops = sf.tflops;
  if (sf.gbps > 0) system.gbps = sf.gbps;
  if (sf.elem_bytes > 0) system.elem_bytes = sf.elem_bytes;
  return system;
}

// OK if the fit was made on this ring (or says nothing of where) or the user asked to rescale
// it; else InvalidArgument naming every difference.
absl::Status CheckFitRing(const parallel::CalibrationFile& cal, const SelectorFlags& sf,
                          const parallel::RingContext& run) {
  if (!cal.made_on || sf.fit_rescale) return absl::OkStatus();
  const std::vector<std::string> differences = parallel::Differences(*cal.made_on, run);
  CPFILL_CHECK_ARG(differences.empty(), "--fit: ", sf.fit_file,
                   " was calibrated on another ring: ", absl::StrJoin(differences, "; "),
                   ". Run `cpfill calibrate` on this one, or pass --fit-rescale to move its "
                   "boundary by the ratio of the eq. 2 thresholds");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SelectorChoice> ResolveSelector(const SelectorFlags& sf, const FlagSet& flags,
                                               const parallel::RingContext& run) {
  SelectorChoice c;
  c.auto_algorithm = sf.algo == "auto";
  if (!c.auto_algorithm) {
    auto algorithm = parallel::ParseRingAlgorithm(sf.algo);
    if (!algorithm.ok()) return ForFlag("algo", algorithm.status());
    c.algorithm = *algorithm;
  }
  c.system = SystemDefaults(run.backend);
  std::optional<parallel::CalibrationFile> cal;
  if (!sf.fit_file.empty()) {
    auto read = parallel::ReadCalibrationFile(sf.fit_file);
    if (!read.ok()) return ForFlag("fit", read.status());
    cal = *std::move(read);
    CPFILL_RETURN_IF_ERROR(CheckFitRing(*cal, sf, run));
    // The fit's measurements stand for this run's where they were made alike.
    const bool same_backend = !cal->made_on || cal->made_on->backend == run.backend;
    const bool same_link = !cal->made_on || (same_backend && cal->made_on->link == run.link);
    if (same_backend && cal->tflops > 0) c.system.tflops = cal->tflops;
    if (same_link && cal->gbps > 0) c.system.gbps = cal->gbps;
  }
  c.system = WithFlags(c.system, sf);
  if (cal)
    c.fitted = sf.fit_rescale ? parallel::RescaleFit(*cal, run.cp_size, c.system) : cal->fitted;
  const std::string rule = sf.rule.empty() ? (sf.fit_file.empty() ? "alg5" : "fitted") : sf.rule;
  auto parsed_rule = parallel::ParseSelectorRule(rule);
  if (!parsed_rule.ok()) return ForFlag("rule", parsed_rule.status());
  c.rule = *parsed_rule;
  return c;
}

runtime::StepOptions ModelOptions(const SelectorChoice& choice) {
  runtime::StepOptions o;
  o.auto_algorithm = choice.auto_algorithm;
  o.algorithm = choice.algorithm;
  o.rule = choice.rule;
  o.system = choice.system;
  o.fitted = choice.fitted;
  return o;
}

}  // namespace cpfill::launch
