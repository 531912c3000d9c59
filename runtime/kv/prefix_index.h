// cpfill/runtime/kv/prefix_index.h — which held KV starts with which tokens: the engine's prefix
// cache index (ChunkAttention's prefix tree as a hash chain, as vLLM's automatic prefix
// caching keys its blocks).
//
// An entry is a KV sequence the engine keeps (a "prefix session" in the model, named by the
// engine) and the tokens it holds. The index keys every full block of `block_tokens` tokens by a
// hash chain: block k's key hashes block k-1's key and block k's tokens, so one key names a whole
// prefix. A lookup walks the request's blocks while some entry holds them, then goes on token by
// token inside that entry (the model forks at any token, KvCache copies a partly filled block),
// and checks the tokens themselves, so a hash collision can cost a miss but never a wrong reuse.
// The KV blocks themselves are shared by KvCache's reference counts on every rank; this index
// lives on world rank 0 only, where the engine decides each batch.
//
//   PrefixIndex index(64);
//   index.Add("\x01pfx-1", prompt_tokens, now);
//   if (auto m = index.Longest(other_prompt, other_prompt.size() - 1, now)) fork(m->entry, ...);
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cpfill::runtime {

class PrefixIndex {
 public:
  explicit PrefixIndex(int block_tokens) : block_tokens_(block_tokens) {}

  struct Match {
    std::string entry;
    int64_t tokens = 0;  // the first `tokens` of the query are the entry's first tokens
  };
  // The entry sharing the longest prefix with `tokens`, at least one full block and at most
  // `limit` tokens (a prefill needs one new token for its logits); touches it (LRU).
  std::optional<Match> Longest(const std::vector<int32_t>& tokens, int64_t limit, int64_t now);
  // Full blocks of `tokens` that no entry holds (what keeping it would add).
  int64_t NewBlocks(const std::vector<int32_t>& tokens) const;
  // How many of their first tokens two sequences share, rounded down to whole blocks.
  int64_t SharedBlockTokens(const std::vector<int32_t>& a, const std::vector<int32_t>& b) const;

  // A new entry (its name unused) holding `tokens`.
  void Add(const std::string& name, std::vector<int32_t> tokens, int64_t now);
  void Remove(const std::string& name);  // nothing for an unknown name
  // Entry names, least recently used (added or matched) first.
  std::vector<std::string> LeastRecentlyUsedFirst() const;

  int64_t entries() const { return static_cast<int64_t>(entries_.size()); }
  int64_t tokens() const { return tokens_; }  // summed over entries (shared ones in each)
  int block_tokens() const { return block_tokens_; }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::vector<uint64_t> keys;  // of its full blocks
    int64_t last_used = 0;
  };
  // The chain keys of the full blocks of `tokens`, first `max_blocks` at most.
  std::vector<uint64_t> Keys(const std::vector<int32_t>& tokens, int64_t max_blocks) const;

  int block_tokens_;
  std::map<std::string, Entry> entries_;
  int64_t tokens_ = 0;
  // Block key -> the entries holding that prefix, the newest last.
  std::map<uint64_t, std::vector<std::string>> holders_;
};

}  // namespace cpfill::runtime
