// cpfill/runtime/model/model_config.h — a Llama-3 family model's geometry, from a Hugging Face
// config.json or a built-in preset.
//
//   CPFILL_ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig("tiny"));          // preset
//   CPFILL_ASSIGN_OR_RETURN(ModelConfig c, LoadModelConfig("/models/llama3"));  // dir/config.json
//   CPFILL_RETURN_IF_ERROR(c.ValidateForTp(/*tp=*/8));
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "runtime/model/fp8.h"

namespace cpfill::runtime {

// Llama 3.1's frequency-dependent RoPE scaling (rope_scaling.rope_type == "llama3").
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string name;           // preset name or the directory it came from
  int hidden_size = 0;        // D
  int num_heads = 0;          // N_H (query heads)
  int num_kv_heads = 0;       // N_KV
  int head_dim = 0;           // hidden_size / num_heads unless config.json says otherwise
  int intermediate_size = 0;  // SwiGLU width
  int num_layers = 0;
  int vocab_size = 0;
  double rope_theta = 500000.0;
  std::optional<Llama3RopeScaling> rope_scaling;  // absent: plain RoPE
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = false;  // LM head = embedding matrix
  int64_t max_position_embeddings = 131072;
  // Generation stops at these: config.json's eos_token_id (a number or a list), replaced by
  // generation_config.json's when that file names one (as transformers' generate does). Presets
  // have none.
  std::vector<int32_t> eos_token_ids;
  // Row-wise FP8 projections: config.json's quantization_config (fbgemm_fp8) or --quantize.
  Fp8Quantization fp8;

  // Parameters of the whole model (embedding, layers, norms, LM head unless tied).
  int64_t ParameterCount() const;
  // InvalidArgument naming the field when the geometry does not split over `tp` ranks (heads,
  // KV heads, intermediate size, vocab) or is inconsistent (heads * head_dim, GQA groups).
  absl::Status ValidateForTp(int tp) const;
};

// Parses a Hugging Face config.json of the Llama family: model_type "llama" and/or architectures
// ["LlamaForCausalLM"] (one of them must be there), hidden_act "silu" (or absent), torch_dtype
// (or dtype) "float32", "bfloat16" or "float16" (or absent), bos/eos/pad_token_id inside the
// vocabulary. InvalidArgument naming the key for a missing or malformed field, another model or
// an unsupported feature (rope_scaling type, biases, sliding windows). generation_config.json is
// read by LoadModelConfig.
absl::StatusOr<ModelConfig> ParseHfConfig(const nlohmann::json& config, std::string name);

// `model` is a preset name (tiny, llama3-8b, llama3-70b, llama3-405b) or a directory holding
// config.json. NotFound when it is neither, naming both possibilities; InvalidArgument naming
// the file when config.json or generation_config.json is not a regular file (a device, a pipe)
// or is larger than 64 MiB, refused before it is read.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model);

// True for the names of built-in presets.
bool IsPreset(const std::string& model);

}  // namespace cpfill::runtime
