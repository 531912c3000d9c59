#include "runtime/kv/kv_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {

namespace {
constexpr char kKvCacheFullPayload[] = "cpfill.runtime.KvCacheFull";
}  // namespace

absl::Status KvCacheFullError(std::string message) {
  absl::Status status = absl::ResourceExhaustedError(std::move(message));
  status.SetPayload(kKvCacheFullPayload, absl::Cord("1"));
  return status;
}

bool IsKvCacheFull(const absl::Status& status) {
  return absl::IsResourceExhausted(status) && status.GetPayload(kKvCacheFullPayload).has_value();
}
namespace {

constexpr int64_t kMaxBlockId = std::numeric_limits<int32_t>::max();
// Runs sized up front by Create (2 per block id and some): a Write over every block of the pool
// fits without growing the device storage's run buffers, up to this many.
constexpr int64_t kMaxPreReservedRuns = int64_t{1} << 16;

// Anonymous private mapping: page aligned, and the kernel commits pages as blocks are first
// written, so a large capacity costs nothing until used (the LIFO free list reuses warm blocks
// first). Without MAP_NORESERVE, so the kernel's overcommit check can refuse an absurd size here
// instead of the process dying on first touch.
class HostKvStorage final : public KvStorage {
 public:
  ~HostKvStorage() override {
    if (base_ != nullptr) munmap(base_, static_cast<size_t>(bytes_));
  }

  absl::Status Allocate(int64_t bytes) override {
    if (base_ != nullptr) {
      return absl::FailedPreconditionError("KV host storage: the pool is allocated once");
    }
    CPFILL_CHECK_ARG(bytes > 0, "KV host storage: cannot allocate ", bytes, " bytes");
    void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV host storage: cannot allocate ", bytes, " bytes (", bytes / double(int64_t{1} << 30),
          " GiB): ", std::strerror(errno), "; lower the KV capacity"));
    }
    base_ = static_cast<char*>(p);
    bytes_ = bytes;
    return absl::OkStatus();
  }

  char* base() const override { return base_; }
  bool on_device() const override { return false; }

  absl::Status CopyRuns(std::span<const CopyRun> runs) override {
    for (const CopyRun& r : runs) {
      CPFILL_CHECK_ARG(r.bytes >= 0, "KV copy run of ", r.bytes, " bytes");
      CPFILL_CHECK_ARG(r.bytes == 0 || (r.dst != nullptr && r.src != nullptr), "KV copy run of ",
                       r.bytes, " bytes with a null pointer");
    }
    for (const CopyRun& r : runs) {
      if (r.bytes > 0) std::memcpy(r.dst, r.src, static_cast<size_t>(r.bytes));
    }
    return absl::OkStatus();
  }

 private:
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

// a * b, or false when it does not fit in int64.
bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Validates the geometry (every field but capacity_tokens) and returns the bytes of one block id
// over every layer's K and V, with every product checked.
absl::StatusOr<int64_t> BytesPerBlockIdChecked(const KvCacheSpec& s) {
  CPFILL_CHECK_ARG(s.num_layers > 0, "KV cache: num_layers ", s.num_layers, " must be positive");
  CPFILL_CHECK_ARG(s.kv_heads > 0, "KV cache: kv_heads ", s.kv_heads, " must be positive");
  CPFILL_CHECK_ARG(s.head_dim > 0, "KV cache: head_dim ", s.head_dim, " must be positive");
  CPFILL_CHECK_ARG(s.block_tokens >= 16 && s.block_tokens <= 256, "KV cache: block_tokens ",
                   s.block_tokens, " is outside 16..256");
  CPFILL_CHECK_ARG(s.dtype == KvDtype::kFloat32 || s.dtype == KvDtype::kBfloat16,
                   "KV cache: unknown dtype ", static_cast<int>(s.dtype));
  int64_t row = 0, block = 0, per_id = 0;
  const bool fits = CheckedMul(int64_t{s.kv_heads} * s.head_dim,
                               static_cast<int64_t>(KvDtypeBytes(s.dtype)), &row) &&
                    CheckedMul(row, s.block_tokens, &block) &&
                    CheckedMul(block, 2 * int64_t{s.num_layers}, &per_id);
  CPFILL_CHECK_ARG(fits, "KV cache: a block of ", s.block_tokens, " tokens x ", s.num_layers,
                   " layers x ", s.kv_heads, " KV heads x ", s.head_dim,
                   " does not fit in int64 bytes");
  return per_id;
}

}  // namespace

size_t KvDtypeBytes(KvDtype dtype) { return dtype == KvDtype::kBfloat16 ? 2 : 4; }

int64_t KvCacheSpec::row_bytes() const {
  return int64_t{kv_heads} * head_dim * static_cast<int64_t>(KvDtypeBytes(dtype));
}
int64_t KvCacheSpec::block_bytes() const { return block_tokens * row_bytes(); }
int64_t KvCacheSpec::bytes_per_token() const { return 2 * int64_t{num_layers} * row_bytes(); }

int64_t KvCacheSpec::v_sum_bytes() const {
  return int64_t{num_layers} * (int64_t{kv_heads} * head_dim * 4 + 8);
}

double KvUsage::usage_ratio() const {
  return blocks_total == 0 ? 0.0 : static_cast<double>(blocks_used) / blocks_total;
}

std::unique_ptr<KvStorage> MakeHostKvStorage() { return std::make_unique<HostKvStorage>(); }

absl::StatusOr<int64_t> CapacityFromMemory(const KvCacheSpec& spec, double fraction,
                                           int64_t free_bytes) {
  // Written so that NaN fails too.
  CPFILL_CHECK_ARG(fraction > 0 && fraction <= 1, "KV memory fraction ", fraction,
                   " is outside (0, 1]");
  CPFILL_CHECK_ARG(free_bytes >= 0, "KV cache: free memory of ", free_bytes, " bytes");
  CPFILL_ASSIGN_OR_RETURN(const int64_t per_id, BytesPerBlockIdChecked(spec));
  // fraction <= 1, but the product is rounded: clamp so the cast cannot leave int64.
  const double usable = fraction * static_cast<double>(free_bytes);
  const int64_t usable_bytes =
      usable >= static_cast<double>(free_bytes) ? free_bytes : static_cast<int64_t>(usable);
  const int64_t blocks = std::min(usable_bytes / (per_id + HostBytesPerBlock(spec)), kMaxBlockId);
  return blocks * spec.block_tokens;
}

KvCache::KvCache(const KvCacheSpec& spec, int64_t num_blocks, std::unique_ptr<KvStorage> storage)
    : spec_(spec),
      num_blocks_(num_blocks),
      storage_(std::move(storage)),
      refcount_(static_cast<size_t>(num_blocks), 0) {
  spec_.capacity_tokens = num_blocks * spec.block_tokens;
  // Ascending ids are a min-heap already (TakeBlock takes the lowest free id).
  free_.reserve(static_cast<size_t>(num_blocks));
  for (int64_t b = 0; b < num_blocks; ++b) free_.push_back(static_cast<int32_t>(b));
}

KvCache::~KvCache() = default;

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheSpec& spec,
                                                         std::unique_ptr<KvStorage> storage) {
  CPFILL_CHECK_ARG(storage != nullptr, "KV cache: no storage");
  CPFILL_ASSIGN_OR_RETURN(const int64_t per_id, BytesPerBlockIdChecked(spec));
  CPFILL_CHECK_ARG(spec.capacity_tokens > 0, "KV cache: capacity of ", spec.capacity_tokens,
                   " tokens must be positive");
  const int64_t blocks =
      spec.capacity_tokens / spec.block_tokens + (spec.capacity_tokens % spec.block_tokens != 0);
  CPFILL_CHECK_ARG(blocks <= kMaxBlockId, "KV cache: ", spec.capacity_tokens, " tokens make ",
                   blocks, " blocks of ", spec.block_tokens, ", more than an int32 block id names");
  int64_t pool_bytes = 0;
  CPFILL_CHECK_ARG(CheckedMul(blocks, per_id, &pool_bytes), "KV cache: ", blocks, " blocks of ",
                   per_id, " bytes do not fit in int64 bytes");
  // The block lists first, the pool last: a pool sized to what is free leaves nothing for them.
  KvStorage& pool = *storage;
  std::unique_ptr<KvCache> cache(new KvCache(spec, blocks, std::move(storage)));
  CPFILL_RETURN_IF_ERROR(pool.ReserveRuns(std::min(2 * blocks + 64, kMaxPreReservedRuns)));
  CPFILL_RETURN_IF_ERROR(pool.Allocate(pool_bytes));
  return cache;
}

int64_t KvCache::BlocksFor(int64_t tokens) const {
  return tokens / spec_.block_tokens + (tokens % spec_.block_tokens != 0);
}

int64_t KvCache::BytesPerBlockId() const {
  return 2 * int64_t{spec_.num_layers} * spec_.block_bytes();
}

std::string KvCache::BytesText(int64_t blocks) const {
  int64_t bytes = 0;
  if (!CheckedMul(blocks, BytesPerBlockId(), &bytes)) return "more than 2^63";
  return absl::StrCat(bytes);
}

bool KvCache::LastBlockNeedsCopy(const Sequence& s) const {
  return s.length % spec_.block_tokens != 0 &&
         refcount_[static_cast<size_t>(s.blocks[s.length / spec_.block_tokens])] > 1;
}

int32_t KvCache::TakeBlock() {
  // The lowest free id: a sequence's blocks stay ascending and, where the pool has room,
  // consecutive, so its rows form long runs in memory (a KV hand-off reads a layer of a fresh
  // sequence in one get instead of one per block) even after other sequences came and went.
  std::pop_heap(free_.begin(), free_.end(), std::greater<>());
  const int32_t b = free_.back();
  free_.pop_back();
  refcount_[static_cast<size_t>(b)] = 1;
  return b;
}

void KvCache::Unref(int32_t block) {
  int32_t& r = refcount_[static_cast<size_t>(block)];
  if (r == 2) --shared_blocks_;
  if (--r == 0) {
    free_.push_back(block);
    std::push_heap(free_.begin(), free_.end(), std::greater<>());
  }
}

void KvCache::AddRun(char* dst, const char* src, int64_t bytes) {
  if (!runs_.empty()) {
    CopyRun& last = runs_.back();
    if (static_cast<char*>(last.dst) + last.bytes == dst &&
        static_cast<const char*>(last.src) + last.bytes == src) {
      last.bytes += bytes;
      return;
    }
  }
  runs_.push_back({dst, src, bytes});
}

void KvCache::AddBlockCopy(int32_t from, int32_t to, int64_t tokens) {
  for (int l = 0; l < spec_.num_layers; ++l) {
    for (int kind = 0; kind < 2; ++kind) {
      AddRun(BlockAddress(l, kind, to), BlockAddress(l, kind, from), tokens * spec_.row_bytes());
    }
  }
}

int64_t KvCache::BlocksNeeded(SeqId seq, int64_t total_tokens) const {
  if (total_tokens <= 0) return 0;
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return BlocksFor(total_tokens);
  const Sequence& s = it->second;
  if (total_tokens <= s.reserved) return 0;
  return std::max<int64_t>(0, BlocksFor(total_tokens) - static_cast<int64_t>(s.blocks.size())) +
         (LastBlockNeedsCopy(s) ? 1 : 0);
}

absl::Status KvCache::Reserve(SeqId seq, int64_t total_tokens) {
  CPFILL_CHECK_ARG(total_tokens >= 0, "KV cache: cannot reserve ", total_tokens,
                   " tokens for sequence ", seq);
  const int64_t need = BlocksNeeded(seq, total_tokens);
  if (need > free_blocks()) {
    return KvCacheFullError(
        absl::StrCat("KV cache full: sequence ", seq, " asks for ", total_tokens,
                     " tokens, which needs ", need, " more blocks (", BytesText(need), " bytes); ",
                     free_blocks(), " blocks (", BytesText(free_blocks()), " bytes) are free of ",
                     num_blocks_, " (capacity ", spec_.capacity_tokens, " tokens)"));
  }
  Sequence& s = seqs_[seq];
  if (total_tokens <= s.reserved) return absl::OkStatus();
  if (LastBlockNeedsCopy(s)) {
    // Copy-on-write: the rows after `length` go into the last block, which others share.
    const size_t last = static_cast<size_t>(s.length / spec_.block_tokens);
    const int32_t fresh = TakeBlock();
    runs_.clear();
    AddBlockCopy(s.blocks[last], fresh, s.length % spec_.block_tokens);
    if (absl::Status st = storage_->CopyRuns(runs_); !st.ok()) {
      Unref(fresh);
      return st;
    }
    Unref(s.blocks[last]);
    s.blocks[last] = fresh;
  }
  for (int64_t n = BlocksFor(total_tokens) - static_cast<int64_t>(s.blocks.size()); n > 0; --n) {
    s.blocks.push_back(TakeBlock());
  }
  s.reserved = total_tokens;
  return absl::OkStatus();
}

absl::Status KvCache::Append(SeqId seq, int64_t tokens) {
  auto it = seqs_.find(seq);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: Append to unknown sequence ", seq);
  CPFILL_CHECK_ARG(tokens >= 0, "KV cache: cannot append ", tokens, " tokens to sequence ", seq);
  Sequence& s = it->second;
  if (tokens > s.reserved - s.length) {
    return absl::FailedPreconditionError(
        absl::StrCat("KV cache: sequence ", seq, " holds ", s.length, " of ", s.reserved,
                     " reserved tokens; appending ", tokens, " goes past them (Reserve first)"));
  }
  s.length += tokens;
  return absl::OkStatus();
}

absl::Status KvCache::Truncate(SeqId seq, int64_t tokens) {
  auto it = seqs_.find(seq);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: Truncate of unknown sequence ", seq);
  Sequence& s = it->second;
  CPFILL_CHECK_ARG(tokens >= 0 && tokens <= s.length, "KV cache: cannot truncate sequence ", seq,
                   " of ", s.length, " tokens to ", tokens);
  s.length = s.reserved = tokens;
  for (int64_t& rows : s.v.rows) rows = rows > tokens ? -1 : rows;
  for (int64_t keep = BlocksFor(tokens); static_cast<int64_t>(s.blocks.size()) > keep;) {
    Unref(s.blocks.back());
    s.blocks.pop_back();
  }
  return absl::OkStatus();
}

void KvCache::Release(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (int32_t b : it->second.blocks) Unref(b);
  seqs_.erase(it);
}

absl::Status KvCache::Fork(SeqId parent, SeqId child, int64_t prefix_tokens) {
  auto it = seqs_.find(parent);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: Fork of unknown sequence ", parent);
  if (Contains(child)) {
    return absl::AlreadyExistsError(
        absl::StrCat("KV cache: Fork of ", parent, " into sequence ", child, ", which exists"));
  }
  const Sequence& p = it->second;
  CPFILL_CHECK_ARG(prefix_tokens >= 0 && prefix_tokens <= p.length, "KV cache: cannot fork ",
                   prefix_tokens, " tokens of sequence ", parent, " (length ", p.length, ")");
  const size_t full = static_cast<size_t>(prefix_tokens / spec_.block_tokens);
  const int64_t partial = prefix_tokens % spec_.block_tokens;
  if (partial > 0 && free_.empty()) {
    return KvCacheFullError(absl::StrCat(
        "KV cache full: Fork of sequence ", parent, " into ", child, " needs 1 block (",
        BytesPerBlockId(), " bytes) for its partly filled last block; 0 bytes are free"));
  }
  Sequence c;
  c.length = c.reserved = prefix_tokens;
  c.blocks.reserve(full + (partial > 0));
  if (partial > 0) {
    const int32_t fresh = TakeBlock();
    runs_.clear();
    AddBlockCopy(p.blocks[full], fresh, partial);
    if (absl::Status st = storage_->CopyRuns(runs_); !st.ok()) {
      Unref(fresh);
      return st;
    }
    c.blocks.assign(p.blocks.begin(), p.blocks.begin() + full);
    c.blocks.push_back(fresh);
  } else {
    c.blocks.assign(p.blocks.begin(), p.blocks.begin() + full);
  }
  for (size_t i = 0; i < full; ++i) {
    if (++refcount_[static_cast<size_t>(c.blocks[i])] == 2) ++shared_blocks_;
  }
  // A fork of the whole parent starts from its sums; of a part, they are summed again on use.
  if (prefix_tokens == p.length) c.v = p.v;
  seqs_.emplace(child, std::move(c));
  return absl::OkStatus();
}

int64_t KvCache::length(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.length;
}

int64_t KvCache::reserved(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.reserved;
}

std::span<const int32_t> KvCache::BlockTable(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  return it->second.blocks;
}

int32_t KvCache::refcount(int32_t block) const {
  if (block < 0 || block >= num_blocks_) return 0;
  return refcount_[static_cast<size_t>(block)];
}

KvUsage KvCache::usage() const {
  KvUsage u;
  u.blocks_total = num_blocks_;
  u.blocks_used = num_blocks_ - free_blocks();
  u.blocks_shared = shared_blocks_;
  for (const auto& [id, s] : seqs_) u.tokens_held += s.length;
  u.bytes_total = num_blocks_ * BytesPerBlockId();
  u.bytes_used = u.blocks_used * BytesPerBlockId();
  u.sequences = static_cast<int>(seqs_.size());
  for (const auto& [id, s] : seqs_) {
    u.v_sum_bytes += static_cast<int64_t>(s.v.sum.size() * 4 + s.v.rows.size() * 8);
  }
  return u;
}

bool KvCache::on_device() const { return storage_->on_device(); }

char* KvCache::BlockAddress(int layer, int kind, int32_t block) const {
  if (layer < 0 || layer >= spec_.num_layers || kind < 0 || kind > 1 || block < 0 ||
      block >= num_blocks_) {
    return nullptr;
  }
  return storage_->base() +
         ((int64_t{layer} * 2 + kind) * num_blocks_ + block) * spec_.block_bytes();
}

absl::Status KvCache::CheckRows(int layer, std::span<const Rows> rows, bool write) const {
  const char* op = write ? "Write" : "Read";
  CPFILL_CHECK_ARG(layer >= 0 && layer < spec_.num_layers, "KV cache: ", op, " of layer ", layer,
                   ", outside 0..", spec_.num_layers - 1);
  for (const Rows& r : rows) {
    auto it = seqs_.find(r.seq);
    CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: ", op, " of unknown sequence ", r.seq);
    CPFILL_CHECK_ARG(r.token_begin >= 0 && r.count >= 0, "KV cache: ", op, " of ", r.count,
                     " rows from token ", r.token_begin, " of sequence ", r.seq);
    CPFILL_CHECK_ARG(r.count == 0 || (r.k != nullptr && r.v != nullptr), "KV cache: ", op,
                     " of sequence ", r.seq, " with a null K or V buffer");
    const Sequence& s = it->second;
    const int64_t limit = write ? s.reserved : s.length;
    if (r.token_begin > limit - r.count) {
      return absl::FailedPreconditionError(absl::StrCat(
          "KV cache: ", op, " of rows [", r.token_begin, ", +", r.count, ") of sequence ", r.seq,
          " goes past its ", limit, write ? " reserved tokens" : " tokens"));
    }
    if (!write || r.count == 0) continue;
    const int64_t first = r.token_begin / spec_.block_tokens;
    const int64_t last = (r.token_begin + r.count - 1) / spec_.block_tokens;
    for (int64_t i = first; i <= last; ++i) {
      const int32_t b = s.blocks[static_cast<size_t>(i)];
      if (refcount_[static_cast<size_t>(b)] > 1) {
        return absl::FailedPreconditionError(
            absl::StrCat("KV cache: Write of rows [", r.token_begin, ", +", r.count,
                         ") of sequence ", r.seq, " lands in block ", b, ", shared by ",
                         refcount_[static_cast<size_t>(b)], " sequences"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status KvCache::Copy(int layer, std::span<const Rows> rows, bool write) {
  CPFILL_RETURN_IF_ERROR(CheckRows(layer, rows, write));
  const int64_t row = spec_.row_bytes(), bt = spec_.block_tokens;
  runs_.clear();
  // K runs first, then V runs: runs of one kind in a row merge across consecutive blocks.
  for (int kind = 0; kind < 2; ++kind) {
    for (const Rows& r : rows) {
      const std::vector<int32_t>& blocks = seqs_.find(r.seq)->second.blocks;
      char* flat = static_cast<char*>(kind == 0 ? r.k : r.v);
      for (int64_t t = r.token_begin, end = r.token_begin + r.count; t < end;) {
        const int64_t n = std::min(bt - t % bt, end - t);
        char* cache =
            BlockAddress(layer, kind, blocks[static_cast<size_t>(t / bt)]) + (t % bt) * row;
        char* buf = flat + (t - r.token_begin) * row;
        if (write) {
          AddRun(cache, buf, n * row);
        } else {
          AddRun(buf, cache, n * row);
        }
        t += n;
      }
    }
  }
  return storage_->CopyRuns(runs_);
}

absl::Status KvCache::Write(int layer, std::span<const Rows> rows) {
  CPFILL_RETURN_IF_ERROR(Copy(layer, rows, /*write=*/true));
  AddToVSums(layer, rows);
  return absl::OkStatus();
}

void KvCache::AddToVSums(int layer, std::span<const Rows> rows) {
  if (storage_->on_device() || spec_.dtype != KvDtype::kFloat32) return;
  const int64_t width = int64_t{spec_.kv_heads} * spec_.head_dim;
  for (const Rows& r : rows) {
    VSums& v = seqs_.find(r.seq)->second.v;
    // A sequence no one asked VSum of keeps none: dense requests pay neither the pass over
    // their V rows nor the memory; VSum's first call sums the blocks once.
    if (v.rows.empty()) continue;
    int64_t& summed = v.rows[static_cast<size_t>(layer)];
    if (summed != r.token_begin) {  // overwrites or skips rows: sum the blocks again on use
      summed = -1;
      continue;
    }
    float* sum = v.sum.data() + layer * width;
    const float* src = static_cast<const float*>(r.v);
    for (int64_t t = 0; t < r.count; ++t) {
      for (int64_t i = 0; i < width; ++i) sum[i] += src[t * width + i];
    }
    summed += r.count;
  }
}

absl::StatusOr<std::span<const float>> KvCache::VSum(int layer, SeqId seq) {
  auto it = seqs_.find(seq);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: VSum of unknown sequence ", seq);
  CPFILL_CHECK_ARG(layer >= 0 && layer < spec_.num_layers, "KV cache: VSum of layer ", layer);
  if (storage_->on_device() || spec_.dtype != KvDtype::kFloat32) {
    return absl::FailedPreconditionError(
        "KV cache: V sums are kept for a host fp32 pool only (SparQ needs the CPU backend)");
  }
  Sequence& s = it->second;
  const int64_t width = int64_t{spec_.kv_heads} * spec_.head_dim, bt = spec_.block_tokens;
  if (s.v.rows.empty()) {
    s.v.sum.assign(static_cast<size_t>(spec_.num_layers * width), 0.0f);
    s.v.rows.assign(static_cast<size_t>(spec_.num_layers), -1);
  }
  float* sum = s.v.sum.data() + layer * width;
  int64_t& summed = s.v.rows[static_cast<size_t>(layer)];
  if (summed != s.length) {  // stale, or rows appended without a Write: sum the blocks
    std::fill(sum, sum + width, 0.0f);
    for (int64_t t = 0; t < s.length; ++t) {
      const float* row = reinterpret_cast<const float*>(
          BlockAddress(layer, 1, s.blocks[static_cast<size_t>(t / bt)]) +
          (t % bt) * spec_.row_bytes());
      for (int64_t i = 0; i < width; ++i) sum[i] += row[i];
    }
    summed = s.length;
  }
  return std::span<const float>(sum, static_cast<size_t>(width));
}

absl::Status KvCache::Read(int layer, std::span<const Rows> rows) {
  return Copy(layer, rows, /*write=*/false);
}

}  // namespace cpfill::runtime
