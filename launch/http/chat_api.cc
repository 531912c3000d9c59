#include "launch/http/chat_api.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/json_io.h"
#include "base/status.h"
#include "launch/http/request_body.h"

namespace cpfill::launch {
namespace {

// Fields passed to the completion as they are (http_api.cc checks them there).
const std::set<std::string> kCompletionFields = {"model",
                                                 "temperature",
                                                 "top_p",
                                                 "top_k",
                                                 "n",
                                                 "seed",
                                                 "stop",
                                                 "stop_token_ids",
                                                 "include_stop_str_in_output",
                                                 "ignore_eos",
                                                 "min_tokens",
                                                 "stream",
                                                 "stream_options",
                                                 "user",
                                                 "skip_special_tokens",
                                                 "spaces_between_special_tokens",
                                                 "presence_penalty",
                                                 "frequency_penalty",
                                                 "repetition_penalty",
                                                 "best_of",
                                                 "logit_bias"};
// The chat's own fields, read here.
const std::set<std::string> kChatFields = {"messages",   "add_generation_prompt",
                                           "max_tokens", "max_completion_tokens",
                                           "logprobs",   "top_logprobs"};

// A message's content as text: a string, null (""), or a list of {"type": "text"} parts.
absl::StatusOr<std::string> ContentText(const nlohmann::json& content, const std::string& where) {
  if (content.is_null()) return std::string();
  if (content.is_string()) return content.get<std::string>();
  CPFILL_CHECK_ARG(content.is_array(), where, " must be a text, null or a list of text parts");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const nlohmann::json& part = content[i];
    const nlohmann::json* type = part.is_object() ? json::Find(part, "type") : nullptr;
    const nlohmann::json* t = part.is_object() ? json::Find(part, "text") : nullptr;
    CPFILL_CHECK_ARG(type != nullptr && *type == "text" && t != nullptr && t->is_string(), where,
                     "[", i, "] is ", json::Show(part),
                     ": only {\"type\": \"text\", \"text\": \"...\"} parts are supported");
    absl::StrAppend(&text, i > 0 ? "\n" : "", t->get_ref<const std::string&>());
  }
  return text;
}

absl::StatusOr<nlohmann::json> Message(const nlohmann::json& m, size_t i) {
  const std::string where = absl::StrCat("\"messages\"[", i, "]");
  CPFILL_CHECK_ARG(m.is_object(), where, " must be an object with \"role\" and \"content\"");
  for (const auto& [key, value] : m.items()) {
    CPFILL_CHECK_ARG(key == "role" || key == "content" || key == "name", where,
                     ": unsupported field \"", key, "\" (role, content and name are)");
  }
  const nlohmann::json* role = json::Find(m, "role");
  CPFILL_CHECK_ARG(
      role != nullptr && role->is_string() && !role->get_ref<const std::string&>().empty(), where,
      ".role must be a non-empty text");
  const nlohmann::json* content = json::Find(m, "content");
  CPFILL_CHECK_ARG(content != nullptr, where, ".content is required");
  CPFILL_ASSIGN_OR_RETURN(std::string text, ContentText(*content, where + ".content"));
  nlohmann::json out = {{"role", *role}, {"content", std::move(text)}};
  if (const nlohmann::json* name = json::Find(m, "name"); name != nullptr && !name->is_null()) {
    CPFILL_CHECK_ARG(name->is_string(), where, ".name must be a text");
    out["name"] = *name;
  }
  return out;
}

// The completion's max_tokens: max_completion_tokens (OpenAI's newer name) before max_tokens,
// else every position left after the prompt.
absl::StatusOr<int64_t> MaxTokens(const nlohmann::json& v, size_t prompt_tokens,
                                  int64_t max_model_len) {
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    const nlohmann::json* m = json::Find(v, name);
    if (m == nullptr || m->is_null()) continue;
    const std::optional<int64_t> n = json::AsInt64(*m);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 1 && *n <= kMaxTokensPerRequest, "\"", name, "\" is ",
                     json::Show(*m), ", must be an integer in [1, ", kMaxTokensPerRequest, "]");
    return *n;
  }
  return std::max<int64_t>(1, max_model_len - static_cast<int64_t>(prompt_tokens));
}

// logprobs (a bool here) and top_logprobs (0-20, only with logprobs).
absl::Status ParseChatLogprobs(const nlohmann::json& v, ChatRequest* chat) {
  if (const nlohmann::json* lp = json::Find(v, "logprobs"); lp != nullptr && !lp->is_null()) {
    CPFILL_CHECK_ARG(lp->is_boolean(), "\"logprobs\" is ", json::Show(*lp),
                     ", must be a boolean (top_logprobs says how many alternatives)");
    chat->logprobs = lp->get<bool>();
  }
  if (const nlohmann::json* top = json::Find(v, "top_logprobs");
      top != nullptr && !top->is_null()) {
    const std::optional<int64_t> n = json::AsInt64(*top);
    CPFILL_CHECK_ARG(n.has_value() && *n >= 0 && *n <= kMaxLogprobs, "\"top_logprobs\" is ",
                     json::Show(*top), ", must be an integer in [0, ", kMaxLogprobs, "]");
    CPFILL_CHECK_ARG(chat->logprobs || *n == 0, "\"top_logprobs\" needs \"logprobs\": true");
    chat->top_logprobs = static_cast<int>(*n);
  }
  return absl::OkStatus();
}

// Chat's logprobs from a completion's: one entry per token, its top alternatives as a list.
nlohmann::ordered_json ChatLogprobs(const nlohmann::ordered_json& lp, int top) {
  const auto bytes = [](const std::string& s) {
    std::vector<int> b;
    for (const char c : s) b.push_back(static_cast<unsigned char>(c));
    return b;
  };
  nlohmann::ordered_json content = nlohmann::ordered_json::array();
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    const std::string token = lp["tokens"][i].get<std::string>();
    nlohmann::ordered_json alternatives = nlohmann::ordered_json::array();
    if (lp["top_logprobs"][i].is_object()) {
      for (const auto& [name, value] : lp["top_logprobs"][i].items()) {
        if (static_cast<int>(alternatives.size()) >= top) break;
        alternatives.push_back({{"token", name}, {"logprob", value}, {"bytes", bytes(name)}});
      }
    }
    content.push_back({{"token", token},
                       {"logprob", lp["token_logprobs"][i]},
                       {"bytes", bytes(token)},
                       {"top_logprobs", std::move(alternatives)}});
  }
  return {{"content", std::move(content)}};
}

}  // namespace

absl::StatusOr<nlohmann::json> ChatRenderInput(const nlohmann::json& fields) {
  const nlohmann::json* messages = json::Find(fields, "messages");
  CPFILL_CHECK_ARG(messages != nullptr && messages->is_array() && !messages->empty(),
                   "\"messages\" must be a non-empty list of {\"role\", \"content\"}");
  nlohmann::json out = {{"messages", nlohmann::json::array()}, {"add_generation_prompt", true}};
  for (size_t i = 0; i < messages->size(); ++i) {
    CPFILL_ASSIGN_OR_RETURN(out["messages"].emplace_back(), Message((*messages)[i], i));
  }
  if (const nlohmann::json* g = json::Find(fields, "add_generation_prompt");
      g != nullptr && !g->is_null()) {
    CPFILL_CHECK_ARG(g->is_boolean(), "\"add_generation_prompt\" must be a boolean");
    out["add_generation_prompt"] = *g;
  }
  return out;
}

absl::StatusOr<ChatRequest> ParseChatRequest(std::string_view body, const std::string& served_model,
                                             const runtime::Tokenizer* tokenizer,
                                             const ChatRenderFn& render, int64_t max_prompt_tokens,
                                             int64_t max_model_len) {
  CPFILL_ASSIGN_OR_RETURN(RequestBody parsed, ParseRequestBody(body, "", 0, 0));
  const nlohmann::json& v = parsed.fields;
  nlohmann::json completion = nlohmann::json::object();
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(kCompletionFields.count(key) || kChatFields.count(key), "unknown field \"",
                     key, "\"",
                     key == "echo" || key == "session" ? " (/v1/completions has it)" : "");
    if (kCompletionFields.count(key)) completion[key] = value;
  }
  if (tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        "/v1/chat/completions needs the model's tokenizer, and none is loaded");
  }
  ChatRequest chat;
  CPFILL_RETURN_IF_ERROR(ParseChatLogprobs(v, &chat));
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json input, ChatRenderInput(v));
  CPFILL_ASSIGN_OR_RETURN(chat.prompt, render(input));
  // The template writes the special tokens it wants: none are added (vLLM's chat does the same).
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(chat.prompt, /*add_bos=*/false);
  CPFILL_CHECK_ARG(ids.ok(), "\"messages\": the rendered prompt: ", ids.status().message());
  CPFILL_CHECK_ARG(!ids->empty(), "\"messages\": the chat template rendered an empty prompt");
  CPFILL_ASSIGN_OR_RETURN(completion["max_tokens"], MaxTokens(v, ids->size(), max_model_len));
  if (chat.logprobs) completion["logprobs"] = std::max(1, chat.top_logprobs);
  completion["prompt"] = *std::move(ids);
  CPFILL_ASSIGN_OR_RETURN(chat.completion, ParseCompletionRequest(completion.dump(), served_model,
                                                                  tokenizer, max_prompt_tokens));
  return chat;
}

absl::StatusOr<nlohmann::ordered_json> TokenizeChat(std::string_view body,
                                                    const std::string& served_model,
                                                    const runtime::Tokenizer* tokenizer,
                                                    const ChatRenderFn& render,
                                                    int64_t max_model_len) {
  CPFILL_ASSIGN_OR_RETURN(RequestBody parsed, ParseRequestBody(body, "", 0, 0));
  const nlohmann::json& v = parsed.fields;
  if (!v.contains("messages")) return Tokenize(body, served_model, tokenizer, max_model_len);
  nlohmann::json plain = nlohmann::json::object();  // checked by Tokenize: model, its flags
  for (const auto& [key, value] : v.items()) {
    CPFILL_CHECK_ARG(key == "model" || key == "messages" || key == "add_generation_prompt" ||
                         key == "add_special_tokens" || key == "return_token_strs",
                     "unknown field \"", key, "\"");
    if (key == "model" || key == "add_special_tokens" || key == "return_token_strs") {
      plain[key] = value;
    }
  }
  if (tokenizer == nullptr) {
    return absl::FailedPreconditionError("this model has no tokenizer: nothing to render with");
  }
  CPFILL_ASSIGN_OR_RETURN(nlohmann::json input, ChatRenderInput(v));
  CPFILL_ASSIGN_OR_RETURN(plain["prompt"], render(input));
  if (!plain.contains("add_special_tokens") || plain["add_special_tokens"].is_null()) {
    plain["add_special_tokens"] = false;
  }
  return Tokenize(plain.dump(), served_model, tokenizer, max_model_len);
}

nlohmann::ordered_json ChatResponse(const ChatRequest& chat, nlohmann::ordered_json completion) {
  nlohmann::ordered_json choices = nlohmann::ordered_json::array();
  for (auto& c : completion["choices"]) {
    nlohmann::ordered_json lp = nullptr;
    if (chat.logprobs && c["logprobs"].is_object())
      lp = ChatLogprobs(c["logprobs"], chat.top_logprobs);
    choices.push_back({{"index", c["index"]},
                       {"message", {{"role", "assistant"}, {"content", c["text"]}}},
                       {"logprobs", std::move(lp)},
                       {"finish_reason", c["finish_reason"]}});
  }
  completion["object"] = "chat.completion";
  completion["choices"] = std::move(choices);
  return completion;
}

std::vector<nlohmann::ordered_json> ChatChunks(const ChatRequest& chat,
                                               nlohmann::ordered_json chunk,
                                               std::vector<bool>* role_sent) {
  std::vector<nlohmann::ordered_json> out;
  chunk["object"] = "chat.completion.chunk";
  nlohmann::ordered_json choices = nlohmann::ordered_json::array();
  for (auto& c : chunk["choices"]) {
    const size_t index = c["index"].get<size_t>();
    if (index < role_sent->size() && !(*role_sent)[index]) {
      (*role_sent)[index] = true;
      nlohmann::ordered_json role = chunk;
      role.erase("usage");
      role["choices"] = {{{"index", index},
                          {"delta", {{"role", "assistant"}, {"content", ""}}},
                          {"logprobs", nullptr},
                          {"finish_reason", nullptr}}};
      out.push_back(std::move(role));
    }
    nlohmann::ordered_json lp = nullptr;
    if (chat.logprobs && c["logprobs"].is_object())
      lp = ChatLogprobs(c["logprobs"], chat.top_logprobs);
    choices.push_back({{"index", index},
                       {"delta", {{"content", c["text"]}}},
                       {"logprobs", std::move(lp)},
                       {"finish_reason", c["finish_reason"]}});
  }
  chunk["choices"] = std::move(choices);
  out.push_back(std::move(chunk));
  return out;
}

}  // namespace cpfill::launch
