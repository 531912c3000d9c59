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
#include <limits>
#include <string>
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
  // The root under 24 decode rows: at 8:1 (192 packed rows) split along its keys (4 ways at 4K,
  // 8 at 8K; forced, CPFILL_PREFIX_ROOT=split: 16 and 32, two merge rounds), at 32:8 (96 packed
  // rows) on the decode kernel; and not split (1000 keys under 335 rows).
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

// One paged step whose first `spec.sharing` sequences share leading blocks, as the ring runs it:
// a decode step (one query row per sequence) on the decode kernel reading the blocks in place,
// or a prefill step (more rows) gathered, the shared blocks once, on the prefill kernels; fresh
// and folded into a running result, against each sequence's fp64 attention over its own keys.
void CheckPagedStep(const AttentionShape& shape, const testing::SharedBlocksSpec& spec,
                    uint64_t seed, int64_t expect_batched) {
  testing::SharedBlocksProblem t = testing::MakeSharedBlocksProblem(shape, spec, seed, RoundBf16);
  __nv_bfloat16* q = Upload(ToBf16(t.pb.q));
  __nv_bfloat16* k = Upload(ToBf16(t.pool_k));
  __nv_bfloat16* v = Upload(ToBf16(t.pool_v));
  int32_t* q_pos = Upload(t.pb.q_pos);
  int32_t* k_pos = Upload(t.pb.k_pos);
  int32_t* table = Upload(t.table);
  const PagedKv paged = t.Paged(table, 2, /*batch=*/true);
  const bool gathered = GathersPagedKv(t.pb.slices);
  const SharedBlockTree tree =
      FindSharedBlocks(shape, t.pb.slices, paged, RuleForStep(t.pb.slices));
  EXPECT_EQ(tree.counts.sequences, expect_batched);
  const PagedGather plan = PlanPagedGather(tree, paged, t.table);
  // No roots: no sharing spares enough (the GPU's costs, raised past any step).
  const SharedBlockTree flat = FindSharedBlocks(
      shape, t.pb.slices, paged, RuleForStep(t.pb.slices, {.min_saved_values = int64_t{1} << 62}));
  EXPECT_EQ(flat.counts.roots, 0);
  // A decode step as the GPU ring plans it (roots not cut), every outer root gathered.
  const SharedBlockTree gpu_tree = FindSharedBlocks(
      shape, t.pb.slices, paged, StepRuleOnGpu(t.pb.slices, {}, /*flat_in_place=*/false));
  const WideRootsPlan wide =
      PlanWideRoots(shape, gpu_tree, paged, t.table,
                    {.min_packed_rows = 0,
                     .max_rows = 1 << 30,
                     .min_reread_values = std::numeric_limits<int64_t>::min()});
  // One run in `mode` (folded into a running result that has seen no key: the same reference).
  const auto check = [&](const std::string& what, OutputMode mode, const auto& bytes_of,
                         const auto& launch) {
    SCOPED_TRACE(what + (mode == OutputMode::kFloat32 ? "" : ", folded"));
    const bool fold = mode == OutputMode::kMergeIntoFloat32;
    float* o = Upload(std::vector<float>(t.pb.o.size(), fold ? 0.0f : testing::kNaN));
    float* lse = Upload(std::vector<float>(t.pb.lse.size(), fold ? -INFINITY : testing::kNaN));
    const CudaAttentionArgs args{.shape = shape,
                                 .q = q,
                                 .q_pos = q_pos,
                                 .q_tokens = t.pb.q_tokens,
                                 .k = k,
                                 .v = v,
                                 .k_pos = k_pos,
                                 .kv_tokens = t.pb.kv_tokens,
                                 .output = mode,
                                 .o = o,
                                 .lse = lse,
                                 .paged = &paged};
    const size_t bytes = bytes_of(args);
    void* ws = nullptr;
    ASSERT_EQ(cudaMalloc(&ws, std::max<size_t>(bytes, 1)), cudaSuccess);
    cudaMemset(ws, 0x7f, std::max<size_t>(bytes, 1));
    const absl::Status s = launch(args, ws, bytes);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaMemcpy(t.pb.o.data(), o, t.pb.o.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(t.pb.lse.data(), lse, t.pb.lse.size() * 4, cudaMemcpyDeviceToHost);
    testing::ExpectOutputsMatch(shape, t.pb.q_tokens, t.pb.o.data(), t.pb.lse.data(), t.ref_o,
                                t.ref_lse, 1e-2, 2e-2);
    for (void* p : {static_cast<void*>(o), static_cast<void*>(lse), ws}) cudaFree(p);
  };
  for (OutputMode mode : {OutputMode::kFloat32, OutputMode::kMergeIntoFloat32}) {
    if (gathered) {
      check(
          "gathered prefill", mode,
          [&](const CudaAttentionArgs& a) { return GatheredPagedWorkspaceBytes(a, plan); },
          [&](const CudaAttentionArgs& a, void* ws, size_t bytes) {
            return GatheredPagedAttentionCuda(a, plan, ws, bytes, nullptr);
          });
      // Where the Hopper kernel reads the blocks (H100, H200): the same tree in place, and the
      // flat step (every sequence over its own blocks, the root split along whole blocks).
      if (ReadsPagedPrefillInPlace(shape, paged) && !::testing::Test::HasFatalFailure()) {
        for (const SharedBlockTree* in_place : {&tree, &flat}) {
          check(
              in_place == &tree ? "prefill in place" : "flat prefill in place", mode,
              [&](const CudaAttentionArgs& a) { return InPlacePagedWorkspaceBytes(a, *in_place); },
              [&](const CudaAttentionArgs& a, void* ws, size_t bytes) {
                return InPlacePagedAttentionCuda(a, *in_place, ws, bytes, nullptr);
              });
          if (::testing::Test::HasFatalFailure()) break;
        }
      }
    } else {
      check(
          "decode in place", mode,
          [&](const CudaAttentionArgs& a) { return SharedBlocksWorkspaceBytes(a, tree); },
          [&](const CudaAttentionArgs& a, void* ws, size_t bytes) {
            return SharedBlocksAttentionCuda(a, tree, ws, bytes, nullptr);
          });
    }
    if (::testing::Test::HasFatalFailure()) break;
  }
  if (!gathered && !wide.gathered.copies.empty() && !::testing::Test::HasFatalFailure()) {
    check(
        "decode, wide roots gathered", OutputMode::kFloat32,
        [&](const CudaAttentionArgs& a) { return WideRootsWorkspaceBytes(a, wide); },
        [&](const CudaAttentionArgs& a, void* ws, size_t bytes) {
          return WideRootsAttentionCuda(a, wide, ws, bytes, nullptr);
        });
    // CPFILL_DECODE_WIDE_ROOTS=in-place where the Hopper kernel reads the blocks: the levels
    // with a slice of more than 4 rows (the roots) on the prefill kernel in place, the others
    // on the decode kernel.
    if (ReadsPagedPrefillInPlace(shape, paged) && !::testing::Test::HasFatalFailure()) {
      check(
          "decode, wide roots in place", OutputMode::kFloat32,
          [&](const CudaAttentionArgs& a) { return InPlacePagedWorkspaceBytes(a, gpu_tree); },
          [&](const CudaAttentionArgs& a, void* ws, size_t bytes) {
            return InPlacePagedAttentionCuda(a, gpu_tree, ws, bytes, nullptr);
          });
    }
  }
  for (void* p :
       {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
        static_cast<void*>(q_pos), static_cast<void*>(k_pos), static_cast<void*>(table)}) {
    cudaFree(p);
  }
}

// A paged decode step whose forks share leading blocks (the model's prefix-batched decode,
// runtime/serving/prefix_cache.md): the roots FindSharedBlocks makes (many query rows per paged
// slice, padding rows between them, members' keys starting inside their tables) run on the decode
// kernel.
TEST(PrefixBatchedCuda, PagedStepOverSharedBlocks) {
  for (const auto& [heads, kv_heads] : {std::pair{32, 8}, std::pair{8, 1}}) {
    for (int block_tokens : {16, 64}) {
      for (int64_t stride : {1, 2}) {
        SCOPED_TRACE("heads " + std::to_string(heads) + ":" + std::to_string(kv_heads) +
                     ", blocks of " + std::to_string(block_tokens) + ", stride " +
                     std::to_string(stride));
        std::vector<int64_t> own(20);
        for (size_t i = 0; i < own.size(); ++i) own[i] = 37 * int64_t(i) % 150;
        // At 8:1 a root over padding rows (stride 2) would take as many m16 tiles as its
        // members: FindSharedBlocks leaves them apart, the plain paged path.
        const bool batched = kv_heads == 8 || stride == 1;
        CheckPagedStep(testing::MakeShape(heads, kv_heads, 128, /*causal=*/true),
                       {.block_tokens = block_tokens,
                        .shared_blocks = 4096 / block_tokens,
                        .own_rows = own,
                        .sharing = 16,
                        .q_stride = stride},
                       heads + block_tokens + stride, batched ? 16 : 0);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A prefill step over paged K/V (questions after a cached document: many query rows per
// sequence, some inside the shared rows' positions): gathered, the shared blocks once, one root
// over every fork's rows on the prefill kernels, padding rows between them or not.
TEST(PrefixBatchedCuda, GatheredPrefillStepOverSharedBlocks) {
  for (const auto& [heads, kv_heads] : {std::pair{32, 8}, std::pair{8, 1}}) {
    for (int block_tokens : {16, 64}) {
      for (int64_t stride : {1, 2}) {
        SCOPED_TRACE("heads " + std::to_string(heads) + ":" + std::to_string(kv_heads) +
                     ", blocks of " + std::to_string(block_tokens) + ", stride " +
                     std::to_string(stride));
        std::vector<int64_t> own(8);
        for (size_t i = 0; i < own.size(); ++i) own[i] = 20 + 53 * int64_t(i) % 170;
        CheckPagedStep(testing::MakeShape(heads, kv_heads, 128, /*causal=*/true),
                       {.block_tokens = block_tokens,
                        .shared_blocks = 2048 / block_tokens,
                        .own_rows = own,
                        .sharing = 6,
                        .q_stride = stride,
                        .queries = 24},
                       7 * heads + block_tokens + stride, 6);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A document under a system prompt: 6 forks share 1K rows, the last 4 of them 512 more (a tree
// of three levels), in a decode step on the decode kernel and a prefill step gathered.
TEST(PrefixBatchedCuda, NestedSharingIsATreeOfThreeLevels) {
  for (const auto& [heads, kv_heads] : {std::pair{32, 8}, std::pair{8, 1}}) {
    for (int64_t queries : {1, 24}) {
      SCOPED_TRACE("heads " + std::to_string(heads) + ":" + std::to_string(kv_heads) + ", " +
                   std::to_string(queries) + " queries");
      CheckPagedStep(testing::MakeShape(heads, kv_heads, 128, /*causal=*/true),
                     {.block_tokens = 64,
                      .shared_blocks = 16,
                      .own_rows = {30, 700, 600, 530, 900, 512, 77},
                      .sharing = 6,
                      .nested_blocks = 8,
                      .nested_sharing = 4,
                      .queries = queries},
                     3 * heads + queries, 6 + 4);
      if (HasFatalFailure()) return;
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
