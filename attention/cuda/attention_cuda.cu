// Launchers of the CUDA attention backend: validation, the key-tile summary pre-pass, the
// mma.sync forward kernel (mma_kernel.cuh) per head dim, the fill of uncovered rows, and the merge.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/attention_decode.h"
#include "attention/cuda/flash_common.cuh"
#include "attention/cuda/key_split.h"
#include "attention/cuda/mma_kernel.cuh"
#include "attention/cuda/pdl.cuh"
#include "attention/online_softmax.h"
#ifdef CPFILL_HAVE_HOPPER_KERNEL
#include "attention/cuda/attention_hopper.h"
#endif
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill {
namespace attention::cuda {
namespace {

using internal::FlashParams;
using internal::KeyTileSummary;
using internal::kMaxSlicesPerLaunch;
using internal::SliceDesc;

// Kernel shapes, chosen at launch (CPFILL_ATTENTION_VARIANT overrides, for benchmarking):
//   0: 8 warps x 16 rows (128), Q in registers, one CTA per SM
//   1: 4 warps x 16 rows (64), Q in registers, two CTAs per SM
//   2: 4 warps x 32 rows (128), 32-key tiles, Q re-read from shared memory, two CTAs per SM:
//      every K/V fragment feeds four MMAs instead of two
//   3: as 2 with 64-key tiles (the default: fastest measured, bench/RESULTS.md; at head dim
//      128 it spills a few registers, reloaded outside the MMA loop's critical path)
// Variants 0, 1 and 3 use 64-key tiles.
int VariantFromEnv() {
  static const int v = static_cast<int>(knobs::Int(knobs::kAttentionVariant));
  return v;
}
int BlockM() { return VariantFromEnv() == 1 ? 64 : 128; }
int BlockN() { return VariantFromEnv() == 2 ? 32 : 64; }

// ---- rows that no slice covers: O = 0, LSE = -inf --------------------------------------

template <typename T>
__global__ void FillEmptyKernel(T* o, float* lse, int64_t rows, int heads, int dim) {
  const int64_t n = rows * heads * dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    o[i] = T(0.f);
    if (i % dim == 0) lse[i / dim] = -INFINITY;
  }
}

// ---- merge of N partials ---------------------------------------------------------------

struct MergeParams {
  const float* o[kMaxMergeParts];
  const float* lse[kMaxMergeParts];
  int num_parts;
  int64_t rows_heads;  // rows * heads
  int dim;
  float* o_out;
  __nv_bfloat16* o_out_bf16;
  float* lse_out;
};

// One thread per 4 consecutive values of one (row, head): 16-byte loads of every part.
__global__ void MergeKernel(const __grid_constant__ MergeParams p) {
  internal::WaitForPrecedingGrids();  // launched as a dependent of the kernel writing the parts
  internal::LetDependentsLaunch();
  const int chunks = p.dim / 4;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= p.rows_heads * chunks) return;
  const int64_t rh = idx / chunks;
  const int c = static_cast<int>(idx % chunks);
  // The weights of online_softmax.h (one definition with the CPU merge): relative to the
  // largest LSE, -inf parts weigh 0 and their O is not read.
  LseMerge<float> merge;
  for (int s = 0; s < p.num_parts; ++s) merge.Add(p.lse[s][rh], s);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float rest = 0.f;
  if (!merge.empty()) {
    for (int s = 0; s < p.num_parts; ++s) {
      const float w = merge.Weight(p.lse[s][rh], s);
      if (w == 0.f) continue;
      const float4 x = reinterpret_cast<const float4*>(p.o[s] + rh * p.dim)[c];
      acc.x += w * x.x;
      acc.y += w * x.y;
      acc.z += w * x.z;
      acc.w += w * x.w;
      if (s != merge.arg_max()) rest += w;
    }
  }
  const float inv = merge.empty() ? 0.f : LseMerge<float>::Normalizer(rest);
  acc.x *= inv;
  acc.y *= inv;
  acc.z *= inv;
  acc.w *= inv;
  if (p.o_out != nullptr) reinterpret_cast<float4*>(p.o_out + rh * p.dim)[c] = acc;
  if (p.o_out_bf16 != nullptr) {
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(p.o_out_bf16 + rh * p.dim + c * 4);
    dst[0] = __floats2bfloat162_rn(acc.x, acc.y);
    dst[1] = __floats2bfloat162_rn(acc.z, acc.w);
  }
  if (c == 0) p.lse_out[rh] = merge.empty() ? -INFINITY : merge.Lse(rest);
}

// ---- dispatch --------------------------------------------------------------------------

template <int kDim, int kBlockN, int kWarps, int kMTiles, int kMinBlocks>
absl::Status LaunchFlashShape(const FlashParams& params, int num_q_tiles, int num_kv_heads,
                              cudaStream_t stream) {
  using Cfg = internal::FlashConfig<kDim, kBlockN, kWarps, kMTiles>;
  auto kernel = internal::FlashForwardKernel<kDim, kBlockN, kWarps, kMTiles, kMinBlocks>;
  // More than 48 KiB of dynamic shared memory must be asked for once per kernel.
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  CPFILL_CUDA_CHECK(attr);
  const dim3 grid(num_q_tiles, num_kv_heads);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params);
  CPFILL_CUDA_CHECK(cudaGetLastError());
  return absl::OkStatus();
}

template <int kDim>
absl::Status LaunchFlash(const FlashParams& params, int num_q_tiles, int num_kv_heads,
                         cudaStream_t stream) {
  switch (VariantFromEnv()) {
    case 0:
      return LaunchFlashShape<kDim, 64, 8, 1, 1>(params, num_q_tiles, num_kv_heads, stream);
    case 1:
      return LaunchFlashShape<kDim, 64, 4, 1, 2>(params, num_q_tiles, num_kv_heads, stream);
    case 3:
      return LaunchFlashShape<kDim, 64, 4, 2, 2>(params, num_q_tiles, num_kv_heads, stream);
    default:
      return LaunchFlashShape<kDim, 32, 4, 2, 2>(params, num_q_tiles, num_kv_heads, stream);
  }
}

// The slices with work, in launch groups of at most kMaxSlicesPerLaunch.
std::vector<int64_t> WorkingSlices(const CudaAttentionArgs& a) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < a.num_slices; ++i) {
    if (a.slices[i].q_len > 0 && a.slices[i].kv_len > 0) out.push_back(i);
  }
  return out;
}

int64_t KeyTiles(const SequenceSlice& s) { return (s.kv_len + BlockN() - 1) / BlockN(); }

// The workspace: the key-tile summaries (sized for the mma.sync kernel's 64-key tiles, enough
// for the Hopper kernel's 128), then the work-item counter of the persistent Hopper kernel's
// scheduler, which each launch's pre-pass zeroes.
size_t SummaryBytes(const CudaAttentionArgs& args) {
  size_t tiles = 0;
  for (int64_t i : WorkingSlices(args)) tiles += KeyTiles(args.slices[i]);
  return tiles * sizeof(KeyTileSummary);
}
inline constexpr size_t kSchedulerCounterBytes = 16;

// The key split PartialAttentionCuda runs `a` with (key_split.h): on the Hopper kernel, for a
// call the decode kernel does not take (with paged K/V, one it reads in place); elsewhere parts 1.
internal::KeySplit KeySplitOf(const CudaAttentionArgs& a) {
#ifdef CPFILL_HAVE_HOPPER_KERNEL
  if (!internal::DecodeAttentionApplies(a) && internal::HopperAttentionUsable(a) &&
      (a.paged == nullptr || internal::PagedPrefillOnHopper(a))) {
    return internal::PlanKeySplit(a, internal::SmCount());
  }
#endif
  return {};
}

// The parts' call: `a` over the split's slices, fp32 into the parts' buffer.
CudaAttentionArgs PartsArgs(const CudaAttentionArgs& a, const internal::KeySplit& split) {
  CudaAttentionArgs b = a;
  b.slices = split.slices.data();
  b.num_slices = static_cast<int64_t>(split.slices.size());
  b.output = OutputMode::kFloat32;
  return b;
}

// The workspace of a key split: the parts' key-tile summaries and scheduler counter, then their
// fp32 O and LSE, part after part.
struct KeySplitLayout {
  size_t counter = 0, o = 0, lse = 0, total = 0;
};
KeySplitLayout LayoutOf(const CudaAttentionArgs& a, const internal::KeySplit& split) {
  constexpr size_t kAlign = 256;
  auto aligned = [](size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; };
  const size_t rows = static_cast<size_t>(a.q_tokens) * split.parts * a.shape.num_heads;
  KeySplitLayout l;
  l.counter = SummaryBytes(PartsArgs(a, split));
  l.o = aligned(l.counter + kSchedulerCounterBytes);
  l.lse = l.o + aligned(rows * a.shape.head_dim * sizeof(float));
  l.total = l.lse + aligned(rows * sizeof(float));
  return l;
}

// AttentionWorkspaceBytes for `args` run with `split` (KeySplitOf(args)).
size_t WorkspaceBytes(const CudaAttentionArgs& args, const internal::KeySplit& split) {
  if (internal::DecodeAttentionApplies(args)) return internal::DecodeWorkspaceBytes(args);
  if (split.parts > 1) return LayoutOf(args, split).total;
  const size_t summaries = SummaryBytes(args);
  return summaries == 0 ? 0 : summaries + kSchedulerCounterBytes;
}

#ifdef CPFILL_HAVE_HOPPER_KERNEL
// The parts in one launch, then merged exactly into the call's output (every query row is in
// some slice: PlanKeySplit splits no other call).
absl::Status RunKeySplit(const CudaAttentionArgs& a, const internal::KeySplit& split,
                         void* workspace, cudaStream_t stream) {
  const KeySplitLayout l = LayoutOf(a, split);
  char* ws = static_cast<char*>(workspace);
  CudaAttentionArgs b = PartsArgs(a, split);
  b.o = ws + l.o;
  b.lse = reinterpret_cast<float*>(ws + l.lse);
  CPFILL_RETURN_IF_ERROR(internal::LaunchHopperAttention(
      b, WorkingSlices(b), static_cast<KeyTileSummary*>(workspace),
      reinterpret_cast<int32_t*>(ws + l.counter), stream, split.out_rows));
  const size_t heads = static_cast<size_t>(a.q_tokens) * a.shape.num_heads;
  std::vector<const float*> os, ls;
  for (int p = 0; p < split.parts; ++p) {
    os.push_back(static_cast<const float*>(b.o) + p * heads * a.shape.head_dim);
    ls.push_back(b.lse + p * heads);
  }
  const bool bf16 = a.output == OutputMode::kBfloat16;
  return MergePartialsCuda(a.shape, a.q_tokens, os, ls, bf16 ? nullptr : static_cast<float*>(a.o),
                           bf16 ? static_cast<__nv_bfloat16*>(a.o) : nullptr, a.lse, stream);
}
#endif

}  // namespace

bool ReadsPagedPrefillInPlace(const AttentionShape& shape, const PagedKv& paged) {
#ifdef CPFILL_HAVE_HOPPER_KERNEL
  return internal::HopperKernelOnThisDevice() && SupportedHeadDim(shape.head_dim) &&
         internal::HopperReadsPagedKv(shape, paged);
#else
  return false;
#endif
}

namespace internal {
bool PagedPrefillOnHopper(const CudaAttentionArgs& a) {
  if (!a.paged_prefill || a.paged == nullptr || !ReadsPagedPrefillInPlace(a.shape, *a.paged) ||
      !Aligned16(a.q) || !Aligned16(a.k) || !Aligned16(a.v)) {
    return false;
  }
  for (int64_t i = 0; i < a.num_slices; ++i) {
    if (a.slices[i].q_len > kMaxDecodeQueryRows && a.slices[i].kv_len > 0) return true;
  }
  return false;
}
}  // namespace internal

bool SupportedHeadDim(int head_dim) { return head_dim == 64 || head_dim == 128; }

int SmsForCommunication() {
  static const int sms = static_cast<int>(knobs::Int(knobs::kCommunicationSms));
  return sms;
}

namespace internal {
bool SplitsKeys(const CudaAttentionArgs& a) { return KeySplitOf(a).parts > 1; }
}  // namespace internal

const char* AttentionKernelName() {
#ifdef CPFILL_HAVE_HOPPER_KERNEL
  if (internal::HopperKernelOnThisDevice()) return "hopper-wgmma";
#endif
  return "mma-sync";
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

size_t AttentionWorkspaceBytes(const CudaAttentionArgs& args) {
  return WorkspaceBytes(args, KeySplitOf(args));
}

AttentionParams ShapeView(const CudaAttentionArgs& a) {
  return AttentionParams{.shape = a.shape,
                         .q = reinterpret_cast<const float*>(a.q),
                         .q_pos = a.q_pos,
                         .q_tokens = a.q_tokens,
                         .k = reinterpret_cast<const float*>(a.k),
                         .v = reinterpret_cast<const float*>(a.v),
                         .k_pos = a.k_pos,
                         .kv_tokens = a.kv_tokens,
                         .slices = a.slices,
                         .num_slices = a.num_slices,
                         .o = static_cast<float*>(a.o),
                         .lse = a.lse};
}

absl::Status PartialAttentionCuda(const CudaAttentionArgs& a, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  // Shapes and slice bounds: the CPU contract's validator.
  CPFILL_RETURN_IF_ERROR(ValidateAttentionParams(ShapeView(a)));
  CPFILL_CHECK_ARG(SupportedHeadDim(a.shape.head_dim), "CUDA attention: head_dim ",
                   a.shape.head_dim, " has no compiled kernel (supported: 64, 128)");
  CPFILL_CHECK_ARG(std::isfinite(a.shape.softmax_scale), "softmax_scale must be finite");
  if (a.paged != nullptr) {
    CPFILL_RETURN_IF_ERROR(a.paged->Validate(int64_t{a.shape.num_kv_heads} * a.shape.head_dim * 2,
                                             a.slices, a.num_slices));
    CPFILL_CHECK_ARG(a.paged->block_stride_bytes % 16 == 0,
                     "CUDA attention: paged K/V needs 16-byte aligned blocks, stride ",
                     a.paged->block_stride_bytes);
    // Its readers (the decode kernel, the Hopper kernel's TMA) load 16 bytes at a time.
    CPFILL_CHECK_ARG(
        internal::Aligned16(a.q) && internal::Aligned16(a.k) && internal::Aligned16(a.v),
        "CUDA attention: paged K/V needs 16-byte aligned q, k and v (their "
        "addresses modulo 16: ",
        reinterpret_cast<uintptr_t>(a.q) % 16, ", ", reinterpret_cast<uintptr_t>(a.k) % 16, ", ",
        reinterpret_cast<uintptr_t>(a.v) % 16, ")");
  }
  const internal::KeySplit split = KeySplitOf(a);  // planned once: the workspace and the launch
  const size_t need = WorkspaceBytes(a, split);
  CPFILL_CHECK_ARG(workspace_bytes >= need && (need == 0 || workspace != nullptr),
                   "CUDA attention: workspace of ", workspace_bytes, " bytes, ", need, " needed");

  // Rows no slice with keys covers are written empty first (not in merge mode: merging nothing
  // is a no-op; the prefill kernels skip slices without keys). Slices do not overlap, so covered
  // rows sum to q_tokens exactly when all are covered.
  int64_t covered = 0;
  for (int64_t i = 0; i < a.num_slices; ++i) {
    if (a.slices[i].kv_len > 0) covered += a.slices[i].q_len;
  }
  const int dim = a.shape.head_dim;
  if (covered < a.q_tokens && a.output != OutputMode::kMergeIntoFloat32) {
    const int64_t n = a.q_tokens * a.shape.num_heads * dim;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 65535));
    if (a.output == OutputMode::kFloat32) {
      FillEmptyKernel<float><<<blocks, 256, 0, stream>>>(static_cast<float*>(a.o), a.lse,
                                                         a.q_tokens, a.shape.num_heads, dim);
    } else {
      FillEmptyKernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(
          static_cast<__nv_bfloat16*>(a.o), a.lse, a.q_tokens, a.shape.num_heads, dim);
    }
    CPFILL_CUDA_CHECK(cudaGetLastError());
  }

  // Decode steps (a few query rows per slice): the split-KV kernel (attention_decode.h).
  if (internal::DecodeAttentionApplies(a)) {
    return internal::LaunchDecodeAttention(a, workspace, workspace_bytes, stream);
  }
  if (a.paged != nullptr && !internal::PagedPrefillOnHopper(a)) {
    // Checked above: the decode kernel refuses paged args only when no slice has a query row.
    CPFILL_CHECK_ARG(covered == 0, "CUDA attention: paged K/V that the decode kernel cannot read");
    return absl::OkStatus();
  }
  const std::vector<int64_t> work = WorkingSlices(a);
  KeyTileSummary* summaries = static_cast<KeyTileSummary*>(workspace);
#ifdef CPFILL_HAVE_HOPPER_KERNEL
  // Hopper: the wgmma/TMA kernel (its 128- or 176-key tiles need fewer summaries than reserved
  // here).
  if (internal::HopperAttentionUsable(a)) {
    if (split.parts > 1) return RunKeySplit(a, split, workspace, stream);
    // The counter is the workspace's last bytes (AttentionWorkspaceBytes).
    int32_t* item_counter =
        reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + need - kSchedulerCounterBytes);
    return internal::LaunchHopperAttention(a, work, summaries, item_counter, stream);
  }
#endif
  int64_t summary_offset = 0;
  for (size_t first = 0; first < work.size(); first += kMaxSlicesPerLaunch) {
    const size_t count = std::min<size_t>(kMaxSlicesPerLaunch, work.size() - first);
    FlashParams p{};
    p.k = a.k;
    p.v = a.v;
    internal::LaunchExtent extent;
    CPFILL_RETURN_IF_ERROR(
        internal::PrepareLaunch(a, std::span<const int64_t>(work).subspan(first, count), BlockM(),
                                BlockN(), summaries + summary_offset, &p, p.slices, &extent));
    const int64_t q_tiles = extent.q_tiles, k_tiles = extent.k_tiles;
    KeyTileSummaryKernel<<<internal::SummaryCtas(k_tiles), internal::kSummaryThreads, 0, stream>>>(
        internal::SummaryParamsOf(p, p.slices), static_cast<int>(k_tiles),
        summaries + summary_offset, nullptr);
    CPFILL_CUDA_CHECK(cudaGetLastError());
    if (dim == 128) {
      CPFILL_RETURN_IF_ERROR(
          LaunchFlash<128>(p, static_cast<int>(q_tiles), a.shape.num_kv_heads, stream));
    } else {
      CPFILL_RETURN_IF_ERROR(
          LaunchFlash<64>(p, static_cast<int>(q_tiles), a.shape.num_kv_heads, stream));
    }
    summary_offset += k_tiles;
  }
  return absl::OkStatus();
}

absl::Status MergePartialsCuda(const AttentionShape& shape, int64_t rows,
                               std::span<const float* const> o_parts,
                               std::span<const float* const> lse_parts, float* o_out,
                               __nv_bfloat16* o_out_bf16, float* lse_out, cudaStream_t stream) {
  CPFILL_CHECK_ARG(o_parts.size() == lse_parts.size(), "merge: ", o_parts.size(), " O parts but ",
                   lse_parts.size(), " LSE parts");
  CPFILL_CHECK_ARG(!o_parts.empty() && o_parts.size() <= static_cast<size_t>(kMaxMergeParts),
                   "merge: ", o_parts.size(), " parts; 1 to ", kMaxMergeParts, " per call");
  CPFILL_CHECK_ARG(shape.num_heads > 0 && shape.head_dim > 0 && shape.head_dim % 4 == 0,
                   "merge: head_dim must be a positive multiple of 4, got ", shape.head_dim);
  CPFILL_CHECK_ARG(rows >= 0, "merge: rows must be >= 0");
  CPFILL_CHECK_ARG(lse_out != nullptr && (o_out != nullptr || o_out_bf16 != nullptr),
                   "merge: no output");
  if (rows == 0) return absl::OkStatus();
  MergeParams p{};
  for (size_t i = 0; i < o_parts.size(); ++i) {
    CPFILL_CHECK_ARG(o_parts[i] != nullptr && lse_parts[i] != nullptr, "merge: part ", i,
                     " is null");
    CPFILL_CHECK_ARG(reinterpret_cast<uintptr_t>(o_parts[i]) % 16 == 0, "merge: part ", i,
                     " is not 16-byte aligned");
    p.o[i] = o_parts[i];
    p.lse[i] = lse_parts[i];
  }
  p.num_parts = static_cast<int>(o_parts.size());
  p.rows_heads = rows * shape.num_heads;
  p.dim = shape.head_dim;
  p.o_out = o_out;
  p.o_out_bf16 = o_out_bf16;
  p.lse_out = lse_out;
  const int64_t threads = p.rows_heads * (shape.head_dim / 4);
  CPFILL_CUDA_CHECK(internal::LaunchAsDependent(
      MergeKernel, dim3(static_cast<unsigned>((threads + 255) / 256)), dim3(256), 0, stream, p));
  return absl::OkStatus();
}

}  // namespace attention::cuda
}  // namespace cpfill
