#include "launch/job/model_flags.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::launch {

void AddModelFlags(FlagSet& flags, ModelFlags* f) {
  flags.String("model", &f->name,
               "a preset (tiny, llama3-8b, llama3-70b, llama3-405b; synthetic weights) or a "
               "Hugging Face checkpoint directory (config.json + safetensors)",
               true);
  flags.Int("layers", &f->layers, "run only the first K layers (0: all)").Within({0, 1e6});
  flags.Int("seed", &f->seed, "seed of synthetic weights").Within(Range::AtLeast(0));
  flags.String("backend", &f->backend,
               "auto | cpu | cuda (auto: cuda when every rank sees a GPU); cuda computes in bf16");
  flags.String("quantize", &f->quantize,
               "fp8-rowwise[:ffn|all]: quantize the feed-forward (ffn, the default) or all "
               "projections to row-wise FP8 at load, as fbgemm_fp8 checkpoints store them");
}

absl::Status ApplyQuantizeFlag(const std::string& flag, runtime::ModelConfig* config) {
  if (flag.empty()) return absl::OkStatus();  // as the checkpoint stores it
  CPFILL_ASSIGN_OR_RETURN(config->fp8.modules, runtime::ParseQuantizeFlag(flag));
  // The flag decides which projections are FP8, not the checkpoint's quantization_config (whose
  // FP8 tensors still load as stored).
  config->fp8.from_checkpoint = false;
  return absl::OkStatus();
}

absl::StatusOr<runtime::ModelConfig> ModelConfigFor(const ModelFlags& f, int tp_size) {
  CPFILL_ASSIGN_OR_RETURN(runtime::ModelConfig config, runtime::LoadModelConfig(f.name));
  // A cut longer than the model would silently run all of it: the user asked for something
  // this model cannot give.
  CPFILL_CHECK_ARG(f.layers <= config.num_layers, "--layers ", f.layers, ": the model has only ",
                   config.num_layers, " layers");
  if (f.layers > 0) config.num_layers = f.layers;
  CPFILL_RETURN_IF_ERROR(ApplyQuantizeFlag(f.quantize, &config));
  CPFILL_RETURN_IF_ERROR(config.ValidateForTp(tp_size));
  return config;
}

void KvFlags::SetOptions(runtime::StepOptions* options) const {
  options->kv_capacity_tokens = capacity_tokens;
  options->kv_memory_fraction = memory_fraction;
  options->kv_block_tokens = block_tokens;
}

void AddKvFlags(FlagSet& flags, KvFlags* f, const KvDefault& kv_default) {
  flags
      .Int("kv-capacity-tokens", &f->capacity_tokens,
           "KV cache capacity per rank, in tokens (every layer's K and V), allocated at start-up "
           "(0: --kv-memory-fraction, else " +
               kv_default.unsized + ")")
      .Within({0, kMaxTokens});
  flags
      .Double("kv-memory-fraction", &f->memory_fraction,
              absl::StrCat("instead of --kv-capacity-tokens: this fraction of the rank's free "
                           "memory (after the weights) for the KV cache; at most ",
                           kMaxKvMemoryFraction, ", the rest is for activations and threads"))
      .Within(kv_default.fraction_may_be_zero ? Range(0, kMaxKvMemoryFraction)
                                              : Range::LeftOpen(0, kMaxKvMemoryFraction));
  flags.Int("kv-block-tokens", &f->block_tokens, "tokens per KV cache block").Within({16, 256});
}

}  // namespace cpfill::launch
