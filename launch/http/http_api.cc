#include "launch/http/http_api.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <span>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_io.h"
#include "base/secure.h"
#include "base/status.h"
#include "base/string_view.h"
#include "parallel/selector.h"

namespace cpfill::launch {
namespace {

// The fields POST /v1/completions understands (OpenAI's, and vLLM's extensions top_k,
// stop_token_ids, ignore_eos). Fields whose feature cpfill lacks are accepted only at their
// neutral value; anything else is refused by name, so a client learns at once that cpfill did not
// do what it asked.
const std::set<std::string> kKnownFields = {"model",
                                            "stop_token_ids",
                                            "ignore_eos",
                                            "stream_options",
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
                                            "include_stop_str_in_output",
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

// A token as the logprobs name it: its text with a tokenizer, else "token_id:N" (vLLM's form
// for token ids), so top_logprobs keys follow OpenAI clients' expectations either way.
std::string TokenName(const runtime::Tokenizer* tokenizer, int32_t id) {
  if (tokenizer != nullptr) {
    const int32_t one[] = {id};
    if (absl::StatusOr<std::string> text = tokenizer->Decode(one, /*skip_special=*/false);
        text.ok()) {
      return *std::move(text);
    }
  }
  return absl::StrCat("token_id:", id);
}

// OpenAI's completion logprobs: each token's name, id (an extension), log-probability, top k by
// name (two ids with one text keep the likelier) and offset (in characters) into the choice's
// text, `text_offsets` (one per token: TokenTextStarts in characters).
nlohmann::ordered_json Logprobs(std::span<const runtime::SampledToken> tokens,
                                std::span<const size_t> text_offsets,
                                const runtime::Tokenizer* tokenizer) {
  nlohmann::ordered_json names = nlohmann::ordered_json::array(), ids = names, lps = names,
                         tops = names, offsets = names;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const runtime::SampledToken& t = tokens[i];
    names.push_back(TokenName(tokenizer, t.id));
    ids.push_back(t.id);
    lps.push_back(t.logprob);
    offsets.push_back(text_offsets[i]);
    nlohmann::ordered_json top = nlohmann::ordered_json::object();
    for (const auto& [id, lp] : t.top) {
      const std::string key = TokenName(tokenizer, id);
      if (!top.contains(key)) top[key] = lp;
    }
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(names)},
          {"token_ids", std::move(ids)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

nlohmann::ordered_json Timing(const runtime::EngineResult& r) {
  const runtime::StepTimings& t = r.timings;
  return {{"queue_ms", r.queue_s * 1e3},
          {"ttft_ms", (r.queue_s + r.prefill_s) * 1e3},
          {"prefill_ms", r.prefill_s * 1e3},
          {"batch_requests", r.batch_requests},
          {"cached_tokens", r.cached_tokens},
          {"phases_ms",
           {{"embedding", t.embed_s * 1e3},
            {"gemms", t.gemm_s * 1e3},
            {"attention_ring", t.attention_s * 1e3},
            {"all_reduce", t.allreduce_s * 1e3},
            {"kv_cache", t.kv_s * 1e3},
            {"lm_head", t.lm_head_s * 1e3},
            {"other", t.other_s * 1e3},
            {"host_plan", t.host_plan_s * 1e3},
            {"host_enqueue", t.host_enqueue_s * 1e3}}},
          {"algorithm", std::string(parallel::RingAlgorithmName(r.algorithm))},
          {"selector", r.selector},
          {"batch_rings", t.rings},
          {"recomputed_session", r.recomputed},
          {"decode_ms", r.decode_s * 1e3},
          {"decode_step_phases_ms", DecodePhasesMs(r.decode_timings)},
          {"tpot_ms", r.tpot_s() * 1e3},
          {"preemptions", r.preemptions}};
}

// `n` choices per prompt: a prompt's tokens count once (its first choice's), as OpenAI's do.
nlohmann::ordered_json Usage(const std::vector<runtime::EngineResult>& results, int n) {
  int64_t prompt = 0, cached = 0, completion = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const runtime::EngineResult& r = results[i];
    if (i % static_cast<size_t>(n) == 0) {
      prompt += r.prompt_tokens;
      cached += r.cached_tokens;
    }
    completion += static_cast<int64_t>(r.tokens.size());
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

// A field that must be a number in [lo, hi] when present and not null.
absl::StatusOr<std::optional<double>> NumberField(const nlohmann::json& v, const char* name,
                                                  double lo, double hi) {
  const nlohmann::json* f = json::Find(v, name);
  if (f == nullptr || f->is_null()) return std::optional<double>();
  CPFILL_CHECK_ARG(f->is_number() && f->get<double>() >= lo && f->get<double>() <= hi, "\"", name,
                   "\" is ", json::Show(*f), ", must be a number in [", lo, ", ", hi, "]");
  return std::optional<double>(f->get<double>());
}

absl::StatusOr<bool> BoolField(const nlohmann::json& v, const char* name) {
  const nlohmann::json* f = json::Find(v, name);
  if (f == nullptr || f->is_null()) return false;
  CPFILL_CHECK_ARG(f->is_boolean(), "\"", name, "\" is ", json::Show(*f),
                   ", must be true or false");
  return f->get<bool>();
}

// Fields cpfill has no feature for, accepted at their neutral values only.
absl::Status RefuseUnsupported(const nlohmann::json& v) {
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    CPFILL_ASSIGN_OR_RETURN(std::optional<double> x, NumberField(v, penalty, -2, 2));
    CPFILL_CHECK_ARG(x.value_or(0) == 0, "\"", penalty, "\" is not supported (only 0)");
  }
  CPFILL_ASSIGN_OR_RETURN(bool echo, BoolField(v, "echo"));
  CPFILL_CHECK_ARG(!echo, "\"echo\" is not supported");
  return absl::OkStatus();
}

// "stop": a string or a list of up to kMaxStopStrings non-empty strings (null or [] : none).
absl::Status ParseStop(const nlohmann::json& v, const runtime::Tokenizer* tokenizer,
                       CompletionRequest* r) {
  CPFILL_ASSIGN_OR_RETURN(r->include_stop_str_in_output,
                          BoolField(v, "include_stop_str_in_output"));
  const nlohmann::json* stop = json::Find(v, "stop");
  if (stop == nullptr || stop->is_null()) return absl::OkStatus();
  const nlohmann::json list = stop->is_string() ? nlohmann::json::array({*stop}) : *stop;
  CPFILL_CHECK_ARG(list.is_array() && list.size() <= kMaxStopStrings, "\"stop\" is ",
                   json::Show(*stop), ", must be a string or a list of at most ", kMaxStopStrings,
                   " strings");
  for (size_t i = 0; i < list.size(); ++i) {
    CPFILL_CHECK_ARG(list[i].is_string() && !list[i].get_ref<const std::string&>().empty() &&
                         list[i].get_ref<const std::string&>().size() <= kMaxStopBytes,
                     stop->is_string() ? "\"stop\"" : absl::StrCat("\"stop\"[", i, "]"), " is ",
                     json::Show(list[i]), ", must be a non-empty string of at most ", kMaxStopBytes,
                     " bytes");
    r->stop.push_back(list[i].get<std::string>());
  }
  CPFILL_CHECK_ARG(r->stop.empty() || tokenizer != nullptr,
                   "\"stop\" strings need the model's tokenizer, and this model has none (a "
                   "preset, or a checkpoint without tokenizer.json); use \"stop_token_ids\"");
  return absl::OkStatus();
}

// "n": choices per prompt, all of them within kMaxPromptsPerRequest.
absl::Status ParseN(const nlohmann::json& v, CompletionRequest* r) {
  const nlohmann::json* n = json::Find(v, "n");
  if (n == nullptr || n->is_null()) return absl::OkStatus();
  const std::optional<int64_t> x = json::AsInt64(*n);
  const int64_t most = kMaxPromptsPerRequest / static_cast<int64_t>(r->prompts.size());
  CPFILL_CHECK_ARG(x.has_value() && *x >= 1 && *x <= most, "\"n\" is ", json::Show(*n),
                   ", must be an integer in [1, ", most, "] (", kMaxPromptsPerRequest,
                   " choices at most over ", r->prompts.size(), " prompt(s))");
  r->n = static_cast<int>(*x);
  return absl::OkStatus();
}

// max_tokens, streaming, sampling, stop ids and logprobs.
absl::Status ParseGeneration(const nlohmann::json& v, CompletionRequest* r) {
  CPFILL_RETURN_IF_ERROR(RefuseUnsupported(v));
  CPFILL_RETURN_IF_ERROR(ParseN(v, r));
  if (const nlohmann::json* m = json::Find(v, "max_tokens"); m != nullptr && !m->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*m);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 1 && *n <= kMaxTokensPerRequest, "\"max_tokens\" is ",
                     json::Show(*m), ", must be an integer in [1, ", kMaxTokensPerRequest, "]");
    r->max_tokens = static_cast<int>(*n);
  }
  CPFILL_ASSIGN_OR_RETURN(r->stream, BoolField(v, "stream"));
  if (const nlohmann::json* o = json::Find(v, "stream_options"); o != nullptr && !o->is_null()) {
    CPFILL_CHECK_ARG(o->is_object(), "\"stream_options\" must be an object");
    CPFILL_ASSIGN_OR_RETURN(r->include_usage, BoolField(*o, "include_usage"));
  }
  CPFILL_ASSIGN_OR_RETURN(std::optional<double> t, NumberField(v, "temperature", 0, 100));
  CPFILL_ASSIGN_OR_RETURN(std::optional<double> p, NumberField(v, "top_p", 0, 1));
  CPFILL_ASSIGN_OR_RETURN(std::optional<double> k, NumberField(v, "top_k", -1, 1e9));
  r->sampling.temperature = t.value_or(1.0);
  r->sampling.top_p = p.value_or(1.0);
  CPFILL_CHECK_ARG(r->sampling.top_p > 0, "\"top_p\" is 0, must be in (0, 1]");
  CPFILL_CHECK_ARG(k.value_or(0) == std::floor(k.value_or(0)), "\"top_k\" must be an integer");
  r->sampling.top_k = std::max(0, static_cast<int>(k.value_or(0)));  // -1 or 0: every token
  if (const nlohmann::json* seed = json::Find(v, "seed"); seed != nullptr && !seed->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*seed);
    CPFILL_CHECK_ARG(n.has_value(), "\"seed\" is ", json::Show(*seed), ", must be an integer");
    r->seed = static_cast<uint64_t>(*n);
  }
  if (const nlohmann::json* ids = json::Find(v, "stop_token_ids");
      ids != nullptr && !ids->is_null()) {
    CPFILL_ASSIGN_OR_RETURN(r->stop_token_ids, TokenIds(*ids, "\"stop_token_ids\""));
  }
  CPFILL_ASSIGN_OR_RETURN(r->ignore_eos, BoolField(v, "ignore_eos"));
  if (const nlohmann::json* lp = json::Find(v, "logprobs"); lp != nullptr && !lp->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*lp);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 0 && *n <= kMaxLogprobs, "\"logprobs\" is ",
                     json::Show(*lp), ", must be an integer in [0, ", kMaxLogprobs, "]");
    r->logprobs = static_cast<int>(*n);
    r->sampling.logprobs = r->logprobs;
  }
  return absl::OkStatus();
}

}  // namespace

nlohmann::ordered_json DecodePhasesMs(const runtime::StepTimings& d) {
  return {{"model", d.total_s * 1e3},
          {"gemms", d.gemm_s * 1e3},
          {"attention_ring", d.attention_s * 1e3},
          {"all_reduce", d.allreduce_s * 1e3},
          {"kv_cache", d.kv_s * 1e3},
          {"lm_head", d.lm_head_s * 1e3},
          {"other", (d.other_s + d.embed_s) * 1e3},
          {"host_plan", d.host_plan_s * 1e3},
          {"host_enqueue", d.host_enqueue_s * 1e3}};
}

bool EndsSplit(std::string_view text) {
  constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
  return text.size() >= kReplacement.size() &&
         text.substr(text.size() - kReplacement.size()) == kReplacement;
}

size_t CodePoints(std::string_view utf8) {
  return std::count_if(utf8.begin(), utf8.end(),
                       [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

namespace {

// kv_transfer_params {"do_remote_decode": true}: the prefill of a disaggregated deployment (as
// vLLM's connectors ask it). One prompt, no session; max_tokens 1 unless the client says otherwise
// (then the engine refuses it by name).
absl::Status ParseKvTransfer(const nlohmann::json& body, CompletionRequest* r) {
  const nlohmann::json& kv = *r->kv_transfer_params;
  const nlohmann::json* remote = kv.is_object() ? json::Find(kv, "do_remote_decode") : nullptr;
  if (remote == nullptr || remote->is_null()) return absl::OkStatus();
  CPFILL_CHECK_ARG(remote->is_boolean(),
                   "\"kv_transfer_params.do_remote_decode\" must be a boolean");
  r->publish_kv = remote->get<bool>();
  if (!r->publish_kv) return absl::OkStatus();
  CPFILL_CHECK_ARG(r->prompts.size() == 1,
                   "\"kv_transfer_params.do_remote_decode\" takes one prompt, got ",
                   r->prompts.size());
  CPFILL_CHECK_ARG(r->n == 1, "\"kv_transfer_params.do_remote_decode\" takes \"n\" 1, got ", r->n);
  CPFILL_CHECK_ARG(!r->stream, "\"kv_transfer_params.do_remote_decode\" does not stream");
  if (const nlohmann::json* m = json::Find(body, "max_tokens"); m == nullptr || m->is_null()) {
    r->max_tokens = 1;
  }
  return absl::OkStatus();
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
  CPFILL_RETURN_IF_ERROR(ParseGeneration(v, &r));
  CPFILL_RETURN_IF_ERROR(ParseStop(v, tokenizer, &r));
  if (const nlohmann::json* s = json::Find(v, "session"); s != nullptr && !s->is_null()) {
    CPFILL_CHECK_ARG(s->is_string() && !s->get_ref<const std::string&>().empty() &&
                         s->get_ref<const std::string&>().size() <= 256,
                     "\"session\" must be a non-empty string of at most 256 bytes");
    CPFILL_CHECK_ARG(r.prompts.size() == 1 && r.n == 1,
                     "\"session\" takes one prompt and \"n\" 1, got ", r.prompts.size(),
                     " prompt(s) and \"n\" ", r.n);
    r.session = s->get<std::string>();
  }
  if (const nlohmann::json* kv = json::Find(v, "kv_transfer_params"); kv != nullptr) {
    CPFILL_CHECK_ARG(kv->is_object() || kv->is_null(),
                     "\"kv_transfer_params\" must be an object or null");
    r.kv_transfer_params = *kv;
    CPFILL_RETURN_IF_ERROR(ParseKvTransfer(v, &r));
  }
  return r;
}

size_t StopCut(const CompletionRequest& request, std::string_view text) {
  size_t cut = std::string::npos, first = std::string::npos;
  for (const std::string& stop : request.stop) {
    const size_t at = text.find(stop);
    if (at < first) {
      first = at;
      cut = request.include_stop_str_in_output ? at + stop.size() : at;
    }
  }
  return cut;
}

size_t StopPrefixHeld(const CompletionRequest& request, std::string_view text) {
  size_t held = 0;
  for (const std::string& stop : request.stop) {
    for (size_t k = std::min(stop.size() - 1, text.size()); k > held; --k) {
      if (text.substr(text.size() - k) == std::string_view(stop).substr(0, k)) {
        held = k;
        break;
      }
    }
  }
  return held;
}

namespace {

// The stop strings of one request, checked on the text of its newest tokens only: a stop
// string that the newest token completed ends within its last bytes, and every token decodes to
// at least one byte, so the last (longest stop + 2) tokens hold it. Earlier text held none, or
// generation would have stopped there.
std::function<bool(const std::vector<runtime::SampledToken>&)> StopWhen(
    const CompletionRequest& request, const runtime::Tokenizer* tokenizer) {
  size_t longest = 0;
  for (const std::string& stop : request.stop) longest = std::max(longest, stop.size());
  return [stops = request.stop, window = longest + 2,
          tokenizer](const std::vector<runtime::SampledToken>& tokens) {
    std::vector<int32_t> ids;
    for (size_t i = tokens.size() > window ? tokens.size() - window : 0; i < tokens.size(); ++i) {
      ids.push_back(tokens[i].id);
    }
    const std::string text = DecodeText(tokenizer, ids);
    return std::any_of(stops.begin(), stops.end(), [&](const std::string& stop) {
      return text.find(stop) != std::string::npos;
    });
  };
}

}  // namespace

std::vector<runtime::EngineRequest> EngineRequestsOf(const CompletionRequest& request,
                                                     uint64_t seed,
                                                     const runtime::Tokenizer* tokenizer) {
  std::vector<runtime::EngineRequest> out;
  for (size_t i = 0; i < request.choices(); ++i) {
    runtime::EngineRequest e{.tokens = request.prompts[i / static_cast<size_t>(request.n)],
                             .session = request.session,
                             .max_tokens = request.max_tokens,
                             .sampling = request.sampling,
                             .stop_ids = request.stop_token_ids,
                             .ignore_eos = request.ignore_eos,
                             .publish_kv = request.publish_kv};
    // Choices of one request draw differently, and repeat with the request's seed.
    e.sampling.seed = request.seed.value_or(seed) + i;
    if (!request.stop.empty() && tokenizer != nullptr) e.stop_when = StopWhen(request, tokenizer);
    out.push_back(std::move(e));
  }
  return out;
}

std::string DecodeText(const runtime::Tokenizer* tokenizer, const std::vector<int32_t>& ids) {
  if (tokenizer == nullptr || ids.empty()) return "";
  return tokenizer->Decode(ids, /*skip_special=*/false).value_or("");
}

size_t NextTokenStart(std::string_view text_before, size_t previous_start) {
  return EndsSplit(text_before) ? previous_start : text_before.size();
}

std::vector<size_t> TokenTextStarts(const runtime::Tokenizer* tokenizer,
                                    const std::vector<int32_t>& ids) {
  std::vector<size_t> starts;
  std::vector<int32_t> before;
  for (const int32_t id : ids) {
    starts.push_back(before.empty() ? 0
                                    : NextTokenStart(DecodeText(tokenizer, before), starts.back()));
    before.push_back(id);
  }
  return starts;
}

size_t TokensBeforeCut(const std::vector<size_t>& starts, size_t cut) {
  if (cut == std::string::npos) return starts.size();
  return std::lower_bound(starts.begin(), starts.end(), cut) - starts.begin();  // non-decreasing
}

namespace {

// A choice's text, cut at a stop string, and its logprobs when asked: of the tokens that text
// covers, each at its offset in characters.
void ChoiceText(const CompletionRequest& request, const std::vector<runtime::SampledToken>& tokens,
                const runtime::Tokenizer* tokenizer, nlohmann::ordered_json* choice) {
  std::vector<int32_t> ids;
  for (const runtime::SampledToken& t : tokens) ids.push_back(t.id);
  const std::string text = DecodeText(tokenizer, ids);
  const size_t cut = StopCut(request, text);
  (*choice)["text"] = cut == std::string::npos ? text : text.substr(0, cut);
  if (request.logprobs == 0) return;
  const std::vector<size_t> starts = TokenTextStarts(tokenizer, ids);
  const size_t covered = TokensBeforeCut(starts, cut);
  std::vector<size_t> offsets;
  for (size_t i = 0; i < covered; ++i) offsets.push_back(CodePoints(text.substr(0, starts[i])));
  (*choice)["logprobs"] =
      Logprobs(std::span(tokens).first(covered), std::span<const size_t>(offsets), tokenizer);
}

}  // namespace

nlohmann::ordered_json CompletionResponse(const CompletionRequest& request,
                                          const std::vector<runtime::EngineResult>& results,
                                          const std::string& id, int64_t created,
                                          const std::string& served_model,
                                          const runtime::Tokenizer* tokenizer) {
  nlohmann::ordered_json choices = nlohmann::ordered_json::array(), timing = choices;
  for (size_t i = 0; i < results.size(); ++i) {
    const runtime::EngineResult& r = results[i];
    nlohmann::ordered_json c = {{"index", i},
                                {"text", ""},
                                {"token_ids", r.token_ids()},
                                {"logprobs", nullptr},
                                {"finish_reason", r.finish_reason}};
    ChoiceText(request, r.tokens, tokenizer, &c);
    choices.push_back(std::move(c));
    timing.push_back(Timing(r));
  }
  nlohmann::ordered_json out = {
      {"id", id},
      {"object", "text_completion"},
      {"created", created},
      {"model", served_model},
      {"choices", std::move(choices)},
      {"usage", Usage(results, request.n)},
      {"cpfill", {{"session", request.session}, {"prompts", std::move(timing)}}}};
  if (request.kv_transfer_params) out["kv_transfer_params"] = *request.kv_transfer_params;
  // A hand-off: the handle replaces the request's parameters (runtime/handoff/kv_handle.h), with
  // the lease's length beside it.
  if (!results.empty() && results[0].kv_handle) {
    nlohmann::ordered_json handle = runtime::ToJson(*results[0].kv_handle);
    handle["lease_s"] = results[0].kv_lease_s;
    out["kv_transfer_params"] = std::move(handle);
  }
  return out;
}

nlohmann::ordered_json StreamChunk(const CompletionRequest& request, const std::string& id,
                                   int64_t created, const std::string& served_model,
                                   const StreamDelta& delta, const runtime::Tokenizer* tokenizer) {
  std::vector<int32_t> ids = delta.unsent_ids;
  std::vector<runtime::SampledToken> covered;
  if (delta.token) {
    ids.insert(ids.begin(), delta.token->id);
    covered.push_back(*delta.token);
  }
  nlohmann::ordered_json c = {{"index", delta.index},
                              {"text", delta.text},
                              {"token_ids", ids},
                              {"logprobs", nullptr},
                              {"finish_reason", nullptr}};
  if (request.logprobs > 0) {
    const size_t offset[] = {delta.text_offset};
    c["logprobs"] = Logprobs(covered, std::span(offset).first(covered.size()), tokenizer);
  }
  if (!delta.finish_reason.empty()) c["finish_reason"] = delta.finish_reason;
  return {{"id", id},
          {"object", "text_completion"},
          {"created", created},
          {"model", served_model},
          {"choices", {std::move(c)}}};
}

nlohmann::ordered_json UsageChunk(const std::string& id, int64_t created,
                                  const std::string& served_model,
                                  const std::vector<runtime::EngineResult>& results, int n) {
  return {{"id", id},
          {"object", "text_completion"},
          {"created", created},
          {"model", served_model},
          {"choices", nlohmann::ordered_json::array()},
          {"usage", Usage(results, n)}};
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
    case absl::StatusCode::kUnauthenticated:
      e.status = 401, type = "authentication_error";
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

const char* RefusalName(Refusal why) {
  switch (why) {
    case Refusal::kUnauthorized:
      return "unauthorized";
    case Refusal::kBadRequest:
      return "bad_request";
    case Refusal::kNotFound:
      return "not_found";
    case Refusal::kTimeout:
      return "timeout";
    case Refusal::kHeaderTooLarge:
      return "header_too_large";
    case Refusal::kBodyTooLarge:
      return "body_too_large";
    case Refusal::kTooLargeForKv:
      return "too_large_for_kv";
    case Refusal::kTooManyConnections:
      return "too_many_connections";
    case Refusal::kOverloaded:
      return "overloaded";
    case Refusal::kQueueFull:
      return "queue_full";
    case Refusal::kDraining:
      return "draining";
  }
  return "unknown";
}

HttpError RefusalResponse(Refusal why, const std::string& message) {
  HttpError e;
  std::string type = "service_unavailable";
  switch (why) {
    case Refusal::kUnauthorized:
      e.status = 401, type = "authentication_error";
      break;
    case Refusal::kBadRequest:
      e.status = 400, type = "invalid_request_error";
      break;
    case Refusal::kNotFound:
      e.status = 404, type = "not_found_error";
      break;
    case Refusal::kTimeout:
      e.status = 408, type = "timeout";
      break;
    case Refusal::kHeaderTooLarge:
      e.status = 431, type = "request_too_large";
      break;
    case Refusal::kBodyTooLarge:
    case Refusal::kTooLargeForKv:
      e.status = 413, type = "request_too_large";
      break;
    case Refusal::kTooManyConnections:
    case Refusal::kOverloaded:
    case Refusal::kQueueFull:
    case Refusal::kDraining:
      e.status = 503;
      break;
  }
  nlohmann::ordered_json body = {
      {"error", {{"message", message}, {"type", type}, {"code", e.status}}}};
  e.body = JsonText(body);
  return e;
}

std::optional<Refusal> RefusalOf(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return Refusal::kBadRequest;
    case absl::StatusCode::kUnauthenticated:
      return Refusal::kUnauthorized;
    case absl::StatusCode::kNotFound:
      return Refusal::kNotFound;
    case absl::StatusCode::kResourceExhausted:
      return Refusal::kTooLargeForKv;
    case absl::StatusCode::kUnavailable:
      return Refusal::kQueueFull;
    case absl::StatusCode::kFailedPrecondition:
      return Refusal::kDraining;
    default:
      return std::nullopt;
  }
}

absl::StatusOr<std::string> ApiKeyFrom(const std::string& flag_key, const std::string& key_file,
                                       const char* env_key) {
  CPFILL_CHECK_ARG(flag_key.empty() || key_file.empty(),
                   "--api-key and --api-key-file: give the key one way");
  std::string key, from;
  if (!flag_key.empty()) {
    key = flag_key, from = "--api-key";
  } else if (!key_file.empty()) {
    std::ifstream in(key_file, std::ios::binary);
    CPFILL_CHECK_ARG(in.good(), "--api-key-file ", key_file, ": cannot be read");
    std::stringstream text;
    text << in.rdbuf();
    key = text.str(), from = absl::StrCat("--api-key-file ", key_file);
    while (!key.empty() && absl::ascii_isspace(static_cast<unsigned char>(key.back()))) {
      key.pop_back();
    }
  } else if (env_key != nullptr) {
    key = env_key, from = "CPFILL_API_KEY";
  } else {
    return std::string();
  }
  CPFILL_CHECK_ARG(!key.empty(), from, ": the key is empty");
  // The message names where the key came from, never the key.
  for (const char c : key) {
    CPFILL_CHECK_ARG(c > ' ' && c < 0x7f, from,
                     ": the key holds a character other than visible ASCII (an Authorization "
                     "header cannot carry it)");
  }
  return key;
}

bool BearerKeyMatches(std::string_view authorization, std::string_view key) {
  constexpr std::string_view kScheme = "bearer ";
  if (authorization.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(Sv(authorization.substr(0, kScheme.size())), Sv(kScheme))) {
    return false;
  }
  std::string_view given = authorization.substr(kScheme.size());
  while (!given.empty() && given.front() == ' ') given.remove_prefix(1);
  while (!given.empty() && given.back() == ' ') given.remove_suffix(1);
  // Digests of equal length: the comparison's time depends on neither key's length or content.
  const Sha256Digest a = Sha256(given), b = Sha256(key);
  return ConstantTimeEqual(std::string_view(reinterpret_cast<const char*>(a.data()), a.size()),
                           std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
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

std::vector<double> LatencyBounds() {
  return {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

void ServingHistograms::Observe(const runtime::EngineResult& r) {
  ttft.Observe(r.queue_s + r.prefill_s);
  queue.Observe(r.queue_s);
  batch_tokens.Observe(static_cast<double>(r.timings.new_tokens));
  e2e.Observe(r.queue_s + r.prefill_s + r.decode_s);
  if (r.tokens.size() > 1) tpot.Observe(r.tpot_s());
}

namespace {

// Prometheus text: one metric's HELP, TYPE and samples ({labels, value}).
class MetricsWriter {
 public:
  void operator()(const std::string& name, const char* type, const std::string& help,
                  const std::vector<std::pair<std::string, double>>& samples) {
    absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, value] : samples) {
      absl::StrAppend(&out, name, labels, " ", absl::StrFormat("%.9g", value), "\n");
    }
  }
  std::string out;
};

// Requests, tokens, steps and the HTTP front's own counters.
void RequestMetrics(const runtime::EngineStats& engine, const ServerCounters& server,
                    MetricsWriter& metric) {
  metric("cpfill:requests_total", "counter",
         "Prompts answered by the engine, and HTTP requests refused.",
         {{"{status=\"ok\"}", double(engine.requests_ok)},
          {"{status=\"failed\"}", double(engine.requests_failed)},
          {"{status=\"http_4xx\"}", double(server.http_client_errors)},
          {"{status=\"http_5xx\"}", double(server.http_server_errors)}});
  metric("cpfill:prompt_tokens_total", "counter", "New prompt tokens prefilled.",
         {{"", double(engine.prompt_tokens)}});
  metric("cpfill:cached_tokens_total", "counter",
         "Prompt tokens whose KV a session or the prefix cache gave.",
         {{"", double(engine.cached_tokens)}});
  metric("cpfill:generation_tokens_total", "counter", "Tokens generated (first tokens included).",
         {{"", double(engine.generation_tokens)}});
  metric("cpfill:batches_total", "counter", "Fused batches prefilled.",
         {{"", double(engine.batches)}});
  metric("cpfill:decode_steps_total", "counter", "Decode steps (one token per running sequence).",
         {{"", double(engine.decode_steps)}});
  metric("cpfill:session_evictions_total", "counter", "Idle sessions evicted from a full KV cache.",
         {{"", double(engine.evictions)}});
  metric("cpfill:num_preemptions_total", "counter",
         "Generations preempted by a full KV cache (recomputed later).",
         {{"", double(engine.preemptions)}});
  metric("cpfill:num_requests_waiting", "gauge", "Prompts queued on rank 0.",
         {{"", double(engine.waiting)}});
  metric("cpfill:num_requests_running", "gauge", "Sequences generating.",
         {{"", double(engine.running)}});
  metric("cpfill:num_http_requests_open", "gauge", "HTTP requests being answered.",
         {{"", double(server.running)}});
  std::vector<std::pair<std::string, double>> refused;
  for (int i = 0; i < kRefusalKinds; ++i) {
    refused.push_back({absl::StrCat("{reason=\"", RefusalName(static_cast<Refusal>(i)), "\"}"),
                       double(server.refused[static_cast<size_t>(i)])});
  }
  metric("cpfill:http_refused_total", "counter",
         "HTTP requests and connections refused, by reason.", refused);
  metric("cpfill:http_connections_open", "gauge",
         "Client connections held: waiting for a request, answered, or closing.",
         {{"", double(server.connections_open)}});
  metric("cpfill:http_pending_body_bytes", "gauge",
         "Request body bytes held by requests being read or answered.",
         {{"", double(server.pending_bytes)}});
  metric("cpfill:http_memory_trims_total", "counter",
         "Times freed memory was given back to the system (malloc_trim) once the server went idle.",
         {{"", double(server.memory_trims)}});
}

// Sessions, the KV cache, the hand-off's leases, the prefix cache.
void KvMetrics(const runtime::EngineStats& engine, MetricsWriter& metric) {
  metric("cpfill:num_sessions", "gauge", "Sessions held.", {{"", double(engine.sessions)}});
  metric("cpfill:kv_cache_usage_ratio", "gauge", "Used share of rank 0's KV cache blocks.",
         {{"", engine.kv_usage_ratio}});
  metric("cpfill:kv_leases", "gauge", "KV hand-offs held for decode workers (leases).",
         {{"", double(engine.kv_leases)}});
  metric("cpfill:kv_leased_tokens", "gauge", "Prompt tokens whose KV the leases hold.",
         {{"", double(engine.kv_leased_tokens)}});
  metric("cpfill:kv_staging_usage_ratio", "gauge",
         "Used share of rank 0's KV hand-off staging pool (0 without staging).",
         {{"", engine.kv_staging_usage_ratio}});
  metric("cpfill:kv_leases_ended_total", "counter",
         "KV leases ended: released by a decode worker or DELETE, or expired.",
         {{"{reason=\"released\"}", double(engine.kv_leases_released)},
          {"{reason=\"expired\"}", double(engine.kv_leases_expired)}});
  metric("cpfill:prefix_cache_queries_total", "counter",
         "Prompts looked up in the prefix cache (those without KV of their own).",
         {{"", double(engine.prefix_queries)}});
  metric("cpfill:prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix.",
         {{"", double(engine.prefix_hits)}});
  metric("cpfill:prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens whose KV came from the prefix cache.",
         {{"", double(engine.prefix_hit_tokens)}});
  metric("cpfill:prefix_cache_entries", "gauge", "Prompts whose KV the prefix cache keeps.",
         {{"", double(engine.prefix_entries)}});
  metric("cpfill:prefix_cache_evictions_total", "counter",
         "Prefix cache entries dropped (least recently used first).",
         {{"", double(engine.prefix_evictions)}});
  metric("cpfill:prefix_batched_key_rows_total", "counter",
         "KV rows prefill batches and decode steps read once for several sequences instead of "
         "once each, over layers and ring steps (rank 0).",
         {{"", double(engine.prefix_batched_key_rows)}});
  metric("cpfill:kv_cache_shared_blocks", "gauge",
         "Rank 0's KV blocks held by more than one sequence (shared prefixes).",
         {{"", double(engine.kv_blocks_shared)}});
}

}  // namespace

std::string MetricsText(const runtime::EngineStats& engine, const ServerCounters& server,
                        const ServingHistograms& h) {
  MetricsWriter metric;
  RequestMetrics(engine, server, metric);
  KvMetrics(engine, metric);
  std::string& out = metric.out;
  out += h.ttft.Text("cpfill:time_to_first_token_seconds", "Queue time plus prefill, per prompt.");
  out += h.queue.Text("cpfill:queue_time_seconds", "Time from arrival to the prompt's batch.");
  out += h.batch_tokens.Text("cpfill:batch_tokens", "New tokens of the batch each prompt ran in.");
  out += h.tpot.Text("cpfill:time_per_output_token_seconds",
                     "Decode time per token after the first, per prompt.");
  out += h.e2e.Text("cpfill:e2e_request_latency_seconds", "Arrival to the last token, per prompt.");
  return out;
}

}  // namespace cpfill::launch
