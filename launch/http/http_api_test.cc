// The HTTP API's pure parts: request bodies refused by field, responses and metrics as clients
// and Prometheus read them.
#include "launch/http/http_api.h"

#include <cmath>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "launch/http/http_test_util.h"

namespace cpfill::launch {
namespace {

TEST(HttpApi, ParsesTokenPromptsSessionsAndLogprobs) {
  auto r = ParseCompletionRequest(
      R"({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "logprobs": 5,
          "session": "chat", "kv_transfer_params": {"do_remote_decode": false}})",
      "tiny", nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0], (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r->session, "chat");
  EXPECT_EQ(r->logprobs, 5);
  ASSERT_TRUE(r->kv_transfer_params.has_value());
  EXPECT_EQ(r->max_tokens, 1);
  auto batch = ParseCompletionRequest(R"({"prompt": [[1], [2, 3]]})", "tiny", nullptr);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ(batch->prompts.size(), 2u);
  // OpenAI's defaults: 16 tokens, temperature 1, a seed drawn by the server.
  EXPECT_EQ(batch->max_tokens, 16);
  EXPECT_EQ(batch->sampling.temperature, 1.0);
  EXPECT_FALSE(batch->seed.has_value());
  EXPECT_FALSE(batch->stream);
}

TEST(HttpApi, ParsesGenerationFields) {
  auto r = ParseCompletionRequest(
      R"({"prompt": [[1, 2], [3]], "max_tokens": 40, "temperature": 0.7, "top_p": 0.9,
          "top_k": -1, "seed": 5, "stop_token_ids": [7, 8], "ignore_eos": true, "stream": true,
          "stream_options": {"include_usage": true}, "stop": [], "n": 1,
          "presence_penalty": 0, "echo": false, "logprobs": 3})",
      "tiny", nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->max_tokens, 40);
  EXPECT_EQ(r->sampling.temperature, 0.7);
  EXPECT_EQ(r->sampling.top_p, 0.9);
  EXPECT_EQ(r->sampling.top_k, 0);
  EXPECT_EQ(r->sampling.logprobs, 3);
  EXPECT_EQ(r->stop_token_ids, (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(r->ignore_eos && r->stream && r->include_usage);
  // The engine requests: one per prompt, each with its own seed from the request's.
  const auto e = EngineRequestsOf(*r, 999, nullptr);
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0].sampling.seed, 5u);
  EXPECT_EQ(e[1].sampling.seed, 6u);
  EXPECT_EQ(e[1].max_tokens, 40);
  EXPECT_EQ(e[1].stop_ids, (std::vector<int32_t>{7, 8}));
  auto unseeded = ParseCompletionRequest(R"({"prompt": [1]})", "tiny", nullptr);
  EXPECT_EQ(EngineRequestsOf(*unseeded, 999, nullptr)[0].sampling.seed, 999u);
  EXPECT_FALSE(e[0].stop_when);  // no stop strings: nothing decodes text on the engine's thread
}

// "n": choices per prompt, prompt-major, each drawing with its own seed; usage counts a prompt's
// tokens once and every choice's completion.
TEST(HttpApi, NChoicesPerPrompt) {
  auto r =
      ParseCompletionRequest(R"({"prompt": [[1, 2], [3]], "n": 3, "seed": 10})", "tiny", nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->choices(), 6u);
  const auto e = EngineRequestsOf(*r, 999, nullptr);
  ASSERT_EQ(e.size(), 6u);
  for (size_t i = 0; i < e.size(); ++i) {
    EXPECT_EQ(e[i].tokens, i < 3 ? std::vector<int32_t>({1, 2}) : std::vector<int32_t>({3}));
    EXPECT_EQ(e[i].sampling.seed, 10 + i);
  }
  std::vector<runtime::EngineResult> results(6);
  for (size_t i = 0; i < results.size(); ++i) {
    results[i].prompt_tokens = i < 3 ? 2 : 1;
    results[i].cached_tokens = i % 3 == 0 ? 0 : 1;
    results[i].tokens.resize(2);
  }
  nlohmann::ordered_json u = UsageChunk("cmpl-5", 7, "tiny", results, r->n);
  EXPECT_EQ(u["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(u["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(u["usage"]["completion_tokens"], 12);
  nlohmann::ordered_json c = CompletionResponse(*r, results, "cmpl-5", 7, "tiny", nullptr);
  ASSERT_EQ(c["choices"].size(), 6u);
  EXPECT_EQ(c["choices"][5]["index"], 5);
}

TEST(HttpApi, StopStringsCutTheTextAndHoldBackWhatMayBeginOne) {
  CompletionRequest r;
  r.stop = {"END", "\n\n"};
  EXPECT_EQ(StopCut(r, "no stop here"), std::string::npos);
  EXPECT_EQ(StopCut(r, "a\n\nbEND"), 1u);  // the earliest stop string wins
  EXPECT_EQ(StopCut(r, "abcENDx"), 3u);
  r.include_stop_str_in_output = true;
  EXPECT_EQ(StopCut(r, "abcENDx\n\n"), 6u);
  // While streaming: a tail that may begin a stop string waits; one that cannot goes out.
  EXPECT_EQ(StopPrefixHeld(r, "abcEN"), 2u);
  EXPECT_EQ(StopPrefixHeld(r, "abc\n"), 1u);
  EXPECT_EQ(StopPrefixHeld(r, "abcENx"), 0u);
  EXPECT_EQ(StopPrefixHeld(r, ""), 0u);
}

TEST(HttpApi, StopStringsParseWithATokenizerOnly) {
  const runtime::Tokenizer tok = ByteTokenizer("parse", {});
  auto one = ParseCompletionRequest(R"({"prompt": [1], "stop": "END"})", "tiny", &tok);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->stop, (std::vector<std::string>{"END"}));
  EXPECT_FALSE(one->include_stop_str_in_output);
  auto four = ParseCompletionRequest(
      R"({"prompt": [1], "stop": ["a", "b\n", "c", "d"], "include_stop_str_in_output": true})",
      "tiny", &tok);
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->stop.size(), 4u);
  EXPECT_TRUE(four->include_stop_str_in_output);
  for (const char* none : {R"({"prompt": [1], "stop": null})", R"({"prompt": [1], "stop": []})"}) {
    auto r = ParseCompletionRequest(none, "tiny", nullptr);  // no stop strings: no tokenizer needed
    ASSERT_TRUE(r.ok()) << none << ": " << r.status();
    EXPECT_TRUE(r->stop.empty());
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"prompt": [1], "stop": ""})", "\"stop\" is \"\", must be a non-empty string"},
      {R"({"prompt": [1], "stop": ["a", ""]})", "\"stop\"[1] is \"\", must be a non-empty"},
      {R"({"prompt": [1], "stop": [7]})", "\"stop\"[0] is 7"},
      {R"({"prompt": [1], "stop": {"a": 1}})", "must be a string or a list of at most 4"},
      {R"({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]})", "a list of at most 4 strings"},
      {R"({"prompt": [1], "stop": [")" + std::string(257, 'x') + R"("]})", "at most 256 bytes"},
  };
  for (const auto& [body, message] : bad) {
    auto r = ParseCompletionRequest(body, "tiny", &tok);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << body << ": " << r.status();
  }
}

// The engine asks stop_when after each token: true once the text holds a stop string, however
// long the generation before it (it decodes only the newest tokens).
TEST(HttpApi, StopWhenFindsAStopStringCompletedByTheNewestToken) {
  const runtime::Tokenizer tok = ByteTokenizer("stop_when", {"ND", "\xC3\xA9"});
  CompletionRequest request;
  request.prompts = {{1}};
  request.stop = {"END", "\xC3\xA9!"};  // "é!"
  const runtime::EngineRequest e = EngineRequestsOf(request, 1, &tok)[0];
  ASSERT_TRUE(e.stop_when);
  std::vector<runtime::SampledToken> tokens;
  const auto add = [&](const std::vector<int32_t>& ids) {
    for (const int32_t id : ids) tokens.push_back({.id = id});
    return e.stop_when(tokens);
  };
  EXPECT_FALSE(add(ByteIds(std::string(300, 'x') + "E")));
  EXPECT_FALSE(add({int32_t{'N'}}));  // "EN": not yet
  EXPECT_FALSE(add({int32_t{'x'}}));  // "ENx": never
  EXPECT_FALSE(add({int32_t{'E'}}));
  EXPECT_TRUE(add({256}));  // "ND" completes "END"
  tokens.clear();
  EXPECT_FALSE(add({0xC3}));  // half of é
  EXPECT_FALSE(add({0xA9}));  // é, split over two tokens
  EXPECT_TRUE(add({int32_t{'!'}}));
  tokens.clear();
  EXPECT_FALSE(add({257}));  // é as one token
  EXPECT_TRUE(add({int32_t{'!'}}));
}

// The whole answer: text cut before the stop string, logprobs of the tokens that text covers
// (at their offsets in characters), token ids and usage of every token generated.
TEST(HttpApi, StopStringCutsTheTextAndItsLogprobsButNotTheTokens) {
  const runtime::Tokenizer tok = ByteTokenizer("response", {"ND"});
  CompletionRequest request;
  request.prompts = {{1}};
  request.stop = {"END"};
  request.logprobs = 1;
  runtime::EngineResult r;
  r.finish_reason = "stop";
  // "\xC3\xA9" (é) split over two tokens, then "a E", then "ND" completing "END".
  std::vector<int32_t> ids = {0xC3, 0xA9, 'a', ' ', 'E', 256};
  for (const int32_t id : ids) r.tokens.push_back({.id = id, .logprob = -0.5 - id});
  const auto choice = [&] {
    return CompletionResponse(request, {r}, "cmpl-1", 0, "tiny", &tok)["choices"][0];
  };
  nlohmann::ordered_json c = choice();
  EXPECT_EQ(c["text"],
            "\xC3\xA9"
            "a ");
  EXPECT_EQ(c["token_ids"], nlohmann::ordered_json(ids));
  EXPECT_EQ(c["finish_reason"], "stop");
  EXPECT_EQ(c["logprobs"]["token_ids"], nlohmann::ordered_json({0xC3, 0xA9, 'a', ' '}));
  EXPECT_EQ(c["logprobs"]["text_offset"], nlohmann::ordered_json({0, 0, 1, 2}));
  EXPECT_EQ(c["logprobs"]["token_logprobs"][3], -0.5 - ' ');
  EXPECT_EQ(
      CompletionResponse(request, {r}, "cmpl-1", 0, "tiny", &tok)["usage"]["completion_tokens"], 6);
  request.include_stop_str_in_output = true;
  c = choice();
  EXPECT_EQ(c["text"],
            "\xC3\xA9"
            "a END");
  EXPECT_EQ(c["logprobs"]["token_ids"], nlohmann::ordered_json(ids));
  EXPECT_EQ(c["logprobs"]["text_offset"], nlohmann::ordered_json({0, 0, 1, 2, 3, 4}));
  request.include_stop_str_in_output = false;
  request.stop = {
      "\xC3\xA9"
      "a"};  // at the very start: no text, no logprobs
  c = choice();
  EXPECT_EQ(c["text"], "");
  EXPECT_TRUE(c["logprobs"]["tokens"].empty());
  request.stop = {"never"};
  c = choice();
  EXPECT_EQ(c["text"],
            "\xC3\xA9"
            "a END");
  EXPECT_EQ(c["logprobs"]["token_ids"].size(), ids.size());
}

TEST(HttpApi, RefusesEachMalformedFieldByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"prompt": [1], "prompt": [2]})", "not valid JSON"},  // duplicate keys
      {R"({})", "\"prompt\" is required"},
      {R"({"prompt": "hello"})", "no tokenizer is loaded"},
      {R"({"prompt": ["hello"]})", "\"prompt\"[0]: text needs the model's tokenizer"},
      {R"({"prompt": 7})", "must be a text"},
      {R"({"prompt": "\ud800"})", "not valid JSON"},  // a lone surrogate is not UTF-8
      {R"({"prompt": []})", "non-empty"},
      {R"({"prompt": [1, -2]})", "\"prompt\"[1] is -2"},
      {R"({"prompt": [1.5]})", "not a token id"},
      {R"({"prompt": [[1], 2]})", "\"prompt\"[1] must be a text or a list"},
      {R"({"prompt": [1], "max_tokens": 0})", "\"max_tokens\" is 0"},
      {R"({"prompt": [1], "max_tokens": 1.5})", "\"max_tokens\""},
      {R"({"prompt": [1], "temperature": -1})", "\"temperature\""},
      {R"({"prompt": [1], "temperature": "hot"})", "\"temperature\""},
      {R"({"prompt": [1], "top_p": 0})", "\"top_p\""},
      {R"({"prompt": [1], "top_k": 2.5})", "\"top_k\""},
      {R"({"prompt": [1], "seed": "x"})", "\"seed\""},
      {R"({"prompt": [1], "stop": ["\n"]})", "\"stop\" strings need the model's tokenizer"},
      {R"({"prompt": [1], "stop": "x"})", "\"stop\" strings need the model's tokenizer"},
      {R"({"prompt": [1], "stop": 5})", "must be a string or a list of at most 4"},
      {R"({"prompt": [1], "include_stop_str_in_output": 1})", "must be true or false"},
      {R"({"prompt": [1], "stop_token_ids": [1, -1]})", "\"stop_token_ids\"[1]"},
      {R"({"prompt": [1], "ignore_eos": 1})", "\"ignore_eos\""},
      {R"({"prompt": [1], "presence_penalty": 0.5})", "\"presence_penalty\" is not supported"},
      {R"({"prompt": [1], "max_tokens": 0})", "0 only with \"echo\""},
      {R"({"prompt": [1], "best_of": 2})", "\"best_of\" is 2: only \"n\" (1)"},
      {R"({"prompt": [1], "logit_bias": {"5": 1}})", "\"logit_bias\" is not supported"},
      {R"({"prompt": [1], "suffix": "x"})", "\"suffix\" is not supported"},
      {R"({"prompt": [1], "frequency_penalty": 1})", "\"frequency_penalty\" is not supported"},
      {R"({"prompt": [1], "repetition_penalty": 1.2})", "\"repetition_penalty\""},
      {R"({"prompt": [1], "min_tokens": 20})", "\"min_tokens\" is 20"},
      {R"({"prompt": [1], "skip_special_tokens": 1})", "\"skip_special_tokens\""},
      {R"({"prompt": [1], "echo": true, "logprobs": 1, "session": "s"})", "takes no \"session\""},
      {R"({"prompt": [1], "echo": true, "logprobs": 1, "n": 2})", "takes \"n\" 1"},
      {R"({"prompt": [1], "stream_options": 3})", "\"stream_options\""},
      {R"({"prompt": [1], "model": "other"})", "this server serves \"tiny\""},
      {R"({"prompt": [1], "logprobs": 21})", "\"logprobs\""},
      {R"({"prompt": [1], "stream": "yes"})", "\"stream\""},
      {R"({"prompt": [1], "n": 0})", "\"n\" is 0, must be an integer in [1, 1024]"},
      {R"({"prompt": [[1], [2]], "n": 513})", "\"n\" is 513, must be an integer in [1, 512]"},
      {R"({"prompt": [1], "n": 1.5})", "\"n\""},
      {R"({"prompt": [1], "n": 2, "session": "s"})", "\"n\" 1"},
      {R"({"prompt": [1], "bogus": 1})", "unknown field \"bogus\""},
      {R"({"prompt": [[1], [2]], "session": "s"})", "takes one prompt"},
      {R"({"prompt": [1], "session": ""})", "\"session\""},
      {R"({"prompt": [1], "kv_transfer_params": 3})", "kv_transfer_params"},
  };
  for (const auto& [body, message] : cases) {
    auto r = ParseCompletionRequest(body, "tiny", nullptr);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_NE(r.status().message().find(message), std::string::npos) << body << ": " << r.status();
  }
}

TEST(HttpApi, ErrorsMapToHttpStatusesWithJsonBodies) {
  EXPECT_EQ(ErrorResponse(absl::InvalidArgumentError("x")).status, 400);
  EXPECT_EQ(ErrorResponse(absl::NotFoundError("x")).status, 404);
  EXPECT_EQ(ErrorResponse(absl::ResourceExhaustedError("x")).status, 413);
  EXPECT_EQ(ErrorResponse(absl::UnavailableError("x")).status, 503);
  EXPECT_EQ(ErrorResponse(absl::InternalError("x")).status, 500);
  const HttpError e = ErrorResponse(absl::InvalidArgumentError("bad \"prompt\""));
  const nlohmann::json body = nlohmann::json::parse(e.body);
  EXPECT_EQ(body["error"]["message"], "bad \"prompt\"");
  EXPECT_EQ(body["error"]["code"], 400);
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
}

TEST(HttpApi, ResponseCarriesTokensUsageLogprobsAndTimings) {
  CompletionRequest request;
  request.prompts = {{1, 2, 3}};
  request.logprobs = 2;
  request.kv_transfer_params = nlohmann::json{{"k", 1}};
  runtime::EngineResult r;
  r.first_token = 2;
  r.logits = {0.0f, 1.0f, 3.0f, 2.0f};
  // The first token and its top two as runtime::SampleToken gives them, then a second token.
  r.tokens.push_back(runtime::SampleToken(r.logits, {.logprobs = 2}, 0));
  r.tokens.push_back({.id = 0, .logprob = -1.5, .top = {{0, -1.5}, {1, -2.0}}});
  r.finish_reason = "stop";
  r.decode_s = 0.01;
  r.prompt_tokens = 3;
  r.cached_tokens = 5;
  r.queue_s = 0.001;
  r.prefill_s = 0.002;
  const nlohmann::ordered_json out = CompletionResponse(request, {r}, "cmpl-1", 7, "tiny", nullptr);
  EXPECT_EQ(out["choices"][0]["token_ids"], nlohmann::ordered_json({2, 0}));
  EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(out["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(out["usage"]["completion_tokens"], 2);
  EXPECT_EQ(out["usage"]["total_tokens"], 5);
  EXPECT_NEAR(out["cpfill"]["prompts"][0]["tpot_ms"].get<double>(), 10.0, 1e-9);
  EXPECT_EQ(out["choices"][0]["logprobs"]["token_logprobs"][1], -1.5);
  EXPECT_EQ(out["choices"][0]["logprobs"]["tokens"],
            nlohmann::ordered_json({"token_id:2", "token_id:0"}));
  EXPECT_EQ(out["choices"][0]["logprobs"]["token_ids"], nlohmann::ordered_json({2, 0}));
  EXPECT_EQ(out["choices"][0]["logprobs"]["text_offset"], nlohmann::ordered_json({0, 0}));
  EXPECT_EQ(out["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
  EXPECT_EQ(out["kv_transfer_params"]["k"], 1);
  // log-softmax of (0, 1, 3, 2): the top two are tokens 2 and 3.
  const auto& top = out["choices"][0]["logprobs"]["top_logprobs"][0];
  ASSERT_EQ(top.size(), 2u);
  const double log_z = std::log(std::exp(0.0) + std::exp(1.0) + std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(top["token_id:2"].get<double>(), 3.0 - log_z, 1e-6);
  EXPECT_NEAR(top["token_id:3"].get<double>(), 2.0 - log_z, 1e-6);
  EXPECT_NEAR(out["cpfill"]["prompts"][0]["ttft_ms"].get<double>(), 3.0, 1e-9);
}

TEST(HttpApi, AcceptsTheNeutralValuesClientsSendByDefault) {
  auto r = ParseCompletionRequest(
      R"({"prompt": [1], "best_of": 1, "logit_bias": {}, "suffix": null, "user": "u",
          "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
          "skip_special_tokens": false, "spaces_between_special_tokens": true,
          "min_tokens": 3, "max_tokens": 5, "echo": false,
          "stream_options": {"include_usage": true, "continuous_usage_stats": true}})",
      "tiny", nullptr);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->skip_special_tokens);
  EXPECT_TRUE(r->include_usage && r->continuous_usage_stats);
  EXPECT_EQ(r->min_tokens, 3);
  EXPECT_EQ(EngineRequestsOf(*r, 1, nullptr)[0].min_tokens, 3);
  EXPECT_EQ(EngineRequestsOf(*r, 1, nullptr)[0].prompt_logprobs, -1);
  auto nulls = ParseCompletionRequest(R"({"prompt": [1], "logit_bias": null, "best_of": null})",
                                      "tiny", nullptr);
  ASSERT_TRUE(nulls.ok()) << nulls.status();
  EXPECT_TRUE(nulls->skip_special_tokens);  // vLLM's default
  // echo with max_tokens 0 asks the engine for one token (dropped) and the prompt's logprobs.
  auto echo = ParseCompletionRequest(R"({"prompt": [1, 2], "echo": true, "max_tokens": 0,
                                         "logprobs": 2})",
                                     "tiny", nullptr);
  ASSERT_TRUE(echo.ok()) << echo.status();
  const auto e = EngineRequestsOf(*echo, 1, nullptr);
  EXPECT_EQ(e[0].max_tokens, 1);
  EXPECT_EQ(e[0].prompt_logprobs, 2);
}

TEST(HttpApi, EchoesThePromptWithItsLogprobsFirstNull) {
  const runtime::Tokenizer tok = ByteTokenizer("echo", {});
  CompletionRequest request;
  request.prompts = {ByteIds("ab")};
  request.prompt_texts = {std::nullopt};
  request.echo = true;
  request.logprobs = 1;
  runtime::EngineResult r;
  r.tokens = {{.id = 'c', .logprob = -1.0, .top = {{'c', -1.0}}}};
  r.prompt_logprobs = {{.id = 'b', .logprob = -3.0, .top = {{'x', -0.1}}}};
  r.finish_reason = "length";
  const auto out = CompletionResponse(request, {r}, "cmpl-1", 7, "tiny", &tok);
  const auto& c = out["choices"][0];
  EXPECT_EQ(c["text"], "abc");
  EXPECT_EQ(c["logprobs"]["tokens"], nlohmann::ordered_json({"a", "b", "c"}));
  EXPECT_EQ(c["logprobs"]["token_logprobs"], nlohmann::ordered_json({nullptr, -3.0, -1.0}));
  EXPECT_EQ(c["logprobs"]["text_offset"], nlohmann::ordered_json({0, 1, 2}));
  EXPECT_TRUE(c["logprobs"]["top_logprobs"][0].is_null());
  // The prompt's token is named beside the top k, as vLLM's prompt logprobs do.
  EXPECT_EQ(c["logprobs"]["top_logprobs"][1]["b"], -3.0);
  EXPECT_EQ(c["logprobs"]["top_logprobs"][1]["x"], -0.1);
  // A text prompt echoes as it was sent; without logprobs only the text changes.
  request.prompt_texts = {"ab"};
  request.logprobs = 0;
  r.tokens.clear();  // max_tokens 0
  const auto alone = CompletionResponse(request, {r}, "cmpl-2", 7, "tiny", &tok);
  EXPECT_EQ(alone["choices"][0]["text"], "ab");
  EXPECT_EQ(alone["usage"]["completion_tokens"], 0);
}

TEST(HttpApi, SkipsSpecialTokensInTextUnlessAsked) {
  const runtime::Tokenizer tok = SpecialTokenizer();
  CompletionRequest request;
  request.prompts = {{1}};
  runtime::EngineResult r;
  for (const int32_t id : ByteIds("Paris.")) r.tokens.push_back({.id = id});
  r.tokens.push_back({.id = 256});  // <|im_end|>
  auto text = [&] {
    return CompletionResponse(request, {r}, "c", 1, "m", &tok)["choices"][0]["text"];
  };
  EXPECT_EQ(text(), "Paris.");
  request.skip_special_tokens = false;
  EXPECT_EQ(text(), "Paris.<|im_end|>");
}

TEST(HttpApi, TokenizesAndDetokenizesAsVllm) {
  const runtime::Tokenizer tok = SpecialTokenizer();
  auto t = Tokenize(R"({"model": "m", "prompt": "hi<|im_end|>", "add_special_tokens": false,
                        "return_token_strs": true})",
                    "m", &tok, 4096);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)["tokens"], nlohmann::ordered_json({'h', 'i', 256}));
  EXPECT_EQ((*t)["count"], 3);
  EXPECT_EQ((*t)["max_model_len"], 4096);
  EXPECT_EQ((*t)["token_strs"][2], "<|im_end|>");
  auto d = Detokenize(R"({"tokens": [104, 105, 256]})", "m", &tok);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)["prompt"], "hi<|im_end|>");
  EXPECT_TRUE(absl::IsInvalidArgument(Detokenize(R"({"tokens": [-1]})", "m", &tok).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Detokenize(R"({"tokens": [1], "x": 1})", "m", &tok).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Tokenize(R"({"messages": []})", "m", &tok, 1).status()));
  EXPECT_TRUE(absl::IsFailedPrecondition(Tokenize(R"({"prompt": "a"})", "m", nullptr, 1).status()));
}

TEST(HttpApi, ContinuousUsageRidesOnEveryChunk) {
  CompletionRequest request;
  request.prompts = {{1, 2, 3}};
  request.continuous_usage_stats = true;
  StreamDelta delta{.index = 0, .text = "x", .token = runtime::SampledToken{.id = 5}};
  delta.prompt_tokens = 3;
  delta.completion_tokens = 2;
  const auto chunk = StreamChunk(request, "c", 1, "m", delta, nullptr);
  EXPECT_EQ(chunk["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(chunk["usage"]["total_tokens"], 5);
}

TEST(HttpApi, TextOffsetsCountCharactersNotBytes) {
  EXPECT_EQ(CodePoints(""), 0u);
  EXPECT_EQ(CodePoints("abc"), 3u);
  EXPECT_EQ(CodePoints("caf\xc3\xa9 \xef\xbf\xbd"), 6u);  // é and U+FFFD: one each
}

TEST(HttpApi, StreamChunksFollowOpenAi) {
  CompletionRequest request;
  request.prompts = {{1}, {2}};
  StreamDelta d{.index = 1, .text = "ab", .token = runtime::SampledToken{.id = 9}};
  nlohmann::ordered_json c = StreamChunk(request, "cmpl-4", 7, "tiny", d, nullptr);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["index"], 1);
  EXPECT_EQ(c["choices"][0]["text"], "ab");
  EXPECT_EQ(c["choices"][0]["token_ids"], nlohmann::ordered_json({9}));
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(c["choices"][0]["logprobs"].is_null());
  d.finish_reason = "length";
  d.text_offset = 5;
  request.logprobs = 1;
  c = StreamChunk(request, "cmpl-4", 7, "tiny", d, nullptr);
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["choices"][0]["logprobs"]["text_offset"], nlohmann::ordered_json({5}));
  // A choice that a stop string closed: the ids past it, no text, no logprobs.
  c = StreamChunk(request, "cmpl-4", 7, "tiny",
                  {.index = 0, .unsent_ids = {3, 4}, .finish_reason = "stop"}, nullptr);
  EXPECT_EQ(c["choices"][0]["token_ids"], nlohmann::ordered_json({3, 4}));
  EXPECT_EQ(c["choices"][0]["text"], "");
  EXPECT_TRUE(c["choices"][0]["logprobs"]["tokens"].empty());
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  runtime::EngineResult r;
  r.prompt_tokens = 4;
  r.tokens.resize(3);
  nlohmann::ordered_json u = UsageChunk("cmpl-4", 7, "tiny", {r, r});
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 6);
}

TEST(HttpApi, MetricsAreValidPrometheusText) {
  ServingHistograms h;
  for (double ttft : {0.0005, 0.003, 5.0}) {
    runtime::EngineResult r;
    r.prefill_s = ttft;
    r.tokens.resize(3);
    r.decode_s = 0.02;
    h.Observe(r);
  }
  runtime::EngineStats s;
  s.requests_ok = 4;
  s.prompt_tokens = 100;
  s.generation_tokens = 9;
  const std::string text = MetricsText(s, {.http_client_errors = 2}, h);
  EXPECT_NE(text.find("cpfill:generation_tokens_total 9\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:time_per_output_token_seconds_bucket{le=\"0.01\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("cpfill:requests_total{status=\"ok\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("cpfill:requests_total{status=\"http_4xx\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:prompt_tokens_total 100\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_bucket{le=\"0.001\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_bucket{le=\"0.005\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_count 3\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE cpfill:kv_cache_usage_ratio gauge\n"), std::string::npos);
}

TEST(HttpApi, MetricsCountRefusalsByReason) {
  ServerCounters counters;
  counters.refused[static_cast<size_t>(Refusal::kUnauthorized)] = 3;
  counters.refused[static_cast<size_t>(Refusal::kTooManyConnections)] = 7;
  const std::string text = MetricsText({}, counters, ServingHistograms{});
  EXPECT_NE(text.find("# TYPE cpfill:http_refused_total counter\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:http_refused_total{reason=\"unauthorized\"} 3\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("cpfill:http_refused_total{reason=\"too_many_connections\"} 7\n"),
            std::string::npos);
  // Every reason is listed, at 0 too, so that a rate over it is defined from the start.
  for (int i = 0; i < kRefusalKinds; ++i) {
    const std::string name = RefusalName(static_cast<Refusal>(i));
    EXPECT_NE(text.find("{reason=\"" + name + "\"}"), std::string::npos) << name;
  }
}

TEST(HttpApi, RefusalsAnswerWithTheirStatusAndOpenAiType) {
  const HttpError unauthorized = RefusalResponse(Refusal::kUnauthorized, "no key");
  EXPECT_EQ(unauthorized.status, 401);
  const nlohmann::json body = nlohmann::json::parse(unauthorized.body);
  EXPECT_EQ(body["error"]["type"], "authentication_error");
  EXPECT_EQ(body["error"]["message"], "no key");
  EXPECT_EQ(body["error"]["code"], 401);
  EXPECT_EQ(RefusalResponse(Refusal::kBodyTooLarge, "").status, 413);
  EXPECT_EQ(RefusalResponse(Refusal::kHeaderTooLarge, "").status, 431);
  EXPECT_EQ(RefusalResponse(Refusal::kTimeout, "").status, 408);
  EXPECT_EQ(RefusalResponse(Refusal::kTooManyConnections, "").status, 503);
  EXPECT_EQ(RefusalResponse(Refusal::kOverloaded, "").status, 503);
  EXPECT_EQ(ErrorResponse(absl::UnauthenticatedError("x")).status, 401);
  EXPECT_EQ(RefusalOf(absl::UnavailableError("queue")), Refusal::kQueueFull);
  EXPECT_EQ(RefusalOf(absl::FailedPreconditionError("stopping")), Refusal::kDraining);
  EXPECT_EQ(RefusalOf(absl::ResourceExhaustedError("kv")), Refusal::kTooLargeForKv);
  EXPECT_FALSE(RefusalOf(absl::InternalError("bug")).has_value());
}

TEST(HttpApi, BearerKeyMatchesOnlyTheKey) {
  const std::string key = "sk-cpfill-0123456789";
  EXPECT_TRUE(BearerKeyMatches("Bearer sk-cpfill-0123456789", key));
  EXPECT_TRUE(BearerKeyMatches("bearer  sk-cpfill-0123456789 ", key));  // RFC 7235: any case
  EXPECT_FALSE(BearerKeyMatches("Bearer sk-cpfill-012345678", key));    // a prefix
  EXPECT_FALSE(BearerKeyMatches("Bearer sk-cpfill-01234567890", key));  // longer
  EXPECT_FALSE(BearerKeyMatches("Bearer sk-cpfill-0123456788", key));   // last byte
  EXPECT_FALSE(BearerKeyMatches("Basic sk-cpfill-0123456789", key));
  EXPECT_FALSE(BearerKeyMatches("sk-cpfill-0123456789", key));
  EXPECT_FALSE(BearerKeyMatches("Bearer ", key));
  EXPECT_FALSE(BearerKeyMatches("", key));
}

TEST(HttpApi, ApiKeyComesFromTheFlagTheFileOrTheEnvironment) {
  EXPECT_EQ(*ApiKeyFrom("", "", nullptr), "");  // none: no key asked for
  EXPECT_EQ(*ApiKeyFrom("k1", "", "k3"), "k1");
  EXPECT_EQ(*ApiKeyFrom("", "", "k3"), "k3");
  const std::string path = ::testing::TempDir() + "/http_api_test_key";
  { std::ofstream(path) << "from-file \n"; }
  EXPECT_EQ(*ApiKeyFrom("", path, "k3"), "from-file");
  // Refusals name the source, never the key.
  absl::StatusOr<std::string> both = ApiKeyFrom("secret-1", path, nullptr);
  ASSERT_FALSE(both.ok());
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> spaced = ApiKeyFrom("secret 2", "", nullptr);
  ASSERT_FALSE(spaced.ok());
  EXPECT_EQ(std::string(spaced.status().message()).find("secret"), std::string::npos)
      << spaced.status();
  EXPECT_FALSE(ApiKeyFrom("", path + ".missing", nullptr).ok());
  EXPECT_FALSE(ApiKeyFrom("", "", "").ok());  // an empty CPFILL_API_KEY is a mistake, not "none"
  { std::ofstream(path) << "\n"; }
  EXPECT_FALSE(ApiKeyFrom("", path, nullptr).ok());
}

}  // namespace
}  // namespace cpfill::launch
