// GPU test of attention over a tree of shared KV (prefix_batched_cuda.h): decode rows and
// prefill-of-suffix rows under a root prefix and group prefixes, against each sequence's fp64
// attention over its concatenated keys (inputs rounded to bf16 first), outputs poisoned with NaN.
// Exits 77 (CTest: skipped) on a machine without a GPU.
#include "attention/cuda/prefix_batched_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "attention/prefix_batched_test_util.h"
#include "gtest/gtest.h"

namespace cpfill::attention::cuda {
namespace {

float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

template <typename T>
T* Upload(const std::vector<T>& h) {
  void* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(d);
}

std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& f) {
  std::vector<__nv_bfloat16> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
  return b;
}

// Decode rows (one query per sequence) under a 4K and an 8K root: the root level takes the
// prefill kernels (one slice of many rows) split along its keys, the suffixes the decode kernel;
// and prefill-of-suffix rows under group prefixes.
TEST(PrefixBatchedCuda, TreeEqualsEachSequenceOverItsConcatenatedKeys) {
  using testing::TreeSpec;
  std::vector<TreeSpec::Sequence> decode(24, {.suffix = 33, .queries = 1});
  for (size_t i = 0; i < decode.size(); ++i) decode[i].suffix = 1 + 37 * int64_t(i) % 300;
  // The root under 24 decode rows: at 8:1 (192 packed rows) split along its keys (16 ways at 4K;
  // 32 at 8K: two merge rounds), at 32:8 (96 packed rows) on the decode kernel; and not split
  // (1000 keys under 335 rows).
  const TreeSpec specs[] = {{.root = 4096, .groups = {{.prefix = 0, .sequences = decode}}},
                            {.root = 8197, .groups = {{.prefix = 0, .sequences = decode}}},
                            {.root = 1000,
                             .groups = {{.prefix = 300, .sequences = {{1, 1}, {200, 200}, {64, 3}}},
                                        {.prefix = 0, .sequences = {{700, 129}, {1, 1}}}}}};
  for (const auto& [heads, kv_heads] : {std::pair{8, 1}, std::pair{32, 8}}) {
    for (size_t si = 0; si < std::size(specs); ++si) {
      SCOPED_TRACE("heads " + std::to_string(heads) + ":" + std::to_string(kv_heads) + " tree " +
                   std::to_string(si));
      const AttentionShape shape = testing::MakeShape(heads, kv_heads, 128, /*causal=*/true);
      testing::TreeProblem t = testing::MakeTreeProblem(shape, specs[si], 17 + si, RoundBf16);
      __nv_bfloat16* q = Upload(ToBf16(t.pb.q));
      __nv_bfloat16* k = Upload(ToBf16(t.pb.k));
      __nv_bfloat16* v = Upload(ToBf16(t.pb.v));
      int32_t* q_pos = Upload(t.pb.q_pos);
      int32_t* k_pos = Upload(t.pb.k_pos);
      float* o = Upload(std::vector<float>(t.pb.o.size(), testing::kNaN));
      float* lse = Upload(std::vector<float>(t.pb.lse.size(), testing::kNaN));
      const CudaAttentionArgs args{.shape = shape,
                                   .q = q,
                                   .q_pos = q_pos,
                                   .q_tokens = t.pb.q_tokens,
                                   .k = k,
                                   .v = v,
                                   .k_pos = k_pos,
                                   .kv_tokens = t.pb.kv_tokens,
                                   .o = o,
                                   .lse = lse};
      const auto levels = t.Levels();
      const size_t bytes = PrefixBatchedWorkspaceBytes(args, levels);
      void* ws = nullptr;
      ASSERT_EQ(cudaMalloc(&ws, std::max<size_t>(bytes, 1)), cudaSuccess);
      ASSERT_TRUE(PrefixBatchedAttentionCuda(args, levels, ws, bytes, nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      cudaMemcpy(t.pb.o.data(), o, t.pb.o.size() * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(t.pb.lse.data(), lse, t.pb.lse.size() * 4, cudaMemcpyDeviceToHost);
      // bf16 inputs, fp32 accumulation: O within 1% (relative to the largest |O|), LSE 0.02.
      testing::ExpectOutputsMatch(shape, t.pb.q_tokens, t.pb.o.data(), t.pb.lse.data(), t.ref_o,
                                  t.ref_lse, 1e-2, 2e-2);
      for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                      static_cast<void*>(q_pos), static_cast<void*>(k_pos), static_cast<void*>(o),
                      static_cast<void*>(lse), ws}) {
        cudaFree(p);
      }
    }
  }
}

}  // namespace
}  // namespace cpfill::attention::cuda

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("prefix_batched_cuda_test: no CUDA device visible; skipped\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
