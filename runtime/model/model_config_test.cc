#include "runtime/model/model_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "gtest/gtest.h"

namespace cpfill::runtime {
namespace {

// meta-llama/Llama-3.1-8B's config.json as published (transformers 4.43).
constexpr char kLlama31_8B[] = R"json({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})json";

nlohmann::json Llama8BJson() {
  absl::StatusOr<nlohmann::json> v = json::Parse(kLlama31_8B);
  EXPECT_TRUE(v.ok()) << v.status();
  return *v;
}

// Copies of `v` without `key`, and with `key` set to `value`.
nlohmann::json Without(nlohmann::json v, const std::string& key) {
  v.erase(key);
  return v;
}
nlohmann::json With(nlohmann::json v, const std::string& key, nlohmann::json value) {
  v[key] = std::move(value);
  return v;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

void ExpectInvalid(const nlohmann::json& config, const std::string& key_text) {
  absl::StatusOr<ModelConfig> c = ParseHfConfig(config, "my-model");
  ASSERT_FALSE(c.ok()) << "expected an error naming " << key_text;
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(Contains(c.status(), key_text)) << c.status();
  EXPECT_TRUE(Contains(c.status(), "my-model")) << c.status();
}

// Llama-3.1's RoPE: theta 500000, llama3 scaling 8 / 1 / 4 from an 8192-token original context.
void ExpectLlama31Rope(const ModelConfig& c) {
  EXPECT_EQ(c.rope_theta, 500000.0);
  ASSERT_TRUE(c.rope_scaling.has_value());
  EXPECT_EQ(c.rope_scaling->factor, 8.0);
  EXPECT_EQ(c.rope_scaling->low_freq_factor, 1.0);
  EXPECT_EQ(c.rope_scaling->high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling->original_max_position_embeddings, 8192);
}

TEST(ParseHfConfig, ReadsLlama31_8B) {
  absl::StatusOr<ModelConfig> c = ParseHfConfig(Llama8BJson(), "/models/llama-3.1-8b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, "/models/llama-3.1-8b");
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->num_heads, 32);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->intermediate_size, 14336);
  EXPECT_EQ(c->num_layers, 32);
  EXPECT_EQ(c->vocab_size, 128256);
  ExpectLlama31Rope(*c);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->max_position_embeddings, 131072);

  // The preset is the same model.
  absl::StatusOr<ModelConfig> preset = LoadModelConfig("llama3-8b");
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ(preset->ParameterCount(), c->ParameterCount());
  EXPECT_EQ(preset->head_dim, c->head_dim);
  EXPECT_EQ(preset->rope_theta, c->rope_theta);
}

TEST(ParseHfConfig, AppliesLlamaConfigDefaults) {
  nlohmann::json v =
      Without(Without(Without(Without(Without(Llama8BJson(), "num_key_value_heads"), "rope_theta"),
                              "rope_scaling"),
                      "tie_word_embeddings"),
              "model_type");
  absl::StatusOr<ModelConfig> c = ParseHfConfig(v, "defaults");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 32);   // = num_attention_heads (multi-head attention)
  EXPECT_EQ(c->head_dim, 128);      // = hidden_size / num_attention_heads
  EXPECT_EQ(c->rope_theta, 10000);  // LlamaConfig's default
  EXPECT_FALSE(c->rope_scaling.has_value());
  EXPECT_FALSE(c->tie_word_embeddings);

  // null means absent for the optional keys.
  v = Llama8BJson();
  v["rope_scaling"] = nullptr;
  v["head_dim"] = nullptr;
  c = ParseHfConfig(v, "nulls");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->rope_scaling.has_value());
  EXPECT_EQ(c->head_dim, 128);
}

TEST(ParseHfConfig, ExplicitHeadDimAndTiedEmbeddings) {
  // Llama-3.2-1B style: tied embeddings and an explicit head_dim.
  nlohmann::json v = Llama8BJson();
  v.update({{"hidden_size", 2048},
            {"num_attention_heads", 32},
            {"head_dim", 64},
            {"tie_word_embeddings", true},
            {"num_hidden_layers", 16},
            {"intermediate_size", 8192}});
  absl::StatusOr<ModelConfig> c = ParseHfConfig(v, "llama-3.2-1b");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->tie_word_embeddings);
  // 1.24e9 parameters with the head tied (Llama 3.2 1B).
  EXPECT_NEAR(static_cast<double>(c->ParameterCount()), 1.2358e9, 0.001e9);

  // head_dim need not be hidden / heads when given explicitly.
  v["head_dim"] = 128;
  c = ParseHfConfig(v, "wide-heads");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
}

TEST(ParseHfConfig, AcceptsOldRopeScalingTypeKey) {
  nlohmann::json v = Llama8BJson();
  v["rope_scaling"] = With(Without(v["rope_scaling"], "rope_type"), "type", "llama3");
  absl::StatusOr<ModelConfig> c = ParseHfConfig(v, "old-transformers");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->rope_scaling.has_value());
  EXPECT_EQ(c->rope_scaling->factor, 8.0);
}

TEST(ParseHfConfig, MissingKeyIsNamed) {
  for (const char* key :
       {"hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
        "vocab_size", "rms_norm_eps", "max_position_embeddings"}) {
    SCOPED_TRACE(key);
    ExpectInvalid(Without(Llama8BJson(), key), absl::StrCat("\"", key, "\" is missing"));
  }
}

TEST(ParseHfConfig, MalformedValuesAreNamed) {
  nlohmann::json v = Llama8BJson();
  ExpectInvalid(With(v, "hidden_size", "4096"), "\"hidden_size\"");
  ExpectInvalid(With(v, "hidden_size", 4096.5), "\"hidden_size\"");
  ExpectInvalid(With(v, "num_key_value_heads", 0), "\"num_key_value_heads\"");
  ExpectInvalid(With(v, "vocab_size", -1), "\"vocab_size\"");
  ExpectInvalid(With(v, "vocab_size", int64_t{1} << 40), "\"vocab_size\"");  // overflows int
  ExpectInvalid(With(v, "vocab_size", 1e3), "\"vocab_size\"");  // a float, not an integer
  ExpectInvalid(With(v, "max_position_embeddings", uint64_t{1} << 63),
                "\"max_position_embeddings\" is 9223372036854775808, expected an integer");
  ExpectInvalid(With(v, "rms_norm_eps", 0), "\"rms_norm_eps\"");
  ExpectInvalid(With(v, "rope_theta", "big"), "\"rope_theta\"");
  ExpectInvalid(With(v, "tie_word_embeddings", 1), "\"tie_word_embeddings\"");
  ExpectInvalid(With(v, "model_type", "mistral"), "\"model_type\"");
  ExpectInvalid(With(v, "rope_scaling", 8), "\"rope_scaling\"");
  // Without head_dim, the heads must tile the hidden size.
  ExpectInvalid(With(v, "hidden_size", 4100), "\"head_dim\"");

  absl::StatusOr<ModelConfig> c = ParseHfConfig(nlohmann::json::array(), "not-an-object");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
}

// Each key whose value changes the forward pass beyond a plain Llama is refused by name; the
// plain value (or null) is accepted, so the refusal is about the value, not the key.
TEST(ParseHfConfig, RefusesUnimplementedFeaturesByName) {
  const nlohmann::json v = Llama8BJson();
  ExpectInvalid(With(v, "hidden_act", "gelu"), "\"hidden_act\" is \"gelu\"");
  ExpectInvalid(With(v, "hidden_act", 3), "\"hidden_act\"");
  ExpectInvalid(With(v, "attention_bias", true), "\"attention_bias\" is true");
  ExpectInvalid(With(v, "mlp_bias", true), "\"mlp_bias\" is true");
  ExpectInvalid(With(v, "mlp_bias", "no"), "\"mlp_bias\"");
  ExpectInvalid(With(v, "use_sliding_window", true), "\"use_sliding_window\" is true");
  ExpectInvalid(With(v, "sliding_window", 4096), "\"sliding_window\" is 4096");
  ExpectInvalid(With(v, "model_type", "qwen2"), "\"model_type\" is \"qwen2\"");
  ExpectInvalid(With(v, "rope_scaling", nlohmann::json{{"rope_type", "yarn"}, {"factor", 4.0}}),
                "\"yarn\"");
  for (const auto& [key, plain] :
       std::vector<std::pair<std::string, nlohmann::json>>{{"hidden_act", "silu"},
                                                           {"attention_bias", false},
                                                           {"mlp_bias", false},
                                                           {"sliding_window", nullptr},
                                                           {"use_sliding_window", false}}) {
    absl::StatusOr<ModelConfig> c = ParseHfConfig(With(v, key, plain), "plain");
    EXPECT_TRUE(c.ok()) << key << ": " << c.status();
  }
  absl::StatusOr<ModelConfig> tied = ParseHfConfig(With(v, "tie_word_embeddings", true), "tied");
  ASSERT_TRUE(tied.ok()) << tied.status();
  EXPECT_TRUE(tied->tie_word_embeddings);
}

// The model a config.json names, its activation, dtype and special token ids: each refused by
// name when it is not what cpfill runs, however well the geometry would load.
TEST(ParseHfConfig, RefusesOtherModelsAndMalformedIdentity) {
  const nlohmann::json v = Llama8BJson();
  ExpectInvalid(With(v, "architectures", nlohmann::json::array({"MistralForCausalLM"})),
                "\"architectures\" is [\"MistralForCausalLM\"]");
  ExpectInvalid(
      With(v, "architectures", nlohmann::json::array({"LlamaForCausalLM", "MistralForCausalLM"})),
      "\"architectures\"");
  ExpectInvalid(With(v, "architectures", nlohmann::json::array()), "\"architectures\"");
  ExpectInvalid(With(v, "architectures", "LlamaForCausalLM"), "\"architectures\"");
  ExpectInvalid(With(v, "architectures", nlohmann::json::array({5})), "\"architectures\"");
  ExpectInvalid(With(v, "model_type", nullptr), "\"model_type\" is null");
  // Neither names the model.
  ExpectInvalid(Without(Without(v, "architectures"), "model_type"),
                "\"model_type\" is missing (and so is \"architectures\")");
  ExpectInvalid(With(Without(v, "model_type"), "architectures", nullptr),
                "\"model_type\" is missing");
  ExpectInvalid(With(v, "hidden_act", nullptr), "\"hidden_act\" is null");
  ExpectInvalid(With(v, "torch_dtype", 5), "\"torch_dtype\" is 5");
  ExpectInvalid(With(v, "torch_dtype", "float8"), "\"torch_dtype\" is \"float8\"");
  ExpectInvalid(With(v, "dtype", "int4"), "\"dtype\" is \"int4\"");
  ExpectInvalid(With(v, "bos_token_id", -7), "bos_token_id -7 is not a token id");
  ExpectInvalid(With(v, "bos_token_id", 128256), "bos_token_id 128256");
  ExpectInvalid(With(v, "bos_token_id", "<s>"), "bos_token_id \"<s>\"");
  ExpectInvalid(With(v, "pad_token_id", -1), "pad_token_id -1");
  ExpectInvalid(With(v, "pad_token_id", 1.5), "pad_token_id 1.5");

  // Either name alone is enough; absent (or null) activation, dtype and ids take the defaults.
  for (const nlohmann::json& ok :
       {Without(v, "architectures"), Without(v, "model_type"), With(v, "architectures", nullptr),
        Without(v, "hidden_act"), With(v, "torch_dtype", nullptr),
        With(v, "torch_dtype", "float32"), With(v, "torch_dtype", "float16"),
        With(v, "bos_token_id", nullptr), With(v, "pad_token_id", 128004),
        With(v, "bos_token_id", 0)}) {
    absl::StatusOr<ModelConfig> c = ParseHfConfig(ok, "fine");
    EXPECT_TRUE(c.ok()) << ok.dump() << ": " << c.status();
  }
}

TEST(ParseHfConfig, RejectsUnsupportedRopeScaling) {
  nlohmann::json v = Llama8BJson();
  const nlohmann::json scaling = v["rope_scaling"];
  ExpectInvalid(With(v, "rope_scaling", With(scaling, "rope_type", "yarn")), "\"yarn\"");
  const nlohmann::json old = Without(scaling, "rope_type");
  ExpectInvalid(With(v, "rope_scaling", With(old, "type", "dynamic")), "\"dynamic\"");
  ExpectInvalid(With(v, "rope_scaling", old), "rope_type");
  ExpectInvalid(With(v, "rope_scaling", Without(scaling, "factor")),
                "\"rope_scaling.factor\" is missing");
  ExpectInvalid(With(v, "rope_scaling", Without(scaling, "original_max_position_embeddings")),
                "\"rope_scaling.original_max_position_embeddings\" is missing");
  ExpectInvalid(With(v, "rope_scaling", With(scaling, "high_freq_factor", 1)),
                "\"rope_scaling.high_freq_factor\"");
}

// transformers 5's save_pretrained writes RoPE as one "rope_parameters" object (rope_theta
// inside it) and no top-level rope_theta or rope_scaling.
nlohmann::json Transformers5Json() {
  nlohmann::json v =
      Without(Without(Without(Llama8BJson(), "rope_scaling"), "rope_theta"), "torch_dtype");
  v["rope_parameters"] = With(Llama8BJson()["rope_scaling"], "rope_theta", 500000.0);
  v["dtype"] = "bfloat16";
  return v;
}

TEST(ParseHfConfig, ReadsTransformers5RopeParameters) {
  absl::StatusOr<ModelConfig> c = ParseHfConfig(Transformers5Json(), "llama-3.1-8b-tf5");
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectLlama31Rope(*c);

  // rope_type "default": rope_theta, no scaling.
  const nlohmann::json plain =
      With(Transformers5Json(), "rope_parameters",
           nlohmann::json{{"rope_type", "default"}, {"rope_theta", 250000.0}});
  c = ParseHfConfig(plain, "plain");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 250000.0);
  EXPECT_FALSE(c->rope_scaling.has_value());
}

TEST(ParseHfConfig, RejectsBadRopeParameters) {
  const nlohmann::json v = Transformers5Json();
  const nlohmann::json rope = v.at("rope_parameters");
  ExpectInvalid(With(v, "rope_parameters", With(rope, "rope_type", "yarn")),
                "\"rope_parameters.rope_type\"");
  ExpectInvalid(With(v, "rope_parameters", Without(rope, "rope_theta")),
                "\"rope_parameters.rope_theta\" is missing");
  ExpectInvalid(With(v, "rope_parameters", With(rope, "rope_theta", -1)),
                "\"rope_parameters.rope_theta\"");
  ExpectInvalid(With(v, "rope_parameters", Without(rope, "factor")),
                "\"rope_parameters.factor\" is missing");
  ExpectInvalid(With(v, "rope_parameters", 3), "\"rope_parameters\"");
}

TEST(LoadModelConfig, PresetsAndDirectories) {
  for (const char* name : {"tiny", "llama3-8b", "llama3-70b", "llama3-405b"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(IsPreset(name));
    absl::StatusOr<ModelConfig> c = LoadModelConfig(name);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->name, name);
    ASSERT_TRUE(c->rope_scaling.has_value());
    EXPECT_EQ(c->rope_theta, 500000.0);
    EXPECT_EQ(c->head_dim * c->num_heads, c->hidden_size);
    EXPECT_TRUE(c->ValidateForTp(1).ok());
  }
  EXPECT_FALSE(IsPreset("llama3"));
  EXPECT_FALSE(IsPreset(""));

  const std::string dir = ::testing::TempDir() + "/model_config_test_dir";
  std::filesystem::create_directories(dir);
  {
    std::ofstream out(dir + "/config.json");
    out << kLlama31_8B;
  }
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->name, dir);
  EXPECT_EQ(c->vocab_size, 128256);

  // A directory without config.json, and a name that is nothing at all.
  const std::string empty = ::testing::TempDir() + "/model_config_test_empty";
  std::filesystem::create_directories(empty);
  for (const std::string& model : {empty, std::string("llama3-13b")}) {
    absl::StatusOr<ModelConfig> bad = LoadModelConfig(model);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
    EXPECT_TRUE(Contains(bad.status(), absl::StrCat("'", model,
                                                    "' is neither a preset (tiny, "
                                                    "llama3-8b, llama3-70b, "
                                                    "llama3-405b) nor a directory "
                                                    "with config.json")))
        << bad.status();
  }

  // A config.json that does not parse names the file.
  const std::string broken = ::testing::TempDir() + "/model_config_test_broken";
  std::filesystem::create_directories(broken);
  {
    std::ofstream out(broken + "/config.json");
    out << "{\"hidden_size\": ";
  }
  absl::StatusOr<ModelConfig> bad = LoadModelConfig(broken);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_TRUE(Contains(bad.status(), "config.json")) << bad.status();
}

// config.json and generation_config.json are read only as regular files of a bounded size: a
// device (endless), a directory or a huge file is refused by name, unread.
TEST(LoadModelConfig, NonRegularAndHugeFilesAreRefusedUnread) {
  const std::string dir = ::testing::TempDir() + "/model_config_test_files";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::create_symlink("/dev/urandom", dir + "/config.json");
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(Contains(c.status(), "config.json: not a regular file")) << c.status();
  std::filesystem::remove(dir + "/config.json");
  std::filesystem::create_directory(dir + "/config.json");
  c = LoadModelConfig(dir);
  EXPECT_TRUE(Contains(c.status(), "config.json: not a regular file")) << c.status();
  std::filesystem::remove(dir + "/config.json");
  std::ofstream(dir + "/config.json") << "{";
  std::filesystem::resize_file(dir + "/config.json", (int64_t{64} << 20) + 1);  // sparse
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(Contains(c.status(), "config.json: 67108865 bytes, more than")) << c.status();

  std::ofstream(dir + "/config.json", std::ios::trunc) << kLlama31_8B;
  ASSERT_TRUE(LoadModelConfig(dir).ok());
  std::filesystem::create_symlink("/dev/zero", dir + "/generation_config.json");
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_TRUE(Contains(c.status(), "generation_config.json: not a regular file")) << c.status();
}

TEST(LoadModelConfig, EosIdsFromConfigAndGenerationConfig) {
  nlohmann::json j = Llama8BJson();
  j["eos_token_id"] = 128001;
  absl::StatusOr<ModelConfig> c = ParseHfConfig(j, "m");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>({128001}));
  j["eos_token_id"] = {128001, 128009};
  EXPECT_EQ(ParseHfConfig(j, "m")->eos_token_ids, std::vector<int32_t>({128001, 128009}));
  j["eos_token_id"] = nullptr;
  EXPECT_TRUE(ParseHfConfig(j, "m")->eos_token_ids.empty());
  for (const nlohmann::json& bad :
       {nlohmann::json("</s>"), nlohmann::json(128256), nlohmann::json({1, -1})}) {
    j["eos_token_id"] = bad;
    absl::StatusOr<ModelConfig> refused = ParseHfConfig(j, "m");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Contains(refused.status(), "eos_token_id")) << refused.status();
  }
  // generation_config.json's list replaces config.json's id.
  const std::string dir = ::testing::TempDir() + "/model_config_test_eos";
  std::filesystem::create_directories(dir);
  j["eos_token_id"] = 128001;
  std::ofstream(dir + "/config.json") << j.dump();
  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": [128001, 128008, 128009]})";
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->eos_token_ids, std::vector<int32_t>({128001, 128008, 128009}));
  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": "x"})";
  EXPECT_TRUE(Contains(LoadModelConfig(dir).status(), "generation_config.json"));
}

TEST(ModelConfig, ParameterCountsMatchPublishedSizes) {
  auto count = [](const std::string& name) {
    absl::StatusOr<ModelConfig> c = LoadModelConfig(name);
    EXPECT_TRUE(c.ok()) << c.status();
    return static_cast<double>(c->ParameterCount());
  };
  EXPECT_NEAR(count("llama3-8b"), 8.03e9, 0.01 * 8.03e9);
  EXPECT_NEAR(count("llama3-70b"), 70.6e9, 0.01 * 70.6e9);
  EXPECT_NEAR(count("llama3-405b"), 405.8e9, 0.01 * 405.8e9);
  // The 8B count is known exactly: 8,030,261,248.
  EXPECT_EQ(count("llama3-8b"), 8030261248.0);

  // tiny, term by term.
  absl::StatusOr<ModelConfig> tiny = LoadModelConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  const int64_t d = 512, q = 8 * 64, kv = 4 * 64, inter = 1376, vocab = 1024;
  const int64_t layer = q * d + 2 * kv * d + d * q + 3 * d * inter + 2 * d;
  EXPECT_EQ(tiny->ParameterCount(), 2 * vocab * d + 4 * layer + d);
  ModelConfig tied = *tiny;
  tied.tie_word_embeddings = true;
  EXPECT_EQ(tied.ParameterCount(), vocab * d + 4 * layer + d);
}

TEST(ModelConfig, ValidateForTp) {
  absl::StatusOr<ModelConfig> tiny = LoadModelConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  for (int tp : {1, 2, 4}) EXPECT_TRUE(tiny->ValidateForTp(tp).ok()) << tp;
  absl::Status s = tiny->ValidateForTp(8);  // 4 KV heads over 8 ranks
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "num_key_value_heads (4)")) << s;
  EXPECT_TRUE(Contains(s, "(8)")) << s;
  EXPECT_TRUE(Contains(s, "tiny")) << s;
  EXPECT_EQ(tiny->ValidateForTp(0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tiny->ValidateForTp(3).code(), absl::StatusCode::kInvalidArgument);

  for (const char* name : {"llama3-8b", "llama3-70b", "llama3-405b"}) {
    absl::StatusOr<ModelConfig> c = LoadModelConfig(name);
    ASSERT_TRUE(c.ok());
    for (int tp : {1, 2, 4, 8}) EXPECT_TRUE(c->ValidateForTp(tp).ok()) << name << " tp " << tp;
    EXPECT_FALSE(c->ValidateForTp(16).ok()) << name;  // 8 KV heads
  }

  auto expect = [](const ModelConfig& c, int tp, const std::string& text) {
    absl::Status s = c.ValidateForTp(tp);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(Contains(s, text)) << s;
  };
  ModelConfig c = *tiny;
  c.num_heads = 10;
  c.hidden_size = 320;
  expect(c, 1, "num_attention_heads (10) is not a multiple of num_key_value_heads (4)");
  c = *tiny;
  c.head_dim = 31;
  expect(c, 1, "head_dim (31) is odd");
  c = *tiny;
  c.intermediate_size = 690;
  expect(c, 4, "intermediate_size (690) is not divisible by the tensor-parallel size (4)");
  c = *tiny;
  c.vocab_size = 1022;
  expect(c, 4, "vocab_size (1022)");
  c = *tiny;
  c.num_layers = 0;
  expect(c, 1, "num_hidden_layers is 0");
}

}  // namespace
}  // namespace cpfill::runtime
