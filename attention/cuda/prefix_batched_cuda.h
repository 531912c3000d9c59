// cpfill/attention/cuda/prefix_batched_cuda.h — attention over a tree of shared KV
// (attention/prefix_batched.h) on the GPU: one PartialAttentionCuda launch per level, the first
// writing fp32 (O, LSE), the others merging into it in place (OutputMode::kMergeIntoFloat32), so
// a shared prefix is read once for all the queries under it and no separate merge pass runs. A
// level whose slices hold many query rows (a prefix under many sequences) takes the prefill
// kernels' 128-row tiles; a level of one decode row per sequence takes the split-KV decode
// kernel, as PartialAttentionCuda dispatches. A root level of few tiles (a long prefix under a
// few decode rows would be one CTA walking every key) is split along its keys into parts run in
// one launch on copies of the queries, then merged exactly (MergePartialsCuda).
//
//   size_t bytes = PrefixBatchedWorkspaceBytes(args, levels);
//   CPFILL_RETURN_IF_ERROR(PrefixBatchedAttentionCuda(args, levels, ws, bytes, stream));
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>

#include "absl/status/status.h"
#include "attention/cuda/attention_cuda.h"
#include "attention/prefix_batched.h"

namespace cpfill::attention::cuda {

// The workspace one call needs: the largest level's (levels run one after another), or the split
// root's (its query copies, partials and merge rounds).
size_t PrefixBatchedWorkspaceBytes(const CudaAttentionArgs& args, KvTree levels);

// args.o (fp32 [q_tokens, num_heads, head_dim]) and args.lse get the attention over the tree;
// args.slices and args.output are ignored. InvalidArgument as ValidateKvTree and
// PartialAttentionCuda; never synchronizes.
absl::Status PrefixBatchedAttentionCuda(const CudaAttentionArgs& args, KvTree levels,
                                        void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream);

// A paged decode step as FindSharedBlocks' levels (prefix_batched.h): level 0 in args.output's
// mode (kFloat32 or kMergeIntoFloat32: the ring's fresh or folded step), then each later level
// merged into it; all on the decode kernel, the only reader of paged K/V.
// args.slices are ignored. InvalidArgument as PartialAttentionCuda, or for a bf16 output.
size_t SharedBlocksWorkspaceBytes(const CudaAttentionArgs& args, const SharedBlockTree& tree);
absl::Status SharedBlocksAttentionCuda(const CudaAttentionArgs& args, const SharedBlockTree& tree,
                                       void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream);

// A gathered paged step (prefix_batched.h GathersPagedKv, PlanPagedGather: a prefill after
// cached rows): the plan's copies, uploaded into the workspace, gather K, V and positions out of
// args.paged's blocks; then level 0 runs in args.output's mode and each later level merges into it,
// on the prefill kernels (a fresh root of few tiles over long keys is split along its keys, as in
// PrefixBatchedAttentionCuda). args.slices are ignored; the plan's host memory may go once the
// call returns. `device_copies`: plan.copies already in device memory (uploaded once for the
// steps that share the plan: an upload from pageable memory may wait for the stream); null, they
// are uploaded into the workspace. InvalidArgument as PartialAttentionCuda, or for a bf16 output.
size_t GatheredPagedWorkspaceBytes(const CudaAttentionArgs& args, const PagedGather& plan);
absl::Status GatheredPagedAttentionCuda(const CudaAttentionArgs& args, const PagedGather& plan,
                                        void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream,
                                        const PagedGather::Copy* device_copies = nullptr);

// A paged prefill step read in place where ReadsPagedPrefillInPlace (attention_cuda.h): the tree's
// levels over args.paged's blocks as GatheredPagedAttentionCuda runs them over gathered rows, with
// no gather (no copy, no gathered rows' memory). args.slices are ignored. InvalidArgument as
// PartialAttentionCuda, or for a bf16 output.
size_t InPlacePagedWorkspaceBytes(const CudaAttentionArgs& args, const SharedBlockTree& tree);
absl::Status InPlacePagedAttentionCuda(const CudaAttentionArgs& args, const SharedBlockTree& tree,
                                       void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream);

// Whether a paged prefill step whose gather `plan` is given runs faster read in place (where
// ReadsPagedPrefillInPlace): where the gather (its rows read and written at the HBM rate) would
// take at least kMinGatherShare of the attention's time (its FLOPs over `slices`, the step's, at
// the Hopper kernel's rate). In place, the kernel loads each 128-key tile through the block table:
// whole where the tile's blocks are consecutive in the pool (mostly: the KV cache hands out the
// lowest free block first), else in parts. On an H100 (bench/RESULTS.md, 2026-11-27), the 56
// suffix-prefill shapes split cleanly: at a gather share of 0.18 or more, in place ran 1.05x to
// 1.33x the gathered step; at 0.07 or less, 0.80x to 1.03x (the in-place kernel is slower than
// the gathered one by a few percent, the gather then costs less than that).
inline constexpr double kMinGatherShare = 0.1;
inline constexpr double kHbmBytesPerSecond = 3.0e12;        // H100 SXM copy rate (read + write)
inline constexpr double kAttentionFlopsPerSecond = 550e12;  // the Hopper kernel, bf16
bool InPlaceBeatsGather(const AttentionShape& shape, const PagedGather& plan,
                        std::span<const SequenceSlice> slices);
// Whether the step without roots (its gather plan over paged.host_table: every slice's keys, the
// slices that read the same blocks once) would be read in place by the rule above.
bool FlatStepReadsInPlace(const AttentionShape& shape, std::span<const SequenceSlice> slices,
                          const PagedKv& paged);

// How a ring step on the GPU finds its roots: RuleForStep under `costs`, with a decode step's
// roots not cut at 128 packed rows (a wide one is gathered, WideRootRuleOf; in a folded step the
// decode kernel reads it in as many m16 tiles as its pieces would take). A prefill step's roots
// are measured against the step without them, which `flat_in_place` says is read in place (the
// caller's rule: FlatStepReadsInPlace, or asked): that step gathers nothing, so roots no longer
// spare a gather of the prefix per sequence, only the in-place kernel's slower loads, and their
// merge must cost kMergeCostAgainstInPlace times less than the reads they spare (nonzero costs).
// Measured on an H200 (bench/RESULTS.md, 2026-11-28), 22 suffix steps whose flat step read in
// place: the tree (gathered) ran 0.90x-0.99x the flat step at 4 to 28 spared values per merged
// one (32:8 after 4K: 0.90x, 0.93x, 0.97x), 1.03x-1.12x from 31 up (8:1 after 64K, 32:8 after
// 16K at B = 32 and after 64K), and 1.01x once at 15.5.
inline constexpr double kMergeCostAgainstInPlace = 30.0;
SharedBlockRule StepRuleOnGpu(std::span<const SequenceSlice> slices, const TreeCosts& costs,
                              bool flat_in_place);
// A decode step's roots of more than 128 packed rows (8 of the decode kernel's m16 tiles) that
// re-read at least 64M K/V values (128 MB of bf16) in place and make 4 prefill tiles (x KV
// heads) or more read their shared rows gathered, on the prefill kernels; up to 256 MiB of
// gathered K and V a step (the rest stay in place: the gather is workspace that the KV cache's
// sizing did not count). Measured on an H100 (bench/RESULTS.md, 2026-11-27): with these, every
// decode shape of the grid ran within 7% of the faster of the two ways.
inline constexpr int64_t kMinWideRootRows = 128;
inline constexpr int64_t kMinWideRootRereads = int64_t{64} << 20;
inline constexpr int64_t kMinWideRootTiles = 4;
inline constexpr int64_t kMaxWideRootBytes = int64_t{256} << 20;
WideRootRule WideRootRuleOf(const AttentionShape& shape);

// A fresh paged decode step whose wide roots are gathered (prefix_batched.h PlanWideRoots):
// those roots as a gathered step (GatheredPagedAttentionCuda, fresh: every row written), then
// the rest of the tree, level by level, in place on the decode kernel, merged in. `device_copies`
// as there. InvalidArgument for a folded output, or as the calls it makes.
size_t WideRootsWorkspaceBytes(const CudaAttentionArgs& args, const WideRootsPlan& plan);
absl::Status WideRootsAttentionCuda(const CudaAttentionArgs& args, const WideRootsPlan& plan,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                    const PagedGather::Copy* device_copies = nullptr);

// Whether a fresh decode step's wide roots are to be read in place instead, by the Hopper kernel
// over the step's tree (InPlacePagedAttentionCuda), on a ring of `cp_size` ranks: asked
// (CPFILL_DECODE_WIDE_ROOTS; auto: on a ring of one rank, 1.04x-1.87x faster than gathering on
// one H200, mixed on CP2) and the step's outer level is wide roots only (the in-place run sends
// a whole level with a slice of more than 4 rows to the Hopper kernel, which would also take
// that level's single rows over long keys). The caller checks that the blocks can be read in
// place (ReadsPagedPrefillInPlace).
bool WideRootsInPlaceAsked(const WideRootsPlan& plan, int cp_size);

}  // namespace cpfill::attention::cuda
