// cpfill/attention/cuda/attention_hopper.h — the Hopper (sm_90a, wgmma + TMA) path of
// PartialAttentionCuda. Internal: attention_cuda.cu dispatches to it after validating the call.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/flash_common.cuh"

namespace cpfill::attention::cuda::internal {

// True when the current device is compute capability 9.0, the driver can encode tensor maps,
// and the environment does not ask for the mma.sync kernel (CPFILL_ATTENTION_KERNEL=mma).
bool HopperKernelOnThisDevice();

// HopperKernelOnThisDevice, and the call's Q/K/V are 16-byte aligned with head_dim 64 or 128.
bool HopperAttentionUsable(const CudaAttentionArgs& a);

// Paged K/V the Hopper kernel reads in place (HopperParams): the table in host memory too (the
// launch looks up each slice's last block), blocks of a multiple of 32 tokens whose rows lie
// back to back (the KV cache's layout: a block's stride is its rows), so each pool is one array
// of rows.
bool HopperReadsPagedKv(const AttentionShape& shape, const PagedKv& paged);

// Launches the key-tile pre-pass and the Hopper kernel over the slices `work` (indices into
// a.slices, each with work to do). `summaries` holds at least one entry per 128 keys of each;
// `item_counter` is one int of device memory for the work-item scheduler. out_rows: each
// slice's output row (indexed as a.slices; empty: its q_begin), for the parts of a key split.
absl::Status LaunchHopperAttention(const CudaAttentionArgs& a, std::span<const int64_t> work,
                                   KeyTileSummary* summaries, int32_t* item_counter,
                                   cudaStream_t stream, std::span<const int64_t> out_rows = {});

}  // namespace cpfill::attention::cuda::internal
