// SparqAttentionCpu against the fp64 reference of Alg. 1 (reference.h), and the reference
// against properties of the algorithm itself (dense at k >= S, exact scores at r = d, window).
#include <cmath>
#include <limits>
#include <numeric>
#include <set>

#include "attention/sparq/reference.h"
#include "attention/sparq/sparq_cpu.h"
#include "attention/sparq/sparq_test_util.h"
#include "gtest/gtest.h"

namespace cpfill::attention::sparq {
namespace {

using testing::ConfigName;
using testing::RandomSparqBatch;
using testing::WorstRatio;

constexpr double kAtol = 2e-5, kRtol = 2e-4;  // fp32 against fp64 on values of order 1
// Selections are compared where the reference's boundary gap exceeds this (no near-tie).
constexpr double kMinMargin = 1e-4;

std::vector<float> RunCpu(const SparqBatch& b, SparqSelection* sel, int threads = 2) {
  ThreadPool pool(threads);
  std::vector<float> o(b.num_seqs() * b.shape.num_heads * b.shape.head_dim,
                       std::numeric_limits<float>::quiet_NaN());  // poisoned
  EXPECT_TRUE(SparqAttentionCpu(b, o.data(), sel, &pool).ok());
  return o;
}

// Same selected positions wherever the reference has no near-tie; returns groups compared.
int ExpectSameSelection(const SparqSelection& got, const SparqReferenceResult& want,
                        const std::string& name) {
  int compared = 0;
  for (size_t i = 0; i < want.selected.size(); ++i) {
    if (want.margin[i] < kMinMargin) continue;
    ++compared;
    EXPECT_EQ(got.positions[i], want.selected[i]) << name << " group " << i;
  }
  return compared;
}

struct Case {
  SparqShape shape;
  std::vector<int64_t> lens;
  SparqConfig config;
};

TEST(SparqCpu, MatchesReferenceAcrossShapes) {
  std::vector<Case> cases;
  for (int d : {64, 128}) {
    for (int group : {1, 4, 8}) {
      const SparqShape sh{2 * group, 2, d};
      cases.push_back({sh, {37, 300}, {.r = 8, .k = 16, .local_window = 0}});
      cases.push_back({sh, {2000, 1}, {.r = 16, .k = 64, .local_window = 8}});
      cases.push_back({sh, {513}, {.r = 32, .k = 128, .local_window = 4}});
    }
  }
  cases.push_back({{32, 8, 128}, {4096}, {.r = 16, .k = 128, .local_window = 16}});
  cases.push_back({{4, 4, 64}, {100, 0, 50}, {.r = 1, .k = 7, .local_window = 3}});
  uint64_t seed = 11;
  int compared = 0, groups = 0;
  for (const Case& c : cases) {
    RandomSparqBatch data(c.shape, c.lens, ++seed);
    const SparqBatch b = data.Batch(c.config);
    const std::string name = ConfigName(c.shape, c.config);
    const SparqReferenceResult ref = SparqReference(b);
    SparqSelection sel;
    const auto o = RunCpu(b, &sel);
    compared += ExpectSameSelection(sel, ref, name);
    groups += static_cast<int>(ref.selected.size());
    EXPECT_LE(WorstRatio(o, ref.o, kAtol, kRtol), 1.0) << name;
  }
  // Near-ties are rare: nearly every group's selection was actually checked.
  EXPECT_GE(compared, groups * 9 / 10);
}

// Dense attention in fp64, for the k >= S case.
std::vector<double> DenseReference(const RandomSparqBatch& data) {
  const SparqShape& sh = data.shape;
  const int d = sh.head_dim;
  std::vector<double> o(data.len.size() * sh.num_heads * d, 0.0);
  for (size_t s = 0; s < data.len.size(); ++s) {
    for (int h = 0; h < sh.num_heads; ++h) {
      const int kvh = h / sh.group_size();
      const float* q = &data.q[(s * sh.num_heads + h) * d];
      std::vector<double> w(data.len[s]);
      double mx = -INFINITY, sum = 0;
      for (int64_t j = 0; j < data.len[s]; ++j) {
        const float* k = &data.k[((data.begin[s] + j) * sh.num_kv_heads + kvh) * d];
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(q[c]) * k[c];
        mx = std::max(mx, w[j] = dot / std::sqrt(double(d)));
      }
      for (double& x : w) sum += (x = std::exp(x - mx));
      for (int64_t j = 0; j < data.len[s]; ++j) {
        const float* v = &data.v[((data.begin[s] + j) * sh.num_kv_heads + kvh) * d];
        for (int c = 0; c < d; ++c) o[(s * sh.num_heads + h) * d + c] += w[j] / sum * v[c];
      }
    }
  }
  return o;
}

TEST(SparqCpu, KAtLeastSIsDenseAttention) {
  RandomSparqBatch data({8, 2, 64}, {50, 128, 1}, 5);
  for (int k : {128, 1000}) {
    const SparqBatch b = data.Batch({.r = 4, .k = k, .local_window = 2});
    const auto dense = DenseReference(data);
    const auto ref = SparqReference(b);
    EXPECT_LE(WorstRatio(ref.o, dense, 1e-12, 1e-10), 1.0) << "reference, k " << k;
    EXPECT_LE(WorstRatio(RunCpu(b, nullptr), dense, kAtol, kRtol), 1.0) << "cpu, k " << k;
  }
}

TEST(SparqCpu, RIsHeadDimRanksByExactScores) {
  RandomSparqBatch data({8, 2, 64}, {700}, 9);
  const SparqBatch full = data.Batch({.r = 64, .k = 40, .local_window = 0});
  const SparqBatch oracle = data.Batch({.r = 3, .k = 40, .local_window = 0, .oracle = true});
  const auto ref = SparqReference(full);
  // With G = 1 per KV head the exact-score top-k is the top-k of q.k: checked independently.
  RandomSparqBatch single({2, 2, 64}, {700}, 9);
  const SparqBatch one = single.Batch({.r = 64, .k = 40, .local_window = 0});
  const auto ref_one = SparqReference(one);
  for (int kvh = 0; kvh < 2; ++kvh) {
    std::vector<std::pair<double, int32_t>> dots;
    for (int32_t j = 0; j < 700; ++j) {
      double dot = 0;
      for (int c = 0; c < 64; ++c)
        dot += double(single.q[kvh * 64 + c]) * single.k[(j * 2 + kvh) * 64 + c];
      dots.push_back({-dot, j});
    }
    std::sort(dots.begin(), dots.end());
    std::vector<int32_t> top;
    for (int t = 0; t < 40; ++t) top.push_back(dots[t].second);
    std::sort(top.begin(), top.end());
    EXPECT_EQ(ref_one.selected[kvh], top) << "kv head " << kvh;
  }
  SparqSelection sel_full, sel_oracle;
  const auto o_full = RunCpu(full, &sel_full);
  const auto o_oracle = RunCpu(oracle, &sel_oracle);
  EXPECT_EQ(sel_full.positions, sel_oracle.positions);
  EXPECT_EQ(o_full, o_oracle);
  EXPECT_GT(ExpectSameSelection(sel_full, ref, "r = d"), 0);
  EXPECT_LE(WorstRatio(o_full, ref.o, kAtol, kRtol), 1.0);
}

TEST(SparqCpu, LocalWindowIsChosenFirstWithinK) {
  RandomSparqBatch data({4, 1, 64}, {400}, 21);
  for (auto [k, l] : {std::pair{32, 10}, std::pair{8, 20}, std::pair{32, 0}}) {
    const SparqBatch b = data.Batch({.r = 8, .k = k, .local_window = l});
    const auto ref = SparqReference(b);
    SparqSelection sel;
    const auto o = RunCpu(b, &sel);
    const std::set<int32_t> chosen(sel.positions[0].begin(), sel.positions[0].end());
    EXPECT_EQ(chosen.size(), static_cast<size_t>(k));
    int in_window = 0;
    for (int32_t p : chosen) in_window += p >= 400 - l;
    EXPECT_EQ(in_window, std::min(k, l)) << "k " << k << " l " << l;
    ExpectSameSelection(sel, ref, "window");
    EXPECT_LE(WorstRatio(o, ref.o, kAtol, kRtol), 1.0) << "k " << k << " l " << l;
  }
}

TEST(SparqCpu, KeptVSumEqualsSummedV) {
  RandomSparqBatch data({8, 2, 128}, {333, 90}, 4);
  SparqBatch b = data.Batch({.r = 16, .k = 32, .local_window = 4});
  std::vector<float> v_sum(2 * 2 * 128, 0.0f);
  for (int s = 0; s < 2; ++s) {
    for (int64_t j = 0; j < data.len[s]; ++j) {
      for (int i = 0; i < 2 * 128; ++i) {
        v_sum[s * 256 + i] += data.v[(data.begin[s] + j) * 256 + i];
      }
    }
  }
  const auto computed = RunCpu(b, nullptr);
  b.v_sum = v_sum.data();
  EXPECT_LE(WorstRatio(RunCpu(b, nullptr), computed, 1e-6, 1e-5), 1.0);
}

// The checks above can fail: SparQ at k < S is measurably not dense attention, and a wrong
// v_bar moves the output past the tolerance.
TEST(SparqCpu, ChecksDiscriminate) {
  RandomSparqBatch data({8, 2, 64}, {1000}, 8);
  const SparqBatch b = data.Batch({.r = 8, .k = 32, .local_window = 0});
  const auto o = RunCpu(b, nullptr);
  EXPECT_GT(WorstRatio(o, DenseReference(data), kAtol, kRtol), 10.0);
  std::vector<float> bad_sum(2 * 64, 1000.0f);
  SparqBatch wrong = b;
  wrong.v_sum = bad_sum.data();
  EXPECT_GT(WorstRatio(RunCpu(wrong, nullptr), SparqReference(b).o, kAtol, kRtol), 10.0);
}

TEST(SparqCpu, SameResultOnAnyThreadCount) {
  RandomSparqBatch data({16, 4, 64}, {500, 200, 31}, 3);
  const SparqBatch b = data.Batch({.r = 8, .k = 24, .local_window = 5});
  SparqSelection one, four;
  EXPECT_EQ(RunCpu(b, &one, 1), RunCpu(b, &four, 4));
  EXPECT_EQ(one.positions, four.positions);
}

TEST(SparqCpu, RejectsBadParameters) {
  RandomSparqBatch data({8, 2, 64}, {10}, 1);
  ThreadPool pool(1);
  std::vector<float> o(8 * 64);
  for (SparqConfig c : {SparqConfig{.r = 0}, SparqConfig{.r = 65}, SparqConfig{.r = 8, .k = 0},
                        SparqConfig{.r = 8, .k = 4, .local_window = -1}}) {
    const absl::Status st = SparqAttentionCpu(data.Batch(c), o.data(), nullptr, &pool);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  }
  SparqBatch bad = data.Batch({.r = 8, .k = 4});
  bad.shape.num_kv_heads = 3;
  EXPECT_EQ(SparqAttentionCpu(bad, o.data(), nullptr, &pool).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cpfill::attention::sparq
