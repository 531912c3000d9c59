// `cpfill select`: the pass-KV / pass-Q decision for one request, as JSON. No MPI.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "launch/commands/commands.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "parallel/selector.h"

namespace cpfill::launch {

int RunSelectCommand(int argc, char** argv) {
  int heads = 0, kv_heads = 0, cp = 0, head_dim = 128;
  double tflops = 0, gbps = 0, elem_bytes = 2;
  int64_t new_tokens = 0, cached_tokens = 0;
  std::string rule_name, fit_file;
  FlagSet flags("select",
                "choose ring pass-KV or pass-Q for one request; prints JSON with 'choice' and "
                "the rule's quantities");
  flags
      .Int("heads", &heads, "query heads N_H (per rank or of the model: only N_KV/N_H matters)",
           true)
      .Within({1, 65536});
  flags.Int("kv-heads", &kv_heads, "key/value heads N_KV", true).Within({1, 65536});
  flags.Int("cp", &cp, "context-parallel ranks N", true).Within({1, 1 << 20});
  flags.Double("tflops", &tflops, "attention compute per rank C, TFLOP/s (alg1/alg5)")
      .Within({0, 1e9});
  flags.Double("gbps", &gbps, "ring bandwidth per rank BW, gigabytes per second (alg1/alg5)")
      .Within({0, 1e9});
  flags.Double("elem-bytes", &elem_bytes, "bytes per element e").Within(Range::LeftOpen(0, 64));
  flags.Int("new-tokens", &new_tokens, "new tokens T", true).Within({0, kMaxTokens});
  flags.Int("cached-tokens", &cached_tokens, "cached tokens P").Within({0, kMaxTokens});
  flags.Int("head-dim", &head_dim, "head dimension (predicted times only)").Within({1, 1024});
  flags.String("rule", &rule_name, "alg1 | alg5 | fitted [fitted with --fit, else alg5]");
  flags.String("fit", &fit_file,
               "calibration JSON from 'cpfill calibrate'; refused when made at another CP size");
  bool fit_rescale = false;
  flags.Bool("fit-rescale", &fit_rescale,
             "use a --fit made at another CP size, its boundary moved by the ratio of the eq. 2 "
             "thresholds");
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  parallel::FittedCoefficients fitted = parallel::FittedCoefficients::Paper();
  if (!fit_file.empty()) {
    auto cal = parallel::ReadCalibrationFile(fit_file);
    if (!cal.ok()) {
      return RefuseInput(cal.status());
    }
    fitted = cal->fitted;
    if (!flags.IsSet("tflops")) tflops = cal->tflops;
    if (!flags.IsSet("gbps")) gbps = cal->gbps;
    // What-if: only the CP size is known here, so only it is checked.
    if (cal->made_on && cal->made_on->cp_size != cp) {
      if (!fit_rescale) {
        return RefuseInput(absl::InvalidArgumentError(absl::StrCat(
            "--fit: ", fit_file, " was calibrated at CP ", cal->made_on->cp_size, ", not --cp ", cp,
            "; pass --fit-rescale to move its boundary by the ratio of the eq. 2 thresholds")));
      }
      fitted = parallel::RescaleFit(*cal, cp, {.tflops = tflops, .gbps = gbps});
    }
  }
  if (rule_name.empty()) rule_name = fit_file.empty() ? "alg5" : "fitted";
  auto rule = parallel::ParseSelectorRule(rule_name);
  if (!rule.ok()) {
    std::fprintf(stderr, "cpfill: error: --rule: %s\n",
                 std::string(rule.status().message()).c_str());
    return kExitBadInput;
  }
  auto selection = parallel::Select(
      {.system = {.tflops = tflops, .gbps = gbps, .elem_bytes = elem_bytes},
       .model = {.num_heads = heads, .num_kv_heads = kv_heads, .head_dim = head_dim},
       .cp_size = cp,
       .new_tokens = new_tokens,
       .cached_tokens = cached_tokens},
      *rule, fitted);
  if (!selection.ok()) {
    return RefuseInput(selection.status());
  }
  absl::StatusOr<std::string> text = json::Dump(selection->ToJson());
  if (!text.ok()) {
    std::fprintf(stderr, "cpfill: error: %s\n", std::string(text.status().message()).c_str());
    return kExitRuntimeError;
  }
  std::printf("%s\n", text->c_str());
  return kExitOk;
}

}  // namespace cpfill::launch
