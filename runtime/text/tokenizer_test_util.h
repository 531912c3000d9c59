// cpfill/runtime/text/tokenizer_test_util.h — for tests that write tokenizer.json files by hand:
// GPT-2's byte-level alphabet, written independently of tokenizer.cc.
//
//   vocab[SpellBytes("\n")] = 10;   // "Ċ", as tokenizer.json spells the newline byte
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace cpfill::runtime {

// Bytes as tokenizer.json spells byte-level tokens: printable Latin-1 bytes are themselves, the
// other 68 bytes U+0100.. in byte order (UTF-8).
inline std::string SpellBytes(std::string_view bytes) {
  const auto printable = [](int x) {
    return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
  };
  std::string out;
  for (const char c : bytes) {
    const int b = static_cast<uint8_t>(c);
    int cp = b;
    if (!printable(b)) {
      cp = 256;
      for (int k = 0; k < b; ++k) cp += printable(k) ? 0 : 1;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

}  // namespace cpfill::runtime
