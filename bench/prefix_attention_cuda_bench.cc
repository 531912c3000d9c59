// Prefix-batched attention on the GPU (attention/cuda/prefix_batched_cuda.h), on the path the
// engine runs: B sequences that share a P-token prefix, each with S tokens of its own, in a KV
// cache's blocks (64 tokens, the engine's default) whose tables start with the same prefix blocks,
// one attention step as parallel/cuda/cuda_ring_ops.cc runs it:
//   decode:  one query per sequence (its newest token) against P + S keys, read in place:
//            FindSharedBlocks' roots (attention/prefix_batched.h) on the decode kernel
//            (SharedBlocksAttentionCuda), or the plain paged launch where it finds none; roots
//            of more than 128 packed rows gathered first (WideRootsAttentionCuda);
//   suffix:  S queries per sequence (the prefill of its suffix after the cached prefix), causal:
//            gathered, the shared blocks once (GatheredPagedAttentionCuda), or read in place by
//            the Hopper kernel (InPlacePagedAttentionCuda) where the engine would
//            (InPlaceBeatsGather); one root over every sequence's queries on the prefill
//            kernels.
// Each shape runs twice: "cpfill" with prefix batching (the engine's default), and "cpfill-flat"
// with no roots, every sequence reading its own keys (a gathered suffix prefill then gathers
// each sequence's keys whole, skipped past 16 GiB). Each step is planned (and a gathered step's
// copies uploaded) before timing, as the engine plans once per forward for all its layers;
// "plan_us" is that host time. Timed with CUDA events behind a spin kernel (median of 15 after 3
// warm-ups); the prefix blocks rotate over copies that together exceed 256 MiB, so every call reads
// them from HBM. The HBM floor reads the prefix once, every suffix, Q, and writes O in bf16, at the
// device-to-device copy rate measured in the same run. bench/gpu/prefix_peer.py times per-sequence
// peers on the same shapes.
//
//   build/bench/prefix_attention_cuda_bench [--quick] > prefix.jsonl   (one JSON object a line)
//   build/bench/prefix_attention_cuda_bench --shape suffix:32:8:4096:256:1 [--shape ...]
//                                            (mode:heads:kv_heads:prefix:suffix:batch, e.g. for
//                                            ncu)
//   --block-tokens N: the KV cache's blocks (default 64); --shuffle-blocks: the blocks in a random
//   order of the pool (a fragmented KV cache; default: in the order a fresh KV cache hands them
//   out, consecutive); CPFILL_PAGED_PREFILL=in-place|gather: suffix prefills read the blocks in
//   place (the Hopper kernel) or gather them, always (default auto: as the engine chooses, in
//   place where the gather would cost more; "in_place" in each line says which ran)
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention/cuda/attention_cuda.h"
#include "attention/cuda/prefix_batched_cuda.h"
#include "attention/prefix_batched.h"
#include "base/knobs.h"
#include "bench/gpu_spin.h"

namespace cpfill::attention::cuda {
namespace {

constexpr int kDim = 128;
int block_tokens = 64;  // --block-tokens: the KV cache's (64, the engine's default)
// --shuffle-blocks: the pool's blocks in a random order (a fragmented KV cache) instead of the
// order a fresh KV cache hands them out in (lowest free block first: consecutive).
bool shuffle_blocks = false;
constexpr size_t kRotateBytes = size_t{256} << 20;

struct Shape {
  std::string mode;  // decode | suffix
  int heads, kv_heads;
  int64_t prefix, suffix, batch;
  int64_t queries() const { return mode == "decode" ? batch : batch * suffix; }
};

void* Alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) return nullptr;
  return p;
}

// Random bf16 in [-1, 1] (never zeros: they time differently): up to 4M values drawn on the host,
// the rest copies of them made on the device (drawing gigabytes on the host took minutes).
void FillRandom(__nv_bfloat16* d, size_t n, uint64_t seed) {
  const size_t drawn = std::min<size_t>(n, size_t{1} << 22);
  std::vector<__nv_bfloat16> h(drawn);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto& x : h) x = __float2bfloat16(u(rng));
  cudaMemcpy(d, h.data(), drawn * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
  for (size_t have = drawn; have < n;) {
    const size_t more = std::min(have, n - have);
    cudaMemcpy(d + have, d, more * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice);
    have += more;
  }
}

template <typename Fn>
double MedianUs(Fn&& fn) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<double> us;
  for (int i = 0; i < 15; ++i) {
    bench::SpinGpu(300'000, nullptr);
    cudaEventRecord(start);
    fn(i);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    us.push_back(ms * 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Device-to-device copy rate: bytes read plus written per second.
double CopyGBps() {
  const size_t bytes = size_t{1} << 30;
  void* a = Alloc(bytes);
  void* b = Alloc(bytes);
  cudaMemset(a, 1, bytes);
  const double us = MedianUs([&](int) { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (us * 1e-6) / 1e9;
}

// A shape's device memory; everything null when one allocation failed.
struct Buffers {
  __nv_bfloat16 *k = nullptr, *v = nullptr, *q = nullptr;
  float *o = nullptr, *lse = nullptr;
  int32_t *q_pos = nullptr, *k_pos = nullptr, *table = nullptr;
  std::vector<void*> all;
  bool ok = true;
  template <typename T>
  void Get(T** p, size_t bytes) {
    *p = static_cast<T*>(Alloc(bytes));
    ok = ok && *p != nullptr;
    all.push_back(*p);
  }
  ~Buffers() {
    for (void* p : all) cudaFree(p);
  }
};

// The step's paged layout: sequence b's local key rows [b * (P + S), (b + 1) * (P + S)), its
// table the prefix blocks of the copy in use, then blocks of its own. One host table per copy.
struct Layout {
  int64_t blocks_per_seq = 0, prefix_blocks = 0, pool_blocks = 0;
  std::vector<std::vector<int32_t>> tables;  // [copy][b * blocks_per_seq + j]
  std::vector<int64_t> seq_kv_begin, seq_table_begin;
  std::vector<SequenceSlice> slices;
  std::vector<int32_t> q_pos, k_pos;
};

Layout MakeLayout(const Shape& s, int copies) {
  Layout l;
  const int64_t len = s.prefix + s.suffix;
  l.prefix_blocks = s.prefix / block_tokens;
  l.blocks_per_seq = (len + block_tokens - 1) / block_tokens;
  const int64_t own = l.blocks_per_seq - l.prefix_blocks;
  l.pool_blocks = copies * l.prefix_blocks + s.batch * own;
  l.tables.resize(copies);
  for (int c = 0; c < copies; ++c) {
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t j = 0; j < l.prefix_blocks; ++j) {
        l.tables[c].push_back(static_cast<int32_t>(c * l.prefix_blocks + j));
      }
      for (int64_t j = 0; j < own; ++j) {
        l.tables[c].push_back(static_cast<int32_t>(copies * l.prefix_blocks + b * own + j));
      }
    }
  }
  if (shuffle_blocks) {
    std::vector<int32_t> perm(l.pool_blocks);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(l.pool_blocks));
    for (auto& table : l.tables) {
      for (int32_t& id : table) id = perm[id];
    }
  }
  const int64_t rows = s.mode == "decode" ? 1 : s.suffix;
  for (int64_t b = 0; b < s.batch; ++b) {
    l.seq_kv_begin.push_back(b * len);
    l.seq_table_begin.push_back(b * l.blocks_per_seq);
    l.slices.push_back({.q_begin = b * rows, .q_len = rows, .kv_begin = b * len, .kv_len = len});
    for (int64_t i = 0; i < len; ++i) l.k_pos.push_back(static_cast<int32_t>(i));
    for (int64_t i = 0; i < rows; ++i) l.q_pos.push_back(static_cast<int32_t>(len - rows + i));
  }
  return l;
}

// CPFILL_PAGED_PREFILL as the engine reads it: "in-place" (always, where the Hopper kernel can),
// "gather" (never), or "auto": in place where the gather would cost more (InPlaceBeatsGather).
bool InPlaceAsked() {
  static const bool asked = knobs::Choice(knobs::kPagedPrefill) == "in-place";
  return asked;
}
bool GatherAsked() {
  static const bool asked = knobs::Choice(knobs::kPagedPrefill) == "gather";
  return asked;
}

// One step as CudaRingOps::Attend runs it, planned once (the engine plans a forward's steps once
// for all its layers, and uploads a gathered step's copies once): roots where FindSharedBlocks
// finds them (only with the host table) under the GPU's costs, else the plain launch; a prefill
// step gathered, or read in place as the engine chooses (CudaRingOps::AttendGathered).
struct PlannedStep {
  SharedBlockTree tree;
  PagedGather gather;
  WideRootsPlan wide;  // a decode step's wide roots (gather.copies empty then)
  bool gathered = false;
  bool in_place = false;   // a gathered step read in place instead (the Hopper kernel)
  void* copies = nullptr;  // gather.copies, or wide.gathered.copies, in device memory
  size_t workspace_bytes = 0;
  double plan_us = 0;  // host time of FindSharedBlocks and PlanPagedGather
  PlannedStep() = default;
  PlannedStep(const PlannedStep&) = delete;
  PlannedStep& operator=(const PlannedStep&) = delete;
  ~PlannedStep() { cudaFree(copies); }
};

void Plan(const CudaAttentionArgs& args, const PagedKv& paged, std::span<const int32_t> table,
          bool batched, PlannedStep* p) {
  const auto start = std::chrono::steady_clock::now();
  const std::span<const SequenceSlice> slices(args.slices, args.num_slices);
  // The flat step read in place as the engine would read it (CudaRingOps::StepRule).
  const bool flat_in_place = GathersPagedKv(slices) && !GatherAsked() &&
                             ReadsPagedPrefillInPlace(args.shape, paged) &&
                             (InPlaceAsked() || FlatStepReadsInPlace(args.shape, slices, paged));
  // Flat: a tree of no roots (no sharing spares enough).
  const SharedBlockRule rule = batched
                                   ? StepRuleOnGpu(slices, kGpuTreeCosts, flat_in_place)
                                   : RuleForStep(slices, {.min_saved_values = int64_t{1} << 62});
  p->tree = FindSharedBlocks(args.shape, slices, paged, rule);
  p->gathered = GathersPagedKv(slices);
  if (p->gathered) {
    p->gather = PlanPagedGather(p->tree, paged, table);
    p->in_place = !GatherAsked() && ReadsPagedPrefillInPlace(args.shape, paged) &&
                  (InPlaceAsked() || InPlaceBeatsGather(args.shape, p->gather, slices));
    if (p->in_place) p->gather = {};
  } else {
    p->wide = PlanWideRoots(args.shape, p->tree, paged, table, WideRootRuleOf(args.shape));
    // The wide roots read in place as CudaRingOps::Attend reads them on a ring of one rank
    // (CPFILL_PAGED_PREFILL=gather: never in place, as there).
    p->in_place = WideRootsInPlaceAsked(p->wide, /*cp_size=*/1) && !GatherAsked() &&
                  ReadsPagedPrefillInPlace(args.shape, paged);
    if (p->in_place) p->wide = {};
  }
  p->plan_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  const std::vector<PagedGather::Copy>& copies =
      p->gathered ? p->gather.copies : p->wide.gathered.copies;
  if (!copies.empty()) {
    const size_t bytes = copies.size() * sizeof(PagedGather::Copy);
    p->copies = Alloc(bytes);
    cudaMemcpy(p->copies, copies.data(), bytes, cudaMemcpyHostToDevice);
  }
  if (p->in_place) {
    p->workspace_bytes = InPlacePagedWorkspaceBytes(args, p->tree);
  } else if (p->gathered) {
    p->workspace_bytes = GatheredPagedWorkspaceBytes(args, p->gather);
  } else if (p->copies != nullptr) {
    p->workspace_bytes = WideRootsWorkspaceBytes(args, p->wide);
  } else {
    p->workspace_bytes = p->tree.counts.roots > 0 ? SharedBlocksWorkspaceBytes(args, p->tree)
                                                  : AttentionWorkspaceBytes(args);
  }
}

absl::Status Launch(const CudaAttentionArgs& args, const PlannedStep& p, void* ws, size_t bytes) {
  if (p.in_place) return InPlacePagedAttentionCuda(args, p.tree, ws, bytes, nullptr);
  if (p.gathered) {
    return GatheredPagedAttentionCuda(args, p.gather, ws, bytes, nullptr,
                                      static_cast<const PagedGather::Copy*>(p.copies));
  }
  if (p.copies != nullptr) {
    return WideRootsAttentionCuda(args, p.wide, ws, bytes, nullptr,
                                  static_cast<const PagedGather::Copy*>(p.copies));
  }
  if (p.tree.counts.roots > 0) return SharedBlocksAttentionCuda(args, p.tree, ws, bytes, nullptr);
  return PartialAttentionCuda(args, ws, bytes, nullptr);
}

void PrintError(const Shape& s, const char* impl, const std::string& error) {
  std::printf(
      "{\"impl\":\"%s\",\"mode\":\"%s\",\"heads\":%d,\"kv_heads\":%d,\"prefix\":%ld,"
      "\"suffix\":%ld,\"batch\":%ld,\"error\":\"%s\"}\n",
      impl, s.mode.c_str(), s.heads, s.kv_heads, s.prefix, s.suffix, s.batch, error.c_str());
}

// Rows a flat suffix prefill gathers (every sequence's keys whole) past which it is skipped.
constexpr double kMaxFlatGatherBytes = 16.0 * (size_t{1} << 30);

// One shape, batched and flat.
void Run(const Shape& s, double copy_gbps) {
  const int64_t row = int64_t{s.kv_heads} * kDim;
  const int64_t prefix_bytes = 2 * s.prefix * row * 2;
  const int copies = static_cast<int>(std::clamp<int64_t>(
      (kRotateBytes + prefix_bytes - 1) / std::max<int64_t>(prefix_bytes, 1), 1, 16));
  const Layout l = MakeLayout(s, copies);
  const int64_t q = s.queries();
  const int64_t kv_tokens = s.batch * (s.prefix + s.suffix);
  const size_t pool_elems = size_t(l.pool_blocks) * block_tokens * row;
  Buffers d;
  d.Get(&d.k, pool_elems * 2);
  d.Get(&d.v, pool_elems * 2);
  d.Get(&d.q, q * s.heads * kDim * 2);
  d.Get(&d.o, q * s.heads * kDim * 4);
  d.Get(&d.lse, q * s.heads * 4);
  d.Get(&d.q_pos, q * 4);
  d.Get(&d.k_pos, kv_tokens * 4);
  d.Get(&d.table, l.tables[0].size() * 4 * copies);
  if (!d.ok) {
    PrintError(s, "cpfill", "out of memory");
    return;
  }
  FillRandom(d.k, pool_elems, 1);
  FillRandom(d.v, pool_elems, 2);
  FillRandom(d.q, q * s.heads * kDim, 3);
  cudaMemcpy(d.k_pos, l.k_pos.data(), l.k_pos.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d.q_pos, l.q_pos.data(), l.q_pos.size() * 4, cudaMemcpyHostToDevice);
  const size_t table_entries = l.tables[0].size();
  for (int c = 0; c < copies; ++c) {
    cudaMemcpy(d.table + c * table_entries, l.tables[c].data(), table_entries * 4,
               cudaMemcpyHostToDevice);
  }
  const AttentionShape shape{.num_heads = s.heads,
                             .num_kv_heads = s.kv_heads,
                             .head_dim = kDim,
                             .softmax_scale = 1.0f / std::sqrt(float(kDim)),
                             .causal = true};
  const double floor_bytes =
      double(s.prefix + s.batch * s.suffix) * row * 2 * 2 + double(q) * s.heads * kDim * 2 * 2;
  const double floor_us = floor_bytes / (copy_gbps * 1e9) * 1e6;
  for (const bool batched : {true, false}) {
    const char* impl = batched ? "cpfill" : "cpfill-flat";
    const bool in_place =
        s.mode == "suffix" && InPlaceAsked() &&
        ReadsPagedPrefillInPlace(shape, {.block_tokens = block_tokens,
                                         .block_stride_bytes = block_tokens * row * 2,
                                         .host_table = l.tables[0]});
    if (!batched && !in_place && s.mode == "suffix" &&
        double(kv_tokens) * row * 2 * 2 > kMaxFlatGatherBytes) {
      PrintError(s, impl, "skipped: the gathered keys exceed 16 GiB");
      continue;
    }
    std::vector<PagedKv> paged(copies);
    for (int c = 0; c < copies; ++c) {
      paged[c] = {.table = d.table + c * table_entries,
                  .block_tokens = block_tokens,
                  .block_stride_bytes = int64_t{block_tokens} * row * 2,
                  .seq_kv_begin = l.seq_kv_begin,
                  .seq_table_begin = l.seq_table_begin,
                  .host_table = l.tables[c],
                  .pool_blocks = l.pool_blocks};
    }
    std::vector<CudaAttentionArgs> args(copies);
    std::vector<PlannedStep> steps(copies);
    size_t ws_bytes = 0;
    for (int c = 0; c < copies; ++c) {
      args[c] = {.shape = shape,
                 .q = d.q,
                 .q_pos = d.q_pos,
                 .q_tokens = q,
                 .k = d.k,
                 .v = d.v,
                 .k_pos = d.k_pos,
                 .kv_tokens = kv_tokens,
                 .slices = l.slices.data(),
                 .num_slices = static_cast<int64_t>(l.slices.size()),
                 .output = OutputMode::kFloat32,
                 .o = d.o,
                 .lse = d.lse,
                 .paged = &paged[c]};
      Plan(args[c], paged[c], l.tables[c], batched, &steps[c]);
      ws_bytes = std::max(ws_bytes, steps[c].workspace_bytes);
    }
    void* ws = Alloc(ws_bytes);
    std::string error = ws == nullptr ? "workspace: out of memory" : "";
    const double us = error.empty() ? MedianUs([&](int i) {
      const int c = i % copies;
      const absl::Status st = Launch(args[c], steps[c], ws, ws_bytes);
      if (!st.ok()) error = std::string(st.message());
    })
                                    : 0;
    cudaFree(ws);
    if (!error.empty()) {
      PrintError(s, impl, error);
      continue;
    }
    std::printf(
        "{\"impl\":\"%s\",\"mode\":\"%s\",\"heads\":%d,\"kv_heads\":%d,\"prefix\":%ld,"
        "\"suffix\":%ld,\"batch\":%ld,\"us\":%.2f,\"floor_us\":%.2f,\"roots\":%ld,"
        "\"in_place\":%s,\"plan_us\":%.1f}\n",
        impl, s.mode.c_str(), s.heads, s.kv_heads, s.prefix, s.suffix, s.batch, us, floor_us,
        steps[0].tree.counts.roots, steps[0].in_place ? "true" : "false", steps[0].plan_us);
    std::fflush(stdout);
  }
}

// The grid of bench/RESULTS.md's "Shared prefixes" (bench/gpu/prefix_peer.py runs the peers on the
// same): prefixes 1K-64K, 8:1 and 32:8 heads, decode with suffixes of 1 and 2K keys at batch 1-256,
// and suffix prefills of 256 and 2K tokens at batches up to 64K query tokens.
std::vector<Shape> Grid(bool quick) {
  std::vector<Shape> grid;
  const std::vector<int64_t> prefixes =
      quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{1024, 4096, 16384, 65536};
  for (const auto& [heads, kv_heads] : {std::pair{8, 1}, std::pair{32, 8}}) {
    for (int64_t p : prefixes) {
      for (int64_t suffix : {int64_t{1}, int64_t{2048}}) {
        for (int64_t b : {1, 8, 32, 64, 256})
          grid.push_back({"decode", heads, kv_heads, p, suffix, b});
      }
      for (int64_t suffix : {int64_t{256}, int64_t{2048}}) {
        for (int64_t b : {1, 8, 32, 256}) {
          if (b * suffix <= 65536) grid.push_back({"suffix", heads, kv_heads, p, suffix, b});
        }
      }
    }
  }
  return grid;
}

// "mode:heads:kv_heads:prefix:suffix:batch", or false.
bool ParseShape(const char* text, Shape* s) {
  char mode[16] = {};
  long p = 0, suffix = 0, batch = 0;
  if (std::sscanf(text, "%15[a-z]:%d:%d:%ld:%ld:%ld", mode, &s->heads, &s->kv_heads, &p, &suffix,
                  &batch) != 6) {
    return false;
  }
  s->mode = mode;
  s->prefix = p;
  s->suffix = suffix;
  s->batch = batch;
  return (s->mode == "decode" || s->mode == "suffix") && s->heads > 0 && s->kv_heads > 0 &&
         s->heads % s->kv_heads == 0 && p >= 0 && p % block_tokens == 0 && suffix > 0 && batch > 0;
}

}  // namespace
}  // namespace cpfill::attention::cuda

int main(int argc, char** argv) {
  using namespace cpfill::attention::cuda;
  // Flags first, then the shapes: a shape's prefix must be whole blocks of --block-tokens.
  bool quick = false, ok = true;
  std::vector<const char*> shape_args;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
      shape_args.push_back(argv[++i]);
    } else if (std::strcmp(argv[i], "--block-tokens") == 0 && i + 1 < argc &&
               std::atoi(argv[i + 1]) >= 16) {
      block_tokens = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--shuffle-blocks") == 0) {
      shuffle_blocks = true;
    } else {
      ok = false;
    }
  }
  std::vector<Shape> shapes;
  for (const char* text : shape_args) {
    Shape s;
    ok = ok && ParseShape(text, &s);
    shapes.push_back(s);
  }
  if (shapes.empty()) shapes = Grid(quick);
  for (const Shape& s : shapes) ok = ok && s.prefix % block_tokens == 0;
  if (!ok) {
    std::fprintf(stderr,
                 "usage: prefix_attention_cuda_bench [--quick] [--block-tokens N] "
                 "[--shuffle-blocks] [--shape mode:heads:kv_heads:prefix:suffix:batch ...]\n"
                 "  mode decode|suffix, every prefix a multiple of the block tokens (%d)\n",
                 block_tokens);
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "prefix_attention_cuda_bench: no CUDA device visible\n");
    return 77;
  }
  const double gbps = CopyGBps();
  std::printf("{\"copy_GBps\":%.1f}\n", gbps);
  for (const Shape& s : shapes) Run(s, gbps);
  return 0;
}
