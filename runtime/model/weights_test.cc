#include "runtime/model/weights.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bfloat16.h"
#include "base/json_io.h"
#include "base/random.h"
#include "gtest/gtest.h"
#include "runtime/model/safetensors.h"

namespace cpfill::runtime {
namespace {

// Small enough to write many checkpoints, large enough that tp 4 splits every dimension.
ModelConfig SmallConfig(bool tied = false) {
  ModelConfig c;
  c.name = "small";
  c.hidden_size = 64;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 8;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.vocab_size = 256;
  c.rope_scaling = Llama3RopeScaling{};
  c.tie_word_embeddings = tied;
  return c;
}

std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/weights_test_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

// Rows [row0, row0 + rows) x columns [col0, col0 + cols) of a row-major matrix `cols_total` wide.
std::vector<float> Block(const std::vector<float>& m, int64_t cols_total, int64_t row0,
                         int64_t rows, int64_t col0, int64_t cols) {
  std::vector<float> out;
  for (int64_t r = row0; r < row0 + rows; ++r) {
    for (int64_t c = col0; c < col0 + cols; ++c) out.push_back(m[r * cols_total + c]);
  }
  return out;
}

// `part` is rank `rank` of `tp` of `whole` (a tp 1 set), written out per tensor kind from the
// Megatron split, independently of weights.cc's tables.
void ExpectSliceOf(const ModelConfig& c, const ModelWeights& whole, const ModelWeights& part,
                   int rank, int tp) {
  const int64_t d = c.hidden_size, hd = c.head_dim;
  const int64_t hq = c.num_heads / tp, hkv = c.num_kv_heads / tp;
  const int64_t inter = c.intermediate_size / tp, vocab = c.vocab_size / tp;
  const int64_t q_all = int64_t{c.num_heads} * hd;
  EXPECT_EQ(part.tp_rank, rank);
  EXPECT_EQ(part.tp_size, tp);
  EXPECT_EQ(part.embedding, whole.embedding);  // replicated
  EXPECT_EQ(part.final_norm, whole.final_norm);
  ASSERT_EQ(part.layers.size(), whole.layers.size());
  for (size_t i = 0; i < whole.layers.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("layer ", i));
    const LayerWeights& w = whole.layers[i];
    const LayerWeights& p = part.layers[i];
    EXPECT_EQ(p.input_norm, w.input_norm);
    EXPECT_EQ(p.post_norm, w.post_norm);
    // Column-parallel: a contiguous block of output rows.
    EXPECT_EQ(p.wq, Block(w.wq, d, rank * hq * hd, hq * hd, 0, d));
    EXPECT_EQ(p.wk, Block(w.wk, d, rank * hkv * hd, hkv * hd, 0, d));
    EXPECT_EQ(p.wv, Block(w.wv, d, rank * hkv * hd, hkv * hd, 0, d));
    EXPECT_EQ(p.w_gate, Block(w.w_gate, d, rank * inter, inter, 0, d));
    EXPECT_EQ(p.w_up, Block(w.w_up, d, rank * inter, inter, 0, d));
    // Row-parallel: every row, this rank's columns.
    EXPECT_EQ(p.wo, Block(w.wo, q_all, 0, d, rank * hq * hd, hq * hd));
    EXPECT_EQ(p.w_down, Block(w.w_down, c.intermediate_size, 0, d, rank * inter, inter));
  }
  // LM head: this rank's vocab rows.
  EXPECT_EQ(part.lm_head, Block(whole.lm_head, d, rank * vocab, vocab, 0, d));
}

ModelWeights Synthetic(const ModelConfig& c, uint64_t seed, int rank, int tp) {
  absl::StatusOr<ModelWeights> w = SyntheticWeights(c, seed, rank, tp);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : ModelWeights{};
}

TEST(SyntheticWeights, ShapesAndScale) {
  const ModelConfig c = SmallConfig();
  const ModelWeights w = Synthetic(c, 7, 0, 1);
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.embedding.size(), 256u * 64);
  EXPECT_EQ(w.lm_head.size(), 256u * 64);
  EXPECT_EQ(w.final_norm.size(), 64u);
  EXPECT_EQ(w.layers[0].wq.size(), 64u * 64);
  EXPECT_EQ(w.layers[0].wk.size(), 32u * 64);
  EXPECT_EQ(w.layers[0].wo.size(), 64u * 64);
  EXPECT_EQ(w.layers[0].w_down.size(), 64u * 128);

  // Matrices: uniform on [-a, a], a = 0.02 sqrt(3), so std 0.02; norms in [0.9, 1.1].
  const double a = 0.02 * std::sqrt(3.0);
  double sum = 0, sum2 = 0;
  for (const float x : w.embedding) {
    EXPECT_LE(std::fabs(x), a + 1e-7);
    sum += x;
    sum2 += double{x} * x;
  }
  const double n = static_cast<double>(w.embedding.size());
  EXPECT_NEAR(sum / n, 0.0, 0.001);
  EXPECT_NEAR(std::sqrt(sum2 / n), 0.02, 0.001);
  for (const float x : w.layers[1].post_norm) {
    EXPECT_GE(x, 0.9f);
    EXPECT_LE(x, 1.1f);
  }

  // Deterministic per seed; distinct tensors and seeds differ.
  EXPECT_EQ(Synthetic(c, 7, 0, 1).layers[1].w_up, w.layers[1].w_up);
  EXPECT_NE(Synthetic(c, 8, 0, 1).layers[1].w_up, w.layers[1].w_up);
  EXPECT_NE(w.layers[0].wk, w.layers[0].wv);
  EXPECT_NE(w.layers[0].wq, w.layers[1].wq);
  EXPECT_NE(w.layers[0].input_norm, w.layers[0].post_norm);
  EXPECT_NE(Block(w.lm_head, 64, 0, 1, 0, 64), Block(w.embedding, 64, 0, 1, 0, 64));
}

TEST(SyntheticWeights, TpSlicesEqualSlicesOfTheWholeModel) {
  for (const bool tied : {false, true}) {
    const ModelConfig c = SmallConfig(tied);
    const ModelWeights whole = Synthetic(c, 42, 0, 1);
    if (tied) {
      EXPECT_EQ(whole.lm_head, whole.embedding);
    }
    for (const int tp : {2, 4}) {
      for (int rank = 0; rank < tp; ++rank) {
        SCOPED_TRACE(absl::StrCat("tied ", tied, " tp ", tp, " rank ", rank));
        ExpectSliceOf(c, whole, Synthetic(c, 42, rank, tp), rank, tp);
      }
    }
  }
}

TEST(SyntheticWeights, RejectsBadTp) {
  const ModelConfig c = SmallConfig();
  EXPECT_EQ(SyntheticWeights(c, 1, 0, 8).status().code(),  // 4 KV heads
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SyntheticWeights(c, 1, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SyntheticWeights(c, 1, -1, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Weights, Fp32RoundTripIsExactForEveryTp) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(absl::StrCat("tied ", tied));
    const ModelConfig c = SmallConfig(tied);
    const ModelWeights whole = Synthetic(c, 3, 0, 1);
    const std::string dir = TempDir(tied ? "fp32_tied" : "fp32");
    ASSERT_TRUE(SaveHfCheckpoint(c, whole, dir, /*bf16=*/false).ok());

    // The file holds HF names; a tied model has no lm_head.weight.
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->names().size(), 1 + 9 * 2 + 1 + (tied ? 0 : 1));
    EXPECT_EQ(file->Find("lm_head.weight") != nullptr, !tied);
    const TensorInfo* o = file->Find("model.layers.1.self_attn.o_proj.weight");
    ASSERT_NE(o, nullptr);
    EXPECT_EQ(o->dtype, DType::kF32);
    EXPECT_EQ(o->shape, (std::vector<int64_t>{64, 64}));
    const TensorInfo* norm = file->Find("model.norm.weight");
    ASSERT_NE(norm, nullptr);
    EXPECT_EQ(norm->shape, (std::vector<int64_t>{64}));

    // config.json reads back as the same model.
    absl::StatusOr<ModelConfig> back = LoadModelConfig(dir);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->ParameterCount(), c.ParameterCount());
    EXPECT_EQ(back->num_kv_heads, c.num_kv_heads);
    EXPECT_EQ(back->head_dim, c.head_dim);
    EXPECT_EQ(back->tie_word_embeddings, tied);
    EXPECT_EQ(back->rope_theta, c.rope_theta);
    EXPECT_EQ(back->rms_norm_eps, c.rms_norm_eps);
    ASSERT_TRUE(back->rope_scaling.has_value());
    EXPECT_EQ(back->rope_scaling->high_freq_factor, c.rope_scaling->high_freq_factor);
    absl::StatusOr<nlohmann::json> raw = json::ReadFile(dir + "/config.json");
    ASSERT_TRUE(raw.ok()) << raw.status();
    EXPECT_EQ(json::GetString(*raw, "torch_dtype").value_or(""), "float32");
    EXPECT_EQ(json::GetString(*raw, "model_type").value_or(""), "llama");

    for (const int tp : {1, 2}) {
      for (int rank = 0; rank < tp; ++rank) {
        SCOPED_TRACE(absl::StrCat("tp ", tp, " rank ", rank));
        absl::StatusOr<ModelWeights> loaded = LoadWeights(c, dir, rank, tp);
        ASSERT_TRUE(loaded.ok()) << loaded.status();
        ExpectSliceOf(c, whole, *loaded, rank, tp);
      }
    }
  }
}

TEST(Weights, Bf16RoundTripIsBf16Rounding) {
  const ModelConfig c = SmallConfig();
  const ModelWeights whole = Synthetic(c, 5, 0, 1);
  const std::string dir = TempDir("bf16");
  ASSERT_TRUE(SaveHfCheckpoint(c, whole, dir, /*bf16=*/true).ok());
  absl::StatusOr<nlohmann::json> raw = json::ReadFile(dir + "/config.json");
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ(json::GetString(*raw, "torch_dtype").value_or(""), "bfloat16");

  // What a bf16 checkpoint holds: every tensor rounded to nearest bf16.
  ModelWeights rounded = whole;
  auto round_all = [](ModelWeights& w) {
    RoundToBfloat16(w.embedding);
    RoundToBfloat16(w.final_norm);
    RoundToBfloat16(w.lm_head);
    for (LayerWeights& l : w.layers) {
      for (std::vector<float>* v : {&l.input_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.post_norm,
                                    &l.w_gate, &l.w_up, &l.w_down}) {
        RoundToBfloat16(*v);
      }
    }
  };
  round_all(rounded);
  for (const int tp : {1, 2}) {
    for (int rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE(absl::StrCat("tp ", tp, " rank ", rank));
      absl::StatusOr<ModelWeights> loaded = LoadWeights(c, dir, rank, tp);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      ExpectSliceOf(c, rounded, *loaded, rank, tp);
    }
  }
  // And rounding is within bf16's half ulp (2^-9 relative) of the fp32 weights.
  absl::StatusOr<ModelWeights> loaded = LoadWeights(c, dir, 0, 1);
  ASSERT_TRUE(loaded.ok());
  for (size_t i = 0; i < whole.layers[0].wq.size(); ++i) {
    const float x = whole.layers[0].wq[i];
    EXPECT_LE(std::fabs(loaded->layers[0].wq[i] - x), std::ldexp(std::fabs(x), -8)) << i;
  }
}

// The HF tensors of a tp 1 set (untied), as fp32 bytes, to build hand-made checkpoints from.
struct NamedTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

std::vector<NamedTensor> HfTensors(const ModelConfig& c, const ModelWeights& w) {
  std::vector<NamedTensor> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, const std::vector<float>& v) {
    NamedTensor t{std::move(name), DType::kF32, std::move(shape), {}};
    t.bytes.resize(v.size() * 4);
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    out.push_back(std::move(t));
  };
  const int64_t d = c.hidden_size, q = int64_t{c.num_heads} * c.head_dim;
  const int64_t kv = int64_t{c.num_kv_heads} * c.head_dim, inter = c.intermediate_size;
  add("model.embed_tokens.weight", {c.vocab_size, d}, w.embedding);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", {d}, l.input_norm);
    add(p + "self_attn.q_proj.weight", {q, d}, l.wq);
    add(p + "self_attn.k_proj.weight", {kv, d}, l.wk);
    add(p + "self_attn.v_proj.weight", {kv, d}, l.wv);
    add(p + "self_attn.o_proj.weight", {d, q}, l.wo);
    add(p + "post_attention_layernorm.weight", {d}, l.post_norm);
    add(p + "mlp.gate_proj.weight", {inter, d}, l.w_gate);
    add(p + "mlp.up_proj.weight", {inter, d}, l.w_up);
    add(p + "mlp.down_proj.weight", {d, inter}, l.w_down);
  }
  add("model.norm.weight", {d}, w.final_norm);
  add("lm_head.weight", {c.vocab_size, d}, w.lm_head);
  return out;
}

void WriteSafetensors(const std::string& path, const std::vector<const NamedTensor*>& tensors) {
  SafetensorsWriter writer;
  for (const NamedTensor* t : tensors) {
    ASSERT_TRUE(writer.Add(t->name, t->dtype, t->shape, t->bytes.data()).ok()) << t->name;
  }
  ASSERT_TRUE(writer.Write(path).ok()) << path;
}

void WriteSingleFile(const std::string& dir, const std::vector<NamedTensor>& tensors) {
  std::vector<const NamedTensor*> all;
  for (const NamedTensor& t : tensors) all.push_back(&t);
  WriteSafetensors(dir + "/model.safetensors", all);
}

NamedTensor* FindTensor(std::vector<NamedTensor>& tensors, const std::string& name) {
  for (NamedTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(Weights, LoadsShardedCheckpoint) {
  const ModelConfig c = SmallConfig();
  const ModelWeights whole = Synthetic(c, 11, 0, 1);
  const std::vector<NamedTensor> tensors = HfTensors(c, whole);
  const std::string dir = TempDir("sharded");
  // Alternate tensors between two shards, as HF's save_pretrained fills shards by size.
  const std::string shard[2] = {"model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors"};
  std::vector<const NamedTensor*> parts[2];
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  int64_t total_bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    parts[i % 2].push_back(&tensors[i]);
    weight_map[tensors[i].name] = shard[i % 2];
    total_bytes += static_cast<int64_t>(tensors[i].bytes.size());
  }
  for (int s = 0; s < 2; ++s) WriteSafetensors(dir + "/" + shard[s], parts[s]);
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total_bytes}}},
                                  {"weight_map", weight_map}};
  ASSERT_TRUE(json::WriteFile(dir + "/model.safetensors.index.json", index).ok());
  for (const int tp : {1, 2, 4}) {
    for (int rank = 0; rank < tp; ++rank) {
      SCOPED_TRACE(absl::StrCat("tp ", tp, " rank ", rank));
      absl::StatusOr<ModelWeights> loaded = LoadWeights(c, dir, rank, tp);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      ExpectSliceOf(c, whole, *loaded, rank, tp);
    }
  }

  // An index that does not list a tensor: NotFound naming the tensor and the index.
  nlohmann::ordered_json partial = weight_map;
  ASSERT_EQ(partial.erase("model.layers.1.mlp.down_proj.weight"), 1u);
  index["weight_map"] = partial;
  ASSERT_TRUE(json::WriteFile(dir + "/model.safetensors.index.json", index).ok());
  absl::StatusOr<ModelWeights> bad = LoadWeights(c, dir, 0, 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
  EXPECT_TRUE(Contains(bad.status(), "model.layers.1.mlp.down_proj.weight")) << bad.status();
  EXPECT_TRUE(Contains(bad.status(), "model.safetensors.index.json")) << bad.status();

  // A shard the index names but that does not exist: NotFound naming the shard.
  partial["model.layers.1.mlp.down_proj.weight"] = "model-00003-of-00002.safetensors";
  index["weight_map"] = partial;
  ASSERT_TRUE(json::WriteFile(dir + "/model.safetensors.index.json", index).ok());
  bad = LoadWeights(c, dir, 0, 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound) << bad.status();
  EXPECT_TRUE(Contains(bad.status(), "model-00003-of-00002.safetensors")) << bad.status();
}

// Reference binary16 decoding, from the definition.
double HalfToDouble(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  if (exponent == 0x1f) return mantissa == 0 ? sign * INFINITY : NAN;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

TEST(Weights, LoadsF16Exactly) {
  // Every tensor F16 with random bit patterns (normals, subnormals, zeros of both signs);
  // the first elements of the embedding are special values.
  const ModelConfig c = SmallConfig();
  std::vector<NamedTensor> tensors = HfTensors(c, Synthetic(c, 1, 0, 1));
  uint64_t counter = 0;
  for (NamedTensor& t : tensors) {
    const size_t n = t.bytes.size() / 4;
    t.dtype = DType::kF16;
    t.bytes.resize(n * 2);
    for (size_t i = 0; i < n; ++i) {
      uint16_t h = static_cast<uint16_t>(Mix64(++counter));
      if (((h >> 10) & 0x1f) == 0x1f) h &= 0xbfff;  // keep it finite
      std::memcpy(t.bytes.data() + 2 * i, &h, 2);
    }
  }
  const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x83ff, 0x0400, 0x3c00,
                              0xc000, 0x7bff, 0x7c00, 0xfc00, 0x3555};
  NamedTensor* embedding = FindTensor(tensors, "model.embed_tokens.weight");
  std::memcpy(embedding->bytes.data(), special, sizeof(special));
  const std::string dir = TempDir("f16");
  WriteSingleFile(dir, tensors);

  absl::StatusOr<ModelWeights> loaded = LoadWeights(c, dir, 1, 2);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto half = [](const NamedTensor& t, int64_t i) {
    uint16_t h;
    std::memcpy(&h, t.bytes.data() + 2 * i, 2);
    return h;
  };
  for (int64_t i = 0; i < static_cast<int64_t>(loaded->embedding.size()); ++i) {
    const uint16_t h = half(*embedding, i);
    const float got = loaded->embedding[static_cast<size_t>(i)];
    ASSERT_EQ(got, static_cast<float>(HalfToDouble(h))) << "bits " << std::hex << h;
    ASSERT_EQ(std::signbit(got), (h >> 15) != 0) << "bits " << std::hex << h;
  }
  EXPECT_EQ(loaded->embedding[2], std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(loaded->embedding[7], 65504.0f);               // largest finite
  EXPECT_EQ(loaded->embedding[8], INFINITY);
  EXPECT_EQ(loaded->embedding[9], -INFINITY);
  // A row-parallel slice (rank 1's columns of down_proj) converts the same way.
  const NamedTensor* down = FindTensor(tensors, "model.layers.1.mlp.down_proj.weight");
  const std::vector<float>& got = loaded->layers[1].w_down;
  ASSERT_EQ(got.size(), 64u * 64);
  for (int64_t r = 0; r < 64; ++r) {
    for (int64_t col = 0; col < 64; ++col) {
      ASSERT_EQ(got[r * 64 + col],
                static_cast<float>(HalfToDouble(half(*down, r * 128 + 64 + col))));
    }
  }
}

struct CorruptCase {
  const char* what;
  absl::StatusCode code;
  std::vector<std::string> message_has;
};

TEST(Weights, CorruptCheckpointsNameFileAndTensor) {
  const ModelConfig c = SmallConfig();
  const ModelWeights whole = Synthetic(c, 9, 0, 1);
  const std::string k_name = "model.layers.0.self_attn.k_proj.weight";
  const std::string o_name = "model.layers.1.self_attn.o_proj.weight";
  const std::string up_name = "model.layers.1.mlp.up_proj.weight";

  auto expect = [&](const std::string& dir, absl::StatusCode code,
                    const std::vector<std::string>& message_has) {
    for (const int tp : {1, 2}) {
      absl::StatusOr<ModelWeights> w = LoadWeights(c, dir, 0, tp);
      EXPECT_EQ(w.status().code(), code) << w.status();
      for (const std::string& text : message_has) {
        EXPECT_TRUE(Contains(w.status(), text)) << "'" << text << "' not in: " << w.status();
      }
    }
  };

  {  // Missing tensor.
    std::vector<NamedTensor> tensors = HfTensors(c, whole);
    std::erase_if(tensors, [&](const NamedTensor& t) { return t.name == up_name; });
    const std::string dir = TempDir("missing");
    WriteSingleFile(dir, tensors);
    expect(dir, absl::StatusCode::kNotFound, {dir + "/model.safetensors", "\"" + up_name + "\""});
  }
  {  // Untied config, checkpoint without lm_head.weight.
    std::vector<NamedTensor> tensors = HfTensors(c, whole);
    std::erase_if(tensors, [&](const NamedTensor& t) { return t.name == "lm_head.weight"; });
    const std::string dir = TempDir("missing_head");
    WriteSingleFile(dir, tensors);
    expect(dir, absl::StatusCode::kNotFound, {dir + "/model.safetensors", "\"lm_head.weight\""});
    // The same file serves the tied model.
    absl::StatusOr<ModelWeights> tied = LoadWeights(SmallConfig(true), dir, 1, 2);
    ASSERT_TRUE(tied.ok()) << tied.status();
    EXPECT_EQ(tied->lm_head, Block(whole.embedding, 64, 128, 128, 0, 64));
  }
  {  // Wrong shape: k_proj with 5 KV heads' rows instead of 4.
    std::vector<NamedTensor> tensors = HfTensors(c, whole);
    NamedTensor* k = FindTensor(tensors, k_name);
    k->shape = {40, 64};
    k->bytes.resize(40 * 64 * 4);
    const std::string dir = TempDir("shape");
    WriteSingleFile(dir, tensors);
    expect(dir, absl::StatusCode::kInvalidArgument,
           {dir + "/model.safetensors", "\"" + k_name + "\"", "[40, 64]", "[32, 64]"});
  }
  {  // A transposed row-parallel matrix is a shape error too, not a silent misread.
    std::vector<NamedTensor> tensors = HfTensors(c, whole);
    FindTensor(tensors, "model.layers.0.mlp.down_proj.weight")->shape = {128, 64};
    const std::string dir = TempDir("transposed");
    WriteSingleFile(dir, tensors);
    expect(dir, absl::StatusCode::kInvalidArgument,
           {"\"model.layers.0.mlp.down_proj.weight\"", "[128, 64]", "[64, 128]"});
  }
  {  // Integer dtype.
    std::vector<NamedTensor> tensors = HfTensors(c, whole);
    FindTensor(tensors, o_name)->dtype = DType::kI32;
    const std::string dir = TempDir("int");
    WriteSingleFile(dir, tensors);
    expect(dir, absl::StatusCode::kInvalidArgument,
           {dir + "/model.safetensors", "\"" + o_name + "\"", "I32"});
  }
  {  // Truncated file: the header promises bytes past the end.
    const std::string dir = TempDir("truncated");
    ASSERT_TRUE(SaveHfCheckpoint(c, whole, dir, false).ok());
    const std::string path = dir + "/model.safetensors";
    std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1000);
    expect(dir, absl::StatusCode::kInvalidArgument, {path, "tensor \"", "truncated"});
  }
  {  // No checkpoint at all.
    const std::string dir = TempDir("empty");
    expect(dir, absl::StatusCode::kNotFound, {dir, "model.safetensors"});
  }
}

TEST(Weights, RejectsBadArguments) {
  const ModelConfig c = SmallConfig();
  const std::string dir = TempDir("args");
  ASSERT_TRUE(SaveHfCheckpoint(c, Synthetic(c, 1, 0, 1), dir, false).ok());
  EXPECT_EQ(LoadWeights(c, dir, 0, 8).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadWeights(c, dir, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);

  // Only whole models can be saved.
  absl::Status s = SaveHfCheckpoint(c, Synthetic(c, 1, 1, 2), TempDir("save_tp2"), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "tp_size 1")) << s;
  // Weights that do not match the config.
  ModelWeights w = Synthetic(c, 1, 0, 1);
  w.layers[1].wv.pop_back();
  s = SaveHfCheckpoint(c, w, TempDir("save_bad"), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "model.layers.1.self_attn.v_proj.weight")) << s;
  // Save creates missing directories.
  const std::string nested = TempDir("nested") + "/a/b";
  EXPECT_TRUE(SaveHfCheckpoint(c, Synthetic(c, 1, 0, 1), nested, true).ok());
  EXPECT_TRUE(std::filesystem::exists(nested + "/model.safetensors"));
}

TEST(Weights, TinyPresetRoundTripsAtTp4) {
  absl::StatusOr<ModelConfig> tiny = LoadModelConfig("tiny");
  ASSERT_TRUE(tiny.ok());
  const ModelWeights whole = Synthetic(*tiny, 2024, 0, 1);
  const std::string dir = TempDir("tiny");
  ASSERT_TRUE(SaveHfCheckpoint(*tiny, whole, dir, false).ok());
  for (int rank = 0; rank < 4; ++rank) {
    SCOPED_TRACE(rank);
    absl::StatusOr<ModelWeights> loaded = LoadWeights(*tiny, dir, rank, 4);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ExpectSliceOf(*tiny, whole, *loaded, rank, 4);
    ExpectSliceOf(*tiny, whole, Synthetic(*tiny, 2024, rank, 4), rank, 4);
  }
}

}  // namespace
}  // namespace cpfill::runtime
