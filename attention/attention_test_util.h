// cpfill/attention/attention_test_util.h — test-only helpers shared by the attention tests: an
// owning problem (tensors, positions, slices, outputs) with random fp32 inputs, NaN poisoning of
// the outputs, and the comparison against the fp64 reference.
//
//   Problem pb = MakeProblem(shape, /*q_tokens=*/100, /*kv_tokens=*/200, /*seed=*/7);
//   pb.q_pos = ...; pb.k_pos = ...; pb.slices = {{0, 100, 0, 200}};
//   ASSERT_TRUE(RunAndPoison(pb, &pool).ok());
//   ExpectMatchesReference(pb);
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "attention/attention.h"
#include "attention/reference.h"
#include "base/random.h"
#include "base/thread_pool.h"
#include "gtest/gtest.h"

namespace cpfill::attention::testing {

inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Problem {
  AttentionShape shape;
  int64_t q_tokens = 0;
  int64_t kv_tokens = 0;
  std::vector<float> q, k, v;
  std::vector<int32_t> q_pos, k_pos;
  std::vector<SequenceSlice> slices;
  std::vector<float> o, lse;

  AttentionParams Params() {
    return AttentionParams{.shape = shape,
                           .q = q.data(),
                           .q_pos = q_pos.data(),
                           .q_tokens = q_tokens,
                           .k = k.data(),
                           .v = v.data(),
                           .k_pos = k_pos.data(),
                           .kv_tokens = kv_tokens,
                           .slices = slices.data(),
                           .num_slices = static_cast<int64_t>(slices.size()),
                           .o = o.data(),
                           .lse = lse.data()};
  }
};

inline AttentionShape MakeShape(int num_heads, int num_kv_heads, int head_dim, bool causal) {
  return AttentionShape{.num_heads = num_heads,
                        .num_kv_heads = num_kv_heads,
                        .head_dim = head_dim,
                        .softmax_scale = 1.0f / std::sqrt(static_cast<float>(head_dim)),
                        .causal = causal};
}

// Uniform [-amplitude, amplitude) inputs from (seed, tensor) streams; positions default to
// 0..n-1 for both queries and keys, and no slices.
inline Problem MakeProblem(const AttentionShape& shape, int64_t q_tokens, int64_t kv_tokens,
                           uint64_t seed, float amplitude = 1.0f) {
  Problem pb;
  pb.shape = shape;
  pb.q_tokens = q_tokens;
  pb.kv_tokens = kv_tokens;
  pb.q.resize(q_tokens * shape.num_heads * shape.head_dim);
  pb.k.resize(kv_tokens * shape.num_kv_heads * shape.head_dim);
  pb.v.resize(pb.k.size());
  for (size_t i = 0; i < pb.q.size(); ++i) pb.q[i] = amplitude * UniformAt(seed, 1, i);
  for (size_t i = 0; i < pb.k.size(); ++i) pb.k[i] = amplitude * UniformAt(seed, 2, i);
  for (size_t i = 0; i < pb.v.size(); ++i) pb.v[i] = UniformAt(seed, 3, i);
  pb.q_pos.resize(q_tokens);
  pb.k_pos.resize(kv_tokens);
  for (int64_t i = 0; i < q_tokens; ++i) pb.q_pos[i] = static_cast<int32_t>(i);
  for (int64_t i = 0; i < kv_tokens; ++i) pb.k_pos[i] = static_cast<int32_t>(i);
  pb.o.resize(q_tokens * shape.num_heads * shape.head_dim);
  pb.lse.resize(q_tokens * shape.num_heads);
  return pb;
}

// Poisons the outputs with NaN, so a row the kernel forgets to write fails the comparison.
inline absl::Status RunAndPoison(Problem& pb, ThreadPool* pool) {
  std::fill(pb.o.begin(), pb.o.end(), kNaN);
  std::fill(pb.lse.begin(), pb.lse.end(), kNaN);
  return PartialAttentionCpu(pb.Params(), pool);
}

// fp32 tolerances: O errors relative to the largest |O| of the reference, LSE absolute.
inline void ExpectOutputsMatch(const AttentionShape& shape, int64_t rows, const float* o,
                               const float* lse, const std::vector<double>& ref_o,
                               const std::vector<double>& ref_lse, double o_rel_tol = 2e-5,
                               double lse_tol = 1e-4) {
  const int64_t heads = shape.num_heads;
  const int64_t dim = shape.head_dim;
  double max_ref = 0.0;
  for (double x : ref_o) max_ref = std::max(max_ref, std::abs(x));
  const double o_tol = o_rel_tol * std::max(max_ref, 1e-3);
  int failures = 0;
  for (int64_t rh = 0; rh < rows * heads && failures < 10; ++rh) {
    const int64_t row = rh / heads;
    const int64_t head = rh % heads;
    if (std::isinf(ref_lse[rh])) {
      if (!(std::isinf(lse[rh]) && lse[rh] < 0)) {
        ADD_FAILURE() << "row " << row << " head " << head << ": LSE " << lse[rh] << ", want -inf";
        ++failures;
      }
      for (int64_t d = 0; d < dim; ++d) {
        if (o[rh * dim + d] != 0.0f) {
          ADD_FAILURE() << "row " << row << " head " << head << " d " << d << ": O "
                        << o[rh * dim + d] << ", want exactly 0 on an empty row";
          ++failures;
          break;
        }
      }
      continue;
    }
    if (!(std::abs(lse[rh] - ref_lse[rh]) <= lse_tol)) {
      ADD_FAILURE() << "row " << row << " head " << head << ": LSE " << lse[rh] << ", want "
                    << ref_lse[rh];
      ++failures;
    }
    for (int64_t d = 0; d < dim; ++d) {
      const double err = std::abs(o[rh * dim + d] - ref_o[rh * dim + d]);
      if (!(err <= o_tol)) {  // also catches NaN
        ADD_FAILURE() << "row " << row << " head " << head << " d " << d << ": O "
                      << o[rh * dim + d] << ", want " << ref_o[rh * dim + d] << " (tol " << o_tol
                      << ")";
        ++failures;
        break;
      }
    }
  }
}

inline void ExpectMatchesReference(Problem& pb) {
  std::vector<double> ref_o, ref_lse;
  ReferenceAttention(pb.Params(), &ref_o, &ref_lse);
  ExpectOutputsMatch(pb.shape, pb.q_tokens, pb.o.data(), pb.lse.data(), ref_o, ref_lse);
}

}  // namespace cpfill::attention::testing
