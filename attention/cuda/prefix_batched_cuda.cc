#include "attention/cuda/prefix_batched_cuda.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "attention/cuda/attention_decode.h"
#include "attention/cuda/key_split.h"
#include "attention/cuda/paged_gather.h"
#include "base/knobs.h"
#include "base/status.h"

namespace cpfill::attention::cuda {
namespace {

// The root level (a shared prefix under many sequences' queries) runs one of two ways:
//   - the split-KV decode kernel: it splits the keys itself, but reads them once per m16 tile of
//     packed (token x GQA group) rows: cheap for a few rows, costly for many over long keys;
//   - the prefill kernels, which give one CTA a 128-row folded tile and one KV head and walk all
//     of its keys (a few CTAs on 132 SMs): so a level of fewer items than SMs is split along its
//     keys into up to kMaxSplits parts (each at least kMinSplitKeys keys), as many as one wave
//     holds, run in one launch on copies of the query rows, and the parts merged exactly
//     (MergePartialsCuda, at most kMaxMergeParts a call: two rounds). One wave: items of equal
//     length finish together, and a second, partial wave (17 splits of 16 items on 132 SMs) cost
//     a third more than 8 splits (bench/RESULTS.md, 2026-11-27).
// A root of at most one folded tile per slice takes the decode kernel, the rest are split: the
// rule measured on an H100 (bench/RESULTS.md, 2026-11-26). CPFILL_PREFIX_ROOT forces either way.
constexpr int kFoldedTileRows = 128;
constexpr int kMaxSplits = kMaxMergeParts * kMaxMergeParts;
constexpr int64_t kMinSplitKeys = 1024;
constexpr int64_t kMinForcedSplitKeys = 256;
constexpr size_t kAlign = 256;

size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

int SmCount() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 132;
  }
  return sms;
}

CudaAttentionArgs LevelArgs(const CudaAttentionArgs& args, std::span<const SequenceSlice> level,
                            OutputMode output) {
  CudaAttentionArgs a = args;
  a.slices = level.data();
  a.num_slices = static_cast<int64_t>(level.size());
  a.output = output;
  return a;
}

// True when the root level runs on the decode kernel: it can, every query row is in a root slice
// (the kernel leaves rows in no slice to its caller), and each slice is at most one folded tile.
bool RootOnDecodeKernel(const CudaAttentionArgs& args, std::span<const SequenceSlice> root) {
  const CudaAttentionArgs a = LevelArgs(args, root, OutputMode::kFloat32);
  if (!internal::DecodeKernelCanRun(a)) return false;
  int64_t covered = 0, widest = 0;
  for (const SequenceSlice& s : root) {
    covered += s.q_len;
    widest = std::max(widest, s.q_len * args.shape.group_size());
  }
  if (covered != args.q_tokens) return false;
  static const std::string forced = knobs::Choice(knobs::kPrefixRoot);
  if (forced != "auto") return forced == "decode";
  return widest <= kFoldedTileRows;
}

// Key splits for a root level the decode kernel does not take: as many (tile, KV head, split)
// items as one wave holds. Forced (CPFILL_PREFIX_ROOT=split, the tests), the rule before
// 2026-11-27, which splits more: enough items for two waves, 256 keys a part at least, so short
// roots split too and 8K keys take two merge rounds.
int RootSplits(const CudaAttentionArgs& args, std::span<const SequenceSlice> root) {
  static const bool forced = knobs::Choice(knobs::kPrefixRoot) == "split";
  const int64_t group = args.shape.group_size();
  int64_t tiles = 0, longest = 0;
  for (const SequenceSlice& s : root) {
    if (s.q_len == 0 || s.kv_len == 0) continue;
    tiles += (s.q_len * group + kFoldedTileRows - 1) / kFoldedTileRows;
    longest = std::max(longest, s.kv_len);
  }
  const int64_t items = std::max<int64_t>(1, tiles * args.shape.num_kv_heads);
  const int64_t wanted = forced ? (2 * SmCount() + items - 1) / items : SmCount() / items;
  const int64_t min_keys = forced ? kMinForcedSplitKeys : kMinSplitKeys;
  return static_cast<int>(
      std::clamp<int64_t>(std::min<int64_t>(wanted, longest / min_keys), 1, kMaxSplits));
}

// The root level split `splits` ways: split s's slices read query rows [s * q_tokens, ...) of
// the repeated queries and 1/splits of each slice's keys, in whole blocks where the keys are
// paged (a part then starts where a block does; the last parts may be empty).
std::vector<SequenceSlice> SplitSlices(const CudaAttentionArgs& args,
                                       std::span<const SequenceSlice> root, int splits) {
  const int64_t q_tokens = args.q_tokens;
  const int64_t align = args.paged == nullptr ? 1 : args.paged->block_tokens;
  std::vector<SequenceSlice> out;
  for (int s = 0; s < splits; ++s) {
    for (const SequenceSlice& x : root) {
      const int64_t chunk = ((x.kv_len + splits - 1) / splits + align - 1) / align * align;
      const int64_t begin = std::min(x.kv_len, s * chunk);
      out.push_back({.q_begin = s * q_tokens + x.q_begin,
                     .q_len = x.q_len,
                     .kv_begin = x.kv_begin + begin,
                     .kv_len = std::min(x.kv_len, begin + chunk) - begin});
    }
  }
  return out;
}

// Where a split root level keeps its pieces in the workspace.
struct SplitLayout {
  size_t q = 0, q_pos = 0, o = 0, lse = 0, o_round = 0, lse_round = 0, total = 0;
};

SplitLayout LayoutOf(const CudaAttentionArgs& args, std::span<const SequenceSlice> split,
                     int splits) {
  const size_t rows = static_cast<size_t>(args.q_tokens);
  const size_t values = rows * args.shape.num_heads * args.shape.head_dim;
  const size_t heads = rows * args.shape.num_heads;
  const size_t rounds = (splits + kMaxMergeParts - 1) / kMaxMergeParts;
  CudaAttentionArgs a = LevelArgs(args, split, OutputMode::kFloat32);
  a.q_tokens = static_cast<int64_t>(rows) * splits;
  SplitLayout l;
  l.q = Aligned(AttentionWorkspaceBytes(a));
  l.q_pos = l.q + Aligned(splits * values * sizeof(__nv_bfloat16));
  l.o = l.q_pos + Aligned(splits * rows * sizeof(int32_t));
  l.lse = l.o + Aligned(splits * values * sizeof(float));
  l.o_round = l.lse + Aligned(splits * heads * sizeof(float));
  l.lse_round = l.o_round + Aligned(rounds * values * sizeof(float));
  l.total = l.lse_round + Aligned(rounds * heads * sizeof(float));
  return l;
}

// Copies `bytes` at `p` to fill `copies` * bytes by doubling: log2(copies) copies, not `copies`.
absl::Status Repeat(void* p, size_t bytes, int copies, cudaStream_t stream) {
  char* base = static_cast<char*>(p);
  for (int have = 1; have < copies;) {
    const int more = std::min(have, copies - have);
    if (cudaMemcpyAsync(base + have * bytes, base, more * bytes, cudaMemcpyDeviceToDevice,
                        stream) != cudaSuccess) {
      return absl::InternalError("prefix-batched attention: copying the queries failed");
    }
    have += more;
  }
  return absl::OkStatus();
}

// Merges `parts` fp32 partials laid out back to back into (o, lse): in rounds of at most
// kMaxMergeParts.
absl::Status MergeSplits(const CudaAttentionArgs& args, int parts, float* o_parts, float* lse_parts,
                         float* o_round, float* lse_round, float* o, float* lse,
                         cudaStream_t stream) {
  const size_t values = size_t(args.q_tokens) * args.shape.num_heads * args.shape.head_dim;
  const size_t heads = size_t(args.q_tokens) * args.shape.num_heads;
  auto merge = [&](float* from_o, float* from_lse, int first, int count, float* to_o,
                   float* to_lse) {
    std::vector<const float*> os, ls;
    for (int i = first; i < first + count; ++i) {
      os.push_back(from_o + i * values);
      ls.push_back(from_lse + i * heads);
    }
    return MergePartialsCuda(args.shape, args.q_tokens, os, ls, to_o, nullptr, to_lse, stream);
  };
  if (parts <= kMaxMergeParts) return merge(o_parts, lse_parts, 0, parts, o, lse);
  int rounds = 0;
  for (int first = 0; first < parts; first += kMaxMergeParts, ++rounds) {
    CPFILL_RETURN_IF_ERROR(merge(o_parts, lse_parts, first, std::min(kMaxMergeParts, parts - first),
                                 o_round + rounds * values, lse_round + rounds * heads));
  }
  return merge(o_round, lse_round, 0, rounds, o, lse);
}

// The root level split along its keys: queries repeated, one launch, the parts merged into
// args.o / args.lse.
absl::Status RunSplitRoot(const CudaAttentionArgs& args, std::span<const SequenceSlice> root,
                          int splits, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  const std::vector<SequenceSlice> split = SplitSlices(args, root, splits);
  const SplitLayout l = LayoutOf(args, split, splits);
  CPFILL_CHECK_ARG(workspace_bytes >= l.total, "prefix-batched attention: ", workspace_bytes,
                   " workspace bytes, ", l.total, " needed (PrefixBatchedWorkspaceBytes)");
  char* ws = static_cast<char*>(workspace);
  const size_t q_bytes =
      size_t(args.q_tokens) * args.shape.num_heads * args.shape.head_dim * sizeof(__nv_bfloat16);
  auto* q = reinterpret_cast<__nv_bfloat16*>(ws + l.q);
  auto* q_pos = reinterpret_cast<int32_t*>(ws + l.q_pos);
  if (cudaMemcpyAsync(q, args.q, q_bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess ||
      cudaMemcpyAsync(q_pos, args.q_pos, args.q_tokens * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                      stream) != cudaSuccess) {
    return absl::InternalError("prefix-batched attention: copying the queries failed");
  }
  CPFILL_RETURN_IF_ERROR(Repeat(q, q_bytes, splits, stream));
  CPFILL_RETURN_IF_ERROR(Repeat(q_pos, args.q_tokens * sizeof(int32_t), splits, stream));
  CudaAttentionArgs a = LevelArgs(args, split, OutputMode::kFloat32);
  a.q = q;
  a.q_pos = q_pos;
  a.q_tokens = args.q_tokens * splits;
  a.o = ws + l.o;
  a.lse = reinterpret_cast<float*>(ws + l.lse);
  CPFILL_RETURN_IF_ERROR(PartialAttentionCuda(a, workspace, l.q, stream));
  return MergeSplits(args, splits, reinterpret_cast<float*>(ws + l.o), a.lse,
                     reinterpret_cast<float*>(ws + l.o_round),
                     reinterpret_cast<float*>(ws + l.lse_round), static_cast<float*>(args.o),
                     args.lse, stream);
}

// How the root level runs, decided once per call.
struct RootPlan {
  enum Way { kPlain, kDecode, kSplit } way = kPlain;  // kPlain: PartialAttentionCuda's dispatch
  int splits = 1;
};

RootPlan PlanRoot(const CudaAttentionArgs& args, std::span<const SequenceSlice> root) {
  static const bool forced_split = knobs::Choice(knobs::kPrefixRoot) == "split";
  if (RootOnDecodeKernel(args, root)) return {.way = RootPlan::kDecode};
  // A level of at most 4 rows per slice goes to the decode kernel through the plain launch, and
  // one the plain launch splits along its keys itself (key_split.h: the queries read in place,
  // not copied per split) goes there too.
  const CudaAttentionArgs a = LevelArgs(args, root, OutputMode::kFloat32);
  if (internal::DecodeAttentionApplies(a) || (!forced_split && internal::SplitsKeys(a))) return {};
  const int splits = RootSplits(args, root);
  return splits > 1 ? RootPlan{.way = RootPlan::kSplit, .splits = splits} : RootPlan{};
}

// The workspace the root level needs beyond its plain launch's.
size_t RootWorkspaceBytes(const CudaAttentionArgs& args, std::span<const SequenceSlice> root,
                          const RootPlan& plan) {
  switch (plan.way) {
    case RootPlan::kDecode:
      return internal::DecodeWorkspaceBytes(LevelArgs(args, root, OutputMode::kFloat32));
    case RootPlan::kSplit:
      return LayoutOf(args, SplitSlices(args, root, plan.splits), plan.splits).total;
    case RootPlan::kPlain:
      break;
  }
  return 0;
}

// The root level into fresh fp32 (O, LSE), as planned.
absl::Status RunRoot(const CudaAttentionArgs& args, std::span<const SequenceSlice> root,
                     const RootPlan& plan, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  const CudaAttentionArgs a = LevelArgs(args, root, OutputMode::kFloat32);
  switch (plan.way) {
    case RootPlan::kSplit:
      return RunSplitRoot(args, root, plan.splits, workspace, workspace_bytes, stream);
    case RootPlan::kDecode:
      // ValidateKvTree checked the shapes and bounds, DecodeKernelCanRun the head dim and the
      // alignment: what the launch expects of its caller.
      CPFILL_CHECK_ARG(workspace_bytes >= internal::DecodeWorkspaceBytes(a),
                       "prefix-batched attention: ", workspace_bytes, " workspace bytes, ",
                       internal::DecodeWorkspaceBytes(a), " needed");
      return internal::LaunchDecodeAttention(a, workspace, workspace_bytes, stream);
    case RootPlan::kPlain:
      break;
  }
  return PartialAttentionCuda(a, workspace, workspace_bytes, stream);
}

OutputMode ModeOf(size_t level) {
  return level == 0 ? OutputMode::kFloat32 : OutputMode::kMergeIntoFloat32;
}

// A tree's levels in launch order: level 0, then every later level that holds slices.
std::vector<std::span<const SequenceSlice>> LevelsToRun(const KvLevels& levels) {
  std::vector<std::span<const SequenceSlice>> run;
  for (size_t l = 0; l < levels.size(); ++l) {
    if (l == 0 || !levels[l].empty()) run.emplace_back(levels[l]);
  }
  return run;
}

// Level 0 in args.output's mode (the ring's fresh or folded step), each later level merged into
// it: one plain launch each.
size_t LevelLaunchesBytes(const CudaAttentionArgs& args, const KvLevels& levels) {
  size_t bytes = 0;
  const auto run = LevelsToRun(levels);
  for (size_t l = 0; l < run.size(); ++l) {
    const OutputMode mode = l == 0 ? args.output : OutputMode::kMergeIntoFloat32;
    bytes = std::max(bytes, AttentionWorkspaceBytes(LevelArgs(args, run[l], mode)));
  }
  return bytes;
}

absl::Status LaunchLevels(const CudaAttentionArgs& args, const KvLevels& levels, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  const auto run = LevelsToRun(levels);
  for (size_t l = 0; l < run.size(); ++l) {
    const OutputMode mode = l == 0 ? args.output : OutputMode::kMergeIntoFloat32;
    CPFILL_RETURN_IF_ERROR(
        PartialAttentionCuda(LevelArgs(args, run[l], mode), workspace, workspace_bytes, stream));
  }
  return absl::OkStatus();
}

// Where a gathered step keeps its pieces in the workspace: the copies, the gathered K, V and
// positions, then the attention's own workspace.
struct GatherLayout {
  size_t copies = 0, k = 0, v = 0, pos = 0, attention = 0, total = 0;
};

// args over the gathered rows (at `ws`, laid out as `l`; without them, for sizing only).
CudaAttentionArgs GatheredArgs(const CudaAttentionArgs& args, const PagedGather& plan,
                               char* ws = nullptr, const GatherLayout* l = nullptr) {
  CudaAttentionArgs a = args;
  a.paged = nullptr;
  a.kv_tokens = plan.rows;
  if (ws != nullptr) {
    a.k = reinterpret_cast<const __nv_bfloat16*>(ws + l->k);
    a.v = reinterpret_cast<const __nv_bfloat16*>(ws + l->v);
    a.k_pos = reinterpret_cast<const int32_t*>(ws + l->pos);
  }
  return a;
}

// The levels' workspace: PrefixBatchedAttentionCuda's for a fresh step; a folded one (not a
// ring step the model makes: pass-KV folds, and paged K/V runs on pass-Q) launches each level.
size_t StepLevelsBytes(const CudaAttentionArgs& a, const KvLevels& levels) {
  if (a.output == OutputMode::kFloat32) return PrefixBatchedWorkspaceBytes(a, LevelsToRun(levels));
  return LevelLaunchesBytes(a, levels);
}

// A prefill step's levels, fresh (the root split as planned) or folded, as StepLevelsBytes sizes.
absl::Status RunStepLevels(const CudaAttentionArgs& a, const KvLevels& levels, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream) {
  if (a.output == OutputMode::kFloat32) {
    return PrefixBatchedAttentionCuda(a, LevelsToRun(levels), workspace, workspace_bytes, stream);
  }
  return LaunchLevels(a, levels, workspace, workspace_bytes, stream);
}

GatherLayout GatherLayoutOf(const CudaAttentionArgs& args, const PagedGather& plan) {
  const size_t row = size_t(args.shape.num_kv_heads) * args.shape.head_dim * sizeof(__nv_bfloat16);
  const size_t rows = static_cast<size_t>(plan.rows);
  GatherLayout l;
  l.k = Aligned(plan.copies.size() * sizeof(PagedGather::Copy));
  l.v = l.k + Aligned(rows * row);
  l.pos = l.v + Aligned(rows * row);
  l.attention = l.pos + Aligned(rows * sizeof(int32_t));
  l.total = l.attention + StepLevelsBytes(GatheredArgs(args, plan), plan.levels);
  return l;
}

}  // namespace

size_t PrefixBatchedWorkspaceBytes(const CudaAttentionArgs& args, KvTree levels) {
  size_t bytes = 0;
  for (size_t l = 0; l < levels.size(); ++l) {
    bytes = std::max(bytes, AttentionWorkspaceBytes(LevelArgs(args, levels[l], ModeOf(l))));
  }
  if (!levels.empty()) {
    bytes = std::max(bytes, RootWorkspaceBytes(args, levels[0], PlanRoot(args, levels[0])));
  }
  return bytes;
}

absl::Status PrefixBatchedAttentionCuda(const CudaAttentionArgs& args, KvTree levels,
                                        void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream) {
  CPFILL_RETURN_IF_ERROR(ValidateKvTree(ShapeView(args), levels));
  CPFILL_RETURN_IF_ERROR(
      RunRoot(args, levels[0], PlanRoot(args, levels[0]), workspace, workspace_bytes, stream));
  for (size_t l = 1; l < levels.size(); ++l) {
    CPFILL_RETURN_IF_ERROR(PartialAttentionCuda(LevelArgs(args, levels[l], ModeOf(l)), workspace,
                                                workspace_bytes, stream));
  }
  return absl::OkStatus();
}

size_t SharedBlocksWorkspaceBytes(const CudaAttentionArgs& args, const SharedBlockTree& tree) {
  return LevelLaunchesBytes(args, tree.levels);
}

absl::Status SharedBlocksAttentionCuda(const CudaAttentionArgs& args, const SharedBlockTree& tree,
                                       void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream) {
  CPFILL_CHECK_ARG(args.output != OutputMode::kBfloat16,
                   "prefix-batched attention merges its levels in fp32: no bf16 output");
  return LaunchLevels(args, tree.levels, workspace, workspace_bytes, stream);
}

bool InPlaceBeatsGather(const AttentionShape& shape, const PagedGather& plan,
                        std::span<const SequenceSlice> slices) {
  double pairs = 0;  // (query, key) pairs the attention computes
  for (const SequenceSlice& s : slices) {
    const double keys = shape.causal ? std::max<double>(0, s.kv_len - s.q_len / 2.0) : s.kv_len;
    pairs += static_cast<double>(s.q_len) * keys;
  }
  const double flops = 4.0 * shape.head_dim * shape.num_heads * pairs;
  const double gathered_bytes = 2.0 * plan.rows * shape.num_kv_heads * shape.head_dim * 2;  // K, V
  const double gather_seconds = 2.0 * gathered_bytes / kHbmBytesPerSecond;  // read and write
  return flops > 0 && gather_seconds >= kMinGatherShare * flops / kAttentionFlopsPerSecond;
}

bool FlatStepReadsInPlace(const AttentionShape& shape, std::span<const SequenceSlice> slices,
                          const PagedKv& paged) {
  const SharedBlockTree flat{.levels = {{slices.begin(), slices.end()}}};
  return InPlaceBeatsGather(shape, PlanPagedGather(flat, paged, paged.host_table), slices);
}

size_t GatheredPagedWorkspaceBytes(const CudaAttentionArgs& args, const PagedGather& plan) {
  return GatherLayoutOf(args, plan).total;
}

absl::Status GatheredPagedAttentionCuda(const CudaAttentionArgs& args, const PagedGather& plan,
                                        void* workspace, size_t workspace_bytes,
                                        cudaStream_t stream,
                                        const PagedGather::Copy* device_copies) {
  CPFILL_CHECK_ARG(args.paged != nullptr, "gathered paged attention: no paged K/V");
  CPFILL_CHECK_ARG(args.output != OutputMode::kBfloat16,
                   "prefix-batched attention merges its levels in fp32: no bf16 output");
  const GatherLayout l = GatherLayoutOf(args, plan);
  CPFILL_CHECK_ARG(workspace_bytes >= l.total, "gathered paged attention: ", workspace_bytes,
                   " workspace bytes, ", l.total, " needed (GatheredPagedWorkspaceBytes)");
  char* ws = static_cast<char*>(workspace);
  const size_t copy_bytes = plan.copies.size() * sizeof(PagedGather::Copy);
  // From pageable memory: returns once the bytes are staged, so the plan may go.
  if (device_copies == nullptr && copy_bytes > 0 &&
      cudaMemcpyAsync(ws + l.copies, plan.copies.data(), copy_bytes, cudaMemcpyHostToDevice,
                      stream) != cudaSuccess) {
    return absl::InternalError("gathered paged attention: uploading the copies failed");
  }
  const auto* copies = device_copies != nullptr
                           ? device_copies
                           : reinterpret_cast<const PagedGather::Copy*>(ws + l.copies);
  const CudaAttentionArgs a = GatheredArgs(args, plan, ws, &l);
  CPFILL_RETURN_IF_ERROR(
      GatherPagedRowsCuda({.copies = copies,
                           .num_copies = static_cast<int64_t>(plan.copies.size()),
                           .max_copy_rows = args.paged->block_tokens,
                           .k_pool = args.k,
                           .v_pool = args.v,
                           .block_stride_bytes = args.paged->block_stride_bytes,
                           .row_bytes = int64_t{args.shape.num_kv_heads} * args.shape.head_dim * 2,
                           .k_pos = args.k_pos,
                           .k_out = const_cast<__nv_bfloat16*>(a.k),
                           .v_out = const_cast<__nv_bfloat16*>(a.v),
                           .k_pos_out = const_cast<int32_t*>(a.k_pos)},
                          stream));
  return RunStepLevels(a, plan.levels, ws + l.attention, workspace_bytes - l.attention, stream);
}

size_t InPlacePagedWorkspaceBytes(const CudaAttentionArgs& args, const SharedBlockTree& tree) {
  CudaAttentionArgs a = args;
  a.paged_prefill = true;
  return StepLevelsBytes(a, tree.levels);
}

absl::Status InPlacePagedAttentionCuda(const CudaAttentionArgs& args, const SharedBlockTree& tree,
                                       void* workspace, size_t workspace_bytes,
                                       cudaStream_t stream) {
  CPFILL_CHECK_ARG(args.paged != nullptr && ReadsPagedPrefillInPlace(args.shape, *args.paged),
                   "in-place paged attention: paged K/V this device does not read in place");
  CPFILL_CHECK_ARG(args.output != OutputMode::kBfloat16,
                   "prefix-batched attention merges its levels in fp32: no bf16 output");
  CudaAttentionArgs a = args;
  a.paged_prefill = true;
  return RunStepLevels(a, tree.levels, workspace, workspace_bytes, stream);
}

SharedBlockRule StepRuleOnGpu(std::span<const SequenceSlice> slices, const TreeCosts& costs,
                              bool flat_in_place) {
  SharedBlockRule rule = RuleForStep(slices, costs);
  if (!GathersPagedKv(slices)) {
    rule.max_root_rows = std::numeric_limits<int64_t>::max();
  } else if (flat_in_place && costs.merge_cost > 0) {
    rule.costs.merge_cost = std::max(costs.merge_cost, kMergeCostAgainstInPlace);
  }
  return rule;
}

WideRootRule WideRootRuleOf(const AttentionShape& shape) {
  const int64_t row_bytes = int64_t{shape.num_kv_heads} * shape.head_dim * 2 * 2;  // K and V
  return {.min_packed_rows = kMinWideRootRows,
          .max_rows = kMaxWideRootBytes / row_bytes,
          .rows_per_read = 16,
          .min_reread_values = kMinWideRootRereads,
          .rows_per_tile = kFoldedTileRows,
          .min_tiles = kMinWideRootTiles};
}

size_t WideRootsWorkspaceBytes(const CudaAttentionArgs& args, const WideRootsPlan& plan) {
  size_t bytes = GatheredPagedWorkspaceBytes(args, plan.gathered);
  for (const std::vector<SequenceSlice>& level : plan.in_place) {
    if (level.empty()) continue;
    bytes = std::max(
        bytes, AttentionWorkspaceBytes(LevelArgs(args, level, OutputMode::kMergeIntoFloat32)));
  }
  return bytes;
}

bool WideRootsInPlaceAsked(const WideRootsPlan& plan, int cp_size) {
  static const std::string knob = knobs::Choice(knobs::kDecodeWideRoots);
  const bool asked = knob == "in-place" || (knob == "auto" && cp_size == 1);
  return asked && !plan.gathered.copies.empty() &&
         (plan.in_place.empty() || plan.in_place[0].empty());
}

absl::Status WideRootsAttentionCuda(const CudaAttentionArgs& args, const WideRootsPlan& plan,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream,
                                    const PagedGather::Copy* device_copies) {
  CPFILL_CHECK_ARG(args.output == OutputMode::kFloat32,
                   "wide roots: a fresh fp32 output only (the gathered roots write every row)");
  CPFILL_CHECK_ARG(!plan.gathered.copies.empty(), "wide roots: none to gather");
  CPFILL_CHECK_ARG(workspace_bytes >= WideRootsWorkspaceBytes(args, plan),
                   "wide roots: ", workspace_bytes, " workspace bytes, ",
                   WideRootsWorkspaceBytes(args, plan), " needed (WideRootsWorkspaceBytes)");
  CPFILL_RETURN_IF_ERROR(GatheredPagedAttentionCuda(args, plan.gathered, workspace, workspace_bytes,
                                                    stream, device_copies));
  // The gathered rows are not read again: the workspace serves the in-place levels, in order.
  for (const std::vector<SequenceSlice>& level : plan.in_place) {
    if (level.empty()) continue;
    CPFILL_RETURN_IF_ERROR(PartialAttentionCuda(
        LevelArgs(args, level, OutputMode::kMergeIntoFloat32), workspace, workspace_bytes, stream));
  }
  return absl::OkStatus();
}

}  // namespace cpfill::attention::cuda
