// The HTTP API's pure parts: request bodies refused by field, responses and metrics as clients
// and Prometheus read them.
#include "launch/http_api.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

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

TEST(HttpApi, StopStringsCutTheTextAndHoldBackWhatMayBeginOne) {
  CompletionRequest r;
  r.stop = {"END", "\n\n"};
  EXPECT_EQ(StopCut(r, "no stop here"), std::string::npos);
  EXPECT_EQ(CutAtStop(r, "a\n\nbEND"), "a");  // the earliest stop string wins
  EXPECT_EQ(CutAtStop(r, "abcENDx"), "abc");
  r.include_stop_str_in_output = true;
  EXPECT_EQ(CutAtStop(r, "abcENDx\n\n"), "abcEND");
  // While streaming: a tail that may begin a stop string waits; one that cannot goes out.
  EXPECT_EQ(StopPrefixHeld(r, "abcEN"), 2u);
  EXPECT_EQ(StopPrefixHeld(r, "abc\n"), 1u);
  EXPECT_EQ(StopPrefixHeld(r, "abcENx"), 0u);
  EXPECT_EQ(StopPrefixHeld(r, ""), 0u);
  // The response's text is cut; its token ids and usage keep every generated token.
  runtime::EngineResult result;
  result.finish_reason = "stop";
  result.tokens = {{.id = 1}, {.id = 2}};
  const auto out = CompletionResponse(r, {result}, "cmpl-1", 0, "tiny", nullptr);
  EXPECT_EQ(out["choices"][0]["token_ids"].size(), 2u);
  EXPECT_EQ(out["usage"]["completion_tokens"], 2);
}

TEST(HttpApi, RefusesEachMalformedFieldByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"prompt": [1], "prompt": [2]})", "not valid JSON"},  // duplicate keys
      {R"({})", "\"prompt\" is required"},
      {R"({"prompt": "hello"})", "this model has none"},
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
      {R"({"prompt": [1], "stop": 5})", "must be a string or a list of at most 4"},
      {R"({"prompt": [1], "stop": ["a", "b", "c", "d", "e"]})", "a list of at most 4 strings"},
      {R"({"prompt": [1], "stop": ["a", ""]})", "\"stop\"[1] is \"\", must be a non-empty"},
      {R"({"prompt": [1], "stop": [7]})", "\"stop\"[0] is 7"},
      {R"({"prompt": [1], "include_stop_str_in_output": 1})", "must be true or false"},
      {R"({"prompt": [1], "stop_token_ids": [1, -1]})", "\"stop_token_ids\"[1]"},
      {R"({"prompt": [1], "ignore_eos": 1})", "\"ignore_eos\""},
      {R"({"prompt": [1], "presence_penalty": 0.5})", "\"presence_penalty\" is not supported"},
      {R"({"prompt": [1], "echo": true})", "\"echo\" is not supported"},
      {R"({"prompt": [1], "stream_options": 3})", "\"stream_options\""},
      {R"({"prompt": [1], "model": "other"})", "this server serves \"tiny\""},
      {R"({"prompt": [1], "logprobs": 21})", "\"logprobs\""},
      {R"({"prompt": [1], "stream": "yes"})", "\"stream\""},
      {R"({"prompt": [1], "n": 2})", "\"n\""},
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
  EXPECT_EQ(out["choices"][0]["token_ids"], nlohmann::json({2, 0}));
  EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(out["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(out["usage"]["completion_tokens"], 2);
  EXPECT_EQ(out["usage"]["total_tokens"], 5);
  EXPECT_NEAR(out["cpfill"]["prompts"][0]["tpot_ms"].get<double>(), 10.0, 1e-9);
  EXPECT_EQ(out["choices"][0]["logprobs"]["token_logprobs"][1], -1.5);
  EXPECT_EQ(out["choices"][0]["logprobs"]["tokens"], nlohmann::json({"token_id:2", "token_id:0"}));
  EXPECT_EQ(out["choices"][0]["logprobs"]["token_ids"], nlohmann::json({2, 0}));
  EXPECT_EQ(out["choices"][0]["logprobs"]["text_offset"], nlohmann::json({0, 0}));
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

TEST(HttpApi, TextOffsetsCountCharactersNotBytes) {
  EXPECT_EQ(CodePoints(""), 0u);
  EXPECT_EQ(CodePoints("abc"), 3u);
  EXPECT_EQ(CodePoints("caf\xc3\xa9 \xef\xbf\xbd"), 6u);  // é and U+FFFD: one each
}

TEST(HttpApi, StreamChunksFollowOpenAi) {
  CompletionRequest request;
  request.prompts = {{1}, {2}};
  runtime::GeneratedToken t{.index = 3, .token = {.id = 9}, .finish_reason = ""};
  nlohmann::ordered_json c = StreamChunk(request, "cmpl-4", 7, "tiny", 1, t, "ab", nullptr, 0);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["index"], 1);
  EXPECT_EQ(c["choices"][0]["text"], "ab");
  EXPECT_EQ(c["choices"][0]["token_ids"][0], 9);
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  t.finish_reason = "length";
  EXPECT_EQ(StreamChunk(request, "cmpl-4", 7, "tiny", 1, t, "", nullptr,
                        0)["choices"][0]["finish_reason"],
            "length");
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

}  // namespace
}  // namespace cpfill::launch
