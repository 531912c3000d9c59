#include "runtime/model/fp8.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "runtime/model/cpu/fp8_linear.h"
#include "runtime/model/memory.h"
#include "runtime/model/model_config.h"
#include "runtime/model/weights.h"

namespace cpfill::runtime {
namespace {

TEST(E4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << code;
      EXPECT_EQ(FloatToE4M3(v) & 0x7f, 0x7f) << code;
      continue;
    }
    EXPECT_EQ(FloatToE4M3(v), code) << "value " << v;
  }
}

TEST(E4M3, DecodesKnownValues) {
  EXPECT_EQ(E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4M3ToFloat(0x07), 7 * std::ldexp(1.0f, -9));
}

TEST(E4M3, RoundsToNearestEvenOnTies) {
  // Between 1 (mantissa 0) and 1.125 (mantissa 1): the tie 1.0625 goes to the even 1.
  EXPECT_EQ(E4M3ToFloat(FloatToE4M3(1.0625f)), 1.0f);
  // Between 1.125 (odd) and 1.25 (even): the tie goes up.
  EXPECT_EQ(E4M3ToFloat(FloatToE4M3(1.1875f)), 1.25f);
  // Just off a tie rounds to the nearer neighbour.
  EXPECT_EQ(E4M3ToFloat(FloatToE4M3(std::nextafter(1.0625f, 2.0f))), 1.125f);
  // Subnormal ties: 0.5 and 1.5 quanta of 2^-9.
  EXPECT_EQ(FloatToE4M3(std::ldexp(0.5f, -9)), 0x00);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(FloatToE4M3(-std::ldexp(2.5f, -9)), 0x82);
  // A tie that carries into the next binade: 1.9375 between 1.875 (odd) and 2.
  EXPECT_EQ(E4M3ToFloat(FloatToE4M3(1.9375f)), 2.0f);
}

TEST(E4M3, SaturatesAndKeepsNaN) {
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(460.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(1e9f), 0x7e);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToE4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToE4M3(std::nanf("")), 0x7f);
  EXPECT_EQ(FloatToE4M3(-std::nanf("")), 0xff);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4M3(1e-30f), 0x00);
}

TEST(E4M3, RoundsEveryValueToTheNearestCode) {
  // Brute force against the decoded table: the chosen code is at least as near as any other.
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-500.0f, 500.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = u(rng) * (i % 3 == 0 ? 1e-3f : 1.0f);
    const float got = E4M3ToFloat(FloatToE4M3(x));
    const float clamped = std::max(-448.0f, std::min(448.0f, x));
    for (int c = 0; c < 256; ++c) {
      if ((c & 0x7f) == 0x7f) continue;
      ASSERT_LE(std::fabs(got - clamped), std::fabs(E4M3ToFloat(static_cast<uint8_t>(c)) - clamped))
          << x;
    }
  }
}

TEST(Fp8Rowwise, ScalesEachRowToItsMax) {
  const std::vector<float> w = {0.5f, -2.0f, 1.0f, 0.0f, 0.0f, 0.0f};
  const Fp8Matrix q = QuantizeRowwise(w.data(), 2, 3);
  EXPECT_FLOAT_EQ(q.row_scale[0], 2.0f / 448.0f);
  EXPECT_EQ(q.codes[1], 0xfe);  // the max maps to -448
  EXPECT_FLOAT_EQ(E4M3ToFloat(q.codes[0]) * q.row_scale[0], 0.5f);
  EXPECT_EQ(q.row_scale[1], kFp8MinRowMax / 448.0f);  // an all-zero row: no division by zero
  EXPECT_EQ(q.codes[3], 0x00);
}

TEST(Fp8Rowwise, ActivationBoundClampsTheScale) {
  const std::vector<float> x = {3000.0f, 1.0f};
  std::vector<uint8_t> xq(2);
  float scale = 0;
  QuantizeActivations(x.data(), 1, 2, 1200.0f, xq.data(), &scale);
  EXPECT_FLOAT_EQ(scale, 1200.0f / 448.0f);
  EXPECT_EQ(xq[0], 0x7e);  // past the bound: saturates
}

// The CPU linear against an fp64 evaluation of the same codes, poisoned output first.
TEST(Fp8Rowwise, LinearMatchesFp64Reference) {
  const int64_t tokens = 7, in = 96, out = 33;
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(tokens * in), w(out * in);
  for (float& v : x) v = n(rng) * 3.0f;
  for (float& v : w) v = n(rng) * 0.02f;
  x[5] = 5000.0f;  // one outlier past the bound
  const Fp8Matrix q = QuantizeRowwise(w.data(), out, in);
  std::vector<float> y(tokens * out, std::nanf(""));
  cpu::Fp8LinearScratch scratch;
  for (bool per_row : {false, true}) {
    std::fill(y.begin(), y.end(), std::nanf(""));
    cpu::LinearFp8Rowwise(x.data(), tokens, in, q.codes.data(), q.row_scale.data(), out, 1200.0f,
                          per_row, y.data(), &scratch);
    std::vector<uint8_t> xq(tokens * in);
    std::vector<float> xs(tokens);
    QuantizeActivations(x.data(), tokens, in, 1200.0f, xq.data(), xs.data());
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t o = 0; o < out; ++o) {
        double acc = 0, mag = 0;
        for (int64_t i = 0; i < in; ++i) {
          const double p = double{E4M3ToFloat(xq[t * in + i])} * E4M3ToFloat(q.codes[o * in + i]);
          acc += p;
          mag += std::fabs(p);
        }
        const double ref = acc * (double{xs[t]} * q.row_scale[o]);
        const double tol = (mag * in * 6e-8 + std::fabs(acc) * 2e-7) * xs[t] * q.row_scale[o];
        ASSERT_NEAR(y[t * out + o], ref, tol + 1e-30) << t << "," << o << " per_row " << per_row;
      }
    }
  }
}

TEST(Fp8Weights, QuantizedTpSlicesMatchTheWholeModel) {
  ModelConfig c = *LoadModelConfig("tiny");
  c.fp8.modules = Fp8Modules::kAll;
  const ModelWeights whole = *SyntheticWeights(c, 1, 0, 1);
  const ModelWeights half = *SyntheticWeights(c, 1, 1, 2);
  ASSERT_TRUE(whole.layers[0].wq.empty());
  const Fp8Matrix& wd = whole.layers[0].w_down_fp8;  // row-parallel: columns split
  const Fp8Matrix& hd = half.layers[0].w_down_fp8;
  const int64_t rows = c.hidden_size, cols = c.intermediate_size;
  ASSERT_EQ(hd.row_scale, wd.row_scale);  // the whole row's scale on every rank
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < cols / 2; ++k) {
      ASSERT_EQ(hd.codes[r * cols / 2 + k], wd.codes[r * cols + cols / 2 + k]);
    }
  }
  const Fp8Matrix& hg = half.layers[0].w_gate_fp8;  // column-parallel: rows split
  const int64_t half_rows = c.intermediate_size / 2;
  EXPECT_EQ(hg.row_scale[0], whole.layers[0].w_gate_fp8.row_scale[half_rows]);
}

TEST(Fp8Weights, FfnModeLeavesAttentionInFloat) {
  ModelConfig c = *LoadModelConfig("tiny");
  c.fp8.modules = Fp8Modules::kFfn;
  const ModelWeights w = *SyntheticWeights(c, 1, 0, 1);
  EXPECT_FALSE(w.layers[0].wq.empty());
  EXPECT_TRUE(w.layers[0].wq_fp8.empty());
  EXPECT_FALSE(w.layers[0].w_up_fp8.empty());
  EXPECT_TRUE(w.layers[0].w_up.empty());
}

// Save as fbgemm_fp8, load back: same codes and scales; and a float checkpoint quantized at load
// gives the codes the synthetic quantization gave.
TEST(Fp8Weights, CheckpointRoundTrips) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("cpfill_fp8_" + std::to_string(getpid())))
          .string();
  ModelConfig c = *LoadModelConfig("tiny");
  c.fp8.modules = Fp8Modules::kFfn;
  c.fp8.activation_scale_ub = 900.0f;
  const ModelWeights w = *SyntheticWeights(c, 1, 0, 1);
  ASSERT_TRUE(SaveHfCheckpoint(c, w, dir, /*bf16=*/false).ok());
  absl::StatusOr<ModelConfig> loaded_config = LoadModelConfig(dir);
  ASSERT_TRUE(loaded_config.ok()) << loaded_config.status();
  EXPECT_TRUE(loaded_config->fp8.from_checkpoint);
  EXPECT_EQ(loaded_config->fp8.activation_scale_ub, 900.0f);
  for (int tp : {1, 2}) {
    absl::StatusOr<ModelWeights> back = LoadWeights(*loaded_config, dir, tp - 1, tp);
    ASSERT_TRUE(back.ok()) << back.status();
    const ModelWeights ref = *SyntheticWeights(c, 1, tp - 1, tp);
    EXPECT_EQ(back->layers[1].w_down_fp8.codes, ref.layers[1].w_down_fp8.codes);
    EXPECT_EQ(back->layers[1].w_down_fp8.row_scale, ref.layers[1].w_down_fp8.row_scale);
    EXPECT_EQ(back->layers[1].w_gate_fp8.codes, ref.layers[1].w_gate_fp8.codes);
    EXPECT_TRUE(back->layers[1].wq_fp8.empty());
    EXPECT_EQ(back->layers[1].wq, ref.layers[1].wq);
  }
  // Quantize at load from an fp32 checkpoint.
  ModelConfig plain = *LoadModelConfig("tiny");
  const ModelWeights fw = *SyntheticWeights(plain, 1, 0, 1);
  ASSERT_TRUE(SaveHfCheckpoint(plain, fw, dir, false).ok());
  ModelConfig q = *LoadModelConfig(dir);
  q.fp8.modules = Fp8Modules::kAll;
  absl::StatusOr<ModelWeights> at_load = LoadWeights(q, dir, 1, 2);
  ASSERT_TRUE(at_load.ok()) << at_load.status();
  ModelConfig all = c;
  all.fp8.modules = Fp8Modules::kAll;
  const ModelWeights ref = *SyntheticWeights(all, 1, 1, 2);
  EXPECT_EQ(at_load->layers[0].wo_fp8.codes, ref.layers[0].wo_fp8.codes);
  EXPECT_EQ(at_load->layers[0].wo_fp8.row_scale, ref.layers[0].wo_fp8.row_scale);
  std::filesystem::remove_all(dir);
}

TEST(Fp8Memory, CountsFp8ProjectionsAtOneBytePlusRowScales) {
  ModelConfig c = *LoadModelConfig("tiny");
  const int64_t bf16 = WeightBytes(c, 2, 2);
  EXPECT_EQ(WeightBytes(c, 2, 4), HostWeightBytes(c, 2));
  c.fp8.modules = Fp8Modules::kFfn;
  const int64_t d = c.hidden_size, i = c.intermediate_size / 2, layers = c.num_layers;
  // gate/up: [I/2, D] with I/2 scales each; down: [D, I/2] with D scales (whole rows).
  const int64_t ffn_bf16 = 3 * i * d * 2, ffn_fp8 = 3 * i * d + 4 * (2 * i + d);
  EXPECT_EQ(WeightBytes(c, 2, 2), bf16 - layers * (ffn_bf16 - ffn_fp8));
}

TEST(Fp8Quantization, ParsesFlagsAndSkipsModules) {
  EXPECT_EQ(*ParseQuantizeFlag("fp8-rowwise"), Fp8Modules::kFfn);
  EXPECT_EQ(*ParseQuantizeFlag("fp8-rowwise:all"), Fp8Modules::kAll);
  EXPECT_FALSE(ParseQuantizeFlag("int8").ok());
  Fp8Quantization q;
  q.modules = Fp8Modules::kAll;
  q.modules_to_not_convert = {"model.layers.1.mlp.up_proj", "lm_head"};
  EXPECT_TRUE(q.Quantizes("model.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(q.Quantizes("model.layers.1.mlp.up_proj"));
  EXPECT_TRUE(q.Quantizes("model.layers.1.mlp.down_proj"));
}

}  // namespace
}  // namespace cpfill::runtime
