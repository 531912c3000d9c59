// cpfill/attention/cuda/hopper_epilogue.cuh — where a Hopper consumer's finished item goes.
//
// The wgmma m64 accumulator layout gives each warp 16 rows in the same per-thread layout as the
// mma.sync m16 tile, so the Hopper kernel shares the mma.sync kernel's epilogue (StoreRows16,
// flash_common.cuh): the row sum reduced over the quad, O / l and LSE = (m + log2 l) ln 2 written
// as bf16 or fp32, or merged into the running fp32 (O, LSE) (kOutMergeF32); empty rows give
// O = 0, LSE = -inf.
//
//   StoreItemRows<kDim>(p, item.kv_head, slice, slice_rows, row0 + tile_row, o, m, l, lane);
#pragma once

#include <cstdint>

#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_params.h"

namespace cpfill::attention::cuda::internal {

// This warp's 16 rows of an item (slice rows row16 .. row16 + 15 of `sl`; rows past slice_rows
// are skipped) from the unnormalised O, the running max m (raw scores) and this thread's part of
// the row sum l.
template <int kDim>
__device__ __forceinline__ void StoreItemRows(const HopperParams& p, int kv_head,
                                              const SliceDesc& sl, int64_t slice_rows,
                                              int64_t row16, const float (&o_acc)[kDim / 8][4],
                                              const float (&m_row)[2], const float (&l_row)[2],
                                              int lane) {
  const EpilogueTarget target{p.o, p.lse, p.num_heads, p.group, p.out_mode, p.scale_log2};
  StoreRows16<kDim>(target, kv_head, sl.o_begin, slice_rows, row16, o_acc, m_row, l_row, lane);
}

}  // namespace cpfill::attention::cuda::internal
