#include <cstdint>

#include "attention/cuda/paged_gather.h"
#include "attention/cuda/pdl.cuh"
#include "base/status.h"

namespace cpfill::attention::cuda {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

constexpr int kGatherThreads = 256;
constexpr int kVectorsPerThread = 2;  // each thread's loads all issued before its stores
constexpr int64_t kVectorsPerCta = kGatherThreads * kVectorsPerThread;

// CTA (c, y) copies part y of copies[c] (kVectorsPerCta 16-byte vectors of K and of V): its rows
// are contiguous in the block and in the output alike. Part 0 also copies the positions. One CTA
// a copy left a short step's gather to a few dozen CTAs: 30 µs for 5 MiB on an H100.
__global__ void __launch_bounds__(kGatherThreads) GatherPagedRowsKernel(PagedGatherLaunch g) {
  // The attention's pre-pass after it may be placed now: it waits for this grid's rows.
  internal::LetDependentsLaunch();
  const PagedGather::Copy c = g.copies[blockIdx.x];
  const int64_t vectors = c.rows * g.row_bytes / 16;
  const int64_t first = blockIdx.y * kVectorsPerCta;
  if (first >= vectors && blockIdx.y > 0) return;
  const int64_t src = c.block * g.block_stride_bytes;
  const int64_t dst = c.to_row * g.row_bytes;
  const auto* ks = reinterpret_cast<const uint4*>(static_cast<const char*>(g.k_pool) + src);
  const auto* vs = reinterpret_cast<const uint4*>(static_cast<const char*>(g.v_pool) + src);
  auto* kd = reinterpret_cast<uint4*>(static_cast<char*>(g.k_out) + dst);
  auto* vd = reinterpret_cast<uint4*>(static_cast<char*>(g.v_out) + dst);
  uint4 k[kVectorsPerThread], v[kVectorsPerThread];
#pragma unroll
  for (int u = 0; u < kVectorsPerThread; ++u) {
    const int64_t i = first + u * kGatherThreads + threadIdx.x;
    if (i < vectors) {
      k[u] = ks[i];
      v[u] = vs[i];
    }
  }
#pragma unroll
  for (int u = 0; u < kVectorsPerThread; ++u) {
    const int64_t i = first + u * kGatherThreads + threadIdx.x;
    if (i < vectors) {
      kd[i] = k[u];
      vd[i] = v[u];
    }
  }
  if (blockIdx.y != 0) return;
  for (int r = threadIdx.x; r < c.rows; r += kGatherThreads) {
    g.k_pos_out[c.to_row + r] = g.k_pos[c.from_row + r];
  }
}

}  // namespace

absl::Status GatherPagedRowsCuda(const PagedGatherLaunch& g, cudaStream_t stream) {
  if (g.num_copies == 0) return absl::OkStatus();
  CPFILL_CHECK_ARG(g.row_bytes > 0 && g.row_bytes % 16 == 0 && g.block_stride_bytes % 16 == 0,
                   "paged gather: rows of ", g.row_bytes, " bytes in blocks of ",
                   g.block_stride_bytes, " bytes; both must be multiples of 16");
  CPFILL_CHECK_ARG(
      Aligned16(g.k_pool) && Aligned16(g.v_pool) && Aligned16(g.k_out) && Aligned16(g.v_out),
      "paged gather: the pools and the outputs must be 16-byte aligned");
  CPFILL_CHECK_ARG(g.num_copies <= INT32_MAX, "paged gather: ", g.num_copies, " block pieces");
  CPFILL_CHECK_ARG(g.max_copy_rows > 0, "paged gather: max_copy_rows must be positive");
  const int64_t parts = (g.max_copy_rows * g.row_bytes / 16 + kVectorsPerCta - 1) / kVectorsPerCta;
  CPFILL_CHECK_ARG(parts <= 65535, "paged gather: copies of ", g.max_copy_rows, " rows of ",
                   g.row_bytes, " bytes are too long");
  GatherPagedRowsKernel<<<dim3(static_cast<unsigned>(g.num_copies), static_cast<unsigned>(parts)),
                          kGatherThreads, 0, stream>>>(g);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace cpfill::attention::cuda
