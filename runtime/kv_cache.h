// cpfill/runtime/kv_cache.h — the per-rank KV store: a pool of fixed-size token blocks for every
// layer's K and V, allocated once at start-up, and a block table per sequence.
//
// Memory layout (one allocation of `capacity_blocks * block_bytes * 2 * num_layers` bytes, in
// the storage's memory space: host for the CPU backend, device for the CUDA one):
//   block b of layer l, kind k (0 = K, 1 = V) at ((l * 2 + k) * num_blocks + b) * block_bytes,
//   holding block_tokens rows of [kv_heads, head_dim] elements of `dtype`.
// Each layer's K pool and V pool are contiguous, so the KV hand-off can register them whole.
// Block ids and the bookkeeping (free list, reference counts, block tables) live on the host;
// only Write/Read touch the storage, one batched copy per call.
//
// A sequence may share its leading blocks with others (Fork): blocks carry reference counts and
// are never written while shared, because a fork copies a partly filled last block.
//
//   KvCacheSpec spec{.num_layers = 32, .kv_heads = 8, .head_dim = 128, .block_tokens = 64,
//                    .capacity_tokens = 1 << 20, .dtype = KvDtype::kBfloat16};
//   CPFILL_ASSIGN_OR_RETURN(auto kv, KvCache::Create(spec, MakeHostKvStorage()));
//   CPFILL_RETURN_IF_ERROR(kv->Reserve(seq, 300));          // ResourceExhausted when full
//   CPFILL_RETURN_IF_ERROR(kv->Append(seq, 300));
//   CPFILL_RETURN_IF_ERROR(kv->Write(layer, {{{seq, 0, 300, k_rows, v_rows}}}));
//   CPFILL_RETURN_IF_ERROR(kv->Read(layer, {{{seq, 0, 300, k_out, v_out}}}));
//   kv->Release(seq);
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace cpfill::runtime {

enum class KvDtype { kFloat32, kBfloat16 };
size_t KvDtypeBytes(KvDtype dtype);

struct KvCacheSpec {
  int num_layers = 0;
  int kv_heads = 0;  // this rank's KV heads (after TP)
  int head_dim = 0;
  int block_tokens = 64;        // 16..256
  int64_t capacity_tokens = 0;  // rounded up to whole blocks
  KvDtype dtype = KvDtype::kFloat32;

  // One token's K (or V) of one layer.
  int64_t row_bytes() const { return int64_t{kv_heads} * head_dim * KvDtypeBytes(dtype); }
  int64_t block_bytes() const { return block_tokens * row_bytes(); }
  // K and V of every layer.
  int64_t bytes_per_token() const { return 2 * int64_t{num_layers} * row_bytes(); }
};

// The capacity in tokens (whole blocks) that `fraction` (0 < f <= 1) of `free_bytes` holds.
absl::StatusOr<int64_t> CapacityFromMemory(const KvCacheSpec& spec, double fraction,
                                           int64_t free_bytes);

// One contiguous copy inside the storage's memory space.
struct CopyRun {
  void* dst;
  const void* src;
  int64_t bytes;
};

// Where the pool lives and how copies run: host memory and memcpy, or device memory and one
// kernel per batch of runs (asynchronous, on the storage's stream). A run list is staged once
// into a numbered slot (on a GPU: uploaded) and executed any number of times, each time with
// its destinations and sources shifted by a byte offset: one layer's copies are layer 0's
// shifted by the layer's place in the pool, so a prefill uploads its lists once, not per layer.
class KvStorage {
 public:
  virtual ~KvStorage() = default;
  virtual absl::Status Allocate(int64_t bytes) = 0;  // once; ResourceExhausted on failure
  virtual char* base() const = 0;
  virtual bool on_device() const = 0;
  virtual absl::Status Stage(int slot, std::span<const CopyRun> runs) = 0;
  // Runs the list last staged into `slot` (`runs` is that same list, for the host).
  virtual absl::Status Execute(int slot, std::span<const CopyRun> runs, int64_t dst_shift,
                               int64_t src_shift) = 0;
};
// Host memory mapped untouched: pages are committed as blocks are first written.
std::unique_ptr<KvStorage> MakeHostKvStorage();

struct KvUsage {
  int64_t blocks_total = 0, blocks_used = 0, blocks_shared = 0;  // shared: reference count > 1
  int64_t tokens_held = 0;                                       // sum of sequence lengths
  int64_t bytes_total = 0, bytes_used = 0;
  int sequences = 0;
  double usage_ratio() const {
    return blocks_total == 0 ? 0 : static_cast<double>(blocks_used) / blocks_total;
  }
};

class KvCache {
 public:
  using SeqId = int64_t;

  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheSpec& spec,
                                                         std::unique_ptr<KvStorage> storage);

  // Room for `total_tokens` tokens of `seq` (created, length 0, if new). ResourceExhausted
  // naming the tokens, the bytes needed and the bytes free when the pool is short; nothing
  // changes then.
  absl::Status Reserve(SeqId seq, int64_t total_tokens);
  // Blocks Reserve(seq, total_tokens) would take from the pool (0 when it already fits).
  int64_t BlocksNeeded(SeqId seq, int64_t total_tokens) const;
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // length(seq) += tokens; FailedPrecondition past what was reserved.
  absl::Status Append(SeqId seq, int64_t tokens);
  // length(seq) = tokens (<= length); blocks past it return to the pool (a failed prefill's
  // rollback).
  absl::Status Truncate(SeqId seq, int64_t tokens);
  // Forgets `seq`; its blocks return to the pool once no other sequence shares them.
  void Release(SeqId seq);
  // `child` (new) shares the blocks of `parent`'s first `prefix_tokens` tokens. A partly filled
  // last block is copied into a block of the child's own, so no write ever lands in a shared
  // block.
  absl::Status Fork(SeqId parent, SeqId child, int64_t prefix_tokens);

  bool Contains(SeqId seq) const { return seqs_.count(seq) != 0; }
  int64_t length(SeqId seq) const;
  std::span<const int32_t> BlockTable(SeqId seq) const;
  KvUsage usage() const;
  const KvCacheSpec& spec() const { return spec_; }
  int64_t num_blocks() const { return num_blocks_; }
  bool on_device() const { return storage_->on_device(); }

  // Rows [token_begin, token_begin + count) of one sequence; k and v each
  // [count, kv_heads, head_dim] contiguous in the storage's memory space. For a write they are
  // the source (rows within what was reserved), for a read the destination (rows within the
  // length).
  struct Rows {
    SeqId seq;
    int64_t token_begin;
    int64_t count;
    void* k;
    void* v;
  };
  // The same rows of every layer, checked and staged once (a prefill's layers all copy alike).
  struct Copy {
    int slot = 0;
    bool to_blocks = false;
    std::vector<CopyRun> runs;  // layer 0's
  };
  enum Slot { kSlotWrite, kSlotRead, kSlotOnce, kSlotFork };
  absl::StatusOr<Copy> PrepareWrite(int slot, std::span<const Rows> rows);
  absl::StatusOr<Copy> PrepareRead(int slot, std::span<const Rows> rows);
  absl::Status Run(const Copy& copy, int layer);
  // One-off copies of one layer (PrepareWrite/Read and Run in one call).
  absl::Status Write(int layer, std::span<const Rows> rows);
  absl::Status Read(int layer, std::span<const Rows> rows);

  // Block `block`'s K (kind 0) or V (kind 1) rows of `layer`: for kernels that read block tables
  // directly and for the KV hand-off.
  char* BlockAddress(int layer, int kind, int32_t block) const;

 private:
  struct Sequence {
    int64_t length = 0;
    std::vector<int32_t> blocks;
  };
  KvCache(const KvCacheSpec& spec, int64_t num_blocks, std::unique_ptr<KvStorage> storage);

  absl::StatusOr<const Sequence*> Find(SeqId seq) const;
  void Unref(int32_t block);
  // The runs moving layer 0's rows between `rows`' buffers and their blocks.
  absl::StatusOr<Copy> Prepare(int slot, std::span<const Rows> rows, bool to_blocks);
  int64_t layer_stride() const { return 2 * num_blocks_ * spec_.block_bytes(); }

  KvCacheSpec spec_;
  int64_t num_blocks_;
  std::unique_ptr<KvStorage> storage_;
  std::vector<int32_t> free_;      // LIFO: recently freed (warm) blocks first
  std::vector<int32_t> refcount_;  // per block
  std::unordered_map<SeqId, Sequence> seqs_;
};

}  // namespace cpfill::runtime
