// The SAX parse of request bodies: prompts of every shape, refusals by name, the token limit
// hit mid-parse, and memory that stays a small multiple of the body's size.
#include "launch/http/request_body.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cpfill::launch {
namespace {

absl::StatusOr<RequestBody> Parse(std::string_view body, int64_t max_tokens = 100) {
  return ParseRequestBody(body, "prompt", max_tokens, 4);
}

TEST(RequestBody, ParsesPromptsOfEveryShapeAndKeepsOtherFields) {
  auto one = Parse(R"({"model": "m", "prompt": [1, 2, 3], "stop": ["a"], "o": {"k": [1, {}]}})");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_TRUE(one->has_prompt);
  EXPECT_FALSE(one->batch);
  ASSERT_EQ(one->prompts.size(), 1u);
  EXPECT_EQ(one->prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FALSE(one->fields.contains("prompt"));
  EXPECT_EQ(one->fields["stop"], nlohmann::json::array({"a"}));
  EXPECT_EQ(one->fields["o"]["k"][1], nlohmann::json::object());
  auto text = Parse(R"({"prompt": "hi"})");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text->prompts[0].text, "hi");
  auto batch = Parse(R"({"prompt": [[4], "x", [5, 6]], "n": 2})");
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(batch->batch);
  ASSERT_EQ(batch->prompts.size(), 3u);
  EXPECT_EQ(batch->prompts[2].ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(*batch->prompts[1].text, "x");
  EXPECT_EQ(batch->fields["n"], 2);
  auto none = Parse(R"({"max_tokens": 3})");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_prompt);
  // No prompt key (chat, tokenize): a top-level "" is a field like any other, for the caller to
  // refuse by name; not a prompt silently dropped, nor a token limit of 0.
  for (const char* body : {R"({"": [1, 2]})", R"({"": "x"})"}) {
    auto empty_key = ParseRequestBody(body, "", 0, 0);
    ASSERT_TRUE(empty_key.ok()) << body << ": " << empty_key.status();
    EXPECT_FALSE(empty_key->has_prompt);
    EXPECT_TRUE(empty_key->fields.contains("")) << body;
  }
}

TEST(RequestBody, RefusesByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {"[1]", "must be a JSON object"},
      {"7", "must be a JSON object"},
      {R"({"prompt": [1], "prompt": [2]})", "\"prompt\" appears twice"},
      {R"({"a": 1, "a": 2})", "\"a\" appears twice"},
      {R"({"prompt": 7})", "must be a text"},
      {R"({"prompt": null})", "must be a text"},
      {R"({"prompt": {}})", "must be a text"},
      {R"({"prompt": []})", "non-empty"},
      {R"({"prompt": [[]]})", "\"prompt\"[0]: a list of token ids is empty"},
      {R"({"prompt": [1, -2]})", "\"prompt\"[1] is -2"},
      {R"({"prompt": [1, 2147483648]})", "\"prompt\"[1] is 2147483648"},
      {R"({"prompt": [1.5]})", "not a token id"},
      {R"({"prompt": [1, "a"]})", "\"prompt\"[1] is a text"},
      {R"({"prompt": [1, [2]]})", "\"prompt\"[1] is a list"},
      {R"({"prompt": [[1], 2]})", "\"prompt\"[1] must be a text or a list"},
      {R"({"prompt": [[1, [2]]]})", "\"prompt\"[0][1] is a list"},
      {R"({"prompt": [[1, true]]})", "\"prompt\"[0][1] is true"},
      {R"({"prompt": [[1], [2], [3], [4], [5]]})", "more than 4 prompts"},
      {std::string(70, '[') + std::string(70, ']'), "must be a JSON object"},
      {std::string("{\"a\":") + std::string(70, '[') + std::string(70, ']') + "}",
       "deeper than 64"},
  };
  for (const auto& [body, message] : cases) {
    auto r = Parse(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << body << ": " << r.status();
  }
  // A huge number is named, not echoed whole into the answer and the log.
  auto huge = Parse(R"({"prompt": [1, 0.)" + std::string(100000, '1') + "]}");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("\"prompt\"[1] is 0.111"), std::string::npos);
  EXPECT_LT(huge.status().message().size(), 200u) << huge.status().message().size();
}

TEST(RequestBody, RefusesAPromptPastTheTokenLimitAsSoonAsItIsReached) {
  // 101 ids, then garbage: the limit is named before the parse reaches the garbage.
  std::string body = R"({"prompt": [)";
  for (int i = 0; i <= 100; ++i) absl::StrAppend(&body, i, ",");
  body += "not json at all";
  auto r = Parse(body, 100);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("more than 100 token ids"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("--max-batch-tokens"), std::string::npos);
  auto batch = Parse(R"({"prompt": [[1], [1, 2, 3]]})", 2);
  ASSERT_FALSE(batch.ok());
  EXPECT_NE(batch.status().message().find("\"prompt\"[1] holds more than 2"), std::string::npos);
  EXPECT_TRUE(Parse(R"({"prompt": [[1, 2], [3, 4]]})", 2).ok());  // the limit is per prompt
}

TEST(RequestBody, BoundsValuesOutsideThePrompt) {
  std::string body = R"({"stop_token_ids": [)";
  for (int64_t i = 0; i <= kMaxFieldValues; ++i) absl::StrAppend(&body, i % 10, ",");
  body += "1]}";
  auto r = Parse(body);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("values besides \"prompt\""), std::string::npos)
      << r.status();
}

TEST(RequestBody, HoldsFourBytesAnIdOfAHugePrompt) {
  // Two million ids in 4 MB of body: the ids take 8 MB, where a DOM took over 30.
  constexpr int kIds = 2'000'000;
  std::string body = R"({"prompt": [)";
  body.reserve(2 * kIds + 32);
  for (int i = 0; i < kIds; ++i) body += i + 1 < kIds ? "7," : "7";
  body += "]}";
  auto r = Parse(body, kIds);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts[0].ids.size(), static_cast<size_t>(kIds));
  EXPECT_LE(r->prompts[0].ids.capacity() * sizeof(int32_t), 2 * body.size());
}

}  // namespace
}  // namespace cpfill::launch
