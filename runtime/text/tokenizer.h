// cpfill/runtime/text/tokenizer.h — the Llama-3 tokenizer: a Hugging Face checkpoint's
// tokenizer.json (byte-level BPE) and tokenizer_config.json, encoding text prompts and decoding
// token ids exactly as the Python `tokenizers` package does (tests/tokenizer_check.py compares
// the two over thousands of strings).
//
//   CPFILL_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load("/models/Meta-Llama-3-8B"));
//   CPFILL_ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok.Encode("Hello", /*add_bos=*/true));
//   CPFILL_ASSIGN_OR_RETURN(std::string text, tok.Decode(ids, /*skip_special=*/true));
//
// What tokenizer.json may hold (what Meta-Llama-3 and GPT-2 use; anything else is refused by
// Load with a message naming the field):
//   model           BPE: vocab, merges as "a b" strings or [a, b] pairs, ignore_merges,
//                   unk_token / fuse_unk; no dropout, byte_fallback, subword prefix or suffix;
//   pre_tokenizer   ByteLevel (add_prefix_space false; use_regex true splits with GPT-2's
//                   pattern), or a Sequence of Split (Regex or String pattern, behavior
//                   Isolated, invert false) ending in that ByteLevel;
//   normalizer      null;
//   added_tokens    matched in the text before pre-tokenization, leftmost then longest, with
//                   special, normalized, lstrip and rstrip honoured; single_word refused;
//   post_processor  null, TemplateProcessing (its `single` template), or a Sequence of
//                   ByteLevel (offsets only) and TemplateProcessing;
//   decoder         ByteLevel.
// tokenizer_config.json (optional) names bos_token and eos_token, as a string or as
// {"content": ...}; without it BOS is the first token the template puts before the text.
//
// Regular expressions run on PCRE2 (Unicode 14 tables in Debian 12's 10.42), `tokenizers` on
// Oniguruma: the two agree except on characters assigned after Unicode 14 (PCRE2 knows no
// letters or digits there) and on U+180E (whitespace to PCRE2 only).
//
// Thread safety: a loaded Tokenizer is immutable; Encode and Decode may run on many threads at
// once. Copies are cheap and share the loaded tables.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace cpfill::runtime {

namespace internal {
struct TokenizerModel;  // the loaded tables, defined in tokenizer.cc
}  // namespace internal

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json and (optional) DIR/tokenizer_config.json. NotFound when DIR has no
  // tokenizer.json; InvalidArgument naming the file and the problem for anything malformed or
  // unsupported (a model type other than BPE, a pre-tokenizer we do not implement, a Split
  // pattern that can match the empty string, ...), and for a file that is not a regular file
  // or is larger than a tokenizer file can be (256 MiB tokenizer.json, 64 MiB
  // tokenizer_config.json), refused before it is read.
  static absl::StatusOr<Tokenizer> Load(const std::string& dir);

  // The ids of `text`. InvalidArgument for text that is not valid UTF-8 (naming the byte
  // offset), and for a pre-tokenizer pattern that matches the empty string in it (Load refuses
  // the patterns it can tell do; this catches the rest instead of looping). add_bos: add what the
  // post-processor's template puts around the text (for Llama 3, BOS in front), as `tokenizers`
  // does with add_special_tokens=True.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_bos) const;

  // The text of `ids`, always valid UTF-8: byte sequences that are not valid UTF-8 become U+FFFD
  // exactly as Rust's String::from_utf8_lossy does (which the `tokenizers` ByteLevel decoder
  // uses). InvalidArgument for an id outside the vocabulary (`tokenizers` would drop it
  // silently). skip_special: leave out special tokens (decode(skip_special_tokens=True)).
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids, bool skip_special) const;

  int32_t bos_id() const;      // -1 when unknown
  int32_t eos_id() const;      // -1 when unknown
  int64_t vocab_size() const;  // the largest id + 1, added tokens included

 private:
  explicit Tokenizer(std::shared_ptr<const internal::TokenizerModel> model)
      : model_(std::move(model)) {}

  std::shared_ptr<const internal::TokenizerModel> model_;
};

}  // namespace cpfill::runtime
