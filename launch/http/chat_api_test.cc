#include "launch/http/chat_api.h"

#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "launch/http/chat_renderer.h"
#include "launch/http/http_test_util.h"

namespace cpfill::launch {
namespace {

const nlohmann::json kHello = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                               {"add_generation_prompt", true}};

// A renderer in sh: it answers every line with `answer` (after `before`, e.g. a sleep or exit).
ChatRenderer Shell(const std::string& before, const std::string& answer, int timeout_ms = 2000) {
  return ChatRenderer(
      {.command = "sh -c 'while read l; do " + before + " echo \"" + answer + "\"; done'",
       .timeout = std::chrono::milliseconds(timeout_ms)});
}

TEST(ChatRenderer, AnswersOneLinePerRequest) {
  ChatRenderer r = Shell("", R"({\"prompt\": \"<s>hi\"})");
  for (int i = 0; i < 3; ++i) EXPECT_EQ(r.Render(kHello).value(), "<s>hi");
  EXPECT_EQ(r.restarts(), 0);
}

TEST(ChatRenderer, TemplateErrorIsInvalidArgument) {
  ChatRenderer r = Shell("", R"({\"error\": \"roles must alternate\"})");
  const absl::Status s = r.Render(kHello).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("roles must alternate"), std::string::npos);
}

// A renderer that answers twice to one request is out of step: its second line must not become
// the next request's answer (another conversation's prompt); it is replaced instead.
TEST(ChatRenderer, ExtraOutputIsNeverTheNextAnswer) {
  ChatRenderer r({.command = "sh -c 'while read l; do echo \"{\\\"prompt\\\": \\\"mine\\\"}\"; "
                             "echo \"{\\\"prompt\\\": \\\"stale\\\"}\"; done'"});
  EXPECT_EQ(r.Render(kHello).value(), "mine");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the extra line arrives
  EXPECT_EQ(r.Render(kHello).value(), "mine");
  EXPECT_EQ(r.restarts(), 1);
}

TEST(ChatRenderer, CrashTimeoutAndGarbageAreUnavailableAndRestart) {
  ChatRenderer crash = Shell("exit 3;", "x");
  EXPECT_TRUE(absl::IsUnavailable(crash.Render(kHello).status()));
  EXPECT_TRUE(absl::IsUnavailable(crash.Render(kHello).status()));
  EXPECT_EQ(crash.restarts(), 1);
  ChatRenderer hang = Shell("sleep 5;", "x", /*timeout_ms=*/200);
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = hang.Render(kHello).status();
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start,
            std::chrono::seconds(4));  // killed, not waited
  ChatRenderer garbage = Shell("", "not json");
  EXPECT_TRUE(absl::IsUnavailable(garbage.Render(kHello).status()));
  ChatRenderer missing({.command = "/nonexistent/renderer"});
  EXPECT_TRUE(absl::IsUnavailable(missing.Render(kHello).status()));
}

TEST(ChatRenderInput, ChecksMessagesAndJoinsTextParts) {
  nlohmann::json body = {
      {"messages",
       {{{"role", "user"},
         {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}}}};
  nlohmann::json in = ChatRenderInput(body).value();
  EXPECT_EQ(in["messages"][0]["content"], "a\nb");
  EXPECT_EQ(in["add_generation_prompt"], true);
  for (const char* bad :
       {R"({"messages": []})", R"({"messages": [{"role": "user"}]})",
        R"({"messages": [{"role": "user", "content": 3}]})",
        R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
        R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ChatRenderInput(nlohmann::json::parse(bad)).status()))
        << bad;
  }
}

TEST(ParseChatRequest, RendersTokenizesWithoutBosAndMapsFields) {
  const runtime::Tokenizer tok = ByteTokenizer("stop", {"END"});
  nlohmann::json seen;
  const ChatRenderFn render = [&](const nlohmann::json& in) -> absl::StatusOr<std::string> {
    seen = in;
    return std::string("<u>") + in["messages"][0]["content"].get<std::string>();
  };
  const std::string body =
      R"({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
          "logprobs": true, "top_logprobs": 2, "temperature": 0})";
  ChatRequest chat = ParseChatRequest(body, "m", &tok, render, 1000, 100).value();
  EXPECT_EQ(chat.prompt, "<u>hi");
  EXPECT_EQ(chat.completion.prompts[0], ByteIds("<u>hi"));
  EXPECT_EQ(chat.completion.max_tokens, 3);
  EXPECT_EQ(chat.completion.logprobs, 2);
  EXPECT_EQ(chat.top_logprobs, 2);
  ChatRequest fill = ParseChatRequest(R"({"messages": [{"role": "user", "content": "hi"}]})", "m",
                                      &tok, render, 1000, 100)
                         .value();
  EXPECT_EQ(fill.completion.max_tokens, 100 - 5);  // the positions left after the prompt
  for (const char* bad :
       {R"({"messages": [{"role": "user", "content": "x"}], "echo": true})",
        R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 2})",
        R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
        R"({"messages": [{"role": "user", "content": "x"}], "model": "other"})"}) {
    EXPECT_TRUE(
        absl::IsInvalidArgument(ParseChatRequest(bad, "m", &tok, render, 1000, 100).status()))
        << bad;
  }
}

TEST(ChatResponse, ReshapesChoicesAndLogprobs) {
  ChatRequest chat;
  chat.logprobs = true;
  chat.top_logprobs = 1;
  nlohmann::ordered_json completion = {
      {"object", "text_completion"},
      {"choices",
       {{{"index", 0},
         {"text", "ok"},
         {"finish_reason", "stop"},
         {"logprobs",
          {{"tokens", {"o", "k"}},
           {"token_logprobs", {-0.5, -0.25}},
           {"top_logprobs", {{{"o", -0.5}, {"a", -1.0}}, {{"k", -0.25}}}}}}}}},
      {"usage", {{"prompt_tokens", 3}}}};
  nlohmann::ordered_json r = ChatResponse(chat, completion);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "ok");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][1]["token"], "k");
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"].size(), 1u);
  EXPECT_EQ(r["choices"][0]["logprobs"]["content"][0]["bytes"], nlohmann::ordered_json({111}));
  EXPECT_EQ(r["usage"]["prompt_tokens"], 3);
}

TEST(ChatChunks, RoleFirstThenContentThenUsage) {
  ChatRequest chat;
  std::vector<bool> role_sent(1, false);
  nlohmann::ordered_json chunk = {
      {"object", "text_completion"},
      {"choices",
       {{{"index", 0}, {"text", "o"}, {"logprobs", nullptr}, {"finish_reason", nullptr}}}}};
  std::vector<nlohmann::ordered_json> first = ChatChunks(chat, chunk, &role_sent);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first[1]["choices"][0]["delta"]["content"], "o");
  EXPECT_EQ(first[1]["object"], "chat.completion.chunk");
  EXPECT_EQ(ChatChunks(chat, chunk, &role_sent).size(), 1u);
  nlohmann::ordered_json usage = {{"object", "text_completion"},
                                  {"choices", nlohmann::ordered_json::array()},
                                  {"usage", {{"prompt_tokens", 1}}}};
  std::vector<nlohmann::ordered_json> last = ChatChunks(chat, usage, &role_sent);
  ASSERT_EQ(last.size(), 1u);
  EXPECT_TRUE(last[0]["choices"].empty());
  EXPECT_EQ(last[0]["object"], "chat.completion.chunk");
}

}  // namespace
}  // namespace cpfill::launch
