// The Llama-3 tokenizer (tokenizer.h). The steps and their order follow the Python `tokenizers`
// package (Rust), so that ids agree exactly:
//   1. added tokens are cut out of the text, leftmost then longest (AddedVocabulary), first those
//      with normalized=false, then the rest in what is left;
//   2. each remaining piece is split by the pre-tokenizer's patterns in turn (Split, Isolated:
//      matches and the text between them become pieces);
//   3. each piece's bytes are its byte-level characters; BPE merges them, lowest merge rank
//      first and leftmost among equals (Word::merge_all), unless ignore_merges finds the whole
//      piece in the vocabulary;
//   4. the template puts BOS (and whatever else it names) around the ids.
// Decoding maps every token back to its bytes (ByteLevel decoder) and replaces what is not
// UTF-8 with U+FFFD as String::from_utf8_lossy does.
#include "runtime/text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <bitset>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "base/string_view.h"

namespace cpfill::runtime {
namespace {

using Json = nlohmann::json;

// The decode tables are dense in the token id: a file naming id 2^31 must not make us allocate
// for it. Published vocabularies stay far below 2^24 tokens (Llama 3: 128,256).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// The files Load reads are bounded: the largest published tokenizer.json files are some tens of
// MB (Llama 3's: 9 MB), tokenizer_config.json a few MB at most. A path that is a device, a FIFO
// or a huge file is refused before it is read, not read without end.
constexpr int64_t kMaxTokenizerJsonBytes = int64_t{256} << 20;
constexpr int64_t kMaxTokenizerConfigBytes = int64_t{64} << 20;

// json::ReadFile of a regular file of at most `max_bytes`: NotFound when it is missing (as
// ReadFile), InvalidArgument naming the file when it is not a regular file or is larger.
absl::StatusOr<Json> ReadBoundedJson(const std::string& path, int64_t max_bytes) {
  std::error_code ec;
  const std::filesystem::file_status status = std::filesystem::status(path, ec);
  if (std::filesystem::exists(status)) {
    if (!std::filesystem::is_regular_file(status)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a regular file (a directory, device or pipe)"));
    }
    const uintmax_t bytes = std::filesystem::file_size(path, ec);
    if (!ec && bytes > static_cast<uintmax_t>(max_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes, " bytes, more than the ",
                                                     max_bytes, " a tokenizer file may have"));
    }
  }
  return json::ReadFile(path);  // missing or unreadable: its error, naming the path
}

// GPT-2's pre-tokenizer pattern, which ByteLevel(use_regex=true) applies.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- UTF-8 ---------------------------------------------------------------------------------

// Well-formed UTF-8 (Unicode Table 3-7): a lead byte gives the sequence length and the range
// its second byte must lie in, which is what excludes overlong forms (C0, C1, E0 80..9F,
// F0 80..8F), surrogates (ED A0..BF) and code points past U+10FFFF (F4 90.., F5..FF). Later
// bytes are 80..BF.
struct Utf8Lead {
  int length;  // 0: this byte starts no character
  uint8_t second_lo;
  uint8_t second_hi;
};

Utf8Lead LeadOf(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// At s[i]: the length of the well-formed character there (> 0), or minus the length of the
// maximal subpart of an ill-formed sequence there: the bytes one U+FFFD replaces in Unicode's
// recommended practice (section 3.9), which Rust's from_utf8_lossy follows.
int Utf8At(std::string_view s, size_t i) {
  const Utf8Lead lead = LeadOf(static_cast<uint8_t>(s[i]));
  if (lead.length == 0) return -1;
  for (int k = 1; k < lead.length; ++k) {
    if (i + k >= s.size()) return -k;
    const auto c = static_cast<uint8_t>(s[i + k]);
    const uint8_t lo = k == 1 ? lead.second_lo : 0x80;
    const uint8_t hi = k == 1 ? lead.second_hi : 0xBF;
    if (c < lo || c > hi) return -k;
  }
  return lead.length;
}

// Why the bytes at s[i] are not UTF-8, for the message of Encode.
std::string Utf8Problem(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  const size_t end = i - Utf8At(s, i);  // past the maximal ill-formed subpart
  if (b >= 0x80 && b < 0xC0) return "a continuation byte without a lead byte";
  if (b == 0xC0 || b == 0xC1) return "an overlong encoding (C0 and C1 start none)";
  if (b >= 0xF5) return "a byte that never occurs in UTF-8";
  if (end == s.size()) return "a sequence cut short by the end of the text";
  const auto next = static_cast<uint8_t>(s[end]);
  if (end == i + 1 && next >= 0x80 && next < 0xC0) {  // a continuation byte out of range
    if (b == 0xE0 || b == 0xF0) return "an overlong encoding";
    if (b == 0xED) return "a UTF-16 surrogate";
    if (b == 0xF4) return "a code point past U+10FFFF";
  }
  return "a sequence cut short by a byte that does not continue it";
}

std::optional<size_t> FirstInvalidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const int n = Utf8At(s, i);
    if (n < 0) return i;
    i += n;
  }
  return std::nullopt;
}

char32_t CodePointAt(std::string_view s, size_t i, int length) {
  static constexpr uint8_t kLeadMask[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
  char32_t cp = static_cast<uint8_t>(s[i]) & kLeadMask[length];
  for (int k = 1; k < length; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3F);
  return cp;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const int n = Utf8At(bytes, i);
    if (n > 0) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD
      i += -n;
    }
  }
  return out;
}

// Unicode White_Space, which the `regex` crate's \s (lstrip/rstrip of added tokens) matches.
bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Where the run of white space that ends at text[end] starts (text is valid UTF-8).
size_t WhiteSpaceRunStart(std::string_view text, size_t end) {
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
    if (!IsWhiteSpace(CodePointAt(text, start, static_cast<int>(end - start)))) break;
    end = start;
  }
  return end;
}

// The bytes of the run of white space that starts at text[begin].
size_t WhiteSpaceRunLength(std::string_view text, size_t begin) {
  size_t i = begin;
  while (i < text.size()) {
    const int n = Utf8At(text, i);
    if (!IsWhiteSpace(CodePointAt(text, i, n))) break;
    i += n;
  }
  return i - begin;
}

// ---- the byte-level alphabet -----------------------------------------------------------------

// GPT-2's byte-level alphabet: the printable Latin-1 bytes stand for themselves and the other
// 68 (controls, space, 7F..A0, AD) for U+0100 onwards in byte order, so that every byte is one
// visible character in vocabulary files.
struct ByteAlphabet {
  std::array<char32_t, 256> char_of_byte;
  std::array<int16_t, 512> byte_of_char;  // -1: not in the alphabet
};

const ByteAlphabet& Alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    a.byte_of_char.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      a.char_of_byte[b] = printable ? static_cast<char32_t>(b) : next++;
      a.byte_of_char[a.char_of_byte[b]] = static_cast<int16_t>(b);
    }
    return a;
  }();
  return alphabet;
}

// The bytes a token stands for when every character of it is in the alphabet; nullopt
// otherwise (the ByteLevel decoder then gives the token's own UTF-8).
std::optional<std::string> ByteLevelBytes(std::string_view token) {
  const ByteAlphabet& a = Alphabet();
  std::string bytes;
  for (size_t i = 0; i < token.size();) {
    const int n = Utf8At(token, i);
    if (n < 0) return std::nullopt;
    const char32_t c = CodePointAt(token, i, n);
    if (c >= a.byte_of_char.size() || a.byte_of_char[c] < 0) return std::nullopt;
    bytes += static_cast<char>(a.byte_of_char[c]);
    i += n;
  }
  return bytes;
}

// ---- PCRE2 ---------------------------------------------------------------------------------

struct Pcre2CodeFree {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataFree {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
using Pcre2Code = std::unique_ptr<pcre2_code, Pcre2CodeFree>;
using Pcre2MatchData = std::unique_ptr<pcre2_match_data, Pcre2MatchDataFree>;

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof(buffer)) < 0) {
    return absl::StrCat("error ", code);
  }
  return reinterpret_cast<const char*>(buffer);
}

// ---- added tokens --------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
};

// A byte trie of added-token contents. Scanning the text position by position and taking the
// longest content at the first position that has one is the leftmost-longest matching that
// tokenizers' Aho-Corasick automaton (MatchKind::LeftmostLongest) does.
class TokenTrie {
 public:
  TokenTrie() : terminal_(1, -1) {}

  void Insert(std::string_view content, int32_t value) {
    first_bytes_.set(static_cast<uint8_t>(content[0]));
    int32_t node = 0;
    for (const char c : content) {
      auto [it, inserted] =
          edges_.try_emplace(Edge(node, c), static_cast<int32_t>(terminal_.size()));
      if (inserted) terminal_.push_back(-1);
      node = it->second;
    }
    terminal_[node] = value;
  }

  // The longest content that starts at text[pos]: {its length, its value}, or {0, -1}.
  std::pair<size_t, int32_t> LongestAt(std::string_view text, size_t pos) const {
    std::pair<size_t, int32_t> best = {0, -1};
    if (!first_bytes_.test(static_cast<uint8_t>(text[pos]))) return best;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      const auto it = edges_.find(Edge(node, text[i]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] >= 0) best = {i + 1 - pos, terminal_[node]};
    }
    return best;
  }

  bool empty() const { return terminal_.size() == 1; }

 private:
  static uint64_t Edge(int32_t node, char c) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
  }

  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child node
  std::vector<int32_t> terminal_;                 // node -> value of the content ending there
  std::bitset<256> first_bytes_;
};

struct BpeMerge {
  int32_t rank;
  int32_t new_id;
};

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

enum TokenKind : uint8_t { kNoToken = 0, kToken = 1, kSpecialToken = 2 };

}  // namespace

namespace internal {

struct TokenizerModel {
  // Pre-tokenizer: each pattern splits every piece in turn (behavior Isolated).
  std::vector<Pcre2Code> splits;

  // BPE over raw bytes (a byte stands for its alphabet character).
  std::array<int32_t, 256> byte_ids;                       // -1: the vocabulary lacks it
  absl::flat_hash_map<std::string, int32_t> ids_by_bytes;  // byte-level vocabulary tokens
  absl::flat_hash_map<uint64_t, BpeMerge> merges;          // PairKey(left, right)
  bool ignore_merges = false;
  int32_t unk_id = -1;  // -1: characters outside the vocabulary are dropped, as in tokenizers
  bool fuse_unk = false;

  // Added tokens; the tries' values index `added`.
  std::vector<AddedToken> added;
  TokenTrie raw_trie;         // normalized=false: matched in the text as given
  TokenTrie normalized_trie;  // normalized=true: matched in what the first pass left

  // The post-processor's template for one sequence: ids before and after the text.
  std::vector<int32_t> prefix_ids;
  std::vector<int32_t> suffix_ids;

  // Decoding: the bytes of token `id` are decode_bytes[decode_offsets[id], [id + 1]).
  std::string decode_bytes;
  std::vector<uint32_t> decode_offsets;
  std::vector<TokenKind> decode_kinds;

  int32_t bos_id = -1;
  int32_t eos_id = -1;
};

}  // namespace internal

namespace {

// ---- reading tokenizer.json ----------------------------------------------------------------

// Where a value sits, for messages: "DIR/tokenizer.json: model.merges[3]: ...".
struct Where {
  const std::string* file;
  std::string field;

  Where In(std::string_view key) const {
    return {file, field.empty() ? std::string(key) : absl::StrCat(field, ".", Sv(key))};
  }
  Where At(size_t i) const { return {file, absl::StrCat(field, "[", i, "]")}; }
  absl::Status Bad(std::string_view what) const {
    return absl::InvalidArgumentError(field.empty()
                                          ? absl::StrCat(*file, ": ", Sv(what))
                                          : absl::StrCat(*file, ": ", field, ": ", Sv(what)));
  }
};

// obj[key] when present and not null; nullptr otherwise.
const Json* Present(const Json& obj, std::string_view key) {
  const Json* v = json::Find(obj, key);
  return v != nullptr && !v->is_null() ? v : nullptr;
}

absl::StatusOr<bool> BoolOr(const Json& obj, std::string_view key, bool fallback, const Where& w) {
  const Json* v = Present(obj, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) {
    return w.In(key).Bad(absl::StrCat("is ", Sv(json::TypeName(*v)), ", expected true or false"));
  }
  return v->get<bool>();
}

absl::StatusOr<std::string> RequiredString(const Json& obj, std::string_view key, const Where& w) {
  const Json* v = Present(obj, key);
  if (v == nullptr) return w.In(key).Bad("missing (a string is required)");
  if (!v->is_string()) {
    return w.In(key).Bad(absl::StrCat("is ", Sv(json::TypeName(*v)), ", expected a string"));
  }
  return v->get<std::string>();
}

// The "type" of a pre-tokenizer, post-processor, decoder or model object.
absl::StatusOr<std::string> ComponentType(const Json& v, const Where& w) {
  if (!v.is_object()) {
    return w.Bad(absl::StrCat("is ", Sv(json::TypeName(v)), ", expected an object"));
  }
  return RequiredString(v, "type", w);
}

// Fields tokenizer.json may set only to null (or leave out): each changes encoding in a way
// cpfill does not implement.
absl::Status MustBeNull(const Json& obj, std::string_view key, const Where& w,
                        std::string_view why) {
  if (const Json* v = Present(obj, key)) {
    return w.In(key).Bad(absl::StrCat(json::Show(*v), " is not supported (only null): ", Sv(why)));
  }
  return absl::OkStatus();
}

// An affix that adds nothing: transformers writes "" for the BPE prefix and suffix it has none of
// (SmolLM2's tokenizer.json), and tokenizers, gluing "" to each word, encodes as with null.
absl::Status MustBeNullOrEmpty(const Json& obj, std::string_view key, const Where& w,
                               std::string_view why) {
  if (const Json* v = Present(obj, key);
      v != nullptr && v->is_string() && v->get_ref<const std::string&>().empty()) {
    return absl::OkStatus();
  }
  return MustBeNull(obj, key, w, why);
}

// Reads one tokenizer.json (and tokenizer_config.json) into a TokenizerModel. Members keep what
// later steps of loading need (the vocabulary by token and by id) and is dropped afterwards.
class Loader {
 public:
  explicit Loader(std::string file) : file_(std::move(file)), root_where_{&file_, ""} {}

  absl::Status ReadTokenizerJson(const Json& root) {
    if (!root.is_object()) return root_where_.Bad("expected a JSON object");
    CPFILL_RETURN_IF_ERROR(ReadTopLevel(root));
    CPFILL_RETURN_IF_ERROR(ReadModel(root));
    CPFILL_RETURN_IF_ERROR(ReadAddedTokens(root));
    CPFILL_RETURN_IF_ERROR(ReadPreTokenizer(root));
    CPFILL_RETURN_IF_ERROR(ReadPostProcessor(root));
    CPFILL_RETURN_IF_ERROR(ReadDecoder(root));
    BuildEncodeTables();
    BuildDecodeTables();
    return absl::OkStatus();
  }

  // tokenizer_config.json: BOS and EOS by name. Optional: without it BOS is the template's first
  // token and EOS unknown.
  absl::Status ReadConfig(const std::string& path) {
    model_->bos_id = model_->prefix_ids.empty() ? -1 : model_->prefix_ids.front();
    absl::StatusOr<Json> config = ReadBoundedJson(path, kMaxTokenizerConfigBytes);
    if (absl::IsNotFound(config.status())) return absl::OkStatus();
    if (!config.ok()) return config.status();
    const Where w{&path, ""};
    if (!config->is_object()) return w.Bad("expected a JSON object");
    CPFILL_ASSIGN_OR_RETURN(const std::optional<int32_t> bos, ConfigToken(*config, "bos_token", w));
    CPFILL_ASSIGN_OR_RETURN(const std::optional<int32_t> eos, ConfigToken(*config, "eos_token", w));
    if (bos.has_value()) model_->bos_id = *bos;
    if (eos.has_value()) model_->eos_id = *eos;
    return absl::OkStatus();
  }

  std::shared_ptr<const internal::TokenizerModel> Finish() { return std::move(model_); }

 private:
  absl::Status ReadTopLevel(const Json& root) {
    if (const Json* version = Present(root, "version")) {
      if (!version->is_string() || version->get<std::string>() != "1.0") {
        return root_where_.In("version").Bad(absl::StrCat(json::Show(*version), " is not \"1.0\""));
      }
    }
    CPFILL_RETURN_IF_ERROR(
        MustBeNull(root, "truncation", root_where_, "cpfill never cuts prompts"));
    CPFILL_RETURN_IF_ERROR(MustBeNull(root, "padding", root_where_, "cpfill never pads prompts"));
    return MustBeNull(root, "normalizer", root_where_, "Llama 3 and GPT-2 normalize nothing");
  }

  // ---- model ----

  absl::Status ReadModel(const Json& root) {
    const Where w = root_where_.In("model");
    const Json* model = Present(root, "model");
    if (model == nullptr) return w.Bad("missing");
    CPFILL_ASSIGN_OR_RETURN(const std::string type, ComponentType(*model, w));
    if (type != "BPE") {
      return w.In("type").Bad(absl::StrCat("\"", type, "\" is not supported (only BPE)"));
    }
    CPFILL_RETURN_IF_ERROR(RefuseBpeOptions(*model, w));
    CPFILL_ASSIGN_OR_RETURN(model_->ignore_merges, BoolOr(*model, "ignore_merges", false, w));
    CPFILL_ASSIGN_OR_RETURN(model_->fuse_unk, BoolOr(*model, "fuse_unk", false, w));
    CPFILL_RETURN_IF_ERROR(ReadVocab(*model, w.In("vocab")));
    CPFILL_RETURN_IF_ERROR(ReadMerges(*model, w.In("merges")));
    if (const Json* unk = Present(*model, "unk_token")) {
      const auto id = unk->is_string() ? VocabId(unk->get_ref<const std::string&>()) : std::nullopt;
      if (!id.has_value()) {
        return w.In("unk_token")
            .Bad(absl::StrCat(json::Show(*unk), " is not a token of model.vocab"));
      }
      model_->unk_id = *id;
    }
    return absl::OkStatus();
  }

  // BPE options of other tokenizer families (SentencePiece-style, WordPiece-like, training).
  static absl::Status RefuseBpeOptions(const Json& model, const Where& w) {
    if (const Json* dropout = Present(model, "dropout");
        dropout != nullptr && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
      return w.In("dropout").Bad(absl::StrCat(
          json::Show(*dropout), " is not supported (only null): encoding would be random"));
    }
    CPFILL_RETURN_IF_ERROR(
        MustBeNullOrEmpty(model, "continuing_subword_prefix", w, "byte-level BPE has none"));
    CPFILL_RETURN_IF_ERROR(
        MustBeNullOrEmpty(model, "end_of_word_suffix", w, "byte-level BPE has none"));
    CPFILL_ASSIGN_OR_RETURN(const bool byte_fallback, BoolOr(model, "byte_fallback", false, w));
    if (byte_fallback) {
      return w.In("byte_fallback").Bad("true is not supported (a SentencePiece-style BPE)");
    }
    return absl::OkStatus();
  }

  absl::Status ReadVocab(const Json& model, const Where& w) {
    const Json* vocab = Present(model, "vocab");
    if (vocab == nullptr || !vocab->is_object() || vocab->empty()) {
      return w.Bad(vocab == nullptr ? "missing" : "expected a non-empty object of token: id");
    }
    std::vector<std::pair<int64_t, const std::string*>> by_id;
    by_id.reserve(vocab->size());
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      const std::string& token = it.key();  // the map's own key: its address stays valid
      const Json& value = it.value();
      const std::optional<int64_t> id = json::AsInt64(value);
      if (!id.has_value() || *id < 0 || *id > kMaxTokenId) {
        return w.Bad(absl::StrCat(json::Show(token), " has id ", json::Show(value),
                                  ", expected an integer in [0, ", kMaxTokenId, "]"));
      }
      by_id.emplace_back(*id, &token);
      vocab_.emplace(token, static_cast<int32_t>(*id));
    }
    std::sort(by_id.begin(), by_id.end());
    tokens_by_id_.resize(by_id.back().first + 1);
    has_vocab_id_.resize(by_id.back().first + 1, false);
    for (size_t i = 0; i < by_id.size(); ++i) {
      if (i > 0 && by_id[i].first == by_id[i - 1].first) {
        return w.Bad(absl::StrCat("id ", by_id[i].first, " is given to both ",
                                  json::Show(*by_id[i - 1].second), " and ",
                                  json::Show(*by_id[i].second)));
      }
      tokens_by_id_[by_id[i].first] = *by_id[i].second;
      has_vocab_id_[by_id[i].first] = true;
    }
    return absl::OkStatus();
  }

  // Merges are "a b" strings (older files; "#version" lines skipped) or [a, b] pairs; a merge's
  // rank is its place in the list. A pair listed twice keeps its last rank, as in tokenizers.
  absl::Status ReadMerges(const Json& model, const Where& w) {
    const Json* merges = Present(model, "merges");
    if (merges == nullptr || !merges->is_array()) {
      return w.Bad(merges == nullptr
                       ? "missing"
                       : absl::StrCat("is ", Sv(json::TypeName(*merges)), ", expected a list"));
    }
    const bool strings = !merges->empty() && (*merges)[0].is_string();
    model_->merges.reserve(merges->size());
    int32_t rank = 0;
    for (size_t i = 0; i < merges->size(); ++i) {
      const Json& item = (*merges)[i];
      if (item.is_string() != strings) {
        return w.At(i).Bad(absl::StrCat("is ", Sv(json::TypeName(item)),
                                        ": the list mixes \"a b\" strings and [a, b] pairs"));
      }
      if (strings && absl::StartsWith(item.get_ref<const std::string&>(), "#version")) continue;
      CPFILL_ASSIGN_OR_RETURN(const auto pair, MergePair(item, w.At(i)));
      CPFILL_RETURN_IF_ERROR(AddMerge(pair.first, pair.second, rank++, w.At(i)));
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<std::pair<std::string, std::string>> MergePair(const Json& item,
                                                                       const Where& w) {
    if (item.is_string()) {
      const std::string& s = item.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return w.Bad(absl::StrCat(json::Show(item), " is not two tokens separated by one space"));
      }
      return std::make_pair(s.substr(0, space), s.substr(space + 1));
    }
    if (!item.is_array() || item.size() != 2 || !item[0].is_string() || !item[1].is_string()) {
      return w.Bad(absl::StrCat(json::Show(item), " is not a pair of two token strings"));
    }
    return std::make_pair(item[0].get<std::string>(), item[1].get<std::string>());
  }

  absl::Status AddMerge(const std::string& left, const std::string& right, int32_t rank,
                        const Where& w) {
    const std::string merged = left + right;
    const std::optional<int32_t> ids[3] = {VocabId(left), VocabId(right), VocabId(merged)};
    for (int k = 0; k < 3; ++k) {
      if (!ids[k].has_value()) {
        const std::string& token = k == 0 ? left : k == 1 ? right : merged;
        return w.Bad(absl::StrCat(json::Show(Json(token)), " is not a token of model.vocab"));
      }
    }
    model_->merges[PairKey(*ids[0], *ids[1])] = {rank, *ids[2]};
    return absl::OkStatus();
  }

  std::optional<int32_t> VocabId(std::string_view token) const {
    const auto it = vocab_.find(Sv(token));
    return it == vocab_.end() ? std::nullopt : std::optional<int32_t>(it->second);
  }

  // ---- added tokens ----

  // tokenizers ignores the ids in the file: an added token that is in the vocabulary takes its
  // id there, the others take the ids after the vocabulary (its size) in file order. A file
  // whose ids say otherwise would decode differently here and there, so it is refused.
  absl::Status ReadAddedTokens(const Json& root) {
    const Where w = root_where_.In("added_tokens");
    const Json* list = Present(root, "added_tokens");
    if (list == nullptr) return absl::OkStatus();
    if (!list->is_array()) {
      return w.Bad(absl::StrCat("is ", Sv(json::TypeName(*list)), ", expected a list"));
    }
    int64_t next_id = static_cast<int64_t>(vocab_.size());
    absl::flat_hash_map<std::string, size_t> seen;
    for (size_t i = 0; i < list->size(); ++i) {
      CPFILL_ASSIGN_OR_RETURN(AddedToken token, ReadAddedToken((*list)[i], w.At(i)));
      if (token.content.empty()) continue;  // tokenizers ignores empty added tokens
      if (auto [it, inserted] = seen.emplace(token.content, i); !inserted) {
        return w.At(i).Bad(absl::StrCat(json::Show(Json(token.content)), " repeats added_tokens[",
                                        it->second, "]"));
      }
      const std::optional<int32_t> in_vocab = VocabId(token.content);
      const int64_t expected = in_vocab.has_value() ? *in_vocab : next_id++;
      if (token.id != expected) {
        return w.At(i).Bad(absl::StrCat(
            "id ", token.id, ", but tokenizers gives ", json::Show(Json(token.content)), " id ",
            expected, " (",
            in_vocab.has_value() ? "its id in model.vocab"
                                 : "the added tokens not in model.vocab follow it in file order",
            ")"));
      }
      if (!in_vocab.has_value() && token.id < static_cast<int64_t>(has_vocab_id_.size()) &&
          has_vocab_id_[token.id]) {
        return w.At(i).Bad(absl::StrCat("id ", token.id, " is model.vocab's id of ",
                                        json::Show(Json(tokens_by_id_[token.id]))));
      }
      model_->added.push_back(std::move(token));
    }
    return absl::OkStatus();
  }

  static absl::StatusOr<AddedToken> ReadAddedToken(const Json& item, const Where& w) {
    if (!item.is_object()) {
      return w.Bad(absl::StrCat("is ", Sv(json::TypeName(item)), ", expected an object"));
    }
    AddedToken t;
    CPFILL_ASSIGN_OR_RETURN(t.content, RequiredString(item, "content", w));
    const Json* id = Present(item, "id");
    const std::optional<int64_t> value = id != nullptr ? json::AsInt64(*id) : std::nullopt;
    if (!value.has_value() || *value < 0 || *value > kMaxTokenId) {
      return w.In("id").Bad(absl::StrCat(id == nullptr ? "missing" : json::Show(*id),
                                         ": expected an integer in [0, ", kMaxTokenId, "]"));
    }
    t.id = static_cast<int32_t>(*value);
    CPFILL_ASSIGN_OR_RETURN(t.special, BoolOr(item, "special", false, w));
    CPFILL_ASSIGN_OR_RETURN(t.lstrip, BoolOr(item, "lstrip", false, w));
    CPFILL_ASSIGN_OR_RETURN(t.rstrip, BoolOr(item, "rstrip", false, w));
    CPFILL_ASSIGN_OR_RETURN(t.normalized, BoolOr(item, "normalized", true, w));
    CPFILL_ASSIGN_OR_RETURN(const bool single_word, BoolOr(item, "single_word", false, w));
    if (single_word) return w.In("single_word").Bad("true is not supported");
    return t;
  }

  // ---- pre-tokenizer ----

  absl::Status ReadPreTokenizer(const Json& root) {
    const Where w = root_where_.In("pre_tokenizer");
    const Json* pt = Present(root, "pre_tokenizer");
    if (pt == nullptr) return w.Bad("null is not supported: a byte-level BPE needs ByteLevel");
    CPFILL_ASSIGN_OR_RETURN(const std::string type, ComponentType(*pt, w));
    if (type == "ByteLevel") return ReadByteLevel(*pt, w);
    if (type != "Sequence") {
      return w.In("type").Bad(absl::StrCat(
          "\"", type,
          "\" is not supported (ByteLevel, or a Sequence of Split, Digits, ByteLevel)"));
    }
    const Json* list = Present(*pt, "pretokenizers");
    if (list == nullptr || !list->is_array() || list->empty()) {
      return w.In("pretokenizers").Bad("expected a non-empty list");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      const Where wi = w.In("pretokenizers").At(i);
      CPFILL_ASSIGN_OR_RETURN(const std::string item_type, ComponentType((*list)[i], wi));
      const bool last = i + 1 == list->size();
      if (item_type == "Split" && !last) {
        CPFILL_RETURN_IF_ERROR(ReadSplit((*list)[i], wi));
      } else if (item_type == "Digits" && !last) {
        CPFILL_RETURN_IF_ERROR(ReadDigits((*list)[i], wi));
      } else if (item_type == "ByteLevel" && last) {
        CPFILL_RETURN_IF_ERROR(ReadByteLevel((*list)[i], wi));
      } else {
        return wi.In("type").Bad(absl::StrCat(
            "\"", item_type, "\" is not supported here (Split or Digits, then ByteLevel last)"));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ReadByteLevel(const Json& pt, const Where& w) {
    CPFILL_ASSIGN_OR_RETURN(const bool add_prefix_space, BoolOr(pt, "add_prefix_space", false, w));
    if (add_prefix_space) return w.In("add_prefix_space").Bad("true is not supported");
    CPFILL_ASSIGN_OR_RETURN(const bool use_regex, BoolOr(pt, "use_regex", true, w));
    if (!use_regex) return absl::OkStatus();
    CPFILL_ASSIGN_OR_RETURN(Pcre2Code code, Compile(kGpt2Pattern, false, w));
    model_->splits.push_back(std::move(code));
    return absl::OkStatus();
  }

  // Digits (SmolLM2, StarCoder) isolates runs of Unicode numbers (Rust's char::is_numeric: the
  // categories Nd, Nl, No, as \p{N}), or each one alone with individual_digits: an Isolated Split.
  absl::Status ReadDigits(const Json& pt, const Where& w) {
    CPFILL_ASSIGN_OR_RETURN(const bool individual, BoolOr(pt, "individual_digits", false, w));
    CPFILL_ASSIGN_OR_RETURN(Pcre2Code code, Compile(individual ? "\\p{N}" : "\\p{N}+", false, w));
    model_->splits.push_back(std::move(code));
    return absl::OkStatus();
  }

  absl::Status ReadSplit(const Json& pt, const Where& w) {
    const Json* pattern = Present(pt, "pattern");
    const Json* regex = pattern != nullptr ? Present(*pattern, "Regex") : nullptr;
    const Json* literal = pattern != nullptr ? Present(*pattern, "String") : nullptr;
    if (pattern == nullptr || !pattern->is_object() || pattern->size() != 1 ||
        (regex == nullptr) == (literal == nullptr) || !(regex ? regex : literal)->is_string()) {
      return w.In("pattern").Bad("expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
    CPFILL_ASSIGN_OR_RETURN(const std::string behavior, RequiredString(pt, "behavior", w));
    if (behavior != "Isolated") {
      return w.In("behavior")
          .Bad(absl::StrCat("\"", behavior, "\" is not supported (only Isolated)"));
    }
    CPFILL_ASSIGN_OR_RETURN(const bool invert, BoolOr(pt, "invert", false, w));
    if (invert) return w.In("invert").Bad("true is not supported");
    CPFILL_ASSIGN_OR_RETURN(Pcre2Code code, Compile((regex ? regex : literal)->get<std::string>(),
                                                    literal != nullptr, w.In("pattern")));
    model_->splits.push_back(std::move(code));
    return absl::OkStatus();
  }

  // Unicode classes (\p{L}, \s) need UCP; the JIT makes matching several times faster and is
  // used when the platform has it.
  static absl::StatusOr<Pcre2Code> Compile(std::string_view pattern, bool literal, const Where& w) {
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    int error = 0;
    PCRE2_SIZE offset = 0;
    Pcre2Code code(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 options, &error, &offset, nullptr));
    if (code == nullptr) {
      return w.Bad(absl::StrCat("PCRE2 cannot compile ", json::Show(Json(std::string(pattern))),
                                " (at offset ", offset, "): ", Pcre2Message(error)));
    }
    // An empty match splits differently in Oniguruma (tokenizers) and PCRE2: refuse patterns
    // that allow one (Llama 3's and GPT-2's never match less than one character). MINLENGTH
    // counts the characters a match consumes, not those it reports: a lookahead alone ("(?=a)")
    // or \K reports an empty match past a MINLENGTH of 1, so the pattern is also tried at every
    // character of a probe text (SplitIsolated refuses any empty match the probe missed).
    uint32_t min_length = 0;
    const bool empty =
        pcre2_pattern_info(code.get(), PCRE2_INFO_MINLENGTH, &min_length) != 0 || min_length == 0;
    if (empty || MatchesEmptyInProbe(code.get())) {
      return w.Bad(absl::StrCat(json::Show(Json(std::string(pattern))),
                                " can match the empty string, which is not supported"));
    }
    pcre2_jit_compile(code.get(), PCRE2_JIT_COMPLETE);  // failing that, pcre2_match interprets
    return code;
  }

  // Whether `code` reports an empty match searching from any character of a text that holds
  // every kind of character a pre-tokenizer pattern tells apart: letters (Latin, accented, CJK),
  // digits (ASCII, Arabic-Indic), punctuation, contractions, blanks and line ends, an emoji.
  static bool MatchesEmptyInProbe(const pcre2_code* code) {
    static constexpr std::string_view kProbe =
        "Hello, World! it's 'll 've 're 'd 'm 't 's 123 4567 \xd9\xa3\xd9\xa4 caf\xc3\xa9 "
        "\xc3\x9f\xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \t\r\n  \n\n x_y-z."
        "\"#$%&()*+/:;<=>?@[\\]^`{|}~ \xc2\xa0"
        "end";
    const Pcre2MatchData data(pcre2_match_data_create_from_pattern(code, nullptr));
    if (data == nullptr) return true;  // cannot tell: refused
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(kProbe.data());
    for (size_t start = 0; start <= kProbe.size(); ++start) {
      if (start < kProbe.size() && (static_cast<uint8_t>(kProbe[start]) & 0xC0) == 0x80) continue;
      if (pcre2_match(code, subject, kProbe.size(), start, 0, data.get(), nullptr) <= 0) continue;
      const PCRE2_SIZE* match = pcre2_get_ovector_pointer(data.get());
      if (match[1] <= match[0]) return true;
    }
    return false;
  }

  // ---- post-processor and decoder ----

  absl::Status ReadPostProcessor(const Json& root) {
    const Where w = root_where_.In("post_processor");
    const Json* pp = Present(root, "post_processor");
    if (pp == nullptr) return absl::OkStatus();
    CPFILL_ASSIGN_OR_RETURN(const std::string type, ComponentType(*pp, w));
    if (type != "Sequence") return ReadProcessor(*pp, type, w);
    const Json* list = Present(*pp, "processors");
    if (list == nullptr || !list->is_array()) return w.In("processors").Bad("expected a list");
    for (size_t i = 0; i < list->size(); ++i) {
      const Where wi = w.In("processors").At(i);
      CPFILL_ASSIGN_OR_RETURN(const std::string item_type, ComponentType((*list)[i], wi));
      CPFILL_RETURN_IF_ERROR(ReadProcessor((*list)[i], item_type, wi));
    }
    return absl::OkStatus();
  }

  // ByteLevel as a post-processor only trims offsets, which cpfill does not report.
  absl::Status ReadProcessor(const Json& pp, const std::string& type, const Where& w) {
    if (type == "ByteLevel") return absl::OkStatus();
    if (type != "TemplateProcessing") {
      return w.In("type").Bad(absl::StrCat(
          "\"", type, "\" is not supported (TemplateProcessing, ByteLevel or a Sequence of them)"));
    }
    if (have_template_) return w.Bad("a second TemplateProcessing is not supported");
    have_template_ = true;
    const Json* single = Present(pp, "single");
    if (single == nullptr || !single->is_array()) return w.In("single").Bad("expected a list");
    bool seen_text = false;
    for (size_t i = 0; i < single->size(); ++i) {
      CPFILL_RETURN_IF_ERROR(ReadTemplatePiece(pp, (*single)[i], w.In("single").At(i), seen_text));
    }
    if (!seen_text) return w.In("single").Bad("has no {\"Sequence\": {\"id\": \"A\"}}");
    return absl::OkStatus();
  }

  // One piece of the template: {"Sequence": {"id": "A"}} (the text) or {"SpecialToken": {"id":
  // NAME}}, whose ids special_tokens[NAME].ids lists.
  absl::Status ReadTemplatePiece(const Json& pp, const Json& piece, const Where& w,
                                 bool& seen_text) {
    const Json* sequence = Present(piece, "Sequence");
    const Json* special = Present(piece, "SpecialToken");
    if (!piece.is_object() || piece.size() != 1 || (sequence == nullptr && special == nullptr)) {
      return w.Bad(absl::StrCat(json::Show(piece),
                                ": expected {\"Sequence\": ...} or {\"SpecialToken\": ...}"));
    }
    if (sequence != nullptr) {
      CPFILL_ASSIGN_OR_RETURN(const std::string id,
                              RequiredString(*sequence, "id", w.In("Sequence")));
      if (id != "A" || seen_text) return w.Bad("the single template must hold sequence A once");
      seen_text = true;
      return absl::OkStatus();
    }
    CPFILL_ASSIGN_OR_RETURN(const std::string name,
                            RequiredString(*special, "id", w.In("SpecialToken")));
    const Json* tokens = json::Find(pp, "special_tokens");
    const Json* entry = tokens != nullptr ? json::Find(*tokens, name) : nullptr;
    const Json* ids = entry != nullptr ? Present(*entry, "ids") : nullptr;
    if (ids == nullptr || !ids->is_array()) {
      return w.Bad(absl::StrCat("special_tokens[", json::Show(Json(name)),
                                "].ids is missing or not a list"));
    }
    for (const Json& id : *ids) {
      const std::optional<int64_t> value = json::AsInt64(id);
      if (!value.has_value() || !IsToken(*value)) {
        return w.Bad(absl::StrCat(json::Show(Json(name)), " has id ", json::Show(id),
                                  ", which is not a token"));
      }
      (seen_text ? model_->suffix_ids : model_->prefix_ids).push_back(static_cast<int32_t>(*value));
    }
    return absl::OkStatus();
  }

  // Every field of the ByteLevel decoder concerns offsets or encoding; decoding ignores them.
  absl::Status ReadDecoder(const Json& root) {
    const Where w = root_where_.In("decoder");
    const Json* decoder = Present(root, "decoder");
    if (decoder == nullptr) return w.Bad("null is not supported (only ByteLevel)");
    CPFILL_ASSIGN_OR_RETURN(const std::string type, ComponentType(*decoder, w));
    if (type != "ByteLevel") {
      return w.In("type").Bad(absl::StrCat("\"", type, "\" is not supported (only ByteLevel)"));
    }
    return absl::OkStatus();
  }

  // ---- tables ----

  bool IsToken(int64_t id) const {
    if (id < 0) return false;
    if (id < static_cast<int64_t>(has_vocab_id_.size()) && has_vocab_id_[id]) return true;
    return std::any_of(model_->added.begin(), model_->added.end(),
                       [&](const AddedToken& t) { return t.id == id; });
  }

  void BuildEncodeTables() {
    const ByteAlphabet& alphabet = Alphabet();
    for (int b = 0; b < 256; ++b) {
      std::string c;
      AppendUtf8(alphabet.char_of_byte[b], c);
      model_->byte_ids[b] = VocabId(c).value_or(-1);
    }
    model_->ids_by_bytes.reserve(vocab_.size());
    for (const auto& [token, id] : vocab_) {
      if (std::optional<std::string> bytes = ByteLevelBytes(token)) {
        model_->ids_by_bytes.emplace(std::move(*bytes), id);
      }
    }
    for (size_t i = 0; i < model_->added.size(); ++i) {
      const AddedToken& t = model_->added[i];
      (t.normalized ? model_->normalized_trie : model_->raw_trie)
          .Insert(t.content, static_cast<int32_t>(i));
    }
  }

  // What decode gives for each id: the added token's content before the vocabulary's token (as
  // tokenizers looks them up), as bytes when every character is in the byte-level alphabet and
  // as its own UTF-8 otherwise (the ByteLevel decoder).
  void BuildDecodeTables() {
    int64_t size = static_cast<int64_t>(tokens_by_id_.size());
    for (const AddedToken& t : model_->added) size = std::max<int64_t>(size, t.id + 1);
    std::vector<int32_t> added_by_id(size, -1);
    for (size_t i = 0; i < model_->added.size(); ++i)
      added_by_id[model_->added[i].id] = static_cast<int32_t>(i);
    model_->decode_offsets.assign(size + 1, 0);
    model_->decode_kinds.assign(size, kNoToken);
    for (int64_t id = 0; id < size; ++id) {
      const AddedToken* added = added_by_id[id] >= 0 ? &model_->added[added_by_id[id]] : nullptr;
      const bool in_vocab = id < static_cast<int64_t>(has_vocab_id_.size()) && has_vocab_id_[id];
      if (added != nullptr || in_vocab) {
        const std::string& token = added != nullptr ? added->content : tokens_by_id_[id];
        const std::optional<std::string> bytes = ByteLevelBytes(token);
        model_->decode_bytes += bytes.has_value() ? *bytes : token;
        model_->decode_kinds[id] = added != nullptr && added->special ? kSpecialToken : kToken;
      }
      model_->decode_offsets[id + 1] = static_cast<uint32_t>(model_->decode_bytes.size());
    }
  }

  // ---- tokenizer_config.json ----

  // A token named by tokenizer_config.json: a string, {"content": ...} (an AddedToken as
  // transformers saves it) or null (nullopt).
  absl::StatusOr<std::optional<int32_t>> ConfigToken(const Json& config, std::string_view key,
                                                     const Where& w) const {
    const Json* v = Present(config, key);
    if (v == nullptr) return std::nullopt;
    const Json* content = v->is_object() ? Present(*v, "content") : v;
    if (content == nullptr || !content->is_string()) {
      return w.In(key).Bad(
          absl::StrCat(json::Show(*v), ": expected a token string or {\"content\": ...}"));
    }
    const std::string& token = content->get_ref<const std::string&>();
    for (const AddedToken& t : model_->added) {
      if (t.content == token) return t.id;
    }
    if (const std::optional<int32_t> id = VocabId(token)) return *id;
    return w.In(key).Bad(absl::StrCat(json::Show(*content), " is not a token of tokenizer.json"));
  }

  std::string file_;
  Where root_where_;
  std::shared_ptr<internal::TokenizerModel> model_ = std::make_shared<internal::TokenizerModel>();
  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> tokens_by_id_;
  std::vector<bool> has_vocab_id_;
  bool have_template_ = false;
};

// ---- encoding ------------------------------------------------------------------------------

// One Encode call's state: the match data of PCRE2 (per call, so that calls may run on many
// threads) and buffers reused for every piece.
class Encoder {
 public:
  explicit Encoder(const internal::TokenizerModel& model)
      : m_(model), match_data_(pcre2_match_data_create(1, nullptr)) {}

  absl::Status Run(std::string_view text, std::vector<int32_t>& ids) {
    if (match_data_ == nullptr) return absl::ResourceExhaustedError("tokenizer: out of memory");
    absl::Status status;
    // Step 1: added tokens, in two passes (normalized=false first).
    SplitAddedTokens(text, m_.raw_trie, [&](std::string_view piece, int32_t added) {
      if (added >= 0) return ids.push_back(m_.added[added].id);
      SplitAddedTokens(piece, m_.normalized_trie, [&](std::string_view rest, int32_t added2) {
        if (added2 >= 0) return ids.push_back(m_.added[added2].id);
        if (status.ok()) status = PreTokenize(rest, ids);
      });
    });
    return status;
  }

 private:
  struct Symbol {
    int32_t id;
    int32_t prev;    // -1: none
    int32_t next;    // -1: none
    int32_t length;  // bytes; 0: merged into its left neighbour
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;  // index of the left symbol
    int32_t new_id;
  };
  // Heap order of tokenizers' Word::merge_all: lowest rank first, then the leftmost.
  static bool Later(const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }

  // Calls emit(piece, index into m_.added or -1) for the text between matches and for the
  // matches, extended over white space by lstrip / rstrip as AddedVocabulary::find_matches does
  // (the search resumes where the match itself ended).
  template <typename Emit>
  void SplitAddedTokens(std::string_view text, const TokenTrie& trie, Emit&& emit) {
    if (trie.empty()) {
      if (!text.empty()) emit(text, -1);
      return;
    }
    size_t start_offset = 0;
    for (size_t pos = 0; pos < text.size();) {
      const auto [length, index] = trie.LongestAt(text, pos);
      if (index < 0) {
        ++pos;
        continue;
      }
      const AddedToken& token = m_.added[index];
      size_t start = pos, stop = pos + length;
      if (token.lstrip) start = std::max(WhiteSpaceRunStart(text, start), start_offset);
      if (token.rstrip) stop += WhiteSpaceRunLength(text, stop);
      if (start_offset < start) emit(text.substr(start_offset, start - start_offset), -1);
      emit(text.substr(start, stop - start), index);
      start_offset = stop;
      pos += length;
    }
    if (start_offset < text.size()) emit(text.substr(start_offset), -1);
  }

  // Step 2: the pre-tokenizer's splits, then step 3 on every piece.
  absl::Status PreTokenize(std::string_view text, std::vector<int32_t>& ids) {
    pieces_.assign(1, text);
    for (const Pcre2Code& pattern : m_.splits) {
      next_pieces_.clear();
      for (const std::string_view piece : pieces_) {
        CPFILL_RETURN_IF_ERROR(SplitIsolated(pattern.get(), piece, next_pieces_));
      }
      pieces_.swap(next_pieces_);
    }
    for (const std::string_view piece : pieces_) Bpe(piece, ids);
    return absl::OkStatus();
  }

  // Matches of `pattern` in `text` and the text between them, in order. The text is valid UTF-8
  // (checked once by Encode), so PCRE2 need not check it again at every match.
  absl::Status SplitIsolated(const pcre2_code* pattern, std::string_view text,
                             std::vector<std::string_view>& out) {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t done = 0;
    while (done < text.size()) {
      const int rc = pcre2_match(pattern, subject, text.size(), done, PCRE2_NO_UTF_CHECK,
                                 match_data_.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("text: the pre-tokenizer's pattern failed at byte ", done, " of a ",
                         text.size(), "-byte piece: ", Pcre2Message(rc)));
      }
      const PCRE2_SIZE* match = pcre2_get_ovector_pointer(match_data_.get());
      // Load refuses patterns that can match nothing (Compile), but no check of a regular
      // expression is complete: an empty match here (or one that \K reports before `done`)
      // would never advance, so it is refused instead of looping.
      if (match[0] < done || match[1] <= match[0]) {
        return absl::InvalidArgumentError(
            absl::StrCat("text: the pre-tokenizer's pattern matched the empty string at byte ",
                         match[0], " of a ", text.size(),
                         "-byte piece (tokenizer.json's Split pattern is not supported)"));
      }
      if (match[0] > done) out.push_back(text.substr(done, match[0] - done));
      out.push_back(text.substr(match[0], match[1] - match[0]));
      done = match[1];
    }
    if (done < text.size()) out.push_back(text.substr(done));
    return absl::OkStatus();
  }

  // Step 3: one pre-token's ids.
  void Bpe(std::string_view word, std::vector<int32_t>& ids) {
    if (m_.ignore_merges) {
      if (const auto it = m_.ids_by_bytes.find(Sv(word)); it != m_.ids_by_bytes.end()) {
        return ids.push_back(it->second);
      }
    }
    InitialSymbols(word);
    MergeAll();
    for (const Symbol& s : symbols_) {
      if (s.length > 0) ids.push_back(s.id);
    }
  }

  // One symbol per byte; bytes outside the vocabulary become unk (fused into one when
  // fuse_unk) or, without an unk token, are dropped (BPE::merge_word).
  void InitialSymbols(std::string_view word) {
    symbols_.clear();
    int32_t unk_length = 0;  // an unknown run not yet added
    auto add = [&](int32_t id, int32_t length) {
      const auto n = static_cast<int32_t>(symbols_.size());
      if (n > 0) symbols_.back().next = n;
      symbols_.push_back({id, n - 1, -1, length});
    };
    for (const char c : word) {
      const int32_t id = m_.byte_ids[static_cast<uint8_t>(c)];
      if (id >= 0) {
        if (unk_length > 0) add(m_.unk_id, std::exchange(unk_length, 0));
        add(id, 1);
      } else if (m_.unk_id >= 0) {
        if (unk_length > 0 && !m_.fuse_unk) add(m_.unk_id, std::exchange(unk_length, 0));
        ++unk_length;
      }
    }
    if (unk_length > 0) add(m_.unk_id, unk_length);
  }

  void Push(int32_t left_pos) {
    const Symbol& left = symbols_[left_pos];
    const auto it = m_.merges.find(PairKey(left.id, symbols_[left.next].id));
    if (it == m_.merges.end()) return;
    heap_.push_back({it->second.rank, left_pos, it->second.new_id});
    std::push_heap(heap_.begin(), heap_.end(), Later);
  }

  // Word::merge_all: a candidate is stale when its left symbol was merged away or its pair no
  // longer merges into the same token.
  void MergeAll() {
    heap_.clear();
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols_.size()); ++i) Push(i);
    while (!heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), Later);
      const Candidate top = heap_.back();
      heap_.pop_back();
      Symbol& left = symbols_[top.pos];
      if (left.length == 0 || left.next < 0) continue;
      const int32_t right_pos = left.next;
      const Symbol right = symbols_[right_pos];
      const auto it = m_.merges.find(PairKey(left.id, right.id));
      if (it == m_.merges.end() || it->second.new_id != top.new_id) continue;
      left.id = top.new_id;
      left.length += right.length;
      left.next = right.next;
      symbols_[right_pos].length = 0;
      if (right.next >= 0) symbols_[right.next].prev = top.pos;
      if (left.prev >= 0) Push(left.prev);
      if (left.next >= 0) Push(top.pos);
    }
  }

  const internal::TokenizerModel& m_;
  Pcre2MatchData match_data_;
  std::vector<std::string_view> pieces_, next_pieces_;
  std::vector<Symbol> symbols_;
  std::vector<Candidate> heap_;
};

}  // namespace

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& dir) {
  const std::string path = dir + "/tokenizer.json";
  Loader loader(path);
  {
    CPFILL_ASSIGN_OR_RETURN(const Json root, ReadBoundedJson(path, kMaxTokenizerJsonBytes));
    CPFILL_RETURN_IF_ERROR(loader.ReadTokenizerJson(root));
  }
  CPFILL_RETURN_IF_ERROR(loader.ReadConfig(dir + "/tokenizer_config.json"));
  return Tokenizer(loader.Finish());
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool add_bos) const {
  if (const std::optional<size_t> bad = FirstInvalidUtf8(text)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("text is not valid UTF-8 at byte offset %d (0x%02x: %s)", *bad,
                        static_cast<uint8_t>(text[*bad]), Utf8Problem(text, *bad)));
  }
  std::vector<int32_t> ids;
  if (add_bos) ids = model_->prefix_ids;
  ids.reserve(ids.size() + text.size() / 3 + 4);
  Encoder encoder(*model_);
  CPFILL_RETURN_IF_ERROR(encoder.Run(text, ids));
  if (add_bos) ids.insert(ids.end(), model_->suffix_ids.begin(), model_->suffix_ids.end());
  return ids;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special) const {
  const internal::TokenizerModel& m = *model_;
  std::string bytes;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab_size() || m.decode_kinds[id] == kNoToken) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " (at position ", i,
                                                     ") is not in the vocabulary (", vocab_size(),
                                                     " ids)"));
    }
    if (skip_special && m.decode_kinds[id] == kSpecialToken) continue;
    bytes.append(m.decode_bytes, m.decode_offsets[id],
                 m.decode_offsets[id + 1] - m.decode_offsets[id]);
  }
  return Utf8Lossy(bytes);
}

int32_t Tokenizer::bos_id() const { return model_->bos_id; }
int32_t Tokenizer::eos_id() const { return model_->eos_id; }
int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(model_->decode_kinds.size()); }

}  // namespace cpfill::runtime
