// cpfill/launch/http/http_test_util.h — for the HTTP API's tests: a byte-level tokenizer whose ids
// are easy to write by hand, so that a test can spell generated text token by token.
//
//   const runtime::Tokenizer tok = ByteTokenizer("stop", {"END"});   // "END" is id 256
//   std::vector<int32_t> ids = ByteIds("hi ");  ids.push_back(256);  // decodes to "hi END"
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/text/tokenizer.h"
#include "runtime/text/tokenizer_test_util.h"

namespace cpfill::launch {

using runtime::SpellBytes;

// The ids of `text` in ByteTokenizer's vocabulary, one byte per token.
inline std::vector<int32_t> ByteIds(std::string_view text) {
  std::vector<int32_t> ids;
  for (const char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

// A byte-level BPE tokenizer: the 256 bytes (id = the byte's value), then `words` (ids 256, 257,
// ...), then `specials` as special added tokens (the ids after the words), no merges. Written
// under the test's temporary directory as `name` and loaded.
inline runtime::Tokenizer ByteTokenizer(const std::string& name,
                                        const std::vector<std::string>& words,
                                        const std::vector<std::string>& specials = {}) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[SpellBytes(std::string(1, static_cast<char>(b)))] = b;
  for (size_t i = 0; i < words.size(); ++i) vocab[SpellBytes(words[i])] = 256 + i;
  nlohmann::json added = nlohmann::json::array();
  for (size_t i = 0; i < specials.size(); ++i) {
    const int id = static_cast<int>(256 + words.size() + i);
    vocab[specials[i]] = id;
    added.push_back({{"id", id},
                     {"content", specials[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  const nlohmann::json byte_level = {{"type", "ByteLevel"},
                                     {"add_prefix_space", false},
                                     {"trim_offsets", true},
                                     {"use_regex", true}};
  const nlohmann::json root = {{"version", "1.0"},
                               {"added_tokens", added},
                               {"normalizer", nullptr},
                               {"pre_tokenizer", byte_level},
                               {"post_processor", nullptr},
                               {"decoder", byte_level},
                               {"model",
                                {{"type", "BPE"},
                                 {"dropout", nullptr},
                                 {"unk_token", nullptr},
                                 {"fuse_unk", false},
                                 {"byte_fallback", false},
                                 {"vocab", vocab},
                                 {"merges", nlohmann::json::array()}}}};
  const std::string dir = ::testing::TempDir() + "/http_test_tokenizer_" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json", std::ios::binary) << root.dump();
  absl::StatusOr<runtime::Tokenizer> tokenizer = runtime::Tokenizer::Load(dir);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return *std::move(tokenizer);
}

// ByteTokenizer plus the special token "<|im_end|>" (id 256), as chat models end a turn.
inline runtime::Tokenizer SpecialTokenizer() {
  return ByteTokenizer("special", {}, {"<|im_end|>"});
}

}  // namespace cpfill::launch
