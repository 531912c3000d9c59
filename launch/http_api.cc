#include "launch/http_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/status.h"
#include "parallel/selector.h"

namespace cpfill::launch {
namespace {

// The fields POST /v1/completions understands. OpenAI sampling fields that change nothing for a
// one-token prefill are accepted as long as they are well-typed; anything else is refused by
// name, so a client learns at once that cpfill did not do what it asked.
const std::set<std::string> kKnownFields = {"model",
                                            "prompt",
                                            "max_tokens",
                                            "logprobs",
                                            "session",
                                            "kv_transfer_params",
                                            "temperature",
                                            "top_p",
                                            "n",
                                            "stream",
                                            "user",
                                            "seed",
                                            "echo",
                                            "stop",
                                            "top_k",
                                            "presence_penalty",
                                            "frequency_penalty"};

absl::StatusOr<std::vector<int32_t>> TokenIds(const nlohmann::json& list,
                                              const std::string& where) {
  CPFILL_CHECK_ARG(list.is_array(), where, " must be a list of token ids");
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const std::optional<int64_t> id = json::AsInt64(list[i]);
    CPFILL_CHECK_ARG(id.has_value() && *id >= 0 && *id <= std::numeric_limits<int32_t>::max(),
                     where, "[", i, "] is ", json::Show(list[i]),
                     ", not a token id (a non-negative integer)");
    ids.push_back(static_cast<int32_t>(*id));
  }
  return ids;
}

absl::StatusOr<std::vector<int32_t>> TextIds(const nlohmann::json& text, const std::string& where,
                                             const runtime::Tokenizer* tokenizer) {
  CPFILL_CHECK_ARG(tokenizer != nullptr, where,
                   ": text needs the model's tokenizer, and this model has none (a preset, or a "
                   "checkpoint without tokenizer.json); send token ids");
  absl::StatusOr<std::vector<int32_t>> ids =
      tokenizer->Encode(text.get_ref<const std::string&>(), /*add_bos=*/true);
  CPFILL_CHECK_ARG(ids.ok(), where, ": ", ids.status().message());
  return ids;
}

// One prompt: a list of token ids or a text.
absl::StatusOr<std::vector<int32_t>> PromptIds(const nlohmann::json& p, const std::string& where,
                                               const runtime::Tokenizer* tokenizer) {
  if (p.is_string()) return TextIds(p, where, tokenizer);
  return TokenIds(p, where);
}

absl::Status ParsePrompts(const nlohmann::json& prompt, const runtime::Tokenizer* tokenizer,
                          CompletionRequest* r) {
  CPFILL_CHECK_ARG(prompt.is_string() || (prompt.is_array() && !prompt.empty()),
                   "\"prompt\" must be a text, a non-empty list of token ids, or a list of "
                   "texts or of such lists");
  const bool batch = prompt.is_array() && (prompt[0].is_array() || prompt[0].is_string());
  if (!batch) {
    CPFILL_ASSIGN_OR_RETURN(r->prompts.emplace_back(), PromptIds(prompt, "\"prompt\"", tokenizer));
    return absl::OkStatus();
  }
  CPFILL_CHECK_ARG(prompt.size() <= kMaxPromptsPerRequest, "\"prompt\" holds ", prompt.size(),
                   " prompts, more than ", kMaxPromptsPerRequest);
  for (size_t i = 0; i < prompt.size(); ++i) {
    const std::string where = absl::StrCat("\"prompt\"[", i, "]");
    CPFILL_CHECK_ARG(prompt[i].is_array() || prompt[i].is_string(), where,
                     " must be a text or a list of token ids");
    CPFILL_ASSIGN_OR_RETURN(r->prompts.emplace_back(), PromptIds(prompt[i], where, tokenizer));
  }
  return absl::OkStatus();
}

// log-softmax of the last position's logits: the first token's and the top k.
nlohmann::ordered_json Logprobs(const runtime::EngineResult& r, int k) {
  const std::vector<float>& z = r.logits;
  double max = -std::numeric_limits<double>::infinity(), sum = 0;
  for (float x : z) max = std::max(max, double(x));
  for (float x : z) sum += std::exp(double(x) - max);
  const double log_z = max + std::log(sum);
  std::vector<int32_t> order(z.size());
  for (size_t i = 0; i < z.size(); ++i) order[i] = static_cast<int32_t>(i);
  const size_t top = std::min<size_t>(static_cast<size_t>(k), z.size());
  std::partial_sort(order.begin(), order.begin() + top, order.end(),
                    [&](int32_t a, int32_t b) { return z[a] > z[b]; });
  nlohmann::ordered_json top_json = nlohmann::ordered_json::object();
  for (size_t i = 0; i < top; ++i) top_json[std::to_string(order[i])] = z[order[i]] - log_z;
  const double first = r.first_token >= 0 && r.first_token < static_cast<int32_t>(z.size())
                           ? z[r.first_token] - log_z
                           : 0.0;
  return {
      {"token_ids", {r.first_token}}, {"token_logprobs", {first}}, {"top_logprobs", {top_json}}};
}

nlohmann::ordered_json Timing(const runtime::EngineResult& r) {
  const runtime::PrefillTimings& t = r.timings;
  const parallel::Selection& sel = t.selection;
  return {{"queue_ms", r.queue_s * 1e3},
          {"ttft_ms", (r.queue_s + r.prefill_s) * 1e3},
          {"prefill_ms", r.prefill_s * 1e3},
          {"batch_requests", r.batch_requests},
          {"phases_ms",
           {{"embedding", t.embed_s * 1e3},
            {"gemms", t.gemm_s * 1e3},
            {"attention_ring", t.attention_s * 1e3},
            {"all_reduce", t.allreduce_s * 1e3},
            {"kv_cache", t.kv_s * 1e3},
            {"lm_head", t.lm_head_s * 1e3},
            {"other", t.other_s * 1e3}}},
          {"algorithm", std::string(parallel::RingAlgorithmName(t.algorithm))},
          {"selector", sel.reason},
          {"recomputed_session", r.recomputed}};
}

}  // namespace

absl::StatusOr<CompletionRequest> ParseCompletionRequest(std::string_view body,
                                                         const std::string& served_model,
                                                         const runtime::Tokenizer* tokenizer) {
  CPFILL_CHECK_ARG(body.size() <= kMaxBodyBytes, "the body has ", body.size(), " bytes, more than ",
                   kMaxBodyBytes);
  absl::StatusOr<nlohmann::json> parsed = json::Parse(body);
  CPFILL_CHECK_ARG(parsed.ok(), "the body is not valid JSON: ", parsed.status().message());
  const nlohmann::json& v = *parsed;
  CPFILL_CHECK_ARG(v.is_object(), "the body must be a JSON object");
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(kKnownFields.count(key), "unknown field \"", key, "\"");
  }
  CompletionRequest r;
  if (const nlohmann::json* model = json::Find(v, "model"); model != nullptr) {
    CPFILL_CHECK_ARG(model->is_string() && model->get_ref<const std::string&>() == served_model,
                     "\"model\" is ", json::Show(*model), "; this server serves \"", served_model,
                     "\"");
  }
  const nlohmann::json* prompt = json::Find(v, "prompt");
  CPFILL_CHECK_ARG(prompt != nullptr, "\"prompt\" is required");
  CPFILL_RETURN_IF_ERROR(ParsePrompts(*prompt, tokenizer, &r));
  if (const nlohmann::json* m = json::Find(v, "max_tokens"); m != nullptr && !m->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*m);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 1, "\"max_tokens\" is ", json::Show(*m),
                     ", must be a positive integer");
    CPFILL_CHECK_ARG(*n == 1, "\"max_tokens\" is ", *n,
                     ": decode is not available; cpfill prefills and returns the first token "
                     "(max_tokens 1)");
  }
  if (const nlohmann::json* n = json::Find(v, "n"); n != nullptr && !n->is_null()) {
    CPFILL_CHECK_ARG(json::AsInt64(*n) == 1, "\"n\" is ", json::Show(*n), "; only 1 is supported");
  }
  if (const nlohmann::json* s = json::Find(v, "stream"); s != nullptr && !s->is_null()) {
    CPFILL_CHECK_ARG(s->is_boolean() && !s->get<bool>(),
                     "\"stream\": streaming needs decode, "
                     "which is not available");
  }
  if (const nlohmann::json* lp = json::Find(v, "logprobs"); lp != nullptr && !lp->is_null()) {
    const std::optional<int64_t> k = json::AsInt64(*lp);
    CPFILL_CHECK_ARG(k.has_value() && *k >= 0 && *k <= kMaxLogprobs, "\"logprobs\" is ",
                     json::Show(*lp), ", must be an integer in [0, ", kMaxLogprobs, "]");
    r.logprobs = static_cast<int>(*k);
  }
  if (const nlohmann::json* s = json::Find(v, "session"); s != nullptr && !s->is_null()) {
    CPFILL_CHECK_ARG(s->is_string() && !s->get_ref<const std::string&>().empty() &&
                         s->get_ref<const std::string&>().size() <= 256,
                     "\"session\" must be a non-empty string of at most 256 bytes");
    CPFILL_CHECK_ARG(r.prompts.size() == 1, "\"session\" takes one prompt, got ", r.prompts.size());
    r.session = s->get<std::string>();
  }
  if (const nlohmann::json* kv = json::Find(v, "kv_transfer_params"); kv != nullptr) {
    CPFILL_CHECK_ARG(kv->is_object() || kv->is_null(),
                     "\"kv_transfer_params\" must be an object or null");
    r.kv_transfer_params = *kv;
  }
  return r;
}

nlohmann::ordered_json CompletionResponse(const CompletionRequest& request,
                                          const std::vector<runtime::EngineResult>& results,
                                          const std::string& id, int64_t created,
                                          const std::string& served_model,
                                          const runtime::Tokenizer* tokenizer) {
  nlohmann::ordered_json choices = nlohmann::ordered_json::array(), timing = choices;
  int64_t prompt_tokens = 0, cached = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const runtime::EngineResult& r = results[i];
    std::string text;
    if (tokenizer != nullptr) {
      const int32_t first = r.first_token;
      text = tokenizer->Decode(std::span<const int32_t>(&first, 1), /*skip_special=*/false)
                 .value_or("");
    }
    nlohmann::ordered_json c = {{"index", i},
                                {"text", std::move(text)},
                                {"token_ids", {r.first_token}},
                                {"logprobs", nullptr},
                                {"finish_reason", "length"}};
    if (request.logprobs > 0) c["logprobs"] = Logprobs(r, request.logprobs);
    choices.push_back(std::move(c));
    timing.push_back(Timing(r));
    prompt_tokens += r.prompt_tokens;
    cached += r.cached_tokens;
  }
  const int64_t completion = static_cast<int64_t>(results.size());
  nlohmann::ordered_json out = {
      {"id", id},
      {"object", "text_completion"},
      {"created", created},
      {"model", served_model},
      {"choices", std::move(choices)},
      {"usage",
       {{"prompt_tokens", prompt_tokens},
        {"completion_tokens", completion},
        {"total_tokens", prompt_tokens + completion},
        {"prompt_tokens_details", {{"cached_tokens", cached}}}}},
      {"cpfill", {{"session", request.session}, {"prompts", std::move(timing)}}}};
  if (request.kv_transfer_params) out["kv_transfer_params"] = *request.kv_transfer_params;
  return out;
}

std::string JsonText(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

HttpError ErrorResponse(const absl::Status& status) {
  HttpError e;
  std::string type = "server_error";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.status = 400, type = "invalid_request_error";
      break;
    case absl::StatusCode::kNotFound:
      e.status = 404, type = "not_found_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 413, type = "request_too_large";
      break;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kFailedPrecondition:
      e.status = 503, type = "service_unavailable";
      break;
    default:
      e.status = 500;
  }
  nlohmann::ordered_json body = {
      {"error", {{"message", std::string(status.message())}, {"type", type}, {"code", e.status}}}};
  e.body = JsonText(body);
  return e;
}

void Histogram::Observe(double x) {
  std::lock_guard lock(mu_);
  size_t b = 0;
  while (b < bounds_.size() && x > bounds_[b]) ++b;
  ++counts_[b];
  sum_ += x;
  ++count_;
}

std::string Histogram::Text(const std::string& name, const std::string& help) const {
  std::lock_guard lock(mu_);
  std::string out = absl::StrCat("# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  int64_t cumulative = 0;
  for (size_t b = 0; b < bounds_.size(); ++b) {
    cumulative += counts_[b];
    absl::StrAppend(&out, name, "_bucket{le=\"", bounds_[b], "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, name, "_bucket{le=\"+Inf\"} ", count_, "\n", name, "_sum ",
                  absl::StrFormat("%.9g", sum_), "\n", name, "_count ", count_, "\n");
  return out;
}

std::string MetricsText(const runtime::EngineStats& engine, const ServerCounters& server,
                        const Histogram& ttft, const Histogram& queue, const Histogram& batch) {
  std::string out;
  auto metric = [&](const std::string& name, const char* type, const std::string& help,
                    const std::vector<std::pair<std::string, double>>& samples) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, value] : samples) {
      absl::StrAppend(&out, name, labels, " ", absl::StrFormat("%.9g", value), "\n");
    }
  };
  metric("cpfill:requests_total", "counter",
         "Prompts answered by the engine, and HTTP requests refused.",
         {{"{status=\"ok\"}", double(engine.requests_ok)},
          {"{status=\"failed\"}", double(engine.requests_failed)},
          {"{status=\"http_4xx\"}", double(server.http_client_errors)},
          {"{status=\"http_5xx\"}", double(server.http_server_errors)}});
  metric("cpfill:prompt_tokens_total", "counter", "New prompt tokens prefilled.",
         {{"", double(engine.prompt_tokens)}});
  metric("cpfill:cached_tokens_total", "counter", "Prompt tokens whose KV a session reused.",
         {{"", double(engine.cached_tokens)}});
  metric("cpfill:batches_total", "counter", "Fused batches prefilled.",
         {{"", double(engine.batches)}});
  metric("cpfill:session_evictions_total", "counter", "Idle sessions evicted from a full KV cache.",
         {{"", double(engine.evictions)}});
  metric("cpfill:num_requests_waiting", "gauge", "Prompts queued on rank 0.",
         {{"", double(engine.waiting)}});
  metric("cpfill:num_requests_running", "gauge", "HTTP requests being answered.",
         {{"", double(server.running)}});
  metric("cpfill:num_sessions", "gauge", "Sessions held.", {{"", double(engine.sessions)}});
  metric("cpfill:kv_cache_usage_ratio", "gauge", "Used share of rank 0's KV cache blocks.",
         {{"", engine.kv_usage_ratio}});
  out += ttft.Text("cpfill:time_to_first_token_seconds", "Queue time plus prefill, per prompt.");
  out += queue.Text("cpfill:queue_time_seconds", "Time from arrival to the prompt's batch.");
  out += batch.Text("cpfill:batch_tokens", "New tokens of the batch each prompt ran in.");
  return out;
}

}  // namespace cpfill::launch
