// cpfill/launch/http/request_body.h — a request body parsed in one pass with nlohmann's SAX
// interface, so that a body never expands to more than a small multiple of its size.
//
// A DOM costs some 16 bytes a value plus its containers' slack: a 60 MB body of 30M token ids
// became over 1 GB on rank 0. Here the prompt's token ids go straight into int32 vectors (4
// bytes an id, and every id takes at least 2 bytes of body: "1,"), a prompt is refused as soon
// as it holds more ids than `max_prompt_tokens` (the engine's --max-batch-tokens, which would
// refuse it anyway), and every other field becomes a small DOM whose values are counted
// (kMaxFieldValues).
//
//   CPFILL_ASSIGN_OR_RETURN(RequestBody b, ParseRequestBody(body, "prompt", 8192));
//   b.fields   // the object without "prompt";  b.prompts[i].ids or .text
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cpfill::launch {

// Values (numbers, strings, ..., containers) a body may hold outside its prompt: far above what
// any client sends (stop lists, logit_bias, chat messages), far below what would cost memory.
inline constexpr int64_t kMaxFieldValues = 1 << 16;
inline constexpr int kMaxJsonDepth = 64;

// One prompt: a list of token ids, or a text.
struct PromptItem {
  std::vector<int32_t> ids;
  std::optional<std::string> text;
};

struct RequestBody {
  nlohmann::json fields = nlohmann::json::object();  // every top-level field but the prompt
  bool has_prompt = false;
  // "prompt": [ids] or "text" give one item (batch false); [[ids], "text", ...] a batch.
  bool batch = false;
  std::vector<PromptItem> prompts;
};

// Parses a JSON object whose top-level field `prompt_key` (when present; "" for a body with no
// prompt, whose every field goes to `fields`) is a text, a non-empty
// list of token ids, or a non-empty list of texts and such lists (at most `max_prompts`).
// InvalidArgument naming the problem: malformed JSON (line and column), a top level other than
// an object, a duplicate key, nesting deeper than kMaxJsonDepth, more than kMaxFieldValues
// values outside the prompt, a prompt of another shape, an id that is not an integer in
// [0, 2^31); ResourceExhausted naming the limit for a prompt of more than `max_prompt_tokens`
// ids, refused as soon as the parse reaches it.
absl::StatusOr<RequestBody> ParseRequestBody(std::string_view body, std::string_view prompt_key,
                                             int64_t max_prompt_tokens, int max_prompts);

}  // namespace cpfill::launch
