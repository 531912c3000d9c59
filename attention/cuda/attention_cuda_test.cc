// GPU tests of the CUDA attention backend: every case against the naive fp64 reference on fresh
// random inputs (rounded to bf16 first, so both see the same numbers), outputs poisoned with NaN
// before each run. Exits 77 (CTest: skipped) on a machine without a GPU.
#include "attention/cuda/attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attention/attention.h"
#include "attention/cuda/attention_decode.h"
#include "attention/cuda/hopper_key_tile.h"
#include "attention/cuda/key_split.h"
#include "attention/reference.h"
#include "base/knobs.h"
#include "gtest/gtest.h"

namespace cpfill::attention::cuda {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

// An owning device allocation.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) {
    void* p = nullptr;
    if (n_ > 0 && cudaMalloc(&p, n_ * sizeof(T)) == cudaSuccess) p_ = static_cast<T*>(p);
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  T* get() const { return p_; }
  void Upload(const std::vector<T>& h) {
    if (n_ > 0) cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> h(n_);
    if (n_ > 0) cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

struct Case {
  std::string name;
  int heads = 16, kv_heads = 1, dim = 128;
  bool causal = true;
  int64_t q_tokens = 0, kv_tokens = 0;
  std::vector<int32_t> q_pos, k_pos;
  std::vector<SequenceSlice> slices;
  float amplitude = 2.0f;  // input range; larger makes the softmax peakier
};

// Host inputs rounded through bf16, and the same numbers as bf16 for the device.
struct Inputs {
  std::vector<float> q, k, v;
  std::vector<__nv_bfloat16> qb, kb, vb;
};

Inputs MakeInputs(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-c.amplitude, c.amplitude);
  Inputs in;
  auto fill = [&](std::vector<float>& f, std::vector<__nv_bfloat16>& b, size_t n) {
    f.resize(n);
    b.resize(n);
    for (size_t i = 0; i < n; ++i) {
      b[i] = __float2bfloat16(u(rng));
      f[i] = __bfloat162float(b[i]);
    }
  };
  fill(in.q, in.qb, c.q_tokens * c.heads * c.dim);
  fill(in.k, in.kb, c.kv_tokens * c.kv_heads * c.dim);
  fill(in.v, in.vb, c.kv_tokens * c.kv_heads * c.dim);
  return in;
}

AttentionShape ShapeOf(const Case& c) {
  return AttentionShape{.num_heads = c.heads,
                        .num_kv_heads = c.kv_heads,
                        .head_dim = c.dim,
                        .softmax_scale = 1.0f / std::sqrt(float(c.dim)),
                        .causal = c.causal};
}

// What the comparison found.
struct Errors {
  double rel_fro_o = 0;    // ||O - ref|| / ||ref|| over rows that see keys
  double max_abs_lse = 0;  // over rows with finite reference LSE
  int64_t bad_empty = 0;   // rows that must be empty (LSE -inf, O 0) but are not, or vice versa
  int64_t unwritten = 0;   // NaN left from the poison
};

Errors Compare(const Case& c, const std::vector<float>& o, const std::vector<float>& lse,
               const std::vector<double>& o_ref, const std::vector<double>& lse_ref) {
  Errors e;
  double d2 = 0, r2 = 0;
  for (int64_t row = 0; row < c.q_tokens * c.heads; ++row) {
    const bool ref_empty = std::isinf(lse_ref[row]);
    if (std::isnan(lse[row])) ++e.unwritten;
    if (ref_empty != (std::isinf(lse[row]) && lse[row] < 0)) ++e.bad_empty;
    if (!ref_empty) e.max_abs_lse = std::max(e.max_abs_lse, std::fabs(lse[row] - lse_ref[row]));
    for (int d = 0; d < c.dim; ++d) {
      const float x = o[row * c.dim + d];
      if (std::isnan(x)) ++e.unwritten;
      if (ref_empty) {
        if (x != 0.f) ++e.bad_empty;
        continue;
      }
      d2 += (x - o_ref[row * c.dim + d]) * (x - o_ref[row * c.dim + d]);
      r2 += o_ref[row * c.dim + d] * o_ref[row * c.dim + d];
    }
  }
  e.rel_fro_o = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  return e;
}

void ExpectGood(const Errors& e, const std::string& what) {
  EXPECT_LE(e.rel_fro_o, 1e-2) << what;    // bf16 inputs and P: about 3e-3 expected
  EXPECT_LE(e.max_abs_lse, 2e-3) << what;  // LSE accumulates in fp32
  EXPECT_EQ(e.bad_empty, 0) << what;
  EXPECT_EQ(e.unwritten, 0) << what;
}

// Runs one case in `mode` on the GPU and returns O (as fp32) and LSE.
struct PagedPool;
void RunOnGpu(const Case& c, const Inputs& in, OutputMode mode, std::vector<float>* o,
              std::vector<float>* lse, const std::vector<float>* running_o = nullptr,
              const std::vector<float>* running_lse = nullptr, const PagedPool* pool = nullptr,
              cudaEvent_t exchange_done = nullptr);

// K/V as a KV cache holds them: each sequence's rows (the distinct kv_begin of the case's
// slices) in shuffled blocks of `block_tokens` rows of a pool whose every other row is NaN; with
// `in_order`, in blocks handed out in pool order after three spare ones (consecutive blocks: the
// Hopper kernel's whole-tile loads).
struct PagedPool {
  int block_tokens = 0;
  bool host_table = false;  // give the table in host memory too (the Hopper kernel's condition)
  int64_t row_elems = 0;
  std::vector<__nv_bfloat16> k, v;  // [blocks][block_tokens][row_elems]
  std::vector<int32_t> table;
  std::vector<int64_t> seq_kv_begin, seq_table_begin;
};

PagedPool MakePagedPool(const Case& c, const Inputs& in, int block_tokens, uint64_t seed,
                        bool in_order = false) {
  PagedPool pool{.block_tokens = block_tokens, .row_elems = int64_t{c.kv_heads} * c.dim};
  std::map<int64_t, int64_t> seqs;  // kv_begin -> rows
  for (const SequenceSlice& s : c.slices) {
    if (s.kv_len > 0) seqs[s.kv_begin] = std::max(seqs[s.kv_begin], s.kv_len);
  }
  int64_t blocks = 3;  // spare blocks nobody uses
  for (auto [begin, rows] : seqs) blocks += (rows + block_tokens - 1) / block_tokens;
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  if (in_order) {
    std::rotate(ids.begin(), ids.begin() + 3, ids.end());
  } else {
    std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  }
  const size_t pool_elems = blocks * block_tokens * pool.row_elems;
  pool.k.assign(pool_elems, __float2bfloat16(kNaN));
  pool.v.assign(pool_elems, __float2bfloat16(kNaN));
  size_t next = 0;
  for (auto [begin, rows] : seqs) {
    pool.seq_kv_begin.push_back(begin);
    pool.seq_table_begin.push_back(static_cast<int64_t>(pool.table.size()));
    for (int64_t r = 0; r < rows; ++r) {
      if (r % block_tokens == 0) pool.table.push_back(ids[next++]);
      const int64_t dst =
          (pool.table.back() * int64_t{block_tokens} + r % block_tokens) * pool.row_elems;
      const int64_t src = (begin + r) * pool.row_elems;
      std::copy_n(in.kb.begin() + src, pool.row_elems, pool.k.begin() + dst);
      std::copy_n(in.vb.begin() + src, pool.row_elems, pool.v.begin() + dst);
    }
  }
  return pool;
}

void RunOnGpu(const Case& c, const Inputs& in, OutputMode mode, std::vector<float>* o,
              std::vector<float>* lse, const std::vector<float>* running_o,
              const std::vector<float>* running_lse, const PagedPool* pool,
              cudaEvent_t exchange_done) {
  const size_t no = c.q_tokens * c.heads * c.dim;
  DeviceArray<__nv_bfloat16> dq(in.qb.size()), dk(in.kb.size()), dv(in.vb.size());
  DeviceArray<int32_t> dqp(c.q_pos.size()), dkp(c.k_pos.size());
  dq.Upload(in.qb);
  dk.Upload(in.kb);
  dv.Upload(in.vb);
  dqp.Upload(c.q_pos);
  dkp.Upload(c.k_pos);
  DeviceArray<float> dof(mode == OutputMode::kBfloat16 ? 0 : no);
  DeviceArray<__nv_bfloat16> dob(mode == OutputMode::kBfloat16 ? no : 0);
  DeviceArray<float> dlse(c.q_tokens * c.heads);
  // Poison: NaN everywhere (or the running values in merge mode).
  if (mode == OutputMode::kMergeIntoFloat32) {
    dof.Upload(*running_o);
    dlse.Upload(*running_lse);
  } else {
    dof.Upload(std::vector<float>(mode == OutputMode::kBfloat16 ? 0 : no, kNaN));
    dob.Upload(
        std::vector<__nv_bfloat16>(mode == OutputMode::kBfloat16 ? no : 0, __float2bfloat16(kNaN)));
    dlse.Upload(std::vector<float>(c.q_tokens * c.heads, kNaN));
  }
  CudaAttentionArgs a{.shape = ShapeOf(c),
                      .q = dq.get(),
                      .q_pos = dqp.get(),
                      .q_tokens = c.q_tokens,
                      .k = dk.get(),
                      .v = dv.get(),
                      .k_pos = dkp.get(),
                      .kv_tokens = c.kv_tokens,
                      .slices = c.slices.data(),
                      .num_slices = static_cast<int64_t>(c.slices.size()),
                      .output = mode,
                      .o = mode == OutputMode::kBfloat16 ? static_cast<void*>(dob.get())
                                                         : static_cast<void*>(dof.get()),
                      .lse = dlse.get()};
  if (exchange_done != nullptr) {  // as a ring step beside an exchange
    a.communication_in_flight = true;
    a.exchange_done = exchange_done;
  }
  DeviceArray<__nv_bfloat16> pk(pool ? pool->k.size() : 0), pv(pool ? pool->v.size() : 0);
  DeviceArray<int32_t> table(pool ? pool->table.size() : 0);
  PagedKv paged;
  if (pool != nullptr) {
    pk.Upload(pool->k);
    pv.Upload(pool->v);
    table.Upload(pool->table);
    paged = {.table = table.get(),
             .block_tokens = pool->block_tokens,
             .block_stride_bytes = pool->block_tokens * pool->row_elems * 2,
             .seq_kv_begin = pool->seq_kv_begin,
             .seq_table_begin = pool->seq_table_begin,
             .host_table = pool->host_table ? std::span<const int32_t>(pool->table)
                                            : std::span<const int32_t>()};
    a.k = pk.get();
    a.v = pv.get();
    a.paged = &paged;
    a.paged_prefill = pool->host_table;
  }
  const size_t ws_bytes = AttentionWorkspaceBytes(a);
  DeviceArray<char> ws(ws_bytes);
  // Workspace garbage too: the kernel must not trust what an earlier call left there (the Hopper
  // scheduler's counter would read as "no items left" and CTAs would stop early).
  if (ws_bytes > 0) {
    ASSERT_CUDA(cudaMemset(ws.get(), 0x7f, ws_bytes));
  }
  absl::Status s = PartialAttentionCuda(a, ws.get(), ws_bytes, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_CUDA(cudaDeviceSynchronize());
  *lse = dlse.Download();
  if (mode == OutputMode::kBfloat16) {
    std::vector<__nv_bfloat16> ob = dob.Download();
    o->resize(no);
    for (size_t i = 0; i < no; ++i) (*o)[i] = __bfloat162float(ob[i]);
  } else {
    *o = dof.Download();
  }
}

void Reference(const Case& c, const Inputs& in, std::vector<double>* o, std::vector<double>* lse,
               const std::vector<SequenceSlice>* slices = nullptr) {
  const std::vector<SequenceSlice>& sl = slices ? *slices : c.slices;
  AttentionParams p{.shape = ShapeOf(c),
                    .q = in.q.data(),
                    .q_pos = c.q_pos.data(),
                    .q_tokens = c.q_tokens,
                    .k = in.k.data(),
                    .v = in.v.data(),
                    .k_pos = c.k_pos.data(),
                    .kv_tokens = c.kv_tokens,
                    .slices = sl.data(),
                    .num_slices = static_cast<int64_t>(sl.size())};
  ReferenceAttention(p, o, lse);
}

void CheckCase(const Case& c, uint64_t seed = 1) {
  const Inputs in = MakeInputs(c, seed);
  std::vector<double> o_ref, lse_ref;
  Reference(c, in, &o_ref, &lse_ref);
  for (OutputMode mode : {OutputMode::kBfloat16, OutputMode::kFloat32}) {
    std::vector<float> o, lse;
    RunOnGpu(c, in, mode, &o, &lse);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectGood(Compare(c, o, lse, o_ref, lse_ref),
               absl::StrCat(c.name, mode == OutputMode::kBfloat16 ? " (bf16 O)" : " (fp32 O)"));
  }
}

// A contiguous run of positions.
void AppendRun(std::vector<int32_t>& pos, int32_t begin, int64_t n) {
  for (int64_t i = 0; i < n; ++i) pos.push_back(begin + static_cast<int32_t>(i));
}

// One slice: n_q queries at [q_start, q_start + n_q) against n_k keys at [k_start, ...).
Case OneSlice(std::string name, int heads, int kv_heads, int dim, bool causal, int64_t n_q,
              int32_t q_start, int64_t n_k, int32_t k_start) {
  Case c{.name = std::move(name),
         .heads = heads,
         .kv_heads = kv_heads,
         .dim = dim,
         .causal = causal,
         .q_tokens = n_q,
         .kv_tokens = n_k};
  AppendRun(c.q_pos, q_start, n_q);
  AppendRun(c.k_pos, k_start, n_k);
  c.slices = {{0, n_q, 0, n_k}};
  return c;
}

TEST(CudaAttentionSmall, CausalAndNotGqaGroupsAndHeadDims) {
  for (int dim : {64, 128}) {
    for (auto [h, kvh] : {std::pair{4, 4}, std::pair{16, 2}, std::pair{16, 1}}) {
      for (bool causal : {true, false}) {
        CheckCase(OneSlice(absl::StrCat("square ", h, ":", kvh, " d", dim, causal ? " causal" : ""),
                           h, kvh, dim, causal, 333, 0, 333, 0),
                  dim * 100 + h);
      }
    }
  }
}

TEST(CudaAttentionSmall, RingStepAndPartialPrefillOffsets) {
  // A later query chunk against an earlier key chunk: fully visible, no mask needed.
  CheckCase(OneSlice("later chunk", 16, 1, 128, true, 200, 3000, 150, 100));
  // An earlier query chunk against a later key chunk: hidden, every row empty.
  CheckCase(OneSlice("earlier chunk", 16, 1, 128, true, 100, 0, 150, 500));
  // Partial prefill: 77 new tokens at positions [1000, 1077) after 1000 cached keys.
  Case c = OneSlice("partial prefill", 8, 1, 128, true, 77, 1000, 0, 0);
  AppendRun(c.k_pos, 0, 1077);
  c.kv_tokens = 1077;
  c.slices = {{0, 77, 0, 1077}};
  CheckCase(c);
  // A load-balanced shard: query chunks 0 and 7 of 8 against key chunks 3 and 4.
  Case d{.name = "load-balanced chunk pairs", .heads = 16, .kv_heads = 1, .dim = 128};
  AppendRun(d.q_pos, 0, 128);
  AppendRun(d.q_pos, 896, 128);
  AppendRun(d.k_pos, 384, 256);
  d.q_tokens = 256;
  d.kv_tokens = 256;
  d.slices = {{0, 256, 0, 256}};
  CheckCase(d);
}

TEST(CudaAttentionSmall, LengthsZeroOneSeventeenAndUnevenFusedBatch) {
  Case c{.name = "uneven fused batch", .heads = 16, .kv_heads = 2, .dim = 64};
  // Sequences of (new, cached): (0, 5), (1, 0), (17, 3), (300, 41), (1, 1000), (129, 0).
  const int64_t news[] = {0, 1, 17, 300, 1, 129}, cached[] = {5, 0, 3, 41, 1000, 0};
  for (int s = 0; s < 6; ++s) {
    const int64_t qb = c.q_pos.size(), kb = c.k_pos.size();
    AppendRun(c.q_pos, static_cast<int32_t>(cached[s]), news[s]);
    AppendRun(c.k_pos, 0, cached[s] + news[s]);
    c.slices.push_back({qb, news[s], kb, cached[s] + news[s]});
  }
  c.q_tokens = c.q_pos.size();
  c.kv_tokens = c.k_pos.size();
  CheckCase(c);
  Case d = c;
  d.dim = 128;
  d.name = "uneven fused batch d128";
  CheckCase(d, 7);
}

TEST(CudaAttentionSmall, PaddingRowsNotInSlicesAndKeysOutOfOrder) {
  // Padding queries (-1) and keys (-1), rows 250.. in no slice, keys in scrambled order.
  Case c{.name = "padding and scrambled keys",
         .heads = 8,
         .kv_heads = 1,
         .dim = 128,
         .q_tokens = 260,
         .kv_tokens = 300};
  for (int i = 0; i < 260; ++i) c.q_pos.push_back(i % 10 == 3 ? -1 : 100 + i);
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) c.k_pos.push_back(i % 13 == 0 ? -1 : i);
  std::shuffle(c.k_pos.begin(), c.k_pos.end(), rng);
  c.slices = {{0, 120, 0, 300}, {130, 120, 10, 200}};  // rows 120..129 and 250..259: no slice
  CheckCase(c);
}

TEST(CudaAttentionSmall, TileEdgesAndGqaGroupsThatDoNotFillTheTile) {
  // Lengths around the Hopper kernel's 128-row and 128-key tiles (and the mma.sync kernel's 64),
  // with group sizes that do not divide the 128 folded rows of a tile (3, 5, 6) next to 16 and 4.
  const std::pair<int, int> groups[] = {{16, 1}, {12, 4}, {10, 2}, {6, 1}, {32, 8}};
  const int64_t lengths[] = {1, 63, 127, 128, 129, 255, 257};
  int k = 0;
  for (auto [h, kvh] : groups) {
    for (int64_t n : lengths) {
      const int dim = (k++ % 2) ? 64 : 128;
      // Queries at the end of a longer key range: the diagonal falls inside a tile.
      const int64_t nk = n + (n * 7) % 131;
      CheckCase(OneSlice(absl::StrCat("edges ", h, ":", kvh, " q", n, " k", nk, " d", dim), h, kvh,
                         dim, true, n, static_cast<int32_t>(nk - n), nk, 0),
                static_cast<uint64_t>(1000 + k));
    }
  }
}

// Without the causal mask: lengths around 128- and 176-key tiles, several sequences in one
// launch, padding keys and queries (the element mask on a tile no causality masks). The Hopper
// kernel's 176-key tiles run these under CPFILL_HOPPER_KEY_TILE=176 (CTest
// attention_cuda_test_keytile176; by default they are for 32K keys and more); a 176-row box past
// a slice's keys: GarbageOutsideTheSlicesIsNeverRead.
TEST(CudaAttentionSmall, TileEdgesWithoutTheCausalMask) {
  const std::pair<int, int> groups[] = {{16, 1}, {32, 8}, {6, 1}};
  // Query and key lengths each at, below and past a tile's edge (a last tile that is full and
  // unmasked among them), keys 4 places along the list from queries.
  const int64_t lengths[] = {1, 127, 128, 129, 175, 176, 177, 352, 353};
  constexpr int kLengths = sizeof(lengths) / sizeof(lengths[0]);
  const bool wide = knobs::Choice(knobs::kHopperKeyTile) == "176";
  int k = 0;
  for (auto [h, kvh] : groups) {
    for (int i = 0; i < kLengths; ++i) {
      const int64_t n = lengths[i], nk = lengths[(i + 4) % kLengths];
      const Case c = OneSlice(absl::StrCat("not causal ", h, ":", kvh, " q", n, " k", nk), h, kvh,
                              128, false, n, 0, nk, 0);
      // The tile the launcher takes for it: 176 keys only where the knob forces them (these
      // sequences are far below kWideTileMinKeys).
      const CudaAttentionArgs a{.shape = ShapeOf(c),
                                .slices = c.slices.data(),
                                .num_slices = static_cast<int64_t>(c.slices.size())};
      const int64_t work[] = {0};
      EXPECT_EQ(internal::HopperKeyTile(a, work, knobs::Choice(knobs::kHopperKeyTile)),
                wide ? internal::kHopperWideBlockN : internal::kHopperBlockN)
          << c.name;
      CheckCase(c, static_cast<uint64_t>(2000 + k++));
    }
  }
  Case c{.name = "fused batch with padding, not causal", .heads = 8, .kv_heads = 2, .dim = 128};
  c.causal = false;
  const int64_t news[] = {0, 1, 17, 300, 1, 129}, keys[] = {5, 176, 20, 531, 1000, 352};
  for (int s = 0; s < 6; ++s) {
    const int64_t qb = c.q_pos.size(), kb = c.k_pos.size();
    for (int64_t i = 0; i < news[s]; ++i)
      c.q_pos.push_back(i % 11 == 4 ? -1 : static_cast<int32_t>(i));
    for (int64_t i = 0; i < keys[s]; ++i)
      c.k_pos.push_back(i % 13 == 0 ? -1 : static_cast<int32_t>(i));
    c.slices.push_back({qb, news[s], kb, keys[s]});
  }
  c.q_tokens = c.q_pos.size();
  c.kv_tokens = c.k_pos.size();
  CheckCase(c, 2100);
}

TEST(CudaAttentionSmall, GarbageOutsideTheSlicesIsNeverRead) {
  // A persistent KV cache may hold anything in rows no slice covers, NaN included: a kernel
  // that reads past a slice's last key row (a neighbour's rows, or free cache rows) would let it
  // into O through 0 * NaN. Key rows 0..39, 140..149 and 300.. are NaN here. Without the
  // causal mask, under CPFILL_HOPPER_KEY_TILE=176, the Hopper kernel reads them in 176-key boxes.
  for (bool causal : {true, false}) {
    Case c{.name = causal ? "NaN outside slices" : "NaN outside slices, not causal",
           .heads = 16,
           .kv_heads = 2,
           .dim = 128,
           .causal = causal};
    c.kv_tokens = 420;
    for (int i = 0; i < 420; ++i) c.k_pos.push_back(i);
    c.q_tokens = 230;
    AppendRun(c.q_pos, 50, 100);   // slice 0: 100 queries at [50, 150) over key rows [40, 140)
    AppendRun(c.q_pos, 100, 130);  // slice 1: 130 queries at [100, 230) over key rows [150, 300)
    for (int i = 150; i < 300; ++i) c.k_pos[i] = i - 150;
    c.slices = {{0, 100, 40, 100}, {100, 130, 150, 150}};
    for (int i = 40; i < 140; ++i) c.k_pos[i] = i - 40 + 50;
    Inputs in = MakeInputs(c, 31);
    const size_t row = static_cast<size_t>(c.kv_heads) * c.dim;
    for (int i = 0; i < 420; ++i) {
      if ((i >= 40 && i < 140) || (i >= 150 && i < 300)) continue;
      for (size_t e = 0; e < row; ++e) {
        in.kb[i * row + e] = in.vb[i * row + e] = __float2bfloat16(kNaN);
      }
    }
    std::vector<double> o_ref, lse_ref;
    Reference(c, in, &o_ref, &lse_ref);
    std::vector<float> o, lse;
    RunOnGpu(c, in, OutputMode::kFloat32, &o, &lse);
    ExpectGood(Compare(c, o, lse, o_ref, lse_ref), c.name);
  }
}

TEST(CudaAttentionSmall, LargeScoresStayFinite) {
  Case c = OneSlice("peaky softmax", 16, 1, 128, true, 200, 0, 200, 0);
  c.amplitude = 12.0f;
  CheckCase(c, 3);
}

TEST(CudaAttentionSmall, FusedMergeEqualsAttentionOverAllKeys) {
  // Keys split in two disjoint halves (interleaved positions): run half A in fp32, then fold
  // half B in with kMergeIntoFloat32; compare with attention over all keys.
  Case c = OneSlice("merge", 16, 2, 128, true, 300, 200, 500, 0);
  const Inputs in = MakeInputs(c, 11);
  std::vector<double> o_ref, lse_ref;
  Reference(c, in, &o_ref, &lse_ref);
  Case a = c, b = c;
  for (int i = 0; i < 500; ++i) {
    (i % 2 ? a : b).k_pos[i] = -1;  // a keeps even keys, b keeps odd keys
  }
  std::vector<float> o_a, lse_a, o_ab, lse_ab;
  RunOnGpu(a, in, OutputMode::kFloat32, &o_a, &lse_a);
  RunOnGpu(b, in, OutputMode::kMergeIntoFloat32, &o_ab, &lse_ab, &o_a, &lse_a);
  ExpectGood(Compare(c, o_ab, lse_ab, o_ref, lse_ref), "fused merge");
}

TEST(CudaAttentionSmall, MergeKernelOfSeveralPartials) {
  Case c = OneSlice("merge kernel", 8, 1, 128, true, 257, 500, 800, 0);
  const Inputs in = MakeInputs(c, 13);
  // Four partials over disjoint key ranges; one of them hidden from every query (-inf rows).
  const int parts = 4;
  std::vector<DeviceArray<float>*> o_parts, lse_parts;
  std::vector<const float*> po, pl;
  for (int s = 0; s < parts; ++s) {
    Case part = c;
    for (int i = 0; i < 800; ++i) {
      if (i % parts != s) part.k_pos[i] = -1;
    }
    if (s == 3) {  // a part that sees no key at all: every row empty (LSE -inf)
      for (int i = 0; i < 800; ++i) part.k_pos[i] = -1;
    }
    std::vector<double> po_ref, pl_ref;
    Reference(part, in, &po_ref, &pl_ref);
    std::vector<float> of(po_ref.begin(), po_ref.end()), lf(pl_ref.begin(), pl_ref.end());
    o_parts.push_back(new DeviceArray<float>(of.size()));
    lse_parts.push_back(new DeviceArray<float>(lf.size()));
    o_parts.back()->Upload(of);
    lse_parts.back()->Upload(lf);
    po.push_back(o_parts.back()->get());
    pl.push_back(lse_parts.back()->get());
  }
  // Part 3 was all hidden, so the merge of parts 0..2 is attention over keys i % 4 != 3: make
  // the reference match by hiding those keys too.
  Case merged = c;
  for (int i = 0; i < 800; ++i) {
    if (i % parts == 3) merged.k_pos[i] = -1;
  }
  std::vector<double> o_ref, lse_ref;
  Reference(merged, in, &o_ref, &lse_ref);
  DeviceArray<float> out(c.q_tokens * c.heads * c.dim), out_lse(c.q_tokens * c.heads);
  DeviceArray<__nv_bfloat16> out_bf16(c.q_tokens * c.heads * c.dim);
  out.Upload(std::vector<float>(c.q_tokens * c.heads * c.dim, kNaN));
  out_lse.Upload(std::vector<float>(c.q_tokens * c.heads, kNaN));
  absl::Status s = MergePartialsCuda(ShapeOf(c), c.q_tokens * 1, po, pl, out.get(), out_bf16.get(),
                                     out_lse.get(), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_CUDA(cudaDeviceSynchronize());
  Errors e = Compare(c, out.Download(), out_lse.Download(), o_ref, lse_ref);
  EXPECT_LE(e.rel_fro_o, 1e-5);  // fp32 merge of fp32 parts
  EXPECT_LE(e.max_abs_lse, 1e-4);
  EXPECT_EQ(e.bad_empty, 0);
  EXPECT_EQ(e.unwritten, 0);
  for (auto* p : o_parts) delete p;
  for (auto* p : lse_parts) delete p;
}

TEST(CudaAttentionSmall, RejectsBadInput) {
  Case c = OneSlice("bad", 16, 3, 128, true, 10, 0, 10, 0);
  CudaAttentionArgs a{.shape = ShapeOf(c), .q_tokens = 10, .kv_tokens = 10};
  EXPECT_EQ(PartialAttentionCuda(a, nullptr, 0, nullptr).code(),
            absl::StatusCode::kInvalidArgument);  // 16 heads, 3 KV heads
  c = OneSlice("dim", 4, 4, 96, true, 10, 0, 10, 0);
  std::vector<SequenceSlice> sl = {{0, 10, 0, 10}};
  int dummy;
  a = {.shape = ShapeOf(c),
       .q = reinterpret_cast<const __nv_bfloat16*>(&dummy),
       .q_pos = &dummy,
       .q_tokens = 10,
       .k = reinterpret_cast<const __nv_bfloat16*>(&dummy),
       .v = reinterpret_cast<const __nv_bfloat16*>(&dummy),
       .k_pos = &dummy,
       .kv_tokens = 10,
       .slices = sl.data(),
       .num_slices = 1,
       .o = &dummy,
       .lse = reinterpret_cast<float*>(&dummy)};
  absl::Status s = PartialAttentionCuda(a, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("head_dim 96"), std::string::npos) << s;
}

TEST(CudaAttentionLarge, LongCausalSequenceAndManySlices) {
  // 4096 tokens causal, 16:1: many tiles, the fully visible path and the boundary path.
  CheckCase(OneSlice("4K causal", 16, 1, 128, true, 4096, 0, 4096, 0), 21);
  CheckCase(OneSlice("4K not causal", 8, 2, 128, false, 4096, 0, 4096, 0), 23);
  // 60 sequences in one call: more slices than one launch takes.
  Case c{.name = "60 slices", .heads = 4, .kv_heads = 1, .dim = 64};
  for (int s = 0; s < 60; ++s) {
    const int64_t n = 1 + (s * 37) % 90;
    c.slices.push_back(
        {static_cast<int64_t>(c.q_pos.size()), n, static_cast<int64_t>(c.k_pos.size()), n});
    AppendRun(c.q_pos, 0, n);
    AppendRun(c.k_pos, 0, n);
  }
  c.q_tokens = c.q_pos.size();
  c.kv_tokens = c.k_pos.size();
  CheckCase(c, 22);
}

// A ring step beside an exchange: the kernel leaves SMs free for it, and once the exchange's
// event has fired a second grid on the same work items joins (attention_hopper.cu). Here the
// event fires 50 ms after a host callback starts sleeping on another stream, so the join comes
// late, after the first grid took its items; every item must still be done exactly once.
TEST(CudaAttentionLarge, SmsLeftForAnExchangeJoinOnceItEnds) {
  const Case c = OneSlice("4K causal beside an exchange", 16, 1, 128, true, 4096, 0, 4096, 0);
  const Inputs in = MakeInputs(c, 23);
  std::vector<double> o_ref, lse_ref;
  Reference(c, in, &o_ref, &lse_ref);
  cudaStream_t side = nullptr;
  cudaEvent_t done = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  ASSERT_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  for (int delay_ms : {50, 0}) {
    ASSERT_CUDA(cudaLaunchHostFunc(
        side, [](void* ms) { std::this_thread::sleep_for(std::chrono::milliseconds(*(int*)ms)); },
        &delay_ms));
    ASSERT_CUDA(cudaEventRecord(done, side));
    std::vector<float> o, lse;
    RunOnGpu(c, in, OutputMode::kFloat32, &o, &lse, nullptr, nullptr, nullptr, done);
    ASSERT_CUDA(cudaStreamSynchronize(side));
    if (::testing::Test::HasFatalFailure()) break;
    ExpectGood(Compare(c, o, lse, o_ref, lse_ref),
               absl::StrCat(c.name, ", join after ", delay_ms, " ms"));
  }
  cudaEventDestroy(done);
  cudaStreamDestroy(side);
}

// ---- key split: few query tiles over long keys (key_split.h) ----------------------------

// One slice per (queries, keys) sequence: the queries at the last q_len key positions (a suffix
// after its prefix), every 29th key padding.
Case SuffixCase(std::string name, int heads, int kv_heads, int dim, bool causal,
                const std::vector<std::pair<int64_t, int64_t>>& seqs) {
  Case c{
      .name = std::move(name), .heads = heads, .kv_heads = kv_heads, .dim = dim, .causal = causal};
  for (auto [nq, nk] : seqs) {
    c.slices.push_back(
        {static_cast<int64_t>(c.q_pos.size()), nq, static_cast<int64_t>(c.k_pos.size()), nk});
    AppendRun(c.q_pos, static_cast<int32_t>(nk - nq), nq);
    for (int64_t i = 0; i < nk; ++i) c.k_pos.push_back(i % 29 == 3 ? -1 : static_cast<int32_t>(i));
  }
  c.q_tokens = c.q_pos.size();
  c.kv_tokens = c.k_pos.size();
  return c;
}

TEST(CudaKeySplitAttention, ShortSuffixesAfterLongPrefixesMatchTheReference) {
  int sms = 0;
  ASSERT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // On the Hopper kernel (unless CPFILL_ATTENTION_KEY_SPLIT=off) these calls run in parts.
  const bool splits = std::string(AttentionKernelName()) == "hopper-wgmma" &&
                      knobs::Choice(knobs::kAttentionKeySplit) != "off";
  const Case cases[] = {
      SuffixCase("8:1, 256 after 4K", 8, 1, 128, true, {{256, 4352}}),
      SuffixCase("32:8, three sequences", 32, 8, 128, true, {{100, 3000}, {17, 700}, {5, 1041}}),
      SuffixCase("16:1 d64, not causal", 16, 1, 64, false, {{130, 5000}}),
      // Parts of 128-key units on 176-key tiles under CPFILL_HOPPER_KEY_TILE=176.
      SuffixCase("16:1 d128, not causal", 16, 1, 128, false, {{130, 5000}})};
  uint64_t seed = 81;
  for (const Case& c : cases) {
    const CudaAttentionArgs a{.shape = ShapeOf(c),
                              .q_tokens = c.q_tokens,
                              .slices = c.slices.data(),
                              .num_slices = static_cast<int64_t>(c.slices.size())};
    const int parts = internal::PlanKeySplit(a, sms).parts;
    if (splits) {
      EXPECT_GT(parts, 1) << c.name;
    }
    CheckCase(c, seed++);
  }
}

// ---- decode: the split-KV kernel (attention_decode.h) -----------------------------------

struct DecodeSeq {
  int64_t q_len, kv_len;
};

// One slice per sequence: kv_len keys at positions 0.. (every 37th padding when `pad_keys`),
// its q_len queries at the last q_len key positions (the new tokens are in the KV already).
// Then three extra slices' worth of edge rows: a padded query, a slice whose keys are all hidden
// from its query (LSE -inf), and a row covered by no slice.
Case DecodeCase(std::string name, int heads, int kv_heads, int dim, bool causal,
                const std::vector<DecodeSeq>& seqs) {
  Case c{
      .name = std::move(name), .heads = heads, .kv_heads = kv_heads, .dim = dim, .causal = causal};
  for (auto [nq, nk] : seqs) {
    const int64_t qb = c.q_pos.size(), kb = c.k_pos.size();
    AppendRun(c.q_pos, static_cast<int32_t>(std::max<int64_t>(0, nk - nq)), nq);
    for (int64_t i = 0; i < nk; ++i) c.k_pos.push_back(i % 37 == 5 ? -1 : static_cast<int32_t>(i));
    c.slices.push_back({qb, nq, kb, nk});
  }
  // A padded query beside a real one, over the first sequence's keys.
  c.slices.push_back({static_cast<int64_t>(c.q_pos.size()), 2, 0, seqs[0].kv_len});
  c.q_pos.push_back(kPadPosition);
  c.q_pos.push_back(static_cast<int32_t>(seqs[0].kv_len));
  // Keys hidden from the query: later positions (causal) or all padding.
  const int64_t kb = c.k_pos.size();
  for (int i = 0; i < 100; ++i) c.k_pos.push_back(causal ? 1000 + i : kPadPosition);
  c.slices.push_back({static_cast<int64_t>(c.q_pos.size()), 1, kb, 100});
  c.q_pos.push_back(3);
  c.q_pos.push_back(7);  // in no slice
  c.q_tokens = c.q_pos.size();
  c.kv_tokens = c.k_pos.size();
  return c;
}

// kMergeIntoFloat32 over a random running (O, LSE) (rows 3 mod 7 empty): covered rows must be
// the exact merge of the running values and this call's reference, other rows untouched.
void CheckMergeIntoRandomRunning(const Case& c, uint64_t seed) {
  const Inputs in = MakeInputs(c, seed);
  std::vector<double> o_ref, lse_ref;
  Reference(c, in, &o_ref, &lse_ref);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t rows = c.q_tokens * c.heads;
  std::vector<float> run_o(rows * c.dim), run_lse(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const bool empty = r % 7 == 3;
    run_lse[r] = empty ? -INFINITY : 3.f + 3.f * u(rng);
    for (int d = 0; d < c.dim; ++d) run_o[r * c.dim + d] = empty ? 0.f : u(rng);
  }
  std::vector<bool> covered(c.q_tokens, false);
  for (const SequenceSlice& s : c.slices) {
    for (int64_t t = s.q_begin; t < s.q_begin + s.q_len; ++t) covered[t] = true;
  }
  std::vector<double> want_o(run_o.begin(), run_o.end()), want_lse(run_lse.begin(), run_lse.end());
  for (int64_t r = 0; r < rows; ++r) {
    const double a = run_lse[r], b = lse_ref[r], m = std::max(a, b);
    if (!covered[r / c.heads] || std::isinf(m)) continue;
    const double wa = std::exp(a - m), wb = std::exp(b - m);
    want_lse[r] = m + std::log(wa + wb);
    for (int d = 0; d < c.dim; ++d) {
      want_o[r * c.dim + d] = (wa * run_o[r * c.dim + d] + wb * o_ref[r * c.dim + d]) / (wa + wb);
    }
  }
  std::vector<float> o, lse;
  RunOnGpu(c, in, OutputMode::kMergeIntoFloat32, &o, &lse, &run_o, &run_lse);
  ExpectGood(Compare(c, o, lse, want_o, want_lse), c.name + " (merge into running)");
}

// Every output mode, after checking the call takes the decode kernel (unless the knob is off).
void CheckDecodeCase(const Case& c, uint64_t seed) {
  CudaAttentionArgs a{.shape = ShapeOf(c),
                      .slices = c.slices.data(),
                      .num_slices = static_cast<int64_t>(c.slices.size())};
  EXPECT_EQ(internal::DecodeAttentionApplies(a), knobs::Bool(knobs::kDecodeKernel)) << c.name;
  CheckCase(c, seed);
  CheckMergeIntoRandomRunning(c, seed + 100);
}

TEST(CudaDecodeAttention, MixedKvLengthsGqaGroupsCausalAndNot) {
  for (auto [h, kvh] : {std::pair{16, 1}, std::pair{32, 8}, std::pair{4, 4}}) {
    for (bool causal : {true, false}) {
      // 40000 keys at 16:1 and 1:1; 9000 at 32:8 (eight KV heads: host memory of the reference)
      const int64_t longest = kvh == 8 ? 9000 : 40000;
      const std::vector<DecodeSeq> seqs = {{1, 1},       {1, 17}, {0, 50},  {2, 1000},
                                           {4, longest}, {3, 17}, {1, 1000}};
      CheckDecodeCase(DecodeCase(absl::StrCat("decode ", h, ":", kvh, causal ? " causal" : ""), h,
                                 kvh, 128, causal, seqs),
                      static_cast<uint64_t>(h * 10 + kvh + causal));
    }
  }
}

TEST(CudaDecodeAttention, HeadDim64AndMoreSlicesThanOneLaunch) {
  // 530 sequences of one query each: two launch groups of the split and combine kernels (512
  // slices a launch), each slice found by bisection; lengths spread 1 to 1500.
  std::vector<DecodeSeq> seqs;
  for (int s = 0; s < 530; ++s) seqs.push_back({1, 1 + (s * 397) % 1500});
  CheckDecodeCase(DecodeCase("decode d64 530 seqs", 16, 2, 64, true, seqs), 41);
}

TEST(CudaDecodeAttention, ManyShortSequencesWriteTheirRowsWithoutACombine) {
  // 300 sequences of one query over up to 600 keys, 16:1: a CTA per sequence fills an H100, so
  // each slice is one split and the split kernel writes the output itself, no combine (the
  // masked rows of DecodeCase's last slices too); then one sequence without keys, which sends
  // the launch back to the combine for its zeros.
  std::vector<DecodeSeq> seqs;
  for (int s = 0; s < 300; ++s) seqs.push_back({1, 1 + (s * 211) % 600});
  for (bool causal : {true, false}) {
    CheckDecodeCase(DecodeCase(absl::StrCat("decode 300 short", causal ? " causal" : ""), 16, 1,
                               128, causal, seqs),
                    47 + causal);
  }
  seqs[7] = {1, 0};
  CheckDecodeCase(DecodeCase("decode 300 short, one without keys", 16, 1, 128, true, seqs), 49);
}

TEST(CudaDecodeAttention, ManySplitsAndPeakySoftmax) {
  // One query over 128K keys: hundreds of splits for the combine; large scores.
  Case c = DecodeCase("decode 128K peaky", 16, 1, 128, true, {{1, 131072}});
  c.amplitude = 12.0f;
  CheckDecodeCase(c, 43);
}

TEST(CudaDecodeAttention, RejectsHeadDim96) {
  Case c = DecodeCase("decode d96", 4, 4, 96, true, {{1, 10}});
  int dummy[4];
  CudaAttentionArgs a{.shape = ShapeOf(c),
                      .q = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .q_pos = dummy,
                      .q_tokens = c.q_tokens,
                      .k = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .v = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .k_pos = dummy,
                      .kv_tokens = c.kv_tokens,
                      .slices = c.slices.data(),
                      .num_slices = static_cast<int64_t>(c.slices.size()),
                      .o = dummy,
                      .lse = reinterpret_cast<float*>(dummy)};
  EXPECT_FALSE(internal::DecodeAttentionApplies(a));
  const absl::Status s = PartialAttentionCuda(a, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("head_dim 96"), std::string::npos) << s;
}

// Paged K/V read in place (a KV cache's blocks, shuffled, NaN between the rows a sequence
// holds) against the reference on the same rows contiguous, every output mode and block size
// the cache allows at both ends, GQA packed and not.
TEST(CudaDecodeAttention, PagedKvFromShuffledBlocks) {
  for (auto [h, kvh] : {std::pair{16, 1}, std::pair{32, 8}}) {
    const std::vector<DecodeSeq> seqs = {{1, 1},    {1, 17}, {0, 50},  {2, 1000},
                                         {4, 5000}, {3, 17}, {1, 1000}};
    const Case c = DecodeCase(absl::StrCat("paged decode ", h, ":", kvh), h, kvh, 128, true, seqs);
    const Inputs in = MakeInputs(c, 61 + h);
    std::vector<double> o_ref, lse_ref;
    Reference(c, in, &o_ref, &lse_ref);
    for (int block_tokens : {16, 64, 256}) {
      const PagedPool pool = MakePagedPool(c, in, block_tokens, block_tokens + h);
      for (OutputMode mode : {OutputMode::kBfloat16, OutputMode::kFloat32}) {
        std::vector<float> o, lse;
        RunOnGpu(c, in, mode, &o, &lse, nullptr, nullptr, &pool);
        if (::testing::Test::HasFatalFailure()) return;
        ExpectGood(Compare(c, o, lse, o_ref, lse_ref),
                   absl::StrCat(c.name, " blocks of ", block_tokens,
                                mode == OutputMode::kBfloat16 ? " (bf16 O)" : " (fp32 O)"));
      }
    }
  }
}

// `c` over `pool` in bf16 and fp32 output against the reference (o_ref, lse_ref); `what` names the
// pool in failures.
void ExpectPagedMatches(const Case& c, const Inputs& in, const PagedPool& pool,
                        const std::vector<double>& o_ref, const std::vector<double>& lse_ref,
                        const std::string& what) {
  for (OutputMode mode : {OutputMode::kBfloat16, OutputMode::kFloat32}) {
    std::vector<float> o, lse;
    RunOnGpu(c, in, mode, &o, &lse, nullptr, nullptr, &pool);
    if (::testing::Test::HasFatalFailure()) return;
    ExpectGood(
        Compare(c, o, lse, o_ref, lse_ref),
        absl::StrCat(c.name, what, mode == OutputMode::kBfloat16 ? " (bf16 O)" : " (fp32 O)"));
  }
}

// Prefill rows over paged K/V, read in place by the Hopper kernel (tensor maps over the pools):
// shuffled blocks (tiles in parts), and blocks in pool order (whole tiles where they can), NaN in
// every row no sequence holds (the tail of each last block too), blocks of 32, 96 (parts of 32
// keys), 64 and 256 tokens, GQA packed and not, every output mode but the merge, against the fp64
// reference over the same rows contiguous.
TEST(CudaPagedPrefillAttention, HopperReadsShuffledBlocksInPlace) {
  if (std::string(AttentionKernelName()) != "hopper-wgmma") {
    GTEST_SKIP() << "no Hopper kernel on this device (" << AttentionKernelName() << ")";
  }
  for (auto [h, kvh] : {std::pair{16, 1}, std::pair{32, 8}}) {
    const std::vector<DecodeSeq> seqs = {{300, 300}, {1, 17},  {129, 1000},
                                         {64, 4000}, {17, 77}, {200, 3001}};
    const Case c = DecodeCase(absl::StrCat("paged prefill ", h, ":", kvh), h, kvh, 128, true, seqs);
    const Inputs in = MakeInputs(c, 71 + h);
    std::vector<double> o_ref, lse_ref;
    Reference(c, in, &o_ref, &lse_ref);
    for (auto [block_tokens, in_order] :
         {std::pair{32, false}, {96, false}, {64, false}, {256, false}, {64, true}, {96, true}}) {
      PagedPool pool = MakePagedPool(c, in, block_tokens, block_tokens * 3 + h, in_order);
      pool.host_table = true;
      const PagedKv layout{.block_tokens = block_tokens,
                           .block_stride_bytes = block_tokens * pool.row_elems * 2,
                           .host_table = pool.table};
      ASSERT_TRUE(ReadsPagedPrefillInPlace(ShapeOf(c), layout));
      ExpectPagedMatches(
          c, in, pool, o_ref, lse_ref,
          absl::StrCat(in_order ? " blocks in order of " : " blocks of ", block_tokens));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Short suffixes after long prefixes in paged blocks read in place: the Hopper kernel runs their
// keys in parts that start on blocks (key_split.h), each part's tiles through the table.
TEST(CudaPagedPrefillAttention, KeyPartsReadShuffledBlocksInPlace) {
  if (std::string(AttentionKernelName()) != "hopper-wgmma") {
    GTEST_SKIP() << "no Hopper kernel on this device (" << AttentionKernelName() << ")";
  }
  int sms = 0;
  ASSERT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const bool splits = knobs::Choice(knobs::kAttentionKeySplit) != "off";
  const Case cases[] = {
      SuffixCase("8:1, 256 after 4K", 8, 1, 128, true, {{256, 4352}}),
      SuffixCase("32:8, three sequences", 32, 8, 128, true, {{100, 3000}, {17, 700}, {5, 1041}})};
  uint64_t seed = 91;
  for (const Case& c : cases) {
    const Inputs in = MakeInputs(c, seed++);
    std::vector<double> o_ref, lse_ref;
    Reference(c, in, &o_ref, &lse_ref);
    for (auto [block_tokens, in_order] :
         {std::pair{64, false}, {96, false}, {256, false}, {64, true}, {32, true}}) {
      PagedPool pool = MakePagedPool(c, in, block_tokens, seed++, in_order);
      pool.host_table = true;
      const PagedKv layout{.block_tokens = block_tokens,
                           .block_stride_bytes = block_tokens * pool.row_elems * 2,
                           .host_table = pool.table};
      const CudaAttentionArgs a{.shape = ShapeOf(c),
                                .q_tokens = c.q_tokens,
                                .slices = c.slices.data(),
                                .num_slices = static_cast<int64_t>(c.slices.size()),
                                .paged = &layout,
                                .paged_prefill = true};
      if (splits) {
        EXPECT_GT(internal::PlanKeySplit(a, sms).parts, 1) << c.name << ", " << block_tokens;
      }
      ExpectPagedMatches(
          c, in, pool, o_ref, lse_ref,
          absl::StrCat(in_order ? " in blocks in order of " : " in blocks of ", block_tokens));
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CudaDecodeAttention, PagedKvRefusesKeysOffBlockBoundaries) {
  Case c = DecodeCase("paged refusals", 16, 1, 128, true, {{1, 100}, {1, 70}});
  const Inputs in = MakeInputs(c, 5);
  const PagedPool pool = MakePagedPool(c, in, 64, 5);
  int dummy[4];
  PagedKv paged{.table = dummy,
                .block_tokens = 64,
                .block_stride_bytes = 64 * 128 * 2,
                .seq_kv_begin = pool.seq_kv_begin,
                .seq_table_begin = pool.seq_table_begin};
  std::vector<SequenceSlice> slices = c.slices;
  CudaAttentionArgs a{.shape = ShapeOf(c),
                      .q = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .q_pos = dummy,
                      .q_tokens = 16,
                      .k = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .v = reinterpret_cast<const __nv_bfloat16*>(dummy),
                      .k_pos = dummy,
                      .kv_tokens = c.kv_tokens,
                      .slices = slices.data(),
                      .num_slices = 1,
                      .o = dummy,
                      .lse = reinterpret_cast<float*>(dummy),
                      .paged = &paged};
  // Inside a sequence, but not on a block boundary.
  slices[0] = {.q_begin = 0, .q_len = 1, .kv_begin = 3, .kv_len = 10};
  const absl::Status s = PartialAttentionCuda(a, nullptr, 0, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("neither a sequence of the block table nor one of its blocks starts"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace cpfill::attention::cuda

int main(int argc, char** argv) {
  if (cpfill::attention::cuda::DeviceCount() == 0) {
    std::printf("SKIPPED: no CUDA device on this machine; the GPU tests run on a GPU host\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("attention kernel on this device: %s\n",
              cpfill::attention::cuda::AttentionKernelName());
  return RUN_ALL_TESTS();
}
