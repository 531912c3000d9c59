// Launcher of the Hopper kernel (hopper_kernel.cuh): tensor maps, knobs, grid, and the kernel's
// explicit instantiations (through KernelFor); no device code of its own. This file alone is
// compiled for sm_90a (wgmma and setmaxnreg exist only there); attention_cuda.cu calls it on
// compute capability 9.0 devices and keeps the mma.sync kernel for every other GPU.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/cuda/attention_hopper.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/hopper_kernel.cuh"
#include "attention/cuda/hopper_key_tile.h"
#include "attention/cuda/hopper_params.h"
#include "attention/cuda/hopper_tile_scheduler.cuh"
#include "attention/cuda/pdl.cuh"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::attention::cuda::internal {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point: linking libcuda directly
// would stop the binary from starting on machines without a driver.
PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A map over `rows` K or V rows from `base`, of num_kv_heads * head_dim bf16 columns, boxes of
// 64 columns x box_rows rows, 128-byte swizzle. Rows past the map read as zeros.
absl::Status EncodeRowsMap(CUtensorMap* map, const void* base, int64_t rows, int num_kv_heads,
                           int head_dim, int box_rows) {
  const int64_t row_elems = static_cast<int64_t>(num_kv_heads) * head_dim;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(row_elems), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_elems * 2)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = TensorMapEncoder()(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat("cuTensorMapEncodeTiled failed (CUresult ", r, ") for ", rows, " key rows"));
  }
  return absl::OkStatus();
}

// A map over one slice's key rows [kv_begin, kv_begin + kv_len), boxes of a whole key tile.
absl::Status EncodeSliceMap(CUtensorMap* map, const __nv_bfloat16* base, int64_t kv_begin,
                            int64_t kv_len, int num_kv_heads, int head_dim, int block_n) {
  return EncodeRowsMap(map, base + kv_begin * num_kv_heads * head_dim, kv_len, num_kv_heads,
                       head_dim, block_n);
}

// Paged K/V: the pools' maps (each pool as rows: HopperReadsPagedKv) and the table, once per
// call.
absl::Status SetPagedPools(const CudaAttentionArgs& a, HopperParams* p) {
  const PagedKv& paged = *a.paged;
  int64_t blocks = paged.pool_blocks;
  if (blocks <= 0) {
    for (int32_t b : paged.host_table) blocks = std::max<int64_t>(blocks, int64_t{b} + 1);
  }
  const int64_t rows = blocks * paged.block_tokens;
  // The kernel computes pool rows (and TMA takes coordinates) in 32-bit ints.
  CPFILL_CHECK_ARG(rows <= INT32_MAX, "paged K/V: a pool of ", rows,
                   " rows is past what the Hopper kernel addresses (", INT32_MAX, ")");
  p->block_table = paged.table;
  p->block_tokens = paged.block_tokens;
  p->box_rows = std::gcd(paged.block_tokens, kHopperBlockN);
  for (auto [pool_map, run_map, pool] : {std::tuple{&p->k_pool_map, &p->k_run_map, a.k},
                                         std::tuple{&p->v_pool_map, &p->v_run_map, a.v}}) {
    CPFILL_RETURN_IF_ERROR(
        EncodeRowsMap(pool_map, pool, rows, a.shape.num_kv_heads, a.shape.head_dim, p->box_rows));
    CPFILL_RETURN_IF_ERROR(
        EncodeRowsMap(run_map, pool, rows, a.shape.num_kv_heads, a.shape.head_dim, kHopperBlockN));
  }
  return absl::OkStatus();
}

// Paged K/V: slice i's map over the keys of its last tile where they are consecutive rows of the
// pool (one box of kHopperBlockN rows, tail_runs bit i), else over its last block's rows that
// hold its keys (boxes of box_rows); rows past them read as zeros.
absl::Status SetLastBlockMaps(const CudaAttentionArgs& a, const SliceDesc& s, int i,
                              HopperParams* p) {
  const PagedKv& paged = *a.paged;
  const int64_t bt = paged.block_tokens;
  const int64_t last = (s.kv_len - 1) / bt;
  const int64_t entry = s.table_begin + last;
  CPFILL_CHECK_ARG(entry < static_cast<int64_t>(paged.host_table.size()), "paged K/V: slice ", i,
                   " needs table entry ", entry, " of ", paged.host_table.size());
  const int64_t tile_key = (s.kv_len - 1) / kHopperBlockN * kHopperBlockN;
  bool consecutive = true;
  for (int64_t b = s.table_begin + tile_key / bt + 1; b <= entry; ++b) {
    consecutive = consecutive && paged.host_table[b] == paged.host_table[b - 1] + 1;
  }
  const int64_t first_row =
      consecutive ? int64_t{paged.host_table[s.table_begin + tile_key / bt]} * bt + tile_key % bt
                  : int64_t{paged.host_table[entry]} * bt;
  const int64_t rows = s.kv_len - (consecutive ? tile_key : last * bt);
  if (consecutive) p->tail_runs |= uint64_t{1} << i;
  const int64_t offset = first_row * (paged.block_stride_bytes / bt);
  for (auto [map, pool] : {std::pair{&p->k_maps[i], a.k}, std::pair{&p->v_maps[i], a.v}}) {
    CPFILL_RETURN_IF_ERROR(EncodeRowsMap(map, reinterpret_cast<const char*>(pool) + offset, rows,
                                         a.shape.num_kv_heads, a.shape.head_dim,
                                         consecutive ? kHopperBlockN : p->box_rows));
  }
  return absl::OkStatus();
}

// Measurement knobs (base/knobs.h; the defaults are the measured best), read once:
//   CPFILL_HOPPER_PINGPONG=0     no ping-pong between the consumer warpgroups
//   CPFILL_HOPPER_PERSISTENT=0   a CTA per work item instead of one per SM taking items in turn
//   CPFILL_HOPPER_Q_BUFFERS=1    one Q buffer: the next item's Q loads wait for this item's last
//                                Q K^T instead of running a whole item ahead
//   CPFILL_HOPPER_MAX_CTAS=N     at most N persistent CTAs (tests: many items per CTA)
//   CPFILL_HOPPER_SCHEDULE=static  CTA b takes items b, b + grid, b + 2 grid, ... instead of the
//                                next free item from a counter
//   CPFILL_HOPPER_KEY_TILE=128|176  128-key tiles everywhere, or 176-key tiles wherever the
//                                kernel has them (auto: HopperKeyTile's rule)
struct HopperKnobs {
  bool pingpong = true, persistent = true, dynamic_schedule = true;
  int q_buffers = 2, max_ctas = 0;
  std::string key_tile = "auto";
};
const HopperKnobs& Knobs() {
  static const HopperKnobs values = [] {
    HopperKnobs k;
    k.pingpong = knobs::Bool(knobs::kHopperPingPong);
    k.persistent = knobs::Bool(knobs::kHopperPersistent);
    k.q_buffers = static_cast<int>(knobs::Int(knobs::kHopperQBuffers));
    k.dynamic_schedule = knobs::Choice(knobs::kHopperSchedule) != "static";
    k.max_ctas = static_cast<int>(knobs::Int(knobs::kHopperMaxCtas));
    k.key_tile = knobs::Choice(knobs::kHopperKeyTile);
    return k;
  }();
  return values;
}

absl::StatusOr<int> SmCount() {
  int device = 0, sms = 0;
  CPFILL_CUDA_CHECK(cudaGetDevice(&device));
  CPFILL_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

template <int kDim, int kQBuffers, int kBlockN, bool kPingPong>
absl::Status LaunchShape(const HopperParams& params, int num_ctas, cudaStream_t stream) {
  using Cfg = HopperConfig<kDim, kHopperStages, kQBuffers, kBlockN>;
  auto kernel = HopperFlashKernel<kDim, kHopperStages, kQBuffers, kBlockN, kPingPong>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  CPFILL_CUDA_CHECK(attr);
  CPFILL_CUDA_CHECK(LaunchAsDependent(kernel, dim3(num_ctas), dim3(kHopperThreads), Cfg::kSmemBytes,
                                      stream, params));
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

using Launch = absl::Status (*)(const HopperParams&, int, cudaStream_t);

// The kernel built for the call's shape, key tile (HopperKeyTile) and the knobs; with 176-key
// tiles, one Q buffer (two do not fit beside their stages).
Launch KernelFor(const CudaAttentionArgs& a, int block_n) {
  const HopperKnobs& k = Knobs();
  if (block_n == kHopperWideBlockN) {
    return k.pingpong ? LaunchShape<128, 1, kHopperWideBlockN, true>
                      : LaunchShape<128, 1, kHopperWideBlockN, false>;
  }
  // [head_dim 128][two Q buffers][ping-pong]
  static constexpr Launch kLaunch[2][2][2] = {
      {{LaunchShape<64, 1, kHopperBlockN, false>, LaunchShape<64, 1, kHopperBlockN, true>},
       {LaunchShape<64, 2, kHopperBlockN, false>, LaunchShape<64, 2, kHopperBlockN, true>}},
      {{LaunchShape<128, 1, kHopperBlockN, false>, LaunchShape<128, 1, kHopperBlockN, true>},
       {LaunchShape<128, 2, kHopperBlockN, false>, LaunchShape<128, 2, kHopperBlockN, true>}}};
  return kLaunch[a.shape.head_dim == 128][k.q_buffers == 2][k.pingpong];
}

// A joining grid's stream and the events that order it: after the launch's key-tile pre-pass
// (its summaries and the reset work counter) and the exchange; the launch's stream then waits for
// it. One set per device, made on first use. The events are shared, so launches on one device
// must be issued from one host thread at a time (as the ring, the model and the engine do):
// another thread's record between this launch's record and wait would reorder the join.
struct JoinStream {
  cudaStream_t side = nullptr;
  cudaEvent_t summaries_done = nullptr, joined = nullptr;
};
absl::StatusOr<const JoinStream*> JoinStreamOfThisDevice() {
  static std::mutex mu;
  static std::map<int, JoinStream>* by_device = new std::map<int, JoinStream>;  // never freed
  int device = 0;
  CPFILL_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  JoinStream& js = (*by_device)[device];
  if (js.side == nullptr) {
    CPFILL_CUDA_CHECK(cudaStreamCreateWithFlags(&js.side, cudaStreamNonBlocking));
    CPFILL_CUDA_CHECK(cudaEventCreateWithFlags(&js.summaries_done, cudaEventDisableTiming));
    CPFILL_CUDA_CHECK(cudaEventCreateWithFlags(&js.joined, cudaEventDisableTiming));
  }
  return &js;
}

// The launch's grid on `stream`, and where SMs were left free for an exchange, `held_back` CTAs
// more that join it on the side stream once the exchange has ended.
template <typename Launch>
absl::Status LaunchWithJoin(Launch launch, HopperParams& p, int ctas, int held_back,
                            cudaEvent_t exchange_done, cudaStream_t stream) {
  p.first_wave = ctas;
  if (held_back == 0) return launch(p, ctas, stream);
  CPFILL_ASSIGN_OR_RETURN(const JoinStream* js, JoinStreamOfThisDevice());
  CPFILL_CUDA_CHECK(cudaEventRecord(js->summaries_done, stream));  // the pre-pass is last on it
  CPFILL_RETURN_IF_ERROR(launch(p, ctas, stream));
  p.joining = 1;
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(js->side, js->summaries_done, 0));
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(js->side, exchange_done, 0));
  CPFILL_RETURN_IF_ERROR(launch(p, held_back, js->side));
  CPFILL_CUDA_CHECK(cudaEventRecord(js->joined, js->side));
  CPFILL_CUDA_CHECK(cudaStreamWaitEvent(stream, js->joined, 0));
  return absl::OkStatus();
}

}  // namespace

bool HopperKernelOnThisDevice() {
  // "hopper" asks for this kernel where it can run, which is what "auto" does already.
  if (knobs::Choice(knobs::kAttentionKernel) == "mma") return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  // sm_90a machine code runs on compute capability 9.0 only.
  return major == 9 && minor == 0 && TensorMapEncoder() != nullptr;
}

bool HopperReadsPagedKv(const AttentionShape& shape, const PagedKv& paged) {
  // Parts of at least 32 keys: at most kMaxPagedParts a key tile. Blocks of rows back to back:
  // the kernel reads each pool as one array of rows.
  const int64_t row_bytes = int64_t{shape.num_kv_heads} * shape.head_dim * 2;
  return !paged.host_table.empty() && paged.block_tokens >= 32 && paged.block_tokens % 32 == 0 &&
         paged.block_stride_bytes == paged.block_tokens * row_bytes;
}

bool HopperAttentionUsable(const CudaAttentionArgs& a) {
  return HopperKernelOnThisDevice() && Aligned16(a.q) && Aligned16(a.k) && Aligned16(a.v) &&
         (a.shape.head_dim == 64 || a.shape.head_dim == 128);
}

absl::Status LaunchHopperAttention(const CudaAttentionArgs& a, std::span<const int64_t> work,
                                   KeyTileSummary* summaries, int32_t* item_counter,
                                   cudaStream_t stream, std::span<const int64_t> out_rows) {
  const std::vector<int64_t> order = LongestSlicesFirst(a.slices, work);
  const std::span<const int64_t> sorted(order);
  const HopperKnobs& settings = Knobs();
  const int block_n = HopperKeyTile(a, work, settings.key_tile);
  int64_t summary_offset = 0;
  // One launch per kMaxHopperSlices slices: a ring step of up to 48 sequences is one launch.
  for (size_t first = 0; first < sorted.size(); first += kMaxHopperSlices) {
    const size_t count = std::min<size_t>(kMaxHopperSlices, sorted.size() - first);
    HopperParams p{};  // about 14 KiB: the launch copies it into the parameter space
    LaunchExtent extent;
    CPFILL_RETURN_IF_ERROR(PrepareLaunch(a, sorted.subspan(first, count), kHopperBlockM, block_n,
                                         summaries + summary_offset, &p, p.slices, &extent,
                                         out_rows));
    p.item_counter = settings.dynamic_schedule ? item_counter : nullptr;
    if (a.paged != nullptr) CPFILL_RETURN_IF_ERROR(SetPagedPools(a, &p));
    for (size_t i = 0; i < count; ++i) {
      const SliceDesc& s = p.slices[i];
      if (a.paged != nullptr) {
        CPFILL_RETURN_IF_ERROR(SetLastBlockMaps(a, s, static_cast<int>(i), &p));
        continue;
      }
      CPFILL_RETURN_IF_ERROR(EncodeSliceMap(&p.k_maps[i], a.k, s.kv_begin, s.kv_len,
                                            a.shape.num_kv_heads, a.shape.head_dim, block_n));
      CPFILL_RETURN_IF_ERROR(EncodeSliceMap(&p.v_maps[i], a.v, s.kv_begin, s.kv_len,
                                            a.shape.num_kv_heads, a.shape.head_dim, block_n));
    }
    const int64_t q_tiles = extent.q_tiles, k_tiles = extent.k_tiles;
    static_assert(kMaxHopperSlices <= kMaxSlicesPerLaunch, "the pre-pass holds every slice");
    CPFILL_CUDA_CHECK(
        LaunchAsDependent(KeyTileSummaryKernel<SummaryParams>, dim3(SummaryCtas(k_tiles)),
                          dim3(kSummaryThreads), 0, stream, SummaryParamsOf(p, p.slices),
                          static_cast<int>(k_tiles), summaries + summary_offset, p.item_counter));
    p.num_q_tiles = static_cast<int32_t>(q_tiles);
    const int64_t items = q_tiles * a.shape.num_kv_heads;
    CPFILL_CHECK_ARG(items <= INT32_MAX, "one launch of ", items, " work items is too many");
    summary_offset += k_tiles;
    if (items == 0) continue;
    int ctas = static_cast<int>(items), held_back = 0;
    if (settings.persistent) {
      CPFILL_ASSIGN_OR_RETURN(const int sms, SmCount());
      // Less the SMs an exchange in flight needs for its own kernel; with the dynamic schedule
      // they join once it has ended.
      const int free_sms =
          a.communication_in_flight ? std::max(1, sms - SmsForCommunication()) : sms;
      ctas = PersistentGridSize(ctas, free_sms, settings.max_ctas);
      if (a.exchange_done != nullptr && p.item_counter != nullptr && settings.max_ctas == 0) {
        held_back = static_cast<int>(std::min<int64_t>(sms - free_sms, items - ctas));
      }
    }
    CPFILL_RETURN_IF_ERROR(
        LaunchWithJoin(KernelFor(a, block_n), p, ctas, held_back, a.exchange_done, stream));
  }
  return absl::OkStatus();
}

}  // namespace cpfill::attention::cuda::internal
