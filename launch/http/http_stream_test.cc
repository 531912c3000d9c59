// A streamed completion as a client reads it: the chunks of each token, text held back while it
// may begin a stop string, and what is streamed adding up to the whole answer.
#include "launch/http/http_stream.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "launch/http/http_test_util.h"

namespace cpfill::launch {
namespace {

// The chunks a stream gives out now (parsed), without waiting.
std::vector<nlohmann::json> Drain(CompletionStream& stream) {
  std::string events;
  stream.Next(&events, std::chrono::milliseconds(0));
  std::vector<nlohmann::json> chunks;
  for (size_t at = 0; (at = events.find("data: ", at)) != std::string::npos;) {
    const size_t end = events.find("\n\n", at);
    chunks.push_back(nlohmann::json::parse(events.substr(at + 6, end - at - 6)));
    at = end;
  }
  return chunks;
}

// Feeds `ids` to choice 0 one token at a time (the last with `finish_reason`) and collects every
// chunk; `texts_after` gets the text streamed so far after each token.
std::vector<nlohmann::json> StreamTokens(CompletionStream& stream, const std::vector<int32_t>& ids,
                                         const std::string& finish_reason,
                                         std::vector<std::string>* texts_after) {
  auto sink = stream.Sink(0);
  std::vector<nlohmann::json> chunks;
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    sink({.index = static_cast<int>(i),
          .token = {.id = ids[i], .logprob = -1.0 - static_cast<double>(i)},
          .finish_reason = i + 1 == ids.size() ? finish_reason : ""});
    for (nlohmann::json& c : Drain(stream)) {
      text += c["choices"][0]["text"].get<std::string>();
      chunks.push_back(std::move(c));
    }
    texts_after->push_back(text);
  }
  return chunks;
}

// The same tokens as one answer (CompletionResponse's choice), as plain json like the chunks:
// comparing the two json types is ambiguous in C++20 (clang refuses it).
nlohmann::json WholeChoice(const CompletionRequest& request, const std::vector<int32_t>& ids,
                           const std::string& reason, const runtime::Tokenizer& tok) {
  runtime::EngineResult r;
  r.finish_reason = reason;
  for (size_t i = 0; i < ids.size(); ++i) {
    r.tokens.push_back({.id = ids[i], .logprob = -1.0 - static_cast<double>(i)});
  }
  return CompletionResponse(request, {r}, "cmpl-1", 0, "m", &tok)["choices"][0];
}

// What the chunks add up to: text, token ids, and logprobs' token ids and offsets.
struct Streamed {
  std::string text;
  nlohmann::json ids = nlohmann::json::array(), logprob_ids = ids, offsets = ids;
};
Streamed AddUp(const std::vector<nlohmann::json>& chunks) {
  Streamed s;
  for (const nlohmann::json& chunk : chunks) {
    const nlohmann::json& c = chunk["choices"][0];
    s.text += c["text"].get<std::string>();
    for (const auto& id : c["token_ids"]) s.ids.push_back(id);
    for (const auto& id : c["logprobs"]["token_ids"]) s.logprob_ids.push_back(id);
    for (const auto& o : c["logprobs"]["text_offset"]) s.offsets.push_back(o);
  }
  return s;
}

CompletionRequest StopRequest(std::vector<std::string> stop) {
  CompletionRequest request;
  request.prompts = {{1}};
  request.stop = std::move(stop);
  request.logprobs = 1;
  return request;
}

TEST(CompletionStream, HoldsBackWhatMayBeginAStopStringAndNeverSendsIt) {
  const runtime::Tokenizer tok = ByteTokenizer("hold", {"ND"});
  const CompletionRequest request = StopRequest({"END"});
  auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
  // "aENxE" then "ND" (id 256) completes "END".
  const std::vector<int32_t> ids = {'a', 'E', 'N', 'x', 'E', 256};
  std::vector<std::string> texts;
  const std::vector<nlohmann::json> chunks = StreamTokens(*stream, ids, "stop", &texts);
  // "E" and "EN" wait; "ENx" cannot begin "END" and goes out; the last "E" waits and is cut.
  EXPECT_EQ(texts, (std::vector<std::string>{"a", "a", "a", "aENx", "aENx", "aENx"}));
  for (const nlohmann::json& c : chunks) {
    EXPECT_EQ(c["choices"][0]["text"].get<std::string>().find("END"), std::string::npos);
  }
  // Chunks: a, E, N, x (each its own text), then the closing one: the ids past the stop string.
  ASSERT_EQ(chunks.size(), 5u);
  EXPECT_EQ(chunks[1]["choices"][0]["text"], "E");
  EXPECT_EQ(chunks[4]["choices"][0]["token_ids"], nlohmann::json({'E', 256}));
  EXPECT_EQ(chunks[4]["choices"][0]["text"], "");
  EXPECT_EQ(chunks[4]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(stream->Finished(0));
  // Streamed or not, the same text, token ids and logprobs.
  const Streamed s = AddUp(chunks);
  const nlohmann::json whole = WholeChoice(request, ids, "stop", tok);
  EXPECT_EQ(s.text, whole["text"]);
  EXPECT_EQ(s.ids, whole["token_ids"]);
  EXPECT_EQ(s.logprob_ids, whole["logprobs"]["token_ids"]);
  EXPECT_EQ(s.offsets, whole["logprobs"]["text_offset"]);
  EXPECT_EQ(s.logprob_ids, nlohmann::json({'a', 'E', 'N', 'x'}));
}

TEST(CompletionStream, StopStringInsideOneTokenKeepsThatTokensTextBeforeIt) {
  const runtime::Tokenizer tok = ByteTokenizer("inside", {"x\n\ny"});
  for (const bool include : {false, true}) {
    CompletionRequest request = StopRequest({"\n\n"});
    request.include_stop_str_in_output = include;
    auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
    const std::vector<int32_t> ids = {'a', 256};
    std::vector<std::string> texts;
    const Streamed s = AddUp(StreamTokens(*stream, ids, "stop", &texts));
    const nlohmann::json whole = WholeChoice(request, ids, "stop", tok);
    EXPECT_EQ(s.text, include ? "ax\n\n" : "ax");
    EXPECT_EQ(s.text, whole["text"]);
    EXPECT_EQ(s.ids, nlohmann::json(ids));
    EXPECT_EQ(s.logprob_ids, whole["logprobs"]["token_ids"]);  // the token starts before the cut
    EXPECT_EQ(s.logprob_ids, nlohmann::json(ids));
  }
}

TEST(CompletionStream, HeldTextGoesOutWhenGenerationEndsWithoutTheStopString) {
  const runtime::Tokenizer tok = ByteTokenizer("length", {});
  const CompletionRequest request = StopRequest({"END"});
  auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
  const std::vector<int32_t> ids = ByteIds("abEN");
  std::vector<std::string> texts;
  const std::vector<nlohmann::json> chunks = StreamTokens(*stream, ids, "length", &texts);
  EXPECT_EQ(texts, (std::vector<std::string>{"a", "ab", "ab", "abEN"}));
  ASSERT_EQ(chunks.size(), ids.size());  // one chunk per token, none left out
  EXPECT_EQ(chunks.back()["choices"][0]["finish_reason"], "length");
  const Streamed s = AddUp(chunks);
  const nlohmann::json whole = WholeChoice(request, ids, "length", tok);
  EXPECT_EQ(s.text, whole["text"]);
  EXPECT_EQ(s.offsets, whole["logprobs"]["text_offset"]);
  EXPECT_EQ(s.offsets, nlohmann::json({0, 1, 2, 3}));
}

// A character split over tokens: its first token's chunk has no text, its last has it all, and
// both sit at the character's offset; with a stop string right after it, neither is sent late.
TEST(CompletionStream, SplitCharactersCountOnceWithOrWithoutStopStrings) {
  const runtime::Tokenizer tok = ByteTokenizer("split", {});
  const std::vector<int32_t> ids = {'a', 0xC3, 0xA9, 'b', '!'};  // "aéb!"
  for (const bool with_stop : {false, true}) {
    CompletionRequest request =
        StopRequest(with_stop ? std::vector<std::string>{"b!"} : std::vector<std::string>{});
    auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
    std::vector<std::string> texts;
    const std::vector<nlohmann::json> chunks =
        StreamTokens(*stream, ids, with_stop ? "stop" : "length", &texts);
    EXPECT_EQ(texts[1], "a");  // half of é: nothing yet
    EXPECT_EQ(texts[2], "a\xC3\xA9");
    const Streamed s = AddUp(chunks);
    const nlohmann::json whole = WholeChoice(request, ids, with_stop ? "stop" : "length", tok);
    EXPECT_EQ(s.text, with_stop ? "a\xC3\xA9"
                                : "a\xC3\xA9"
                                  "b!");
    EXPECT_EQ(s.text, whole["text"]);
    EXPECT_EQ(s.ids, nlohmann::json(ids));
    EXPECT_EQ(s.offsets, whole["logprobs"]["text_offset"]);
    EXPECT_EQ(s.offsets, with_stop ? nlohmann::json({0, 1, 1}) : nlohmann::json({0, 1, 1, 2, 3}));
  }
}

TEST(CompletionStream, WithoutATokenizerEveryTokenGoesOutAtOnce) {
  CompletionRequest request;
  request.prompts = {{1}};
  auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", nullptr);
  std::vector<std::string> texts;
  const std::vector<nlohmann::json> chunks = StreamTokens(*stream, {5, 6, 7}, "length", &texts);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["token_ids"], nlohmann::json({5}));
  EXPECT_EQ(chunks[2]["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(chunks[2]["choices"][0]["logprobs"].is_null());
}

// echo (as vLLM streams it): the prompt's text and prompt logprobs first, then the tokens, each
// at its offset past the prompt; the whole adds up to the answer without streaming.
TEST(CompletionStream, EchoSendsThePromptFirst) {
  const runtime::Tokenizer tok = ByteTokenizer("stop", {"END"});
  CompletionRequest request;
  request.prompts = {ByteIds("ab")};
  request.prompt_texts = {std::string("ab")};
  request.echo = true;
  request.logprobs = 1;
  auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
  runtime::SampledToken scored{.id = 'b', .logprob = -0.5};
  stream->Sink(0)({.index = 0, .token = {.id = 'c', .logprob = -1.0}, .prompt_logprobs = {scored}});
  stream->Sink(0)({.index = 1, .token = {.id = 'd', .logprob = -2.0}, .finish_reason = "length"});
  const std::vector<nlohmann::json> chunks = Drain(*stream);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[0]["choices"][0]["text"], "ab");
  EXPECT_EQ(chunks[0]["choices"][0]["logprobs"]["token_logprobs"], nlohmann::json({nullptr, -0.5}));
  EXPECT_EQ(chunks[1]["choices"][0]["logprobs"]["text_offset"], nlohmann::json({2}));
  EXPECT_EQ(chunks[2]["choices"][0]["text"], "d");
  runtime::EngineResult r{.tokens = {{.id = 'c', .logprob = -1.0}, {.id = 'd', .logprob = -2.0}},
                          .prompt_logprobs = {scored},
                          .finish_reason = "length"};
  const nlohmann::json whole =
      CompletionResponse(request, {r}, "cmpl-1", 0, "m", &tok)["choices"][0];
  EXPECT_EQ(whole["text"], "abcd");
  EXPECT_EQ(whole["logprobs"]["text_offset"], nlohmann::json({0, 1, 2, 3}));
}

// echo with max_tokens 0: the prompt alone, closed with "length"; the engine's token not sent.
TEST(CompletionStream, EchoAloneIsOneChunk) {
  const runtime::Tokenizer tok = ByteTokenizer("stop", {"END"});
  CompletionRequest request;
  request.prompts = {ByteIds("ab")};
  request.prompt_texts = {std::nullopt};
  request.echo = true;
  request.max_tokens = 0;
  auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", 0, "m", &tok);
  stream->Sink(0)({.index = 0, .token = {.id = 'c'}, .finish_reason = "length"});
  std::string events;
  EXPECT_FALSE(stream->Next(&events, std::chrono::milliseconds(0)));  // every choice finished
  ASSERT_EQ(events.find("data: ", 1), std::string::npos) << events;  // one event
  EXPECT_NE(events.find(R"("text":"ab")"), std::string::npos) << events;
  EXPECT_NE(events.find(R"("finish_reason":"length")"), std::string::npos) << events;
}

}  // namespace
}  // namespace cpfill::launch
