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
#include "launch/http/request_body.h"
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
                                            "frequency_penalty",
                                            "repetition_penalty",
                                            "best_of",
                                            "logit_bias",
                                            "suffix",
                                            "skip_special_tokens",
                                            "spaces_between_special_tokens",
                                            "min_tokens",
                                            "sparq"};

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

absl::StatusOr<std::vector<int32_t>> TextIds(const std::string& text, const std::string& where,
                                             const runtime::Tokenizer* tokenizer) {
  CPFILL_CHECK_ARG(tokenizer != nullptr, where,
                   ": text needs the model's tokenizer, and no tokenizer is loaded (a preset, a "
                   "checkpoint without tokenizer.json, or one the server's log says it cannot "
                   "read); send token ids");
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(text, /*add_bos=*/true);
  CPFILL_CHECK_ARG(ids.ok(), where, ": ", ids.status().message());
  return ids;
}

// The prompts as the SAX parse left them (request_body.h): texts encoded, id lists taken as
// they are; a text prompt's text is kept for echo.
absl::Status ParsePrompts(RequestBody& body, const runtime::Tokenizer* tokenizer,
                          CompletionRequest* r) {
  CPFILL_CHECK_ARG(body.has_prompt, "\"prompt\" is required");
  for (size_t i = 0; i < body.prompts.size(); ++i) {
    PromptItem& p = body.prompts[i];
    const std::string where = body.batch ? absl::StrCat("\"prompt\"[", i, "]") : "\"prompt\"";
    if (p.text) {
      CPFILL_ASSIGN_OR_RETURN(r->prompts.emplace_back(), TextIds(*p.text, where, tokenizer));
    } else {
      r->prompts.push_back(std::move(p.ids));
    }
    r->prompt_texts.push_back(std::move(p.text));
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
          {"preemptions", r.preemptions},
          {"sparq_decode_steps", r.sparq_decode_steps}};
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

// Fields cpfill has no feature for, accepted at their neutral values only (client libraries
// send them by default): penalties 0 (repetition_penalty 1), best_of null or n, logit_bias null
// or {}, suffix null or "".
absl::Status RefuseUnsupported(const nlohmann::json& v, int n) {
  for (const char* penalty : {"presence_penalty", "frequency_penalty"}) {
    CPFILL_ASSIGN_OR_RETURN(std::optional<double> x, NumberField(v, penalty, -2, 2));
    CPFILL_CHECK_ARG(x.value_or(0) == 0, "\"", penalty, "\" is not supported (only 0)");
  }
  CPFILL_ASSIGN_OR_RETURN(std::optional<double> rep, NumberField(v, "repetition_penalty", 0, 100));
  CPFILL_CHECK_ARG(rep.value_or(1) == 1, "\"repetition_penalty\" is not supported (only 1)");
  if (const nlohmann::json* b = json::Find(v, "best_of"); b != nullptr && !b->is_null()) {
    CPFILL_CHECK_ARG(json::AsInt64(*b) == n, "\"best_of\" is ", json::Show(*b),
                     ": only \"n\" (", n, ") is supported");
  }
  if (const nlohmann::json* bias = json::Find(v, "logit_bias"); bias != nullptr) {
    CPFILL_CHECK_ARG(bias->is_null() || (bias->is_object() && bias->empty()),
                     "\"logit_bias\" is not supported (only null or {})");
  }
  if (const nlohmann::json* suffix = json::Find(v, "suffix"); suffix != nullptr) {
    CPFILL_CHECK_ARG(suffix->is_null() || (suffix->is_string() && suffix->empty()),
                     "\"suffix\" is not supported (only null or \"\")");
  }
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

// max_tokens (0 only with echo: the prompt's logprobs alone), min_tokens, echo and how text is
// decoded.
absl::Status ParseLengths(const nlohmann::json& v, CompletionRequest* r) {
  CPFILL_ASSIGN_OR_RETURN(r->echo, BoolField(v, "echo"));
  if (const nlohmann::json* m = json::Find(v, "max_tokens"); m != nullptr && !m->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*m);
    const int least = r->echo ? 0 : 1;
    CPFILL_CHECK_ARG(n.has_value() && *n >= least && *n <= kMaxTokensPerRequest,
                     "\"max_tokens\" is ", json::Show(*m), ", must be an integer in [", least,
                     ", ", kMaxTokensPerRequest, "]", r->echo ? "" : " (0 only with \"echo\")");
    r->max_tokens = static_cast<int>(*n);
  }
  if (const nlohmann::json* m = json::Find(v, "min_tokens"); m != nullptr && !m->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*m);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 0 && *n <= r->max_tokens, "\"min_tokens\" is ",
                     json::Show(*m), ", must be an integer in [0, max_tokens ", r->max_tokens,
                     "]");
    r->min_tokens = static_cast<int>(*n);
  }
  if (const nlohmann::json* s = json::Find(v, "skip_special_tokens"); s != nullptr) {
    CPFILL_ASSIGN_OR_RETURN(r->skip_special_tokens, BoolField(v, "skip_special_tokens"));
    if (s->is_null()) r->skip_special_tokens = true;
  }
  if (const nlohmann::json* s = json::Find(v, "spaces_between_special_tokens"); s != nullptr) {
    CPFILL_ASSIGN_OR_RETURN(r->spaces_between_special_tokens,
                            BoolField(v, "spaces_between_special_tokens"));
    if (s->is_null()) r->spaces_between_special_tokens = true;
  }
  return absl::OkStatus();
}

// "sparq": {"r": int, "k": int, "l": int (optional, 0)}: r >= 1 (<= head_dim is checked where
// the model is known), k >= 1, l >= 0; every field refused by name.
absl::Status ParseSparq(const nlohmann::json& v, CompletionRequest* r) {
  const nlohmann::json* s = json::Find(v, "sparq");
  if (s == nullptr || s->is_null()) return absl::OkStatus();
  CPFILL_CHECK_ARG(s->is_object(), "\"sparq\" must be an object {\"r\", \"k\", \"l\"}");
  attention::sparq::SparqConfig c;
  const auto field = [&](const char* name, bool required, int least, int* out) -> absl::Status {
    const nlohmann::json* f = json::Find(*s, name);
    if (f == nullptr || f->is_null()) {
      CPFILL_CHECK_ARG(!required, "\"sparq.", name, "\" is required");
      *out = 0;
      return absl::OkStatus();
    }
    const std::optional<int64_t> n = json::AsInt64(*f);
    CPFILL_CHECK_ARG(n.has_value() && *n >= least && *n <= (1 << 30), "\"sparq.", name, "\" is ",
                     json::Show(*f), ", must be an integer >= ", least);
    *out = static_cast<int>(*n);
    return absl::OkStatus();
  };
  for (const auto& [key, value] : s->items()) {
    CPFILL_CHECK_ARG(key == "r" || key == "k" || key == "l", "unknown field \"sparq.", key, "\"");
  }
  CPFILL_RETURN_IF_ERROR(field("r", true, 1, &c.r));
  CPFILL_RETURN_IF_ERROR(field("k", true, 1, &c.k));
  CPFILL_RETURN_IF_ERROR(field("l", false, 0, &c.local_window));
  r->sparq = c;
  return absl::OkStatus();
}

// max_tokens, streaming, sampling, stop ids and logprobs.
absl::Status ParseGeneration(const nlohmann::json& v, CompletionRequest* r) {
  CPFILL_RETURN_IF_ERROR(ParseN(v, r));
  CPFILL_RETURN_IF_ERROR(RefuseUnsupported(v, r->n));
  CPFILL_RETURN_IF_ERROR(ParseLengths(v, r));
  CPFILL_ASSIGN_OR_RETURN(r->stream, BoolField(v, "stream"));
  if (const nlohmann::json* o = json::Find(v, "stream_options"); o != nullptr && !o->is_null()) {
    CPFILL_CHECK_ARG(o->is_object(), "\"stream_options\" must be an object");
    CPFILL_ASSIGN_OR_RETURN(r->include_usage, BoolField(*o, "include_usage"));
    CPFILL_ASSIGN_OR_RETURN(r->continuous_usage_stats, BoolField(*o, "continuous_usage_stats"));
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
                                                         const runtime::Tokenizer* tokenizer,
                                                         int64_t max_prompt_tokens) {
  CPFILL_ASSIGN_OR_RETURN(
      RequestBody parsed,
      ParseRequestBody(body, "prompt", max_prompt_tokens, kMaxPromptsPerRequest));
  const nlohmann::json& v = parsed.fields;
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(kKnownFields.count(key), "unknown field \"", key, "\"");
  }
  CompletionRequest r;
  if (const nlohmann::json* model = json::Find(v, "model"); model != nullptr) {
    CPFILL_CHECK_ARG(model->is_string() && model->get_ref<const std::string&>() == served_model,
                     "\"model\" is ", json::Show(*model), "; this server serves \"", served_model,
                     "\"");
  }
  CPFILL_RETURN_IF_ERROR(ParsePrompts(parsed, tokenizer, &r));
  CPFILL_RETURN_IF_ERROR(ParseGeneration(v, &r));
  CPFILL_RETURN_IF_ERROR(ParseSparq(v, &r));
  CPFILL_RETURN_IF_ERROR(ParseStop(v, tokenizer, &r));
  if (const nlohmann::json* s = json::Find(v, "session"); s != nullptr && !s->is_null()) {
    CPFILL_CHECK_ARG(s->is_string() && !s->get_ref<const std::string&>().empty() &&
                         s->get_ref<const std::string&>().size() <= 256,
                     "\"session\" must be a non-empty string of at most 256 bytes");
    CPFILL_CHECK_ARG(r.prompts.size() == 1 && r.n == 1,
                     "\"session\" takes one prompt and \"n\" 1, got ", r.prompts.size(),
                     " prompt(s) and \"n\" ", r.n);
    r.session = s->get<std::string>();
    // A session's earlier turns are cached: the logits before this turn's first token are gone.
    CPFILL_CHECK_ARG(!(r.echo && r.logprobs > 0), "\"echo\" with \"logprobs\" takes no \"session\"");
  }
  // Each choice would score the whole prompt again and hold its own copy (a 128K prompt at
  // logprobs 20 is ~47 MB a choice on rank 0): the prompt's logprobs are the same for every
  // choice, so one request asks for them once.
  CPFILL_CHECK_ARG(!(r.echo && r.logprobs > 0 && r.n > 1),
                   "\"echo\" with \"logprobs\" takes \"n\" 1 (the prompt's logprobs are the same "
                   "for every choice: ask for them once, and for more choices without echo)");
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
  return [stops = request.stop, window = longest + 2, skip = request.skip_special_tokens,
          tokenizer](const std::vector<runtime::SampledToken>& tokens) {
    std::vector<int32_t> ids;
    for (size_t i = tokens.size() > window ? tokens.size() - window : 0; i < tokens.size(); ++i) {
      ids.push_back(tokens[i].id);
    }
    const std::string text = DecodeText(tokenizer, ids, skip);
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
                             // max_tokens 0 (echo): the prefill's token is dropped from the answer
                             .max_tokens = std::max(1, request.max_tokens),
                             .sampling = request.sampling,
                             .stop_ids = request.stop_token_ids,
                             .ignore_eos = request.ignore_eos,
                             .publish_kv = request.publish_kv};
    e.min_tokens = request.min_tokens;
    e.sparq = request.sparq;
    if (request.echo && request.logprobs > 0) e.prompt_logprobs = request.logprobs;
    // Choices of one request draw differently, and repeat with the request's seed.
    e.sampling.seed = request.seed.value_or(seed) + i;
    if (!request.stop.empty() && tokenizer != nullptr) e.stop_when = StopWhen(request, tokenizer);
    out.push_back(std::move(e));
  }
  return out;
}

std::string DecodeText(const runtime::Tokenizer* tokenizer, std::span<const int32_t> ids,
                       bool skip_special) {
  if (tokenizer == nullptr || ids.empty()) return "";
  return tokenizer->Decode(ids, skip_special).value_or("");
}

size_t NextTokenStart(std::string_view text_before, size_t previous_start) {
  return EndsSplit(text_before) ? previous_start : text_before.size();
}

// Linear in the tokens (a prompt's logprobs may cover 100K of them): the text decoded so far is
// split at the last token after which it ended in a whole character; the text of the tokens
// before that point is fixed (byte-level decoding concatenates bytes, and a character boundary
// stays one), so only the tail after it is decoded again.
std::vector<size_t> TokenTextStarts(const runtime::Tokenizer* tokenizer,
                                    std::span<const int32_t> ids, bool skip_special) {
  std::vector<size_t> starts;
  size_t fixed_bytes = 0, fixed_tokens = 0, before_bytes = 0;
  bool before_split = false;
  for (size_t i = 0; i < ids.size(); ++i) {
    starts.push_back(i == 0 ? 0 : before_split ? starts.back() : before_bytes);
    const std::string tail =
        DecodeText(tokenizer, ids.subspan(fixed_tokens, i + 1 - fixed_tokens), skip_special);
    before_bytes = fixed_bytes + tail.size();
    before_split = EndsSplit(tail);
    if (!before_split) fixed_bytes = before_bytes, fixed_tokens = i + 1;
  }
  return starts;
}

std::vector<size_t> CodePointOffsets(std::string_view text, const std::vector<size_t>& starts,
                                     size_t count, size_t base) {
  std::vector<size_t> out;
  size_t at = 0, points = base;
  for (size_t i = 0; i < count; ++i) {
    points += CodePoints(text.substr(at, starts[i] - at));  // starts never decrease
    at = starts[i];
    out.push_back(points);
  }
  return out;
}

size_t TokensBeforeCut(const std::vector<size_t>& starts, size_t cut) {
  if (cut == std::string::npos) return starts.size();
  return std::lower_bound(starts.begin(), starts.end(), cut) - starts.begin();  // non-decreasing
}

namespace {

// The prompt's part of an echoed choice's logprobs: every prompt token at its offset in the
// echoed text; the first has no logprob (nothing comes before it), the others the model's
// (`scored`: of tokens 1..n-1) and its top k, which names the prompt's token too, as vLLM's do.
nlohmann::ordered_json PromptLogprobs(const CompletionRequest& request,
                                      const std::vector<int32_t>& ids,
                                      const std::vector<runtime::SampledToken>& scored,
                                      const runtime::Tokenizer* tokenizer) {
  const std::string text = DecodeText(tokenizer, ids, request.skip_special_tokens);
  const std::vector<size_t> offsets = CodePointOffsets(
      text, TokenTextStarts(tokenizer, ids, request.skip_special_tokens), ids.size(), 0);
  std::vector<runtime::SampledToken> tokens(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    tokens[i].id = ids[i];
    if (i >= 1 && i - 1 < scored.size()) tokens[i] = scored[i - 1];
  }
  nlohmann::ordered_json lp = Logprobs(tokens, offsets, tokenizer);
  for (size_t i = 1; i < tokens.size(); ++i) {
    const std::string name = TokenName(tokenizer, tokens[i].id);
    if (!lp["top_logprobs"][i].contains(name)) lp["top_logprobs"][i][name] = tokens[i].logprob;
  }
  if (!ids.empty()) lp["token_logprobs"][0] = nullptr, lp["top_logprobs"][0] = nullptr;
  return lp;
}

// The text echo sends for prompt `prompt`: the text sent, else its ids decoded.
std::string EchoedText(const CompletionRequest& request, size_t prompt,
                       const runtime::Tokenizer* tokenizer) {
  const bool sent_text =
      prompt < request.prompt_texts.size() && request.prompt_texts[prompt].has_value();
  return sent_text ? *request.prompt_texts[prompt]
                   : DecodeText(tokenizer, request.prompts[prompt], request.skip_special_tokens);
}

// A choice's text (its prompt's first with echo), cut at a stop string, and its logprobs when
// asked: of the tokens that text covers (the prompt's first with echo), each at its offset in
// characters.
void ChoiceText(const CompletionRequest& request, size_t prompt, const runtime::EngineResult& r,
                const runtime::Tokenizer* tokenizer, nlohmann::ordered_json* choice) {
  std::vector<int32_t> ids;
  for (const runtime::SampledToken& t : r.tokens) ids.push_back(t.id);
  const bool skip = request.skip_special_tokens;
  const std::string text = DecodeText(tokenizer, ids, skip);
  const size_t cut = StopCut(request, text);
  const std::string echoed = request.echo ? EchoedText(request, prompt, tokenizer) : "";
  (*choice)["text"] = echoed + (cut == std::string::npos ? text : text.substr(0, cut));
  if (request.logprobs == 0) return;
  const std::vector<size_t> starts = TokenTextStarts(tokenizer, ids, skip);
  const size_t covered = TokensBeforeCut(starts, cut);
  const std::vector<size_t> offsets = CodePointOffsets(text, starts, covered, CodePoints(echoed));
  nlohmann::ordered_json lp = Logprobs(std::span(r.tokens).first(covered), offsets, tokenizer);
  if (request.echo) {
    nlohmann::ordered_json both =
        PromptLogprobs(request, request.prompts[prompt], r.prompt_logprobs, tokenizer);
    for (auto& [key, list] : both.items()) {
      for (auto& v : lp[key]) list.push_back(std::move(v));
    }
    lp = std::move(both);
  }
  (*choice)["logprobs"] = std::move(lp);
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
    ChoiceText(request, i / static_cast<size_t>(request.n), r, tokenizer, &c);
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
  nlohmann::ordered_json chunk = {{"id", id},
                                  {"object", "text_completion"},
                                  {"created", created},
                                  {"model", served_model},
                                  {"choices", {std::move(c)}}};
  if (delta.completion_tokens >= 0) {
    chunk["usage"] = {{"prompt_tokens", delta.prompt_tokens},
                      {"completion_tokens", delta.completion_tokens},
                      {"total_tokens", delta.prompt_tokens + delta.completion_tokens}};
  }
  return chunk;
}

nlohmann::ordered_json EchoChunk(const CompletionRequest& request, size_t prompt, int index,
                                 const std::string& id, int64_t created,
                                 const std::string& served_model,
                                 const std::vector<runtime::SampledToken>& scored,
                                 const std::string& finish_reason,
                                 const runtime::Tokenizer* tokenizer) {
  nlohmann::ordered_json c = {{"index", index},
                              {"text", EchoedText(request, prompt, tokenizer)},
                              {"token_ids", nlohmann::ordered_json::array()},
                              {"logprobs", nullptr},
                              {"finish_reason", nullptr}};
  if (request.logprobs > 0) {
    c["logprobs"] = PromptLogprobs(request, request.prompts[prompt], scored, tokenizer);
  }
  if (!finish_reason.empty()) c["finish_reason"] = finish_reason;
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

namespace {

// The "model" of a body, when given, must be the served one.
absl::Status CheckModel(const nlohmann::json& v, const std::string& served_model) {
  if (const nlohmann::json* model = json::Find(v, "model"); model != nullptr && !model->is_null()) {
    CPFILL_CHECK_ARG(model->is_string() && model->get_ref<const std::string&>() == served_model,
                     "\"model\" is ", json::Show(*model), "; this server serves \"", served_model,
                     "\"");
  }
  return absl::OkStatus();
}

absl::Status NeedTokenizer(const runtime::Tokenizer* tokenizer) {
  if (tokenizer != nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(
      "this model has no tokenizer (a preset, or a checkpoint without tokenizer.json)");
}

}  // namespace

absl::StatusOr<nlohmann::ordered_json> Tokenize(std::string_view body,
                                                const std::string& served_model,
                                                const runtime::Tokenizer* tokenizer,
                                                int64_t max_model_len) {
  CPFILL_ASSIGN_OR_RETURN(RequestBody parsed, ParseRequestBody(body, "", 0, 0));
  const nlohmann::json& v = parsed.fields;
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(key == "model" || key == "prompt" || key == "add_special_tokens" ||
                         key == "messages" || key == "return_token_strs",
                     "unknown field \"", key, "\"");
  }
  CPFILL_RETURN_IF_ERROR(CheckModel(v, served_model));
  CPFILL_CHECK_ARG(!v.contains("messages"),
                   "\"messages\" needs a chat template, and this server renders none: send "
                   "\"prompt\"");
  const nlohmann::json* prompt = json::Find(v, "prompt");
  CPFILL_CHECK_ARG(prompt != nullptr && prompt->is_string(), "\"prompt\" must be a text");
  CPFILL_ASSIGN_OR_RETURN(bool plain, BoolField(v, "add_special_tokens"));
  const bool add = !v.contains("add_special_tokens") || v["add_special_tokens"].is_null() || plain;
  CPFILL_RETURN_IF_ERROR(NeedTokenizer(tokenizer));
  absl::StatusOr<std::vector<int32_t>> ids =
      tokenizer->Encode(prompt->get_ref<const std::string&>(), add);
  CPFILL_CHECK_ARG(ids.ok(), "\"prompt\": ", ids.status().message());
  nlohmann::ordered_json out = {
      {"count", ids->size()}, {"max_model_len", max_model_len}, {"tokens", *ids}};
  CPFILL_ASSIGN_OR_RETURN(bool strs, BoolField(v, "return_token_strs"));
  if (strs) {
    nlohmann::ordered_json names = nlohmann::ordered_json::array();
    for (const int32_t id : *ids) names.push_back(TokenName(tokenizer, id));
    out["token_strs"] = std::move(names);
  }
  return out;
}

absl::StatusOr<nlohmann::ordered_json> Detokenize(std::string_view body,
                                                  const std::string& served_model,
                                                  const runtime::Tokenizer* tokenizer) {
  CPFILL_ASSIGN_OR_RETURN(RequestBody parsed,
                          ParseRequestBody(body, "tokens", kMaxTokensPerRequest, 1));
  const nlohmann::json& v = parsed.fields;
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(key == "model", "unknown field \"", key, "\"");
  }
  CPFILL_RETURN_IF_ERROR(CheckModel(v, served_model));
  CPFILL_CHECK_ARG(parsed.has_prompt && parsed.prompts.size() == 1 && !parsed.batch &&
                       !parsed.prompts[0].text,
                   "\"tokens\" must be a non-empty list of token ids");
  CPFILL_RETURN_IF_ERROR(NeedTokenizer(tokenizer));
  absl::StatusOr<std::string> text = tokenizer->Decode(parsed.prompts[0].ids, false);
  CPFILL_CHECK_ARG(text.ok(), "\"tokens\": ", text.status().message());
  return nlohmann::ordered_json{{"prompt", *text}};
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
  metric("cpfill:sparq_decode_steps_total", "counter",
         "Decode steps where some sequence attended with SparQ.",
         {{"", double(engine.sparq_decode_steps)}});
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
