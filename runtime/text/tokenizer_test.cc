#include "runtime/text/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "runtime/text/tokenizer_test_util.h"

namespace cpfill::runtime {
namespace {

using Json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Llama 3's pre-tokenizer pattern.
constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|)"
    R"( ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A Llama-3-shaped tokenizer.json whose vocabulary is the 256 bytes (id = byte value); tests
// add tokens, merges and added tokens to it.
class TokenizerJson {
 public:
  TokenizerJson() {
    Json vocab = Json::object();
    for (int b = 0; b < 256; ++b) vocab[SpellBytes(std::string(1, static_cast<char>(b)))] = b;
    root_ = {{"version", "1.0"},
             {"truncation", nullptr},
             {"padding", nullptr},
             {"added_tokens", Json::array()},
             {"normalizer", nullptr},
             {"pre_tokenizer",
              {{"type", "Sequence"},
               {"pretokenizers",
                {{{"type", "Split"},
                  {"pattern", {{"Regex", kLlama3Pattern}}},
                  {"behavior", "Isolated"},
                  {"invert", false}},
                 {{"type", "ByteLevel"},
                  {"add_prefix_space", false},
                  {"trim_offsets", true},
                  {"use_regex", false}}}}}},
             {"post_processor", nullptr},
             {"decoder",
              {{"type", "ByteLevel"},
               {"add_prefix_space", true},
               {"trim_offsets", true},
               {"use_regex", true}}},
             {"model",
              {{"type", "BPE"},
               {"dropout", nullptr},
               {"unk_token", nullptr},
               {"continuing_subword_prefix", nullptr},
               {"end_of_word_suffix", nullptr},
               {"fuse_unk", false},
               {"byte_fallback", false},
               {"ignore_merges", false},
               {"vocab", vocab},
               {"merges", Json::array()}}}};
  }

  // A vocabulary token for these bytes; its id.
  int32_t Token(std::string_view bytes) {
    const auto id = static_cast<int32_t>(root_["model"]["vocab"].size());
    root_["model"]["vocab"][SpellBytes(bytes)] = id;
    return id;
  }
  // The next merge (lowest priority so far), as a [a, b] pair; the merged token must exist.
  void Merge(std::string_view a, std::string_view b) {
    root_["model"]["merges"].push_back({SpellBytes(a), SpellBytes(b)});
  }
  // An added token after the vocabulary (tokenizers' numbering); its id.
  int32_t Added(const std::string& content, bool special, Json extra = Json::object()) {
    const auto id =
        static_cast<int32_t>(root_["model"]["vocab"].size() + root_["added_tokens"].size());
    Json t = {{"id", id},          {"content", content}, {"single_word", false},
              {"lstrip", false},   {"rstrip", false},    {"normalized", !special},
              {"special", special}};
    t.update(extra);
    root_["added_tokens"].push_back(t);
    return id;
  }
  // TemplateProcessing with `bos` before the text, as Llama 3's post-processor.
  void BosTemplate(const std::string& bos, int32_t id) {
    const Json byte_level = {{"type", "ByteLevel"},
                             {"add_prefix_space", true},
                             {"trim_offsets", false},
                             {"use_regex", true}};
    Json single = Json::array();
    single.push_back({{"SpecialToken", {{"id", bos}, {"type_id", 0}}}});
    single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
    Json special_tokens = Json::object();
    special_tokens[bos] = {{"id", bos}, {"ids", Json::array({id})}, {"tokens", Json::array({bos})}};
    const Json templ = {{"type", "TemplateProcessing"},
                        {"single", single},
                        {"pair", Json::array()},
                        {"special_tokens", special_tokens}};
    root_["post_processor"] = {{"type", "Sequence"},
                               {"processors", Json::array({byte_level, templ})}};
  }

  Json& root() { return root_; }

 private:
  Json root_;
};

std::string Dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/tokenizer_test_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

absl::StatusOr<Tokenizer> LoadJson(const std::string& name, const Json& tokenizer,
                                   const Json* config = nullptr) {
  const std::string dir = Dir(name);
  WriteText(dir + "/tokenizer.json", tokenizer.dump());
  if (config != nullptr) WriteText(dir + "/tokenizer_config.json", config->dump());
  return Tokenizer::Load(dir);
}

Tokenizer MustLoad(const std::string& name, const Json& tokenizer, const Json* config = nullptr) {
  absl::StatusOr<Tokenizer> t = LoadJson(name, tokenizer, config);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

std::vector<int32_t> Ids(const Tokenizer& t, std::string_view text, bool add_bos = false) {
  absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, add_bos);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

std::vector<int32_t> Bytes(std::string_view s) {
  std::vector<int32_t> ids;
  for (const char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

// The message as a std::string (gmock prints Debian's absl::string_view character by character).
std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(Tokenizer, MergesApplyInRankOrder) {
  for (const bool ab_first : {true, false}) {
    TokenizerJson j;
    const int32_t ab = j.Token("ab"), bc = j.Token("bc");
    if (ab_first) {
      j.Merge("a", "b");
      j.Merge("b", "c");
    } else {
      j.Merge("b", "c");
      j.Merge("a", "b");
    }
    const Tokenizer t = MustLoad("rank", j.root());
    EXPECT_EQ(Ids(t, "abc"),
              ab_first ? std::vector<int32_t>({ab, 'c'}) : std::vector<int32_t>({'a', bc}));
  }
}

TEST(Tokenizer, EqualRanksMergeLeftmostFirst) {
  TokenizerJson j;
  const int32_t aa = j.Token("aa"), aaaa = j.Token("aaaa");
  j.Merge("a", "a");
  j.Merge("aa", "aa");
  const Tokenizer t = MustLoad("leftmost", j.root());
  EXPECT_THAT(Ids(t, "aaa"), ElementsAre(aa, 'a'));
  EXPECT_THAT(Ids(t, "aaaaa"), ElementsAre(aaaa, 'a'));
}

TEST(Tokenizer, LegacyStringMergesMatchPairs) {
  TokenizerJson j;
  const int32_t sp_w = j.Token(" w"), sp_wo = j.Token(" wo");
  j.Merge(" ", "w");
  j.Merge(" w", "o");
  Json legacy = j.root();
  legacy["model"]["merges"] = {"#version: 0.2", SpellBytes(" ") + " w", SpellBytes(" w") + " o"};
  for (const Json* root : {&j.root(), &legacy}) {
    const Tokenizer t = MustLoad("legacy", *root);
    EXPECT_THAT(Ids(t, "a wo w"), ElementsAre('a', sp_wo, sp_w));
  }
}

TEST(Tokenizer, IgnoreMergesTakesWholePreTokens) {
  for (const bool ignore : {true, false}) {
    TokenizerJson j;
    const int32_t hello = j.Token("hello");  // no merges lead to it
    const int32_t d123 = j.Token("123"), d456 = j.Token("456");
    j.root()["model"]["ignore_merges"] = ignore;
    const Tokenizer t = MustLoad("ignore", j.root());
    if (ignore) {
      EXPECT_THAT(Ids(t, "hello"), ElementsAre(hello));
      // Digits are split in threes first: 1234567 -> 123 456 7.
      EXPECT_THAT(Ids(t, "1234567"), ElementsAre(d123, d456, '7'));
    } else {
      EXPECT_EQ(Ids(t, "hello"), Bytes("hello"));
    }
  }
}

// transformers writes "" for the affixes a byte-level BPE has none of; tokenizers reads "" as
// null, and so must cpfill (SmolLM2's tokenizer.json).
TEST(Tokenizer, EmptyAffixesReadAsNull) {
  TokenizerJson j;
  const int32_t ab = j.Token("ab");
  j.Merge("a", "b");
  j.root()["model"]["continuing_subword_prefix"] = "";
  j.root()["model"]["end_of_word_suffix"] = "";
  const Tokenizer t = MustLoad("empty_affixes", j.root());
  EXPECT_THAT(Ids(t, "abc ab"), ElementsAre(ab, 'c', ' ', ab));
}

TEST(Tokenizer, PreTokenizerSplitsBeforeMerging) {
  TokenizerJson j;
  const int32_t ab = j.Token("ab"), sp_a = j.Token(" a");
  j.Merge("a", "b");
  j.Merge(" ", "a");
  const Tokenizer t = MustLoad("split", j.root());
  // "ab ab": pieces "ab", " ab": the space belongs to the next word; "b a" never merges across
  // the piece boundary.
  EXPECT_THAT(Ids(t, "ab ab"), ElementsAre(ab, ' ', ab));
  EXPECT_THAT(Ids(t, "x a"), ElementsAre('x', sp_a));
  EXPECT_THAT(Ids(t, "It'S"), ElementsAre('I', 't', '\'', 'S'));
  EXPECT_TRUE(Ids(t, "").empty());
}

TEST(Tokenizer, GptTwoByteLevelRegex) {
  TokenizerJson j;
  const int32_t sp_a = j.Token(" a");
  j.Merge(" ", "a");
  j.root()["pre_tokenizer"] = {{"type", "ByteLevel"},
                               {"add_prefix_space", false},
                               {"trim_offsets", true},
                               {"use_regex", true}};
  const Tokenizer t = MustLoad("gpt2", j.root());
  EXPECT_THAT(Ids(t, "1 a"), ElementsAre('1', sp_a));
}

TEST(Tokenizer, AddedTokensMatchLongestThenLeftmost) {
  TokenizerJson j;
  const int32_t bos = j.Added("<|begin_of_text|>", true);
  const int32_t short_tok = j.Added("<|begin", true);
  const int32_t ab = j.Added("ab", false, {{"normalized", false}});
  const int32_t bc = j.Added("bc", false, {{"normalized", false}});
  const Tokenizer t = MustLoad("added", j.root());
  EXPECT_THAT(Ids(t, "x<|begin_of_text|>y"), ElementsAre('x', bos, 'y'));
  EXPECT_THAT(Ids(t, "<|beginning"), ElementsAre(short_tok, 'n', 'i', 'n', 'g'));
  EXPECT_THAT(Ids(t, "abc"), ElementsAre(ab, 'c'));
  EXPECT_THAT(Ids(t, "xbc"), ElementsAre('x', bc));
}

TEST(Tokenizer, NonNormalizedTokensAreMatchedFirst) {
  TokenizerJson j;
  const int32_t xy = j.Added("xy", false, {{"normalized", true}});
  const int32_t yz = j.Added("yz", false, {{"normalized", false}});
  const Tokenizer t = MustLoad("passes", j.root());
  // tokenizers matches normalized=false tokens in the whole text first: yz wins over xy.
  EXPECT_THAT(Ids(t, "xyz"), ElementsAre('x', yz));
  EXPECT_THAT(Ids(t, "xyw"), ElementsAre(xy, 'w'));
}

TEST(Tokenizer, LstripAndRstripTakeWhiteSpace) {
  TokenizerJson j;
  const int32_t mask = j.Added("<mask>", true, {{"lstrip", true}, {"rstrip", true}});
  const Tokenizer t = MustLoad("strip", j.root());
  EXPECT_THAT(Ids(t, "a  <mask>\u3000 b"), ElementsAre('a', mask, 'b'));
}

TEST(Tokenizer, TemplateAddsBos) {
  TokenizerJson j;
  const int32_t bos = j.Added("<|begin_of_text|>", true);
  const int32_t eos = j.Added("<|end_of_text|>", true);
  const Tokenizer plain = MustLoad("no_template", j.root());
  EXPECT_EQ(plain.bos_id(), -1);
  EXPECT_THAT(Ids(plain, "a", true), ElementsAre('a'));
  j.BosTemplate("<|begin_of_text|>", bos);
  const Tokenizer t = MustLoad("template", j.root());
  EXPECT_EQ(t.bos_id(), bos);
  EXPECT_EQ(t.eos_id(), -1);
  EXPECT_THAT(Ids(t, "a", true), ElementsAre(bos, 'a'));
  EXPECT_THAT(Ids(t, "", true), ElementsAre(bos));
  EXPECT_THAT(Ids(t, "a", false), ElementsAre('a'));
  EXPECT_EQ(t.vocab_size(), eos + 1);
  const Json config = {{"bos_token", {{"__type", "AddedToken"}, {"content", "<|begin_of_text|>"}}},
                       {"eos_token", "<|end_of_text|>"}};
  const Tokenizer with_config = MustLoad("config", j.root(), &config);
  EXPECT_EQ(with_config.bos_id(), bos);
  EXPECT_EQ(with_config.eos_id(), eos);
}

TEST(Tokenizer, InvalidUtf8IsRefusedWithItsOffset) {
  TokenizerJson j;
  const Tokenizer t = MustLoad("utf8", j.root());
  const std::vector<std::pair<std::string, size_t>> cases = {
      {"ab\x80", 2},                // a stray continuation byte
      {"\xC0\xAF", 0},              // overlong '/'
      {"x\xC1\xBF", 1},             // overlong
      {"ok\xE0\x80\xAF", 2},        // overlong three-byte
      {"\xF0\x80\x80\xAF", 0},      // overlong four-byte
      {"a\xED\xA0\x80", 1},         // surrogate U+D800
      {"\xED\xBF\xBFz", 0},         // surrogate U+DFFF
      {"\xF4\x90\x80\x80", 0},      // U+110000
      {"\xF5\x80\x80\x80", 0},      // never a lead byte
      {"\xFF", 0},                  // never in UTF-8
      {"caf\xC3", 3},               // cut by the end
      {"\xE2\x82z", 0},             // cut by a non-continuation
      {"\xF0\x9F\x98", 0},          // four-byte cut by the end
      {"\xe2\x82\xac\xe2\x82", 3},  // a whole euro sign, then a cut one
  };
  for (const auto& [text, offset] : cases) {
    const absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, true);
    ASSERT_FALSE(ids.ok()) << absl::CEscape(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(ids.status()), HasSubstr(absl::StrCat("byte offset ", offset, " ")))
        << absl::CEscape(text) << ": " << ids.status();
  }
  // The extremes of well-formed UTF-8 pass.
  EXPECT_EQ(Ids(t, "\x7F\xC2\x80\xEF\xBF\xBF\xF4\x8F\xBF\xBF\xED\x9F\xBF\xEE\x80\x80").size(), 16);
}

TEST(Tokenizer, DecodeReplacesInvalidBytesAsFromUtf8Lossy) {
  TokenizerJson j;
  const Tokenizer t = MustLoad("lossy", j.root());
  const std::string r = "\xEF\xBF\xBD";  // U+FFFD
  // One U+FFFD per maximal ill-formed subpart (Unicode 3.9; Rust's from_utf8_lossy).
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\xE2\x82\xAC", "\xE2\x82\xAC"},
      {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},
      {"\xF0\x9F\x98", r},
      {"a\xE2\x82"
       "b",
       "a" + r + "b"},
      {"\xE0\x80", r + r},
      {"\xC0\xAF", r + r},
      {"\xED\xA0\x80", r + r + r},
      {"\xF4\x90\x80\x80", r + r + r + r},
      {"\x80\x80", r + r},
      {"\xF5", r},
      {"\xF0\x90\x80\xF0", r + r},
      {"\xE1\x80\xE2\xF0\x91\x92\xF1\xBF\x41", r + r + r + r + "A"},
  };
  for (const auto& [bytes, want] : cases) {
    const absl::StatusOr<std::string> text = t.Decode(Bytes(bytes), false);
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, want) << absl::CEscape(bytes);
  }
}

TEST(Tokenizer, DecodeSkipsSpecialTokensAndRefusesUnknownIds) {
  TokenizerJson j;
  const int32_t bos = j.Added("<|begin_of_text|>", true);
  const int32_t reserved = j.Added("<|reserved special token 0|>", true);
  const int32_t plain = j.Added("plain word", false);
  const Tokenizer t = MustLoad("decode", j.root());
  const std::vector<int32_t> ids = {bos, 'h', 'i', reserved, plain, 0xC3, 0xA9};
  EXPECT_EQ(*t.Decode(ids, false),
            "<|begin_of_text|>hi<|reserved special token 0|>plain word\xC3\xA9");
  EXPECT_EQ(*t.Decode(ids, true), "hiplain word\xC3\xA9");
  // The vocabulary spells a space as U+0120: decoding gives the byte back.
  EXPECT_EQ(*t.Decode(Ids(t, "a b\n"), false), "a b\n");
  for (const int32_t bad : {-1, plain + 1, 1 << 30}) {
    const absl::StatusOr<std::string> text = t.Decode(std::vector<int32_t>{'a', bad}, false);
    ASSERT_FALSE(text.ok());
    EXPECT_THAT(Message(text.status()),
                HasSubstr(absl::StrCat("token id ", bad, " (at position 1)")));
  }
}

TEST(Tokenizer, LongPiecesStayFast) {
  TokenizerJson j;
  const int32_t aa = j.Token("aa");
  j.Merge("a", "a");
  const Tokenizer t = MustLoad("long", j.root());
  // One pre-token of 200,000 letters: BPE with a heap is n log n, not n^2.
  const std::vector<int32_t> ids = Ids(t, std::string(200000, 'a'));
  EXPECT_EQ(ids, std::vector<int32_t>(100000, aa));
  EXPECT_EQ(Ids(t, std::string(200000, ' ')).size(), 200000);
}

TEST(Tokenizer, EncodesOnManyThreads) {
  TokenizerJson j;
  j.Token("ab");
  j.Merge("a", "b");
  const int32_t bos = j.Added("<|begin_of_text|>", true);
  j.BosTemplate("<|begin_of_text|>", bos);
  const Tokenizer t = MustLoad("threads", j.root());
  std::string text;
  for (int i = 0; i < 2000; ++i) absl::StrAppend(&text, "ab cd\u00e9 12345 <|begin_of_text|>\n");
  const std::vector<int32_t> want = Ids(t, text, true);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { got[i] = Ids(t, text, true); });
  for (std::thread& th : threads) th.join();
  for (const auto& ids : got) EXPECT_EQ(ids, want);
}

TEST(Tokenizer, MissingDirectoryIsNotFound) {
  const absl::StatusOr<Tokenizer> t = Tokenizer::Load(Dir("empty"));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json"));
}

// Each malformed or unsupported file is refused with InvalidArgument naming the file and the
// field.
TEST(Tokenizer, MalformedFilesAreRefused) {
  using Edit = std::function<void(Json&)>;
  const std::vector<std::tuple<std::string, Edit, std::string>> cases = {
      {"a list", [](Json& r) { r = Json::array(); }, "expected a JSON object"},
      {"version", [](Json& r) { r["version"] = "2.0"; }, "version: \"2.0\" is not \"1.0\""},
      {"truncation",
       [](Json& r) {
         r["truncation"] = {{"max_length", 8}};
       },
       "truncation:"},
      {"normalizer",
       [](Json& r) {
         r["normalizer"] = {{"type", "NFC"}};
       },
       "normalizer:"},
      {"model missing", [](Json& r) { r.erase("model"); }, "model: missing"},
      {"model type", [](Json& r) { r["model"]["type"] = "WordPiece"; },
       "model.type: \"WordPiece\""},
      {"model not an object", [](Json& r) { r["model"] = 5; }, "model: is a number"},
      {"vocab missing", [](Json& r) { r["model"].erase("vocab"); }, "model.vocab: missing"},
      {"vocab a list",
       [](Json& r) {
         r["model"]["vocab"] = {1, 2};
       },
       "model.vocab: expected"},
      {"vocab id negative", [](Json& r) { r["model"]["vocab"]["zz"] = -1; }, "\"zz\" has id -1"},
      {"vocab id float", [](Json& r) { r["model"]["vocab"]["zz"] = 1.5; }, "\"zz\" has id 1.5"},
      {"vocab id huge", [](Json& r) { r["model"]["vocab"]["zz"] = 1LL << 40; }, "\"zz\" has id"},
      {"vocab id string", [](Json& r) { r["model"]["vocab"]["zz"] = "3"; }, "\"zz\" has id \"3\""},
      {"vocab id twice", [](Json& r) { r["model"]["vocab"]["zz"] = 7; }, "id 7 is given to both"},
      {"merges missing", [](Json& r) { r["model"].erase("merges"); }, "model.merges: missing"},
      {"merge no space", [](Json& r) { r["model"]["merges"] = {"ab"}; },
       "model.merges[0]: \"ab\" is not two tokens"},
      {"merge two spaces", [](Json& r) { r["model"]["merges"] = {"a  b"}; }, "model.merges[0]"},
      {"merge unknown", [](Json& r) { r["model"]["merges"] = {"a b"}; },
       "model.merges[0]: \"ab\" is not a token"},
      {"merge triple",
       [](Json& r) {
         r["model"]["merges"] = {{"a", "b", "c"}};
       },
       "not a pair"},
      {"merge number",
       [](Json& r) {
         r["model"]["merges"] = {{1, 2}};
       },
       "model.merges[0]"},
      {"merges mixed",
       [](Json& r) {
         r["model"]["vocab"]["ab"] = 256;
         r["model"]["merges"] = Json::array({Json::array({"a", "b"}), "a b"});
       },
       "mixes"},
      {"byte_fallback", [](Json& r) { r["model"]["byte_fallback"] = true; }, "model.byte_fallback"},
      {"dropout", [](Json& r) { r["model"]["dropout"] = 0.1; }, "model.dropout"},
      {"ignore_merges type", [](Json& r) { r["model"]["ignore_merges"] = "yes"; },
       "model.ignore_merges: is a string"},
      {"prefix", [](Json& r) { r["model"]["continuing_subword_prefix"] = "##"; },
       "continuing_subword_prefix"},
      {"suffix", [](Json& r) { r["model"]["end_of_word_suffix"] = "</w>"; }, "end_of_word_suffix"},
      {"unk unknown", [](Json& r) { r["model"]["unk_token"] = "<unk>"; }, "model.unk_token"},
      {"pre_tokenizer null", [](Json& r) { r["pre_tokenizer"] = nullptr; }, "pre_tokenizer: null"},
      {"pre_tokenizer type",
       [](Json& r) {
         r["pre_tokenizer"] = {{"type", "Whitespace"}};
       },
       "pre_tokenizer.type: \"Whitespace\""},
      {"split behavior",
       [](Json& r) { r["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "pretokenizers[0].behavior"},
      {"split invert", [](Json& r) { r["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
       "pretokenizers[0].invert"},
      {"split bad regex",
       [](Json& r) {
         r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(a"}};
       },
       "PCRE2 cannot compile"},
      {"split empty match",
       [](Json& r) {
         r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "a*"}};
       },
       "empty string"},
      // MINLENGTH is 1 for these, yet each reports an empty match (a lookahead alone, \K).
      {"split lookahead only",
       [](Json& r) {
         r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(?=a)"}};
       },
       "empty string"},
      {"split keep-out",
       [](Json& r) {
         r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "\\s\\K"}};
       },
       "empty string"},
      {"split empty literal",
       [](Json& r) {
         r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", ""}};
       },
       "empty string"},
      {"split pattern", [](Json& r) { r["pre_tokenizer"]["pretokenizers"][0]["pattern"] = "x"; },
       "pretokenizers[0].pattern"},
      {"byte level first",
       [](Json& r) {
         auto& l = r["pre_tokenizer"]["pretokenizers"];
         std::swap(l[0], l[1]);
       },
       "not supported here"},
      {"prefix space",
       [](Json& r) { r["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
       "add_prefix_space"},
      {"added a map", [](Json& r) { r["added_tokens"] = Json::object(); },
       "added_tokens: is an object"},
      {"added no content",
       [](Json& r) {
         r["added_tokens"] = {{{"id", 256}}};
       },
       "added_tokens[0].content: missing"},
      {"added wrong id",
       [](Json& r) {
         r["added_tokens"] = {{{"id", 300}, {"content", "<x>"}}};
       },
       "id 300, but tokenizers gives \"<x>\" id 256"},
      {"added twice",
       [](Json& r) {
         r["added_tokens"] = {{{"id", 256}, {"content", "<x>"}}, {{"id", 256}, {"content", "<x>"}}};
       },
       "added_tokens[1]: \"<x>\" repeats added_tokens[0]"},
      {"added single_word",
       [](Json& r) {
         r["added_tokens"] = {{{"id", 256}, {"content", "<x>"}, {"single_word", true}}};
       },
       "single_word"},
      {"post_processor",
       [](Json& r) {
         r["post_processor"] = {{"type", "BertProcessing"}};
       },
       "post_processor.type: \"BertProcessing\""},
      {"template no A",
       [](Json& r) {
         r["post_processor"] = {{"type", "TemplateProcessing"}, {"single", Json::array()}};
       },
       "has no {\"Sequence\""},
      {"template unknown token",
       [](Json& r) {
         r["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", "<s>"}}}}}}};
       },
       "special_tokens[\"<s>\"]"},
      {"template bad id",
       [](Json& r) {
         r["post_processor"] = {{"type", "TemplateProcessing"},
                                {"single", {{{"SpecialToken", {{"id", "<s>"}}}}}},
                                {"special_tokens", {{"<s>", {{"ids", {999}}}}}}};
       },
       "has id 999, which is not a token"},
      {"decoder null", [](Json& r) { r["decoder"] = nullptr; }, "decoder: null"},
      {"decoder type",
       [](Json& r) {
         r["decoder"] = {{"type", "WordPiece"}};
       },
       "decoder.type: \"WordPiece\""},
  };
  for (const auto& [name, edit, needle] : cases) {
    TokenizerJson j;
    edit(j.root());
    const absl::StatusOr<Tokenizer> t = LoadJson("malformed", j.root());
    ASSERT_FALSE(t.ok()) << name;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json: ")) << name;
    EXPECT_THAT(Message(t.status()), HasSubstr(needle)) << name << ": " << t.status();
  }
}

// A pattern whose empty match Load cannot see (a lookahead for a character its probe lacks) is
// refused when the text has that character, instead of splitting forever.
TEST(Tokenizer, EmptyMatchAtEncodeIsRefusedNotLooped) {
  TokenizerJson j;
  j.root()["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(?=\u2603)"}};
  const Tokenizer t = MustLoad("empty_at_encode", j.root());
  EXPECT_THAT(Ids(t, "no snowman"), ElementsAre('n', 'o', ' ', 's', 'n', 'o', 'w', 'm', 'a', 'n'));
  const absl::StatusOr<std::vector<int32_t>> ids = t.Encode("a\u2603b", false);
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(ids.status()), HasSubstr("matched the empty string at byte 1"));
}

// Load reads regular files of a bounded size only: a device (endless), a directory or a file
// larger than any tokenizer is refused by name before it is read.
TEST(Tokenizer, NonRegularAndHugeFilesAreRefusedUnread) {
  TokenizerJson j;
  const std::string dir = Dir("files");
  std::filesystem::create_symlink("/dev/zero", dir + "/tokenizer.json");
  absl::StatusOr<Tokenizer> t = Tokenizer::Load(dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json: not a regular file"));
  std::filesystem::remove(dir + "/tokenizer.json");
  std::filesystem::create_directory(dir + "/tokenizer.json");
  t = Tokenizer::Load(dir);
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json: not a regular file"));
  std::filesystem::remove(dir + "/tokenizer.json");

  // Sparse files: their size is what counts, nothing is written.
  WriteText(dir + "/tokenizer.json", "{");
  std::filesystem::resize_file(dir + "/tokenizer.json", (int64_t{256} << 20) + 1);
  t = Tokenizer::Load(dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json: 268435457 bytes, more than"));

  WriteText(dir + "/tokenizer.json", j.root().dump());
  std::filesystem::create_symlink("/dev/urandom", dir + "/tokenizer_config.json");
  t = Tokenizer::Load(dir);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer_config.json: not a regular file"));
  std::filesystem::remove(dir + "/tokenizer_config.json");
  WriteText(dir + "/tokenizer_config.json", "{");
  std::filesystem::resize_file(dir + "/tokenizer_config.json", (int64_t{64} << 20) + 1);
  t = Tokenizer::Load(dir);
  EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer_config.json: 67108865 bytes, more than"));
}

TEST(Tokenizer, MalformedTextAndConfigAreRefused) {
  const std::string dir = Dir("text");
  for (const std::string text : {"", "{", "[1, 2", "{\"a\": 1, \"a\": 2}", "\xFF"}) {
    WriteText(dir + "/tokenizer.json", text);
    const absl::StatusOr<Tokenizer> t = Tokenizer::Load(dir);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer.json"));
  }
  TokenizerJson j;
  for (const Json& config : {Json{{"bos_token", 5}}, Json{{"eos_token", "<nope>"}},
                             Json{{"bos_token", {{"text", "a"}}}}, Json::array()}) {
    const absl::StatusOr<Tokenizer> t = LoadJson("config_bad", j.root(), &config);
    ASSERT_FALSE(t.ok()) << config;
    EXPECT_THAT(Message(t.status()), HasSubstr("tokenizer_config.json: ")) << t.status();
  }
}

}  // namespace
}  // namespace cpfill::runtime
