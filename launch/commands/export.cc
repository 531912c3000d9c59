// `cpfill export`: writes a preset's synthetic model as a Hugging Face checkpoint directory
// (config.json + model.safetensors), for other tools and for checking cpfill against them.
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/knobs.h"
#include "launch/commands/commands.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "launch/job/model_flags.h"
#include "launch/job/model_setup.h"
#include "runtime/model/model_config.h"
#include "runtime/model/weights.h"

namespace cpfill::launch {

int RunExportCommand(int argc, char** argv) {
  std::string model, out, quantize;
  int64_t seed = 1;
  int layers = 0;
  bool bf16 = false;
  FlagSet flags("export",
                "write a preset's synthetic weights as a Hugging Face checkpoint "
                "directory (no MPI)");
  flags.String("model", &model, "preset: tiny, llama3-8b, llama3-70b, llama3-405b", true);
  flags.String("out", &out, "directory to write config.json and model.safetensors to", true);
  flags.Int("seed", &seed, "seed of the synthetic weights (as cpfill prefill --seed)")
      .Within(Range::AtLeast(0));
  flags.Int("layers", &layers, "keep only the first K layers (0: all)").Within({0, 1e6});
  flags.Bool("bf16", &bf16, "store bf16 (default fp32)");
  flags.String("quantize", &quantize,
               "fp8-rowwise[:ffn|all]: store the feed-forward (or all) projections as row-wise "
               "FP8, an fbgemm_fp8 checkpoint (F8_E4M3 weights, weight_scale per output row)");
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  if (!runtime::IsPreset(model)) {
    return RefuseInput(
        absl::InvalidArgumentError("--model: export writes presets only, got '" + model + "'"));
  }
  auto config = runtime::LoadModelConfig(model);
  if (!config.ok()) return RefuseInput(config.status());
  if (layers > config->num_layers) {
    return RefuseInput(absl::InvalidArgumentError(absl::StrCat(
        "--layers ", layers, ": ", model, " has only ", config->num_layers, " layers")));
  }
  if (layers > 0) config->num_layers = layers;
  if (absl::Status s = ApplyQuantizeFlag(quantize, &*config); !s.ok()) return RefuseInput(s);
  if (absl::Status s = WeightsFit(*config, 1); !s.ok()) return RefuseInput(s);
  auto weights = runtime::SyntheticWeights(*config, static_cast<uint64_t>(seed), 0, 1);
  if (!weights.ok()) return RefuseInput(weights.status());
  if (absl::Status s = runtime::SaveHfCheckpoint(*config, *weights, out, bf16); !s.ok()) {
    return RefuseInput(absl::InvalidArgumentError(absl::StrCat("--out: ", s.message())));
  }
  std::printf("saved %s (%d layers, %s%s) to %s\n", model.c_str(), config->num_layers,
              bf16 ? "bf16" : "fp32", config->fp8.enabled() ? ", row-wise FP8 projections" : "",
              out.c_str());
  return kExitOk;
}

}  // namespace cpfill::launch
