// The KV device storage against the host storage: the same copy runs, and the same KvCache
// operations, on random bf16 bit patterns; device outputs poisoned first. Skips (GTEST_SKIP,
// with a message) where no CUDA device is visible.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/kv/cuda/kv_storage_cuda.h"
#include "runtime/kv/kv_cache.h"

namespace cpfill::runtime::cuda {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

constexpr uint8_t kPoison = 0xA5;

// An owning device allocation of raw bytes.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t n) : n_(n) {
    if (cudaMalloc(&p_, std::max<size_t>(n_, 1)) != cudaSuccess) p_ = nullptr;
  }
  ~DeviceBytes() { cudaFree(p_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  char* get() const { return static_cast<char*>(p_); }
  void Upload(const void* h) { cudaMemcpy(p_, h, n_, cudaMemcpyHostToDevice); }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> h(n_);
    cudaMemcpy(h.data(), p_, n_, cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  size_t n_;
  void* p_ = nullptr;
};

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> x(n);
  for (uint8_t& b : x) b = static_cast<uint8_t>(rng());
  return x;
}

class KvStorageCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      cudaGetLastError();  // clear the "no driver" error
      GTEST_SKIP() << "no CUDA device visible: the KV device storage tests need a GPU host";
    }
    ASSERT_CUDA(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

// Runs with disjoint destinations (so their order does not matter) at every alignment: sizes from
// 0 to several chunks, offsets aligned, equally misaligned, and differently misaligned.
struct RunPlan {
  int64_t dst_offset, src_offset, bytes;
};
std::vector<RunPlan> PlanRuns(int count, int64_t dst_bytes, int64_t src_bytes,
                              std::mt19937_64& rng) {
  std::vector<RunPlan> plans;
  const int64_t span = dst_bytes / count;  // each run's own part of the destination
  for (int i = 0; i < count; ++i) {
    const int64_t shape = static_cast<int64_t>(rng() % 4);
    const int64_t max_bytes = span - 32;
    int64_t bytes = static_cast<int64_t>(rng() % (max_bytes + 1));
    if (shape == 0) bytes &= ~int64_t{15};  // whole vectors
    if (i % 17 == 0) bytes = 0;
    const int64_t dst_shift = shape <= 1 ? 0 : static_cast<int64_t>(rng() % 16);
    const int64_t src_shift = shape == 3 ? static_cast<int64_t>(rng() % 16) : dst_shift;
    const int64_t src_base = static_cast<int64_t>(rng() % (src_bytes - span)) & ~int64_t{15};
    plans.push_back({i * span + dst_shift, src_base + src_shift, bytes});
  }
  return plans;
}

TEST_F(KvStorageCudaTest, CopyRunsMatchesTheHostStorage) {
  std::mt19937_64 rng(17);
  constexpr int64_t kBytes = 8 << 20;
  const std::vector<uint8_t> src = RandomBytes(kBytes, rng);
  std::vector<uint8_t> host_dst(kBytes, kPoison);
  DeviceBytes d_src(kBytes), d_dst(kBytes);
  ASSERT_NE(d_src.get(), nullptr);
  ASSERT_NE(d_dst.get(), nullptr);
  d_src.Upload(src.data());
  d_dst.Upload(host_dst.data());

  auto host = MakeHostKvStorage();
  auto device = MakeDeviceKvStorage(stream_);
  ASSERT_TRUE(device->Allocate(1 << 20).ok());
  EXPECT_TRUE(device->on_device());
  // Batches of growing size, issued back to back: the run buffers grow while earlier batches may
  // still be queued; each batch writes its own part of the destination.
  const int counts[] = {1, 5, 64, 700, 3000};
  int64_t region = 0;
  const int64_t region_bytes = kBytes / 5;
  for (int count : counts) {
    std::vector<RunPlan> plans = PlanRuns(count, region_bytes, kBytes, rng);
    std::vector<CopyRun> h_runs, d_runs;
    for (const RunPlan& p : plans) {
      const int64_t dst = region * region_bytes + p.dst_offset;
      h_runs.push_back({host_dst.data() + dst, src.data() + p.src_offset, p.bytes});
      d_runs.push_back({d_dst.get() + dst, d_src.get() + p.src_offset, p.bytes});
    }
    ASSERT_TRUE(host->CopyRuns(h_runs).ok());
    ASSERT_TRUE(device->CopyRuns(d_runs).ok());
    ++region;
  }
  ASSERT_CUDA(cudaStreamSynchronize(stream_));
  const std::vector<uint8_t> got = d_dst.Download();
  ASSERT_EQ(got.size(), host_dst.size());
  for (int64_t i = 0; i < kBytes; ++i) {
    ASSERT_EQ(got[i], host_dst[i]) << "byte " << i;
  }
  // Nothing to copy, bad runs.
  EXPECT_TRUE(device->CopyRuns({}).ok());
  CopyRun negative[] = {{d_dst.get(), d_src.get(), -1}};
  EXPECT_EQ(device->CopyRuns(negative).code(), absl::StatusCode::kInvalidArgument);
  CopyRun null_src[] = {{d_dst.get(), nullptr, 4}};
  EXPECT_EQ(device->CopyRuns(null_src).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(device->Allocate(16).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(KvStorageCudaTest, AllocationFailureIsResourceExhausted) {
  auto device = MakeDeviceKvStorage(stream_);
  const absl::Status st = device->Allocate(int64_t{1} << 60);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(std::string(st.message()).find("1152921504606846976 bytes"), std::string::npos) << st;
  auto free_bytes = FreeDeviceBytes();
  ASSERT_TRUE(free_bytes.ok()) << free_bytes.status();
  EXPECT_GT(*free_bytes, 0);
}

// The same operations on a host KvCache and a device KvCache (bf16 both): every Read agrees.
void CheckCacheAgainstHost(cudaStream_t stream, int kv_heads, int head_dim, uint64_t seed) {
  const KvCacheSpec spec{.num_layers = 3,
                         .kv_heads = kv_heads,
                         .head_dim = head_dim,
                         .block_tokens = 16,
                         .capacity_tokens = 64 * 16,
                         .dtype = KvDtype::kBfloat16};
  auto host = KvCache::Create(spec, MakeHostKvStorage());
  auto device = KvCache::Create(spec, MakeDeviceKvStorage(stream));
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_TRUE(device.ok()) << device.status();
  ASSERT_TRUE((*device)->on_device());
  const int64_t row = spec.row_bytes();
  std::mt19937_64 rng(seed);

  // Reserve, Append and Write `tokens` random rows (bf16 bit patterns) in every layer of both.
  const auto extend = [&](KvCache::SeqId seq, int64_t tokens) {
    const int64_t begin = (*host)->length(seq);
    for (KvCache* kv : {host->get(), device->get()}) {
      ASSERT_TRUE(kv->Reserve(seq, begin + tokens).ok());
      ASSERT_TRUE(kv->Append(seq, tokens).ok());
    }
    for (int l = 0; l < spec.num_layers; ++l) {
      std::vector<uint8_t> k = RandomBytes(tokens * row, rng), v = RandomBytes(tokens * row, rng);
      DeviceBytes dk(k.size()), dv(v.size());
      dk.Upload(k.data());
      dv.Upload(v.data());
      KvCache::Rows h_rows[] = {{seq, begin, tokens, k.data(), v.data()}};
      KvCache::Rows d_rows[] = {{seq, begin, tokens, dk.get(), dv.get()}};
      ASSERT_TRUE((*host)->Write(l, h_rows).ok());
      ASSERT_TRUE((*device)->Write(l, d_rows).ok());
      ASSERT_CUDA(cudaStreamSynchronize(stream));  // before dk, dv go
    }
  };
  // Every layer of every sequence, read in one call per layer on each side.
  const auto verify = [&](std::vector<KvCache::SeqId> seqs) {
    int64_t total = 0;
    for (KvCache::SeqId s : seqs) total += (*host)->length(s);
    for (int l = 0; l < spec.num_layers; ++l) {
      std::vector<uint8_t> hk(total * row, kPoison), hv(total * row, kPoison);
      DeviceBytes dk(hk.size()), dv(hv.size());
      dk.Upload(hk.data());
      dv.Upload(hv.data());
      std::vector<KvCache::Rows> h_rows, d_rows;
      int64_t at = 0;
      for (KvCache::SeqId s : seqs) {
        const int64_t n = (*host)->length(s);
        h_rows.push_back({s, 0, n, hk.data() + at * row, hv.data() + at * row});
        d_rows.push_back({s, 0, n, dk.get() + at * row, dv.get() + at * row});
        at += n;
      }
      ASSERT_TRUE((*host)->Read(l, h_rows).ok());
      ASSERT_TRUE((*device)->Read(l, d_rows).ok());
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(dk.Download() == hk) << "K of layer " << l;
      EXPECT_TRUE(dv.Download() == hv) << "V of layer " << l;
    }
  };

  for (int step = 0; step < 30; ++step) {
    extend(step % 5, 1 + static_cast<int64_t>(rng() % 40));
  }
  extend(1, 40);  // long enough for the fork below
  verify({0, 1, 2, 3, 4});
  // Forks (a copy of a partial last block on the device), a truncation into a shared prefix and
  // the copy-on-write of the next Reserve.
  for (KvCache* kv : {host->get(), device->get()}) {
    ASSERT_TRUE(kv->Fork(0, 10, kv->length(0) - 3).ok());
    ASSERT_TRUE(kv->Fork(1, 11, 32).ok());
    ASSERT_TRUE(kv->Truncate(11, 21).ok());
  }
  extend(10, 7);
  extend(11, 30);
  extend(0, 5);
  verify({0, 1, 2, 3, 4, 10, 11});
  EXPECT_EQ((*device)->usage().blocks_shared, (*host)->usage().blocks_shared);
}

TEST_F(KvStorageCudaTest, KvCacheMatchesTheHostOnAlignedRows) {
  CheckCacheAgainstHost(stream_, 2, 64, 5);  // 256-byte rows: 16-byte vectors
}

TEST_F(KvStorageCudaTest, KvCacheMatchesTheHostOnUnalignedRows) {
  CheckCacheAgainstHost(stream_, 1, 3, 6);  // 6-byte rows: most runs move byte by byte
}

}  // namespace
}  // namespace cpfill::runtime::cuda
