// The SparQ kernels (sparq_cuda.h) against the fp64 reference of Alg. 1 on bf16-rounded random
// inputs, outputs poisoned first. Exits 77 (CTest: skipped) on a machine without a GPU.
#include "attention/sparq/cuda/sparq_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <limits>

#include "attention/sparq/reference.h"
#include "attention/sparq/sparq_test_util.h"
#include "gtest/gtest.h"

namespace cpfill::attention::sparq::cuda {
namespace {

using testing::ConfigName;
using testing::RandomSparqBatch;
using testing::WorstRatio;

template <typename T>
T* Upload(const std::vector<T>& h) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), sizeof(T) * std::max<size_t>(h.size(), 1)),
            cudaSuccess);
  cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice);
  return d;
}
std::vector<__nv_bfloat16> ToBf16(std::vector<float>& x) {  // rounds x in place too
  std::vector<__nv_bfloat16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = __float2bfloat16(x[i]);
    x[i] = __bfloat162float(out[i]);
  }
  return out;
}

struct Result {
  std::vector<float> o;
  std::vector<int32_t> selected;  // [seqs, kv_heads, k]
};

Result RunGpu(RandomSparqBatch& data, const SparqConfig& config) {
  const SparqShape& sh = data.shape;
  const int64_t seqs = data.len.size(), rows = data.k.size() / (sh.num_kv_heads * sh.head_dim);
  std::vector<float> v_sum(seqs * sh.num_kv_heads * sh.head_dim, 0.0f);
  auto q = ToBf16(data.q), k = ToBf16(data.k), v = ToBf16(data.v);
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t j = 0; j < data.len[s]; ++j) {
      for (int i = 0; i < sh.num_kv_heads * sh.head_dim; ++i) {
        v_sum[s * sh.num_kv_heads * sh.head_dim + i] +=
            data.v[(data.begin[s] + j) * sh.num_kv_heads * sh.head_dim + i];
      }
    }
  }
  Result r;
  r.o.assign(seqs * sh.num_heads * sh.head_dim, std::numeric_limits<float>::quiet_NaN());
  r.selected.assign(seqs * sh.num_kv_heads * config.k, -7);
  SparqCudaArgs a{.shape = sh,
                  .config = config,
                  .q = Upload(q),
                  .k = Upload(k),
                  .v = Upload(v),
                  .kv_begin = Upload(data.begin),
                  .kv_len = Upload(data.len),
                  .num_seqs = seqs,
                  .kv_rows = rows,
                  .max_kv_len = *std::max_element(data.len.begin(), data.len.end()),
                  .v_sum = Upload(v_sum),
                  .o = Upload(r.o),
                  .selected = Upload(r.selected)};
  const size_t ws_bytes = SparqWorkspaceBytes(a);
  void* ws = nullptr;
  EXPECT_EQ(cudaMalloc(&ws, ws_bytes), cudaSuccess);
  cudaMemset(ws, 0xff, ws_bytes);  // poisoned: NaN floats, -1 ints
  const absl::Status st = LaunchSparqAttention(a, ws, ws_bytes, nullptr);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaMemcpy(r.o.data(), a.o, sizeof(float) * r.o.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(r.selected.data(), a.selected, sizeof(int32_t) * r.selected.size(),
             cudaMemcpyDeviceToHost);
  for (const void* p : {(const void*)a.q, (const void*)a.k, (const void*)a.v,
                        (const void*)a.kv_begin, (const void*)a.kv_len, (const void*)a.v_sum,
                        (const void*)a.o, (const void*)a.selected, (const void*)ws}) {
    cudaFree(const_cast<void*>(p));
  }
  return r;
}

struct Case {
  SparqShape shape;
  std::vector<int64_t> lens;
  SparqConfig config;
};

TEST(SparqCuda, MatchesReference) {
  std::vector<Case> cases;
  for (int d : {64, 128}) {
    for (int group : {1, 4, 8, 16}) {
      const SparqShape sh{2 * group, 2, d};
      cases.push_back({sh, {37, 300, 0}, {.r = 8, .k = 16, .local_window = 0}});
      cases.push_back({sh, {5000, 1}, {.r = 16, .k = 64, .local_window = 8}});
      cases.push_back({sh, {100}, {.r = 32, .k = 128, .local_window = 4}});  // k >= S: dense
    }
  }
  cases.push_back({{32, 8, 128}, {20000, 3000}, {.r = 16, .k = 256, .local_window = 16}});
  cases.push_back({{8, 1, 64}, {2500}, {.r = 64, .k = 100, .local_window = 0}});   // r = d
  cases.push_back({{8, 1, 64}, {2500}, {.r = 3, .k = 100, .oracle = true}});       // oracle
  cases.push_back({{4, 1, 128}, {3000}, {.r = 16, .k = 32, .local_window = 50}});  // l > k
  cases.push_back({{16, 1, 128}, {70000}, {.r = 32, .k = 1024, .local_window = 64}});
  uint64_t seed = 300;
  int compared = 0, groups = 0;
  for (const Case& c : cases) {
    const std::string name = ConfigName(c.shape, c.config);
    RandomSparqBatch data(c.shape, c.lens, ++seed);
    const Result got = RunGpu(data, c.config);  // rounds data to bf16 first
    const SparqReferenceResult ref = SparqReference(data.Batch(c.config));
    EXPECT_LE(WorstRatio(got.o, ref.o, 3e-5, 3e-4), 1.0) << name;
    for (size_t i = 0; i < ref.selected.size(); ++i) {
      ++groups;
      if (ref.margin[i] < 1e-4) continue;
      ++compared;
      std::vector<int32_t> sel(got.selected.begin() + i * c.config.k,
                               got.selected.begin() + (i + 1) * c.config.k);
      std::vector<int32_t> want = ref.selected[i];
      want.resize(c.config.k, -1);
      EXPECT_EQ(sel, want) << name << " group " << i;
    }
  }
  EXPECT_GE(compared, groups * 9 / 10);
}

TEST(SparqCuda, RejectsUncompiledShapes) {
  SparqCudaArgs a{.shape = {12, 4, 128}, .config = {.r = 8, .k = 8}};
  EXPECT_EQ(ValidateSparqCudaArgs(a).code(), absl::StatusCode::kInvalidArgument);
  a.shape = {8, 8, 96};
  EXPECT_EQ(ValidateSparqCudaArgs(a).code(), absl::StatusCode::kInvalidArgument);
  a.shape = {8, 8, 128};
  a.config.k = kMaxK + 1;
  EXPECT_EQ(ValidateSparqCudaArgs(a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cpfill::attention::sparq::cuda

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device on this machine; the GPU tests run on a GPU host\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
