// cpfill/runtime/model/model_config.cc — Hugging Face config.json parsing and the built-in presets.
//
// Key names and defaults follow transformers' LlamaConfig: num_key_value_heads defaults to
// num_attention_heads, head_dim to hidden_size / num_attention_heads, rope_theta to 10000,
// tie_word_embeddings to false; RoPE comes from "rope_parameters" (transformers 5) or from
// "rope_theta" and "rope_scaling" (earlier versions). Everything else a Llama forward needs is
// required, so a config.json of another family fails here, naming the key, instead of producing a
// wrong model.
#include "runtime/model/model_config.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

constexpr char kPresetNames[] = "tiny, llama3-8b, llama3-70b, llama3-405b";

// config.json and generation_config.json are some KB; a path that is a device, a FIFO or a huge
// file is refused before it is read, not read without end.
constexpr int64_t kMaxConfigBytes = int64_t{64} << 20;

// InvalidArgument naming `path` unless it is a regular file of at most kMaxConfigBytes (one that
// cannot be examined is left to the reader, whose error names it).
absl::Status CheckConfigFile(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (ec) return absl::OkStatus();
  if (!std::filesystem::is_regular_file(status)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file (a directory, device or pipe)"));
  }
  const uintmax_t bytes = std::filesystem::file_size(path, ec);
  if (!ec && bytes > static_cast<uintmax_t>(kMaxConfigBytes)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes, " bytes, more than the ",
                                                   kMaxConfigBytes, " a config file may have"));
  }
  return absl::OkStatus();
}

// The Llama 3.1 RoPE every preset uses (theta 500000, scaling 8 / 1 / 4 / 8192).
ModelConfig Llama3Base(std::string name) {
  ModelConfig c;
  c.name = std::move(name);
  c.rope_theta = 500000.0;
  c.rope_scaling = Llama3RopeScaling{.factor = 8.0,
                                     .low_freq_factor = 1.0,
                                     .high_freq_factor = 4.0,
                                     .original_max_position_embeddings = 8192};
  c.rms_norm_eps = 1e-5;
  c.tie_word_embeddings = false;
  c.max_position_embeddings = 131072;
  return c;
}

ModelConfig Geometry(std::string name, int hidden, int heads, int kv_heads, int head_dim,
                     int intermediate, int layers, int vocab) {
  ModelConfig c = Llama3Base(std::move(name));
  c.hidden_size = hidden;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate_size = intermediate;
  c.num_layers = layers;
  c.vocab_size = vocab;
  return c;
}

std::optional<ModelConfig> Preset(const std::string& model) {
  // tiny: every count divides by tp 1, 2 and 4 (kv heads 4 rules out tp 8); head_dim 64, the
  // smallest the CUDA attention kernel takes, so one preset runs on both backends; small enough
  // for CPU tests (about 12M parameters).
  if (model == "tiny") return Geometry("tiny", 512, 8, 4, 64, 1376, 4, 1024);
  if (model == "llama3-8b") return Geometry("llama3-8b", 4096, 32, 8, 128, 14336, 32, 128256);
  if (model == "llama3-70b") return Geometry("llama3-70b", 8192, 64, 8, 128, 28672, 80, 128256);
  if (model == "llama3-405b") {
    return Geometry("llama3-405b", 16384, 128, 8, 128, 53248, 126, 128256);
  }
  return std::nullopt;
}

// Readers for one config.json: every error names the key and the model.
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& config, const std::string& name)
      : config_(config), name_(name) {}

  absl::Status Error(std::string_view key, std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("model config '", name_, "': key \"",
                                                   std::string(key), "\" ", std::string(what)));
  }

  // Absent or null.
  bool Has(std::string_view key) const {
    const nlohmann::json* v = json::Find(config_, key);
    return v != nullptr && !v->is_null();
  }

  // A positive integer that fits in T, from `obj` (the config or a nested object, whose keys
  // errors spell with `prefix`, e.g. "rope_scaling.").
  template <typename T>
  absl::StatusOr<T> PositiveInt(std::string_view key, const nlohmann::json* obj = nullptr,
                                std::string_view prefix = "") const {
    if (obj == nullptr) obj = &config_;
    const std::string label = absl::StrCat(std::string(prefix), std::string(key));
    const nlohmann::json* v = json::Find(*obj, key);
    if (v == nullptr || v->is_null()) return Error(label, "is missing");
    const std::optional<int64_t> i = json::AsInt64(*v);
    if (!i.has_value()) {
      return Error(label, absl::StrCat("is ", json::Show(*v), ", expected an integer"));
    }
    if (*i <= 0 || *i > std::numeric_limits<T>::max()) {
      return Error(label, absl::StrCat("is ", *i, ", expected a positive integer up to ",
                                       std::numeric_limits<T>::max()));
    }
    return static_cast<T>(*i);
  }

  // A number > 0 (the parser refuses numbers that overflow a double).
  absl::StatusOr<double> PositiveNumber(std::string_view key, const nlohmann::json* obj = nullptr,
                                        std::string_view prefix = "") const {
    if (obj == nullptr) obj = &config_;
    const std::string label = absl::StrCat(std::string(prefix), std::string(key));
    const nlohmann::json* v = json::Find(*obj, key);
    if (v == nullptr || v->is_null()) return Error(label, "is missing");
    if (!v->is_number() || !(v->get<double>() > 0) || !std::isfinite(v->get<double>())) {
      return Error(label, absl::StrCat("is ", json::Show(*v), ", expected a positive number"));
    }
    return v->get<double>();
  }

  absl::StatusOr<bool> Bool(std::string_view key, bool default_value) const {
    if (!Has(key)) return default_value;
    const nlohmann::json* v = json::Find(config_, key);
    if (!v->is_boolean()) {
      return Error(key, absl::StrCat("is ", json::Show(*v), ", expected true/false"));
    }
    return v->get<bool>();
  }

 private:
  const nlohmann::json& config_;
  const std::string& name_;
};

// RoPE settings from the object under `key`: "rope_scaling" (transformers 4: the scaling alone,
// rope_theta at the top level) or "rope_parameters" (transformers 5, which save_pretrained writes:
// rope_type "default" or "llama3", rope_theta inside). Null when absent or "default".
absl::StatusOr<std::optional<Llama3RopeScaling>> ParseRopeScaling(const ConfigReader& reader,
                                                                  const nlohmann::json& config,
                                                                  std::string_view key) {
  const nlohmann::json* v = json::Find(config, key);
  if (v == nullptr || v->is_null()) return std::optional<Llama3RopeScaling>();
  const std::string prefix = absl::StrCat(std::string(key), ".");
  if (!v->is_object()) {
    return reader.Error(key, absl::StrCat("is ", json::Show(*v), ", expected null or an object"));
  }
  // transformers renamed "type" to "rope_type" (4.43); both appear in published configs.
  const nlohmann::json* type = json::Find(*v, "rope_type");
  std::string type_key = absl::StrCat(prefix, "rope_type");
  if (type == nullptr) {
    type = json::Find(*v, "type");
    type_key = absl::StrCat(prefix, "type");
  }
  if (type == nullptr || !type->is_string()) {
    return reader.Error(key, "has no string \"rope_type\" (or \"type\")");
  }
  const std::string& type_name = type->get_ref<const std::string&>();
  if (type_name == "default") return std::optional<Llama3RopeScaling>();
  if (type_name != "llama3") {
    return reader.Error(
        type_key,
        absl::StrCat("is \"", type_name, "\"; only \"default\" and \"llama3\" RoPE are supported"));
  }
  Llama3RopeScaling s;
  CPFILL_ASSIGN_OR_RETURN(s.factor, reader.PositiveNumber("factor", v, prefix));
  CPFILL_ASSIGN_OR_RETURN(s.low_freq_factor, reader.PositiveNumber("low_freq_factor", v, prefix));
  CPFILL_ASSIGN_OR_RETURN(s.high_freq_factor, reader.PositiveNumber("high_freq_factor", v, prefix));
  CPFILL_ASSIGN_OR_RETURN(
      s.original_max_position_embeddings,
      reader.PositiveInt<int64_t>("original_max_position_embeddings", v, prefix));
  // The smoothing between the two wavelength bounds divides by (high - low).
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    return reader.Error(absl::StrCat(prefix, "high_freq_factor"),
                        absl::StrCat("is ", s.high_freq_factor, ", must exceed low_freq_factor (",
                                     s.low_freq_factor, ")"));
  }
  return std::optional<Llama3RopeScaling>(s);
}

// The model a config.json names: "model_type" "llama" and "architectures" ["LlamaForCausalLM"],
// either or both (transformers reads model_type; architectures names the class the weights were
// saved from). A Mistral, Qwen or other checkpoint is refused here, naming the key, even where
// its geometry would load: its forward differs from Llama's.
absl::Status RefuseOtherModels(const ConfigReader& reader, const nlohmann::json& config) {
  const nlohmann::json* type = json::Find(config, "model_type");
  if (type != nullptr) {
    if (!type->is_string() || type->get_ref<const std::string&>() != "llama") {
      return reader.Error("model_type",
                          absl::StrCat("is ", json::Show(*type), "; only \"llama\" is supported"));
    }
  }
  const nlohmann::json* architectures = json::Find(config, "architectures");
  if (architectures != nullptr && !architectures->is_null()) {
    bool llama = architectures->is_array() && !architectures->empty();
    for (const nlohmann::json& a : llama ? *architectures : nlohmann::json::array()) {
      llama = llama && a.is_string() && a.get_ref<const std::string&>() == "LlamaForCausalLM";
    }
    if (!llama) {
      return reader.Error("architectures",
                          absl::StrCat("is ", json::Show(*architectures),
                                       "; only [\"LlamaForCausalLM\"] is supported"));
    }
  } else if (type == nullptr) {
    return reader.Error("model_type",
                        "is missing (and so is \"architectures\"): config.json must name the "
                        "model, \"llama\"");
  }
  return absl::OkStatus();
}

// The dtype the checkpoint was saved in ("torch_dtype"; transformers 5 writes "dtype"): only
// recorded (the weights' own dtypes are read from the safetensors), but it must be one of the
// dtypes a Llama checkpoint's weights may have, not a number or a name nothing knows.
absl::Status CheckDtype(const ConfigReader& reader, const nlohmann::json& config) {
  for (const char* key : {"torch_dtype", "dtype"}) {
    const nlohmann::json* v = json::Find(config, key);
    if (v == nullptr || v->is_null()) continue;
    const bool known = v->is_string() && (*v == "float32" || *v == "bfloat16" || *v == "float16");
    if (!known) {
      return reader.Error(key, absl::StrCat("is ", json::Show(*v),
                                            "; expected \"float32\", \"bfloat16\" or "
                                            "\"float16\""));
    }
  }
  return absl::OkStatus();
}

// Keys of LlamaConfig (and its relatives) that change the forward pass in a way cpfill does not
// implement: running such a checkpoint as a plain Llama would give wrong logits without a
// word, so each is refused by name. Absent and the plain-Llama value are accepted; null is too,
// except for hidden_act (transformers would look up an activation named None).
absl::Status RefuseUnimplemented(const ConfigReader& reader, const nlohmann::json& config) {
  if (const nlohmann::json* act = json::Find(config, "hidden_act"); act != nullptr) {
    if (!act->is_string() || act->get_ref<const std::string&>() != "silu") {
      return reader.Error("hidden_act",
                          absl::StrCat("is ", json::Show(*act), "; only \"silu\" is implemented"));
    }
  }
  for (const char* key : {"attention_bias", "mlp_bias", "use_sliding_window"}) {
    CPFILL_ASSIGN_OR_RETURN(bool on, reader.Bool(key, false));
    if (on) return reader.Error(key, "is true; cpfill implements only the bias-free full Llama");
  }
  if (reader.Has("sliding_window")) {
    return reader.Error("sliding_window",
                        absl::StrCat("is ", json::Show(*json::Find(config, "sliding_window")),
                                     "; sliding-window attention is not implemented (null only)"));
  }
  return absl::OkStatus();
}

// quantization_config: only fbgemm's row-wise FP8 ("fbgemm_fp8"); which projections are FP8 is
// then read from each tensor's dtype (weights.cc), the key only supplies the activation bound.
absl::StatusOr<Fp8Quantization> ParseQuantizationConfig(const ConfigReader& reader,
                                                        const nlohmann::json& config) {
  Fp8Quantization q;
  const nlohmann::json* qc = json::Find(config, "quantization_config");
  if (qc == nullptr || qc->is_null()) return q;
  const nlohmann::json* method = qc->is_object() ? json::Find(*qc, "quant_method") : nullptr;
  if (method == nullptr || !method->is_string() ||
      method->get_ref<const std::string&>() != "fbgemm_fp8") {
    return reader.Error("quantization_config",
                        absl::StrCat("has quant_method ", method ? json::Show(*method) : "(none)",
                                     "; only \"fbgemm_fp8\" (row-wise FP8) is implemented"));
  }
  q.modules = Fp8Modules::kAll;
  q.from_checkpoint = true;
  if (const nlohmann::json* ub = json::Find(*qc, "activation_scale_ub"); ub && !ub->is_null()) {
    if (!ub->is_number() || !(ub->get<double>() > 0)) {
      return reader.Error("quantization_config.activation_scale_ub",
                          absl::StrCat("is ", json::Show(*ub), ", expected a positive number"));
    }
    q.activation_scale_ub = ub->get<float>();
  }
  if (const nlohmann::json* skip = json::Find(*qc, "modules_to_not_convert");
      skip && skip->is_array()) {
    for (const nlohmann::json& m : *skip) {
      if (m.is_string()) q.modules_to_not_convert.push_back(m.get<std::string>());
    }
  }
  return q;
}

}  // namespace

int64_t ModelConfig::ParameterCount() const {
  const int64_t d = hidden_size;
  const int64_t q_width = int64_t{num_heads} * head_dim;
  const int64_t kv_width = int64_t{num_kv_heads} * head_dim;
  const int64_t per_layer = q_width * d                  // q_proj
                            + 2 * kv_width * d           // k_proj, v_proj
                            + d * q_width                // o_proj
                            + 3 * d * intermediate_size  // gate, up, down
                            + 2 * d;                     // input and post-attention norms
  const int64_t embedding = int64_t{vocab_size} * d;
  return embedding + num_layers * per_layer + d + (tie_word_embeddings ? 0 : embedding);
}

absl::Status ModelConfig::ValidateForTp(int tp) const {
  const std::string where = absl::StrCat("model '", name, "': ");
  CPFILL_CHECK_ARG(tp >= 1, where, "tensor-parallel size ", tp, " must be >= 1");
  const std::pair<const char*, int> sizes[] = {{"hidden_size", hidden_size},
                                               {"num_attention_heads", num_heads},
                                               {"num_key_value_heads", num_kv_heads},
                                               {"head_dim", head_dim},
                                               {"intermediate_size", intermediate_size},
                                               {"num_hidden_layers", num_layers},
                                               {"vocab_size", vocab_size}};
  for (const auto& [field, value] : sizes) {
    CPFILL_CHECK_ARG(value > 0, where, field, " is ", value, ", must be positive");
  }
  CPFILL_CHECK_ARG(num_heads % num_kv_heads == 0, where, "num_attention_heads (", num_heads,
                   ") is not a multiple of num_key_value_heads (", num_kv_heads,
                   "): GQA needs whole query groups");
  CPFILL_CHECK_ARG(head_dim % 2 == 0, where, "head_dim (", head_dim,
                   ") is odd: RoPE rotates pairs of dimensions");
  const std::pair<const char*, int> split[] = {{"num_attention_heads", num_heads},
                                               {"num_key_value_heads", num_kv_heads},
                                               {"intermediate_size", intermediate_size},
                                               {"vocab_size", vocab_size}};
  for (const auto& [field, value] : split) {
    CPFILL_CHECK_ARG(value % tp == 0, where, field, " (", value,
                     ") is not divisible by the tensor-parallel size (", tp, ")");
  }
  return absl::OkStatus();
}

// bos_token_id, eos_token_id, pad_token_id (`key`): a token id, a list of them, or null; each
// inside the vocabulary.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const nlohmann::json& v, std::string_view key,
                                                   int vocab, const std::string& where) {
  std::vector<int32_t> ids;
  if (v.is_null()) return ids;
  const nlohmann::json list = v.is_array() ? v : nlohmann::json::array({v});
  for (const nlohmann::json& id : list) {
    const std::optional<int64_t> n = json::AsInt64(id);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 0 && *n < vocab, where, ": ", std::string(key), " ",
                     json::Show(id), " is not a token id of the vocabulary [0, ", vocab, ")");
    ids.push_back(static_cast<int32_t>(*n));
  }
  return ids;
}

absl::StatusOr<ModelConfig> ParseHfConfig(const nlohmann::json& config, std::string name) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config '", name, "': config.json is not a JSON object"));
  }
  ModelConfig c;
  c.name = std::move(name);
  const ConfigReader reader(config, c.name);

  CPFILL_RETURN_IF_ERROR(RefuseOtherModels(reader, config));
  CPFILL_RETURN_IF_ERROR(RefuseUnimplemented(reader, config));
  CPFILL_RETURN_IF_ERROR(CheckDtype(reader, config));
  CPFILL_ASSIGN_OR_RETURN(c.hidden_size, reader.PositiveInt<int>("hidden_size"));
  CPFILL_ASSIGN_OR_RETURN(c.num_heads, reader.PositiveInt<int>("num_attention_heads"));
  if (reader.Has("num_key_value_heads")) {
    CPFILL_ASSIGN_OR_RETURN(c.num_kv_heads, reader.PositiveInt<int>("num_key_value_heads"));
  } else {
    c.num_kv_heads = c.num_heads;
  }
  if (reader.Has("head_dim")) {
    CPFILL_ASSIGN_OR_RETURN(c.head_dim, reader.PositiveInt<int>("head_dim"));
  } else {
    // The default only makes sense when the heads tile the hidden size exactly.
    if (c.hidden_size % c.num_heads != 0) {
      return reader.Error("head_dim", absl::StrCat("is absent and hidden_size (", c.hidden_size,
                                                   ") is not divisible by num_attention_heads (",
                                                   c.num_heads, ")"));
    }
    c.head_dim = c.hidden_size / c.num_heads;
  }
  CPFILL_ASSIGN_OR_RETURN(c.intermediate_size, reader.PositiveInt<int>("intermediate_size"));
  CPFILL_ASSIGN_OR_RETURN(c.num_layers, reader.PositiveInt<int>("num_hidden_layers"));
  CPFILL_ASSIGN_OR_RETURN(c.vocab_size, reader.PositiveInt<int>("vocab_size"));
  // transformers 5 writes "rope_parameters" (rope_theta and the scaling together) and no
  // top-level rope_theta or rope_scaling; earlier versions write those two. Reading only the old
  // keys would silently build RoPE with theta 10000 and no scaling.
  const nlohmann::json* rope_parameters = json::Find(config, "rope_parameters");
  if (rope_parameters != nullptr && !rope_parameters->is_null()) {
    CPFILL_ASSIGN_OR_RETURN(c.rope_scaling, ParseRopeScaling(reader, config, "rope_parameters"));
    if (json::Find(*rope_parameters, "rope_theta") != nullptr) {
      CPFILL_ASSIGN_OR_RETURN(
          c.rope_theta, reader.PositiveNumber("rope_theta", rope_parameters, "rope_parameters."));
    } else if (reader.Has("rope_theta")) {
      CPFILL_ASSIGN_OR_RETURN(c.rope_theta, reader.PositiveNumber("rope_theta"));
    } else {
      return reader.Error("rope_parameters.rope_theta", "is missing");
    }
  } else {
    if (reader.Has("rope_theta")) {
      CPFILL_ASSIGN_OR_RETURN(c.rope_theta, reader.PositiveNumber("rope_theta"));
    } else {
      c.rope_theta = 10000.0;  // LlamaConfig's default
    }
    CPFILL_ASSIGN_OR_RETURN(c.rope_scaling, ParseRopeScaling(reader, config, "rope_scaling"));
  }
  CPFILL_ASSIGN_OR_RETURN(c.rms_norm_eps, reader.PositiveNumber("rms_norm_eps"));
  CPFILL_ASSIGN_OR_RETURN(c.tie_word_embeddings, reader.Bool("tie_word_embeddings", false));
  CPFILL_ASSIGN_OR_RETURN(c.max_position_embeddings,
                          reader.PositiveInt<int64_t>("max_position_embeddings"));
  CPFILL_ASSIGN_OR_RETURN(c.fp8, ParseQuantizationConfig(reader, config));
  const std::string where = "model config '" + c.name + "'";
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    const nlohmann::json* ids = json::Find(config, key);
    if (ids == nullptr) continue;
    CPFILL_ASSIGN_OR_RETURN(std::vector<int32_t> parsed,
                            ParseTokenIds(*ids, key, c.vocab_size, where));
    if (std::string_view(key) == "eos_token_id") c.eos_token_ids = std::move(parsed);
  }
  return c;
}

bool IsPreset(const std::string& model) { return Preset(model).has_value(); }

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model) {
  if (std::optional<ModelConfig> preset = Preset(model)) return *std::move(preset);
  const std::filesystem::path config_path = std::filesystem::path(model) / "config.json";
  std::error_code ec;
  if (model.empty() || !std::filesystem::exists(config_path, ec)) {
    return absl::NotFoundError(absl::StrCat("'", model, "' is neither a preset (", kPresetNames,
                                            ") nor a directory with config.json"));
  }
  CPFILL_RETURN_IF_ERROR(CheckConfigFile(config_path.string()));
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json config, json::ReadFile(config_path.string()));
  CPFILL_ASSIGN_OR_RETURN(ModelConfig c, ParseHfConfig(config, model));
  const std::filesystem::path generation = std::filesystem::path(model) / "generation_config.json";
  if (std::filesystem::exists(generation, ec)) {
    CPFILL_RETURN_IF_ERROR(CheckConfigFile(generation.string()));
    CPFILL_ASSIGN_OR_RETURN(nlohmann::json g, json::ReadFile(generation.string()));
    const nlohmann::json* eos = g.is_object() ? json::Find(g, "eos_token_id") : nullptr;
    if (eos != nullptr) {
      CPFILL_ASSIGN_OR_RETURN(
          c.eos_token_ids, ParseTokenIds(*eos, "eos_token_id", c.vocab_size, generation.string()));
    }
  }
  return c;
}

}  // namespace cpfill::runtime
