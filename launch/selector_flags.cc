#include "launch/selector_flags.h"

#include "base/status.h"

namespace cpfill::launch {

void AddSelectorFlags(FlagSet& flags, SelectorFlags* sf) {
  flags.String("algo", &sf->algo, "auto | pass-kv | pass-q | all-gather");
  flags.String("rule", &sf->rule,
               "selector rule for --algo auto: alg1 | alg5 | fitted [fitted with --fit, else "
               "alg5]");
  flags.String("fit", &sf->fit_file, "calibration JSON from 'cpfill calibrate' (a, b, c; C, BW)");
  flags.Double("tflops", &sf->tflops, "selector: attention compute per rank C, TFLOP/s")
      .Within({0, 1e9});
  flags.Double("gbps", &sf->gbps, "selector: ring bandwidth per rank BW, GB/s (bytes)")
      .Within({0, 1e9});
  flags.Double("elem-bytes", &sf->elem_bytes, "selector: bytes per element e")
      .Within(Range::LeftOpen(0, 64));
}

absl::StatusOr<SelectorChoice> ResolveSelector(const SelectorFlags& sf, const FlagSet& flags) {
  SelectorChoice c;
  c.auto_algorithm = sf.algo == "auto";
  if (!c.auto_algorithm) {
    CPFILL_ASSIGN_OR_RETURN(c.algorithm, parallel::ParseRingAlgorithm(sf.algo));
  }
  c.system = {.tflops = sf.tflops, .gbps = sf.gbps, .elem_bytes = sf.elem_bytes};
  if (!sf.fit_file.empty()) {
    CPFILL_ASSIGN_OR_RETURN(parallel::CalibrationFile cal,
                            parallel::ReadCalibrationFile(sf.fit_file));
    c.fitted = cal.fitted;
    if (!flags.IsSet("tflops") && cal.tflops > 0) c.system.tflops = cal.tflops;
    if (!flags.IsSet("gbps") && cal.gbps > 0) c.system.gbps = cal.gbps;
  }
  const std::string rule = sf.rule.empty() ? (sf.fit_file.empty() ? "alg5" : "fitted") : sf.rule;
  CPFILL_ASSIGN_OR_RETURN(c.rule, parallel::ParseSelectorRule(rule));
  return c;
}

}  // namespace cpfill::launch
