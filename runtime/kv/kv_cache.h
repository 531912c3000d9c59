// cpfill/runtime/kv/kv_cache.h — the per-rank KV store: a pool of fixed-size token blocks for every
// layer's K and V, allocated once at start-up and never per request, and a block table per
// sequence. The storage decides where the pool lives: host memory (CPU backend, fp32, here) or
// device memory (CUDA backend, bf16, runtime/kv/cuda/kv_storage_cuda.h).
//
// Pool layout (one allocation of 2 * num_layers * num_blocks * block_bytes bytes, in the
// storage's memory space):
//   block b of layer l, kind k (0 = K, 1 = V) starts at byte
//     ((l * 2 + k) * num_blocks + b) * block_bytes
//   and holds block_tokens rows, each [kv_heads, head_dim] elements of `dtype` (row_bytes), token
//   t of the block at byte t * row_bytes. So each layer's K pool and V pool is one contiguous
//   range of num_blocks * block_bytes bytes (the KV hand-off registers it whole), and a block id
//   names the same slot in every layer. Example, Llama-3-70B on TP8 (1 KV head x 128, bf16),
//   64-token blocks: row_bytes = 256, block_bytes = 16 KiB, a block id across 80 layers' K and V
//   = 2.5 MiB, 1M tokens = 40 GiB.
//
// Bookkeeping lives on the host, O(blocks touched) per call: a LIFO free list of block ids (the
// most recently freed, warm block first), a reference count per block, and per sequence its
// length, its reserved tokens and its block table. Only Write, Read, Fork and the copy-on-write
// in Reserve touch the storage, one batched CopyRuns per call.
//
// Sharing: Fork gives a child the parent's full prefix blocks (reference counted) and a copy of a
// partly filled last block, so no write ever lands in a shared block; Write refuses one that
// would, and Reserve copies a shared last block first (left shared by a Truncate into a prefix).
//
// Not thread-safe: one thread (the rank's engine loop) owns a KvCache.
//
//   KvCacheSpec spec{.num_layers = 32, .kv_heads = 8, .head_dim = 128, .block_tokens = 64,
//                    .capacity_tokens = 1 << 20, .dtype = KvDtype::kFloat32};
//   CPFILL_ASSIGN_OR_RETURN(auto kv, KvCache::Create(spec, MakeHostKvStorage()));
//   CPFILL_RETURN_IF_ERROR(kv->Reserve(seq, 300));     // ResourceExhausted when full
//   CPFILL_RETURN_IF_ERROR(kv->Append(seq, 300));      // length 300
//   KvCache::Rows rows[] = {{seq, 0, 300, k_rows, v_rows}};
//   CPFILL_RETURN_IF_ERROR(kv->Write(layer, rows));    // k_rows, v_rows: [300, 8, 128] fp32
//   kv->Release(seq);
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cpfill::runtime {

// ResourceExhausted that says "the KV cache's free blocks do not suffice" (a status payload), as
// opposed to other memory shortfalls: only this one can be cured by freeing blocks (the engine
// evicts idle sessions for it).
absl::Status KvCacheFullError(std::string message);
bool IsKvCacheFull(const absl::Status& status);

enum class KvDtype { kFloat32, kBfloat16 };
size_t KvDtypeBytes(KvDtype dtype);

struct KvCacheSpec {
  int num_layers = 0;
  int kv_heads = 0;  // this rank's KV heads (after TP)
  int head_dim = 0;
  int block_tokens = 64;        // 16..256
  int64_t capacity_tokens = 0;  // rounded up to whole blocks by KvCache::Create
  KvDtype dtype = KvDtype::kFloat32;

  // One token of K (or V) of one layer: kv_heads * head_dim elements.
  int64_t row_bytes() const;
  // block_tokens rows.
  int64_t block_bytes() const;
  // K and V of every layer: 2 * num_layers * row_bytes().
  int64_t bytes_per_token() const;
  // One sequence's running V sums (KvCache::VSum): num_layers * kv_heads * head_dim fp32 plus a
  // row count per layer.
  int64_t v_sum_bytes() const;
};

// Host bytes the cache keeps per block besides its K and V (its free list and reference count).
inline constexpr int64_t kHostBytesPerBlock = 8;
// Host bytes per block with a sequence's V sums (SparQ's v_bar, KvCache::VSum) counted too: a
// sequence of rows holds at least one block, so one set of sums per block bounds them.
inline int64_t HostBytesPerBlock(const KvCacheSpec& spec) {
  return kHostBytesPerBlock + spec.v_sum_bytes();
}

// The capacity in tokens (whole blocks) that `fraction` (0 < f <= 1) of `free_bytes` holds,
// the blocks' bookkeeping (kHostBytesPerBlock) counted.
// InvalidArgument for a bad fraction, negative bytes or a bad geometry (capacity_tokens ignored).
absl::StatusOr<int64_t> CapacityFromMemory(const KvCacheSpec& spec, double fraction,
                                           int64_t free_bytes);

// One contiguous copy of `bytes` from src to dst, both in the storage's memory space.
struct CopyRun {
  void* dst;
  const void* src;
  int64_t bytes;
};

// Where the pool lives and how copies run. Host: page-aligned host memory, memcpy, synchronous.
// Device: one cudaMalloc, one kernel per batch of runs on the storage's stream (asynchronous,
// never synchronizes).
class KvStorage {
 public:
  virtual ~KvStorage() = default;
  // Once; ResourceExhausted naming the bytes when the memory is not there.
  virtual absl::Status Allocate(int64_t bytes) = 0;
  virtual char* base() const = 0;
  virtual bool on_device() const = 0;
  // Runs of 0 bytes are skipped; InvalidArgument for a negative size or a null pointer.
  virtual absl::Status CopyRuns(std::span<const CopyRun> runs) = 0;
  // Sizes the buffers that carry a batch of `runs` runs up front, so CopyRuns does not grow them
  // on the hot path (a batch larger still grows them). Nothing to do for the host storage.
  virtual absl::Status ReserveRuns(int64_t runs) { return absl::OkStatus(); }
};
std::unique_ptr<KvStorage> MakeHostKvStorage();

struct KvUsage {
  int64_t blocks_total = 0, blocks_used = 0, blocks_shared = 0;  // shared: reference count > 1
  int64_t tokens_held = 0;                                       // sum of sequence lengths
  int64_t bytes_total = 0, bytes_used = 0;                       // every layer's K and V
  int64_t v_sum_bytes = 0;  // the sequences' V sums (VSum), host memory
  int sequences = 0;
  double usage_ratio() const;  // blocks_used / blocks_total
};

class KvCache {
 public:
  using SeqId = int64_t;

  // Allocates spec.capacity_tokens (rounded up to whole blocks) of every layer's K and V, once.
  // InvalidArgument for a bad spec: block_tokens outside 16..256, non-positive sizes, or a pool
  // whose size does not fit in int64 or whose block ids do not fit in int32.
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(const KvCacheSpec& spec,
                                                         std::unique_ptr<KvStorage> storage);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  // Room for `total_tokens` tokens of `seq` (created, length 0, if new): grows its block table.
  // ResourceExhausted naming the sequence, the tokens, the bytes needed and the bytes free when
  // the free blocks do not suffice; nothing changes then.
  absl::Status Reserve(SeqId seq, int64_t total_tokens);
  // Blocks Reserve(seq, total_tokens) would take from the pool (0 when it fits): for a capacity
  // check agreed by every rank before any work.
  int64_t BlocksNeeded(SeqId seq, int64_t total_tokens) const;
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_blocks() const { return num_blocks_; }
  // length(seq) += tokens; FailedPrecondition past the reserved tokens.
  absl::Status Append(SeqId seq, int64_t tokens);
  // length(seq) = reserved(seq) = tokens (<= length); blocks past it go back to the pool (the
  // rollback of a failed prefill).
  absl::Status Truncate(SeqId seq, int64_t tokens);
  // Forgets `seq`; its blocks return to the pool once no other sequence shares them. No-op if
  // unknown.
  void Release(SeqId seq);
  // `child` (new; AlreadyExists otherwise) shares the blocks of `parent`'s first `prefix_tokens`
  // tokens; a partly filled last block is copied into a block of the child's own (copy-on-write
  // at fork time). Child length = reserved = prefix_tokens. ResourceExhausted when that copy has
  // no free block.
  absl::Status Fork(SeqId parent, SeqId child, int64_t prefix_tokens);

  bool Contains(SeqId seq) const { return seqs_.count(seq) != 0; }
  int64_t length(SeqId seq) const;    // 0 if unknown
  int64_t reserved(SeqId seq) const;  // tokens it may hold without another Reserve; 0 if unknown
  // Block ids of `seq`'s tokens in order (token t in block [t / block_tokens]); empty if unknown.
  // Valid until the next call that changes `seq`.
  std::span<const int32_t> BlockTable(SeqId seq) const;
  int32_t refcount(int32_t block) const;  // sequences holding `block`; 0 when free or invalid
  KvUsage usage() const;
  const KvCacheSpec& spec() const { return spec_; }  // capacity_tokens rounded up
  bool on_device() const;

  // Rows [token_begin, token_begin + count) of sequence `seq` in one layer: k and v each
  // [count, kv_heads, head_dim] elements of spec().dtype, contiguous, in the storage's memory
  // space. For Write they are the source (rows within the reserved tokens, in blocks not shared),
  // for Read the destination (rows within the length). One CopyRuns per call; every entry is
  // checked before anything is copied.
  struct Rows {
    SeqId seq;
    int64_t token_begin;
    int64_t count;
    void* k;
    void* v;
  };
  absl::Status Write(int layer, std::span<const Rows> rows);
  absl::Status Read(int layer, std::span<const Rows> rows);

  // The first byte of block `block`'s K (kind 0) or V (kind 1) rows of `layer` (layout above):
  // for kernels that read block tables directly and for the KV hand-off. nullptr when an argument
  // is out of range.
  char* BlockAddress(int layer, int kind, int32_t block) const;

  // The fp32 sum of V over all length(seq) rows of `layer`, [kv_heads, head_dim] (SparQ's v_bar
  // times the count; sums, not means, so CP ranks' sums add exactly). Kept per sequence and
  // layer as Write appends rows in order (O(row) each); a Truncate, a Fork of part of a sequence
  // or an out-of-order Write marks it stale and the next call sums the blocks again. Released
  // with the sequence. Host fp32 storage only: FailedPrecondition on a device pool.
  // Valid until the next call that changes `seq`.
  absl::StatusOr<std::span<const float>> VSum(int layer, SeqId seq);

 private:
  // Per layer: the V sum [kv_heads * head_dim] over rows [0, rows[layer]); rows -1 = stale.
  struct VSums {
    std::vector<float> sum;
    std::vector<int64_t> rows;
  };
  struct Sequence {
    int64_t length = 0;
    int64_t reserved = 0;  // >= length; <= blocks.size() * block_tokens
    std::vector<int32_t> blocks;
    VSums v;  // empty until the sequence's first VSum (only SparQ's sequences pay for sums)
  };
  // Adds Write's V rows to the sums of the sequences that keep them, where they continue them,
  // else marks the sums stale.
  void AddToVSums(int layer, std::span<const Rows> rows);

  KvCache(const KvCacheSpec& spec, int64_t num_blocks, std::unique_ptr<KvStorage> storage);

  int64_t BlocksFor(int64_t tokens) const;
  // Bytes of one block id over every layer's K and V.
  int64_t BytesPerBlockId() const;
  std::string BytesText(int64_t blocks) const;  // blocks * BytesPerBlockId(), for messages
  // True when `s`'s last block holds some rows, is shared, and is where its next rows go.
  bool LastBlockNeedsCopy(const Sequence& s) const;
  int32_t TakeBlock();  // from the free list, reference count 1
  void Unref(int32_t block);
  // Appends runs copying rows [0, tokens) of block `from` to block `to`, every layer, K and V.
  void AddBlockCopy(int32_t from, int32_t to, int64_t tokens);
  // Appends a run, merged into the previous one when both sides continue it.
  void AddRun(char* dst, const char* src, int64_t bytes);
  absl::Status CheckRows(int layer, std::span<const Rows> rows, bool write) const;
  absl::Status Copy(int layer, std::span<const Rows> rows, bool write);

  KvCacheSpec spec_;
  int64_t num_blocks_;
  std::unique_ptr<KvStorage> storage_;
  std::vector<int32_t> free_;      // free block ids, a min-heap: TakeBlock takes the lowest
  std::vector<int32_t> refcount_;  // per block; 0 = free
  int64_t shared_blocks_ = 0;      // blocks with refcount > 1
  std::unordered_map<SeqId, Sequence> seqs_;
  std::vector<CopyRun> runs_;  // scratch of Copy, Fork and Reserve: no allocation per call
};

}  // namespace cpfill::runtime
