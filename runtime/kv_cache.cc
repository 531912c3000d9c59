#include "runtime/kv_cache.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max() / 4;

// Anonymous mmap: the kernel commits pages on first touch, so a large capacity costs nothing
// until its blocks are used (the free list hands out warm blocks first).
class HostKvStorage : public KvStorage {
 public:
  ~HostKvStorage() override {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  absl::Status Allocate(int64_t bytes) override {
    CPFILL_CHECK_INTERNAL(base_ == nullptr, "the KV pool is allocated once");
    void* p = mmap(nullptr, std::max<int64_t>(bytes, 1), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("KV cache: cannot map ", bytes, " bytes of host memory: ",
                       std::strerror(errno), " (lower --kv-capacity-tokens)"));
    }
    base_ = static_cast<char*>(p);
    bytes_ = std::max<int64_t>(bytes, 1);
    return absl::OkStatus();
  }
  char* base() const override { return base_; }
  bool on_device() const override { return false; }
  absl::Status Stage(int slot, std::span<const CopyRun> runs) override {
    return absl::OkStatus();
  }
  absl::Status Execute(int slot, std::span<const CopyRun> runs, int64_t dst_shift,
                       int64_t src_shift) override {
    for (const CopyRun& r : runs) {
      std::memcpy(static_cast<char*>(r.dst) + dst_shift,
                  static_cast<const char*>(r.src) + src_shift, r.bytes);
    }
    return absl::OkStatus();
  }

 private:
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

absl::Status ValidateSpec(const KvCacheSpec& s) {
  CPFILL_CHECK_ARG(s.num_layers > 0 && s.kv_heads > 0 && s.head_dim > 0,
                   "KV cache: layers (", s.num_layers, "), KV heads (", s.kv_heads,
                   ") and head_dim (", s.head_dim, ") must be positive");
  CPFILL_CHECK_ARG(s.block_tokens >= 16 && s.block_tokens <= 256, "--kv-block-tokens ",
                   s.block_tokens, " is outside 16..256");
  CPFILL_CHECK_ARG(s.capacity_tokens > 0, "KV cache: the capacity (", s.capacity_tokens,
                   " tokens) must be positive");
  // Every product below stays far from overflow: each factor is bounded first.
  CPFILL_CHECK_ARG(int64_t{s.kv_heads} * s.head_dim <= (int64_t{1} << 24) &&
                       s.num_layers <= (1 << 16) && s.capacity_tokens <= (int64_t{1} << 40),
                   "KV cache: ", s.num_layers, " layers x ", s.kv_heads, " KV heads x ",
                   s.head_dim, " x ", s.capacity_tokens, " tokens does not fit in memory");
  const double bytes = double(s.bytes_per_token()) * double(s.capacity_tokens);
  CPFILL_CHECK_ARG(bytes < double(kMaxBytes), "KV cache: ", s.capacity_tokens, " tokens of ",
                   s.bytes_per_token(), " bytes each do not fit in memory");
  return absl::OkStatus();
}

}  // namespace

size_t KvDtypeBytes(KvDtype dtype) { return dtype == KvDtype::kBfloat16 ? 2 : 4; }

std::unique_ptr<KvStorage> MakeHostKvStorage() { return std::make_unique<HostKvStorage>(); }

absl::StatusOr<int64_t> CapacityFromMemory(const KvCacheSpec& spec, double fraction,
                                           int64_t free_bytes) {
  CPFILL_CHECK_ARG(fraction > 0 && fraction <= 1, "--kv-memory-fraction ", fraction,
                   " is outside (0, 1]");
  CPFILL_CHECK_ARG(free_bytes >= 0, "free memory ", free_bytes, " bytes is negative");
  const int64_t block = spec.bytes_per_token() * spec.block_tokens;
  CPFILL_CHECK_ARG(block > 0, "KV cache: empty geometry");
  const int64_t blocks = static_cast<int64_t>(fraction * double(free_bytes)) / block;
  return blocks * spec.block_tokens;
}

KvCache::KvCache(const KvCacheSpec& spec, int64_t num_blocks, std::unique_ptr<KvStorage> storage)
    : spec_(spec), num_blocks_(num_blocks), storage_(std::move(storage)), refcount_(num_blocks) {
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

absl::StatusOr<std::unique_ptr<KvCache>> KvCache::Create(const KvCacheSpec& spec,
                                                         std::unique_ptr<KvStorage> storage) {
  CPFILL_RETURN_IF_ERROR(ValidateSpec(spec));
  CPFILL_CHECK_ARG(storage != nullptr, "KV cache: no storage");
  const int64_t blocks = CeilDiv(spec.capacity_tokens, spec.block_tokens);
  CPFILL_CHECK_ARG(blocks <= std::numeric_limits<int32_t>::max(), "KV cache: ", blocks,
                   " blocks are more than a block id holds");
  CPFILL_RETURN_IF_ERROR(storage->Allocate(blocks * spec.block_bytes() * 2 * spec.num_layers));
  return std::unique_ptr<KvCache>(new KvCache(spec, blocks, std::move(storage)));
}

absl::StatusOr<const KvCache::Sequence*> KvCache::Find(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache: no sequence ", seq));
  }
  return &it->second;
}

int64_t KvCache::length(SeqId seq) const {
  auto it = seqs_.find(seq);
  return it == seqs_.end() ? 0 : it->second.length;
}

std::span<const int32_t> KvCache::BlockTable(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  return it->second.blocks;
}

int64_t KvCache::BlocksNeeded(SeqId seq, int64_t total_tokens) const {
  auto it = seqs_.find(seq);
  const int64_t held = it == seqs_.end() ? 0 : static_cast<int64_t>(it->second.blocks.size());
  return std::max<int64_t>(0, CeilDiv(std::max<int64_t>(total_tokens, 0), spec_.block_tokens) -
                                  held);
}

absl::Status KvCache::Reserve(SeqId seq, int64_t total_tokens) {
  CPFILL_CHECK_ARG(total_tokens >= 0, "KV cache: cannot reserve ", total_tokens, " tokens");
  const int64_t need = BlocksNeeded(seq, total_tokens);
  if (need > free_blocks()) {
    const int64_t per_block = spec_.block_bytes() * 2 * spec_.num_layers;
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache: sequence ", seq, " needs room for ", total_tokens, " tokens: ",
        need * per_block, " bytes more, ", free_blocks() * per_block,
        " bytes free (capacity ", num_blocks_ * spec_.block_tokens, " tokens)"));
  }
  Sequence& s = seqs_[seq];
  for (int64_t i = 0; i < need; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    refcount_[b] = 1;
    s.blocks.push_back(b);
  }
  return absl::OkStatus();
}

absl::Status KvCache::Append(SeqId seq, int64_t tokens) {
  auto it = seqs_.find(seq);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: no sequence ", seq);
  Sequence& s = it->second;
  const int64_t reserved = static_cast<int64_t>(s.blocks.size()) * spec_.block_tokens;
  if (tokens < 0 || s.length + tokens > reserved) {
    return absl::FailedPreconditionError(absl::StrCat("KV cache: sequence ", seq, " holds ",
                                                      s.length, " of ", reserved,
                                                      " reserved tokens; cannot append ", tokens));
  }
  s.length += tokens;
  return absl::OkStatus();
}

void KvCache::Unref(int32_t block) {
  if (--refcount_[block] == 0) free_.push_back(block);
}

absl::Status KvCache::Truncate(SeqId seq, int64_t tokens) {
  auto it = seqs_.find(seq);
  CPFILL_CHECK_ARG(it != seqs_.end(), "KV cache: no sequence ", seq);
  Sequence& s = it->second;
  CPFILL_CHECK_ARG(tokens >= 0 && tokens <= s.length, "KV cache: cannot truncate sequence ", seq,
                   " of ", s.length, " tokens to ", tokens);
  s.length = tokens;
  const size_t keep = static_cast<size_t>(CeilDiv(tokens, spec_.block_tokens));
  while (s.blocks.size() > keep) {
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
  CPFILL_ASSIGN_OR_RETURN(const Sequence* p, Find(parent));
  if (Contains(child)) {
    return absl::AlreadyExistsError(absl::StrCat("KV cache: sequence ", child, " exists"));
  }
  CPFILL_CHECK_ARG(prefix_tokens >= 0 && prefix_tokens <= p->length, "KV cache: cannot fork ",
                   prefix_tokens, " tokens of sequence ", parent, " (", p->length, " tokens)");
  const int64_t full = prefix_tokens / spec_.block_tokens;
  const int64_t partial = prefix_tokens % spec_.block_tokens;
  if (partial > 0 && free_.empty()) {
    return absl::ResourceExhaustedError("KV cache: no free block for the fork's last block");
  }
  Sequence c;
  c.length = prefix_tokens;
  c.blocks.assign(p->blocks.begin(), p->blocks.begin() + full);
  for (int32_t b : c.blocks) ++refcount_[b];
  if (partial > 0) {  // copy-on-write at fork time: the child appends into its own block
    const int32_t src = p->blocks[full], dst = free_.back();
    free_.pop_back();
    refcount_[dst] = 1;
    c.blocks.push_back(dst);
    std::vector<CopyRun> runs;
    for (int l = 0; l < spec_.num_layers; ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        runs.push_back({BlockAddress(l, kind, dst), BlockAddress(l, kind, src),
                        partial * spec_.row_bytes()});
      }
    }
    CPFILL_RETURN_IF_ERROR(storage_->Stage(kSlotFork, runs));
    CPFILL_RETURN_IF_ERROR(storage_->Execute(kSlotFork, runs, 0, 0));
  }
  seqs_.emplace(child, std::move(c));
  return absl::OkStatus();
}

KvUsage KvCache::usage() const {
  KvUsage u;
  u.blocks_total = num_blocks_;
  u.blocks_used = num_blocks_ - free_blocks();
  for (int32_t r : refcount_) u.blocks_shared += r > 1;
  for (const auto& [id, s] : seqs_) u.tokens_held += s.length;
  const int64_t per_block = spec_.block_bytes() * 2 * spec_.num_layers;
  u.bytes_total = num_blocks_ * per_block;
  u.bytes_used = u.blocks_used * per_block;
  u.sequences = static_cast<int>(seqs_.size());
  return u;
}

char* KvCache::BlockAddress(int layer, int kind, int32_t block) const {
  return storage_->base() + ((int64_t{layer} * 2 + kind) * num_blocks_ + block) * spec_.block_bytes();
}

absl::StatusOr<KvCache::Copy> KvCache::Prepare(int slot, std::span<const Rows> rows,
                                               bool to_blocks) {
  const int64_t row = spec_.row_bytes(), bt = spec_.block_tokens;
  Copy copy{.slot = slot, .to_blocks = to_blocks};
  for (const Rows& r : rows) {
    CPFILL_ASSIGN_OR_RETURN(const Sequence* s, Find(r.seq));
    const int64_t limit = to_blocks ? static_cast<int64_t>(s->blocks.size()) * bt : s->length;
    CPFILL_CHECK_ARG(r.token_begin >= 0 && r.count >= 0 && r.token_begin + r.count <= limit,
                     "KV cache: rows [", r.token_begin, ", ", r.token_begin + r.count,
                     ") of sequence ", r.seq, " are outside its ", limit,
                     to_blocks ? " reserved tokens" : " tokens");
    // A run per block touched, for K and for V.
    for (int64_t t = r.token_begin; t < r.token_begin + r.count;) {
      const int32_t block = s->blocks[t / bt];
      if (to_blocks && refcount_[block] > 1) {
        return absl::FailedPreconditionError(absl::StrCat(
            "KV cache: token ", t, " of sequence ", r.seq, " lies in a block it shares"));
      }
      const int64_t in_block = std::min(bt - t % bt, r.token_begin + r.count - t);
      const int64_t offset = (t % bt) * row, buf = (t - r.token_begin) * row;
      for (int kind = 0; kind < 2; ++kind) {
        char* cache = BlockAddress(0, kind, block) + offset;
        char* flat = static_cast<char*>(kind == 0 ? r.k : r.v) + buf;
        copy.runs.push_back(to_blocks ? CopyRun{cache, flat, in_block * row}
                                      : CopyRun{flat, cache, in_block * row});
      }
      t += in_block;
    }
  }
  CPFILL_RETURN_IF_ERROR(storage_->Stage(slot, copy.runs));
  return copy;
}

absl::StatusOr<KvCache::Copy> KvCache::PrepareWrite(int slot, std::span<const Rows> rows) {
  return Prepare(slot, rows, /*to_blocks=*/true);
}

absl::StatusOr<KvCache::Copy> KvCache::PrepareRead(int slot, std::span<const Rows> rows) {
  return Prepare(slot, rows, /*to_blocks=*/false);
}

absl::Status KvCache::Run(const Copy& copy, int layer) {
  CPFILL_CHECK_ARG(layer >= 0 && layer < spec_.num_layers, "KV cache: layer ", layer,
                   " is outside 0..", spec_.num_layers - 1);
  const int64_t shift = layer * layer_stride();
  return storage_->Execute(copy.slot, copy.runs, copy.to_blocks ? shift : 0,
                           copy.to_blocks ? 0 : shift);
}

absl::Status KvCache::Write(int layer, std::span<const Rows> rows) {
  CPFILL_ASSIGN_OR_RETURN(Copy copy, PrepareWrite(kSlotOnce, rows));
  return Run(copy, layer);
}

absl::Status KvCache::Read(int layer, std::span<const Rows> rows) {
  CPFILL_ASSIGN_OR_RETURN(Copy copy, PrepareRead(kSlotOnce, rows));
  return Run(copy, layer);
}

}  // namespace cpfill::runtime
