// `cpfill tokenize`: a checkpoint's tokenizer (runtime/text/tokenizer.h) on the command line.
// Encodes texts to token ids and decodes id lists to texts, as JSON; tests/tokenizer_check.py
// compares it with the Python `tokenizers` package. No MPI.
//
//   cpfill tokenize --model ckpt --text "Hello world"             # {"ids": [[128000, ...]]}
//   cpfill tokenize --model ckpt --texts prompts.json --decode ids.json --json out.json
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/knobs.h"
#include "base/status.h"
#include "launch/commands/commands.h"
#include "launch/job/flags.h"
#include "launch/job/job.h"
#include "runtime/model/model_config.h"
#include "runtime/text/tokenizer.h"

namespace cpfill::launch {
namespace {

// A preset has synthetic weights and no tokenizer: its prompts are token ids.
absl::StatusOr<runtime::Tokenizer> LoadTokenizer(const std::string& model) {
  absl::StatusOr<runtime::Tokenizer> tokenizer = runtime::Tokenizer::Load(model);
  if (tokenizer.ok()) return tokenizer;
  if (absl::IsNotFound(tokenizer.status())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model ", model, ": ",
        runtime::IsPreset(model) ? "a preset has no tokenizer (its prompts are token ids only)"
                                 : tokenizer.status().message()));
  }
  return absl::InvalidArgumentError(absl::StrCat("--model: ", tokenizer.status().message()));
}

// --texts: a JSON list of strings.
absl::StatusOr<std::vector<std::string>> ReadTexts(const std::string& path) {
  absl::StatusOr<nlohmann::json> v = json::ReadFile(path);
  CPFILL_CHECK_ARG(v.ok(), "--texts: ", v.status().message());
  CPFILL_CHECK_ARG(v->is_array(), "--texts: ", path, ": expected a JSON list of strings, not ",
                   std::string(json::TypeName(*v)));
  std::vector<std::string> texts;
  for (size_t i = 0; i < v->size(); ++i) {
    CPFILL_CHECK_ARG((*v)[i].is_string(), "--texts: ", path, ": item ", i, " is ",
                     std::string(json::TypeName((*v)[i])), ", expected a string");
    texts.push_back((*v)[i].get<std::string>());
  }
  return texts;
}

// --decode: a JSON list of lists of token ids.
absl::StatusOr<std::vector<std::vector<int32_t>>> ReadIdLists(const std::string& path) {
  absl::StatusOr<nlohmann::json> v = json::ReadFile(path);
  CPFILL_CHECK_ARG(v.ok(), "--decode: ", v.status().message());
  CPFILL_CHECK_ARG(v->is_array(), "--decode: ", path,
                   ": expected a JSON list of lists of token ids, not ",
                   std::string(json::TypeName(*v)));
  std::vector<std::vector<int32_t>> lists(v->size());
  for (size_t i = 0; i < v->size(); ++i) {
    const nlohmann::json& list = (*v)[i];
    CPFILL_CHECK_ARG(list.is_array(), "--decode: ", path, ": item ", i, " is ",
                     std::string(json::TypeName(list)), ", expected a list of token ids");
    for (const nlohmann::json& id : list) {
      const std::optional<int64_t> value = json::AsInt64(id);
      CPFILL_CHECK_ARG(value.has_value() && *value >= std::numeric_limits<int32_t>::min() &&
                           *value <= std::numeric_limits<int32_t>::max(),
                       "--decode: ", path, ": item ", i, " holds ", json::Show(id),
                       ", which is not an integer token id (int32)");
      lists[i].push_back(static_cast<int32_t>(*value));
    }
  }
  return lists;
}

// texts_path: the --texts file, empty for --text.
absl::StatusOr<nlohmann::ordered_json> EncodeAll(const runtime::Tokenizer& tokenizer,
                                                 const std::vector<std::string>& texts,
                                                 const std::string& texts_path, bool add_bos) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < texts.size(); ++i) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(texts[i], add_bos);
    CPFILL_CHECK_ARG(
        ids.ok(),
        texts_path.empty() ? "--text" : absl::StrCat("--texts: ", texts_path, ": item ", i), ": ",
        ids.status().message());
    out.push_back(*ids);
  }
  return out;
}

absl::StatusOr<nlohmann::ordered_json> DecodeAll(const runtime::Tokenizer& tokenizer,
                                                 const std::vector<std::vector<int32_t>>& lists,
                                                 const std::string& path, bool skip_special) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < lists.size(); ++i) {
    absl::StatusOr<std::string> text = tokenizer.Decode(lists[i], skip_special);
    CPFILL_CHECK_ARG(text.ok(), "--decode: ", path, ": item ", i, ": ", text.status().message());
    out.push_back(*text);
  }
  return out;
}

struct TokenizeArgs {
  std::string model, text, texts, decode, json;
  bool text_set = false;
  bool no_bos = false, skip_special = false;
};

// Steps: read the inputs (everything that can be refused is refused before any output), encode
// and decode, then write the JSON.
absl::StatusOr<nlohmann::ordered_json> Tokenize(const TokenizeArgs& a) {
  CPFILL_CHECK_ARG(!(a.text_set && !a.texts.empty()), "--text and --texts: give one of them");
  CPFILL_CHECK_ARG(a.text_set || !a.texts.empty() || !a.decode.empty(),
                   "--text, --texts or --decode: give at least one");
  if (!a.json.empty()) CPFILL_RETURN_IF_ERROR(CheckWritable("json", a.json));
  CPFILL_ASSIGN_OR_RETURN(const runtime::Tokenizer tokenizer, LoadTokenizer(a.model));
  std::vector<std::string> texts;
  if (a.text_set) texts.push_back(a.text);
  if (!a.texts.empty()) {
    CPFILL_ASSIGN_OR_RETURN(texts, ReadTexts(a.texts));
  }
  std::vector<std::vector<int32_t>> lists;
  if (!a.decode.empty()) {
    CPFILL_ASSIGN_OR_RETURN(lists, ReadIdLists(a.decode));
  }
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  if (a.text_set || !a.texts.empty()) {
    CPFILL_ASSIGN_OR_RETURN(out["ids"], EncodeAll(tokenizer, texts, a.texts, !a.no_bos));
  }
  if (!a.decode.empty()) {
    CPFILL_ASSIGN_OR_RETURN(out["texts"], DecodeAll(tokenizer, lists, a.decode, a.skip_special));
  }
  return out;
}

}  // namespace

int RunTokenizeCommand(int argc, char** argv) {
  TokenizeArgs a;
  FlagSet flags("tokenize",
                "encode texts with a checkpoint's tokenizer (tokenizer.json) and decode token "
                "ids; prints {\"ids\": [[...], ...], \"texts\": [...]} (no MPI)");
  flags.String("model", &a.model, "checkpoint directory with tokenizer.json", true);
  flags.String("text", &a.text, "one text to encode");
  flags.String("texts", &a.texts, "JSON file: a list of texts to encode");
  flags.String("decode", &a.decode, "JSON file: a list of token id lists to decode");
  flags.Bool("no-bos", &a.no_bos, "encode without BOS (the post-processor's template)");
  flags.Bool("skip-special", &a.skip_special, "leave special tokens out of decoded texts");
  flags.String("json", &a.json, "write the JSON here instead of printing it");
  if (auto done = AnswerFlagsFirst(flags, flags.Parse(argc, argv, 2))) return *done;
  a.text_set = flags.IsSet("text");
  absl::StatusOr<nlohmann::ordered_json> out = Tokenize(a);
  if (!out.ok()) return RefuseInput(out.status());
  if (!a.json.empty()) {
    if (absl::Status s = json::WriteFile(a.json, *out); !s.ok()) return RefuseInput(s);
    std::printf("wrote %s\n", a.json.c_str());
    return kExitOk;
  }
  absl::StatusOr<std::string> text = json::Dump(*out);
  if (!text.ok()) return RefuseInput(text.status());
  std::printf("%s\n", text->c_str());
  return kExitOk;
}

}  // namespace cpfill::launch
