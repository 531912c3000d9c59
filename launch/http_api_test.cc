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
  auto batch = ParseCompletionRequest(R"({"prompt": [[1], [2, 3]]})", "tiny", nullptr);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_EQ(batch->prompts.size(), 2u);
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
      {R"({"prompt": [1], "max_tokens": 16})", "decode is not available"},
      {R"({"prompt": [1], "max_tokens": 0})", "positive integer"},
      {R"({"prompt": [1], "model": "other"})", "this server serves \"tiny\""},
      {R"({"prompt": [1], "logprobs": 21})", "\"logprobs\""},
      {R"({"prompt": [1], "stream": true})", "streaming needs decode"},
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
    EXPECT_NE(r.status().message().find(message), std::string::npos)
        << body << ": " << r.status();
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
  r.prompt_tokens = 3;
  r.cached_tokens = 5;
  r.queue_s = 0.001;
  r.prefill_s = 0.002;
  const nlohmann::ordered_json out = CompletionResponse(request, {r}, "cmpl-1", 7, "tiny", nullptr);
  EXPECT_EQ(out["choices"][0]["token_ids"][0], 2);
  EXPECT_EQ(out["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(out["usage"]["completion_tokens"], 1);
  EXPECT_EQ(out["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
  EXPECT_EQ(out["kv_transfer_params"]["k"], 1);
  // log-softmax of (0, 1, 3, 2): the top two are tokens 2 and 3.
  const auto& top = out["choices"][0]["logprobs"]["top_logprobs"][0];
  ASSERT_EQ(top.size(), 2u);
  const double log_z = std::log(std::exp(0.0) + std::exp(1.0) + std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(top["2"].get<double>(), 3.0 - log_z, 1e-6);
  EXPECT_NEAR(top["3"].get<double>(), 2.0 - log_z, 1e-6);
  EXPECT_NEAR(out["cpfill"]["prompts"][0]["ttft_ms"].get<double>(), 3.0, 1e-9);
}

TEST(HttpApi, MetricsAreValidPrometheusText) {
  Histogram h({0.1, 1});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(5);
  runtime::EngineStats s;
  s.requests_ok = 4;
  s.prompt_tokens = 100;
  const std::string text = MetricsText(s, {.http_client_errors = 2}, h, h, h);
  EXPECT_NE(text.find("cpfill:requests_total{status=\"ok\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("cpfill:requests_total{status=\"http_4xx\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:prompt_tokens_total 100\n"), std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_bucket{le=\"0.1\"} 1\n"),
            std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_bucket{le=\"1\"} 2\n"),
            std::string::npos);
  EXPECT_NE(text.find("cpfill:time_to_first_token_seconds_count 3\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE cpfill:kv_cache_usage_ratio gauge\n"), std::string::npos);
}

}  // namespace
}  // namespace cpfill::launch
