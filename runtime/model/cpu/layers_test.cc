// Tests of the CPU Llama layers against fp64 references written independently here: naive
// matmul, RMSNorm, SiLU, a complex-rotation RoPE, and Llama 3.1 inverse frequencies computed by
// hand. Outputs are poisoned with NaN before each run.

#include "runtime/model/cpu/layers.h"

#include <cmath>
#include <complex>
#include <cstdint>
#include <limits>
#include <numbers>
#include <vector>

#include "base/random.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"
#include "runtime/model/model_config.h"

namespace cpfill::runtime::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> Random(int64_t n, uint64_t stream, uint64_t seed = 1) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = UniformAt(seed, stream, i);
  return v;
}

ModelConfig RopeConfig(int head_dim, bool llama3_scaling) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = 500000.0;
  if (llama3_scaling) {
    c.rope_scaling = Llama3RopeScaling{.factor = 8.0,
                                       .low_freq_factor = 1.0,
                                       .high_freq_factor = 4.0,
                                       .original_max_position_embeddings = 8192};
  }
  return c;
}

// ---- Linear ---------------------------------------------------------------------------------

struct LinearShape {
  int64_t tokens, in, out;
};

void CheckLinear(const LinearShape& s, bool accumulate) {
  SCOPED_TRACE(::testing::Message() << "tokens " << s.tokens << " in " << s.in << " out " << s.out
                                    << " accumulate " << accumulate);
  const std::vector<float> x = Random(s.tokens * s.in, 1, s.tokens + s.in);
  const std::vector<float> w = Random(s.out * s.in, 2, s.out);
  const std::vector<float> y0 = Random(s.tokens * s.out, 3);
  std::vector<float> y = accumulate ? y0 : std::vector<float>(s.tokens * s.out, kNaN);
  Linear(x.data(), s.tokens, s.in, w.data(), s.out, y.data(), accumulate);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t o = 0; o < s.out; ++o) {
      double ref = accumulate ? y0[t * s.out + o] : 0.0;
      double magnitude = std::abs(ref);
      for (int64_t i = 0; i < s.in; ++i) {
        const double p = static_cast<double>(x[t * s.in + i]) * w[o * s.in + i];
        ref += p;
        magnitude += std::abs(p);
      }
      // fp32 accumulation: error grows like eps * sum |terms| (a loose bound).
      const double tol = 1e-6 + 4e-7 * magnitude * std::sqrt(static_cast<double>(s.in) + 1);
      ASSERT_NEAR(y[t * s.out + o], ref, tol) << "t " << t << " o " << o;
    }
  }
}

TEST(Linear, MatchesNaiveDoubleLoop) {
  const LinearShape shapes[] = {{1, 1, 1},     {1, 7, 5},   {3, 13, 9},    {17, 33, 21},
                                {64, 100, 70}, {5, 256, 3}, {1, 515, 130}, {130, 64, 257}};
  for (const LinearShape& s : shapes) CheckLinear(s, /*accumulate=*/false);
}

TEST(Linear, AccumulatesIntoY) {
  const LinearShape shapes[] = {{1, 1, 1}, {1, 9, 11}, {7, 33, 17}, {70, 129, 63}};
  for (const LinearShape& s : shapes) CheckLinear(s, /*accumulate=*/true);
}

TEST(Linear, EmptyInnerDimensionIsZeroOrUnchanged) {
  std::vector<float> y(6, kNaN);
  Linear(nullptr, 2, 0, nullptr, 3, y.data());
  for (float v : y) EXPECT_EQ(v, 0.0f);
  std::vector<float> acc = {1, 2, 3, 4, 5, 6};
  Linear(nullptr, 2, 0, nullptr, 3, acc.data(), /*accumulate=*/true);
  EXPECT_EQ(acc, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  Linear(nullptr, 0, 4, nullptr, 3, nullptr);  // no rows: nothing touched
}

// ---- RmsNorm --------------------------------------------------------------------------------

void CheckRmsNorm(int64_t tokens, int64_t hidden, ThreadPool* pool, bool in_place) {
  SCOPED_TRACE(::testing::Message() << "tokens " << tokens << " hidden " << hidden << " pool "
                                    << (pool != nullptr) << " in_place " << in_place);
  const double eps = 1e-5;
  std::vector<float> x = Random(tokens * hidden, 4, hidden);
  // Scale rows differently, one row tiny so that eps matters.
  for (int64_t t = 0; t < tokens; ++t) {
    const float scale = t == 0 ? 1e-3f : 0.5f + static_cast<float>(t % 7);
    for (int64_t i = 0; i < hidden; ++i) x[t * hidden + i] *= scale;
  }
  const std::vector<float> weight = Random(hidden, 5);
  const std::vector<float> x_copy = x;
  std::vector<float> y_buf(tokens * hidden, kNaN);
  float* y = in_place ? x.data() : y_buf.data();
  RmsNorm(x.data(), weight.data(), tokens, hidden, eps, y, pool);
  for (int64_t t = 0; t < tokens; ++t) {
    double sum_sq = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      sum_sq += static_cast<double>(x_copy[t * hidden + i]) * x_copy[t * hidden + i];
    }
    const double inv_rms = 1.0 / std::sqrt(sum_sq / hidden + eps);
    for (int64_t i = 0; i < hidden; ++i) {
      const double ref = x_copy[t * hidden + i] * inv_rms * weight[i];
      ASSERT_NEAR(y[t * hidden + i], ref, 1e-6 + 2e-6 * std::abs(ref)) << "t " << t << " i " << i;
    }
  }
}

TEST(RmsNorm, MatchesDoubleReference) {
  ThreadPool pool(2);
  for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
    CheckRmsNorm(1, 1, p, false);
    CheckRmsNorm(37, 129, p, false);
    CheckRmsNorm(45, 4096, p, false);  // several rows per pool item, uneven last item
    CheckRmsNorm(3, 70000, p, false);  // one row per item
  }
}

TEST(RmsNorm, WorksInPlace) {
  ThreadPool pool(2);
  CheckRmsNorm(37, 129, nullptr, true);
  CheckRmsNorm(45, 4096, &pool, true);
}

// ---- SwiGlu, Embed --------------------------------------------------------------------------

TEST(SwiGlu, MatchesDoubleReference) {
  std::vector<float> gate = Random(1000, 6);
  for (float& g : gate) g *= 12.0f;
  gate.insert(gate.end(), {0.0f, -100.0f, 100.0f, -1e4f, 1e4f, 1e-20f});
  const int64_t n = static_cast<int64_t>(gate.size());
  const std::vector<float> up = Random(n, 7);
  std::vector<float> out(n, kNaN);
  SwiGlu(gate.data(), up.data(), n, out.data());
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double ref = g / (1.0 + std::exp(-g)) * up[i];
    ASSERT_NEAR(out[i], ref, 1e-7 + 1e-6 * std::abs(ref)) << "gate " << g;
  }
  // Aliasing the output with either input gives the same values.
  std::vector<float> gate_alias = gate, up_alias = up;
  SwiGlu(gate_alias.data(), up.data(), n, gate_alias.data());
  SwiGlu(gate.data(), up_alias.data(), n, up_alias.data());
  EXPECT_EQ(gate_alias, out);
  EXPECT_EQ(up_alias, out);
}

TEST(Embed, CopiesTableRows) {
  const int64_t vocab = 11, hidden = 7;
  const std::vector<float> table = Random(vocab * hidden, 8);
  const std::vector<int32_t> ids = {3, 0, 10, 3, 5};
  std::vector<float> out(ids.size() * hidden, kNaN);
  Embed(ids.data(), static_cast<int64_t>(ids.size()), table.data(), hidden, out.data());
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t i = 0; i < hidden; ++i) {
      EXPECT_EQ(out[t * hidden + i], table[ids[t] * hidden + i]);
    }
  }
}

// ---- RoPE -----------------------------------------------------------------------------------

// Rotates each pair (x[i], x[i + d/2]) of every head as the complex number x[i] + j x[i + d/2]
// times exp(j pos inv_freq[i]), in double.
std::vector<double> RopeReference(const std::vector<float>& x, const std::vector<int32_t>& pos,
                                  int heads, int head_dim, const std::vector<double>& inv_freq) {
  const int half = head_dim / 2;
  std::vector<double> out(x.size());
  for (size_t t = 0; t < pos.size(); ++t) {
    for (int h = 0; h < heads; ++h) {
      const size_t base = (t * heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const std::complex<double> z(x[base + i], x[base + i + half]);
        const std::complex<double> r = z * std::polar(1.0, pos[t] * inv_freq[i]);
        out[base + i] = r.real();
        out[base + i + half] = r.imag();
      }
    }
  }
  return out;
}

TEST(Rope, PlainInverseFrequencies) {
  for (int head_dim : {2, 64, 128}) {
    const RopeTable rope = RopeTable::Make(RopeConfig(head_dim, false));
    ASSERT_EQ(rope.inv_freq().size(), static_cast<size_t>(head_dim / 2));
    for (int i = 0; i < head_dim / 2; ++i) {
      // theta^(-2i/d) written as exp(-(2i/d) ln theta).
      const double expected = std::exp(-(2.0 * i / head_dim) * std::log(500000.0));
      EXPECT_NEAR(rope.inv_freq()[i], expected, 1e-14 * expected) << "i " << i;
    }
  }
}

TEST(Rope, MatchesComplexRotation) {
  const std::vector<int32_t> positions = {0, 7, 3, 131071, 42, 1, 8191, 65536, 2};
  const int64_t tokens = static_cast<int64_t>(positions.size());
  for (bool scaling : {false, true}) {
    for (int head_dim : {2, 16, 128}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << " scaling " << scaling);
      const int heads = 3;
      const RopeTable rope = RopeTable::Make(RopeConfig(head_dim, scaling));
      std::vector<float> x = Random(tokens * heads * head_dim, 9, head_dim);
      const std::vector<double> ref = RopeReference(x, positions, heads, head_dim, rope.inv_freq());
      rope.Apply(x.data(), positions.data(), tokens, heads, head_dim);
      for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(x[i], ref[i], 2e-6) << "element " << i;
    }
  }
}

TEST(Rope, Llama3ScalingMatchesHandComputedFrequencies) {
  // theta 500000, d 128, factor 8, low_freq_factor 1, high_freq_factor 4, original 8192:
  // wavelengths below 8192 / 4 = 2048 keep their frequency, above 8192 / 1 are divided by 8,
  // between them smooth = (8192 / wavelen - 1) / (4 - 1) blends the two.
  const RopeTable rope = RopeTable::Make(RopeConfig(128, true));
  ASSERT_EQ(rope.inv_freq().size(), 64u);
  auto plain = [](int i) { return std::pow(500000.0, -i / 64.0); };
  auto wavelen = [&](int i) { return 2 * std::numbers::pi / plain(i); };

  // High frequency (i = 10): wavelength ~ 49 tokens, unchanged.
  ASSERT_LT(wavelen(10), 2048.0);
  EXPECT_NEAR(rope.inv_freq()[10], plain(10), 1e-15);
  EXPECT_NEAR(rope.inv_freq()[10], 0.12868737343265052, 1e-12);

  // Low frequency (i = 60): wavelength ~ 1.1e7 tokens, divided by 8.
  ASSERT_GT(wavelen(60), 8192.0);
  EXPECT_NEAR(rope.inv_freq()[60], plain(60) / 8, 1e-18);
  EXPECT_NEAR(rope.inv_freq()[60], 5.677088100759837e-07, 1e-18);

  // Band (i = 31): wavelength ~ 3800 tokens, smooth ~ 0.42.
  ASSERT_GT(wavelen(31), 2048.0);
  ASSERT_LT(wavelen(31), 8192.0);
  const double smooth = (8192.0 / wavelen(31) - 1.0) / 3.0;
  EXPECT_NEAR(smooth, 0.421151, 1e-6);
  EXPECT_NEAR(rope.inv_freq()[31], plain(31) * (smooth + (1 - smooth) / 8), 1e-16);
  EXPECT_NEAR(rope.inv_freq()[31], 0.0008567514129196321, 1e-15);

  // Band edges for this geometry: 0..28 unchanged, 29..34 blended, 35..63 divided.
  for (int i = 0; i < 64; ++i) {
    const double f = rope.inv_freq()[i];
    if (i <= 28) {
      EXPECT_DOUBLE_EQ(f, plain(i)) << "i " << i;
    } else if (i >= 35) {
      EXPECT_DOUBLE_EQ(f, plain(i) / 8) << "i " << i;
    } else {
      EXPECT_LT(f, plain(i)) << "i " << i;
      EXPECT_GT(f, plain(i) / 8) << "i " << i;
    }
  }
}

TEST(Rope, PreservesPairNorms) {
  const int heads = 2, head_dim = 128, half = head_dim / 2;
  const RopeTable rope = RopeTable::Make(RopeConfig(head_dim, true));
  std::vector<int32_t> positions;
  for (int i = 0; i < 16; ++i) positions.push_back(static_cast<int32_t>((i * 7919) % 131072));
  const int64_t tokens = static_cast<int64_t>(positions.size());
  const std::vector<float> x0 = Random(tokens * heads * head_dim, 10);
  std::vector<float> x = x0;
  rope.Apply(x.data(), positions.data(), tokens, heads, head_dim);
  for (int64_t row = 0; row < tokens * heads; ++row) {
    for (int i = 0; i < half; ++i) {
      const size_t a = row * head_dim + i, b = a + half;
      const double before = std::hypot<double>(x0[a], x0[b]);
      const double after = std::hypot<double>(x[a], x[b]);
      ASSERT_NEAR(after, before, 1e-6) << "row " << row << " pair " << i;
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnPositionDifference) {
  const int heads = 4, head_dim = 128;
  const RopeTable rope = RopeTable::Make(RopeConfig(head_dim, true));
  const std::vector<float> q0 = Random(heads * head_dim, 11);
  const std::vector<float> k0 = Random(heads * head_dim, 12);
  auto rotated_dots = [&](int32_t q_pos, int32_t k_pos) {
    std::vector<float> q = q0, k = k0;
    rope.Apply(q.data(), &q_pos, 1, heads, head_dim);
    rope.Apply(k.data(), &k_pos, 1, heads, head_dim);
    std::vector<double> dots(heads, 0.0);
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < head_dim; ++i) {
        dots[h] += static_cast<double>(q[h * head_dim + i]) * k[h * head_dim + i];
      }
    }
    return dots;
  };
  const std::pair<int32_t, int32_t> pairs[] = {{0, 0},     {10, 3},         {3, 10},
                                               {1000, 17}, {100000, 99000}, {131000, 5}};
  for (const auto& [p, p_prime] : pairs) {
    const std::vector<double> a = rotated_dots(p, p_prime);
    const std::vector<double> b = rotated_dots(p + 5, p_prime + 5);
    for (int h = 0; h < heads; ++h) {
      EXPECT_NEAR(a[h], b[h], 1e-4) << "positions " << p << ", " << p_prime << " head " << h;
    }
  }
  // And it does depend on the difference: a shift of one side changes the dot products.
  const std::vector<double> a = rotated_dots(10, 3);
  const std::vector<double> c = rotated_dots(11, 3);
  double change = 0;
  for (int h = 0; h < heads; ++h) change += std::abs(a[h] - c[h]);
  EXPECT_GT(change, 1e-2);
}

}  // namespace
}  // namespace cpfill::runtime::cpu
