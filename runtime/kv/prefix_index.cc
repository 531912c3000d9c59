#include "runtime/kv/prefix_index.h"

#include <algorithm>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/types/span.h"

namespace cpfill::runtime {

std::vector<uint64_t> PrefixIndex::Keys(const std::vector<int32_t>& tokens,
                                        int64_t max_blocks) const {
  const int64_t blocks =
      std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_tokens_);
  std::vector<uint64_t> keys;
  uint64_t parent = 0x9e3779b97f4a7c15ull;  // the empty prefix
  for (int64_t b = 0; b < blocks; ++b) {
    const absl::Span<const int32_t> block(tokens.data() + b * block_tokens_,
                                          static_cast<size_t>(block_tokens_));
    parent = absl::HashOf(parent, block);
    keys.push_back(parent);
  }
  return keys;
}

std::optional<PrefixIndex::Match> PrefixIndex::Longest(const std::vector<int32_t>& tokens,
                                                       int64_t limit, int64_t now) {
  if (limit < block_tokens_) return std::nullopt;
  const std::vector<uint64_t> keys = Keys(tokens, limit / block_tokens_);
  const std::string* holder = nullptr;
  int64_t blocks = 0;
  for (const uint64_t key : keys) {
    auto it = holders_.find(key);
    if (it == holders_.end()) break;
    holder = &it->second.back();
    ++blocks;
  }
  if (holder == nullptr) return std::nullopt;
  Entry& e = entries_.at(*holder);
  int64_t n = blocks * block_tokens_;
  if (!std::equal(tokens.begin(), tokens.begin() + n, e.tokens.begin())) return std::nullopt;
  const int64_t most =
      std::min({limit, static_cast<int64_t>(e.tokens.size()), static_cast<int64_t>(tokens.size())});
  while (n < most && e.tokens[n] == tokens[n]) ++n;
  e.last_used = now;
  return Match{.entry = *holder, .tokens = n};
}

int64_t PrefixIndex::NewBlocks(const std::vector<int32_t>& tokens) const {
  const std::vector<uint64_t> keys = Keys(tokens, INT64_MAX);
  return std::count_if(keys.begin(), keys.end(),
                       [&](uint64_t key) { return holders_.count(key) == 0; });
}

int64_t PrefixIndex::SharedBlockTokens(const std::vector<int32_t>& a,
                                       const std::vector<int32_t>& b) const {
  const size_t n = std::min(a.size(), b.size());
  const size_t same = std::mismatch(a.begin(), a.begin() + n, b.begin()).first - a.begin();
  return static_cast<int64_t>(same) / block_tokens_ * block_tokens_;
}

void PrefixIndex::Add(const std::string& name, std::vector<int32_t> tokens, int64_t now) {
  Entry e{.keys = Keys(tokens, INT64_MAX), .last_used = now};
  e.tokens = std::move(tokens);
  for (const uint64_t key : e.keys) holders_[key].push_back(name);
  tokens_ += static_cast<int64_t>(e.tokens.size());
  entries_[name] = std::move(e);
}

void PrefixIndex::Remove(const std::string& name) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  for (const uint64_t key : it->second.keys) {
    std::vector<std::string>& names = holders_[key];
    names.erase(std::find(names.begin(), names.end(), name));
    if (names.empty()) holders_.erase(key);
  }
  tokens_ -= static_cast<int64_t>(it->second.tokens.size());
  entries_.erase(it);
}

std::vector<std::string> PrefixIndex::LeastRecentlyUsedFirst() const {
  std::vector<std::pair<int64_t, std::string>> by_use;
  for (const auto& [name, e] : entries_) by_use.push_back({e.last_used, name});
  std::sort(by_use.begin(), by_use.end());
  std::vector<std::string> names;
  for (auto& [used, name] : by_use) names.push_back(std::move(name));
  return names;
}

}  // namespace cpfill::runtime
