#include <cstdint>

#include "attention/cuda/paged_gather.h"
#include "base/status.h"

namespace cpfill::attention::cuda {
namespace {

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// CTA c copies copies[c]: its rows are contiguous in the block and in the output alike.
__global__ void GatherPagedRowsKernel(PagedGatherLaunch g) {
  const PagedGather::Copy c = g.copies[blockIdx.x];
  const int64_t vectors = c.rows * g.row_bytes / 16;
  const int64_t src = c.block * g.block_stride_bytes;
  const int64_t dst = c.to_row * g.row_bytes;
  const auto* ks = reinterpret_cast<const uint4*>(static_cast<const char*>(g.k_pool) + src);
  const auto* vs = reinterpret_cast<const uint4*>(static_cast<const char*>(g.v_pool) + src);
  auto* kd = reinterpret_cast<uint4*>(static_cast<char*>(g.k_out) + dst);
  auto* vd = reinterpret_cast<uint4*>(static_cast<char*>(g.v_out) + dst);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
  for (int r = threadIdx.x; r < c.rows; r += blockDim.x) {
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
  GatherPagedRowsKernel<<<static_cast<unsigned>(g.num_copies), 256, 0, stream>>>(g);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace cpfill::attention::cuda
