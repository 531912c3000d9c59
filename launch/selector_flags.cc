#include "launch/selector_flags.h"

#include "absl/strings/str_cat.h"
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

namespace {

// `status` with the flag it came from in front, so the message names what to change.
absl::Status ForFlag(const char* flag, const absl::Status& status) {
  return absl::Status(status.code(), absl::StrCat("--", flag, ": ", status.message()));
}

}  // namespace

absl::StatusOr<SelectorChoice> ResolveSelector(const SelectorFlags& sf, const FlagSet& flags) {
  SelectorChoice c;
  c.auto_algorithm = sf.algo == "auto";
  if (!c.auto_algorithm) {
    auto algorithm = parallel::ParseRingAlgorithm(sf.algo);
    if (!algorithm.ok()) return ForFlag("algo", algorithm.status());
    c.algorithm = *algorithm;
  }
  c.system = {.tflops = sf.tflops, .gbps = sf.gbps, .elem_bytes = sf.elem_bytes};
  if (!sf.fit_file.empty()) {
    auto cal = parallel::ReadCalibrationFile(sf.fit_file);
    if (!cal.ok()) return ForFlag("fit", cal.status());
    c.fitted = cal->fitted;
    if (!flags.IsSet("tflops") && cal->tflops > 0) c.system.tflops = cal->tflops;
    if (!flags.IsSet("gbps") && cal->gbps > 0) c.system.gbps = cal->gbps;
  }
  const std::string rule = sf.rule.empty() ? (sf.fit_file.empty() ? "alg5" : "fitted") : sf.rule;
  auto parsed_rule = parallel::ParseSelectorRule(rule);
  if (!parsed_rule.ok()) return ForFlag("rule", parsed_rule.status());
  c.rule = *parsed_rule;
  return c;
}

runtime::PrefillOptions ModelOptions(const SelectorChoice& choice) {
  runtime::PrefillOptions o;
  o.auto_algorithm = choice.auto_algorithm;
  o.algorithm = choice.algorithm;
  o.rule = choice.rule;
  o.system = choice.system;
  o.fitted = choice.fitted;
  return o;
}

}  // namespace cpfill::launch
