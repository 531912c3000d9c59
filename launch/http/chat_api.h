// cpfill/launch/http/chat_api.h — POST /v1/chat/completions as OpenAI and vLLM answer it, over
// the completions API of http_api.h: the conversation is rendered to a prompt by the chat
// template (ChatRenderer), tokenized without BOS (the template writes its own special tokens,
// as vLLM's chat does), and runs as a completion of those ids; the completion's answer and
// stream chunks are then reshaped into chat.completion and chat.completion.chunk objects.
//
//   CPFILL_ASSIGN_OR_RETURN(ChatRequest chat, ParseChatRequest(body, "m", tok, render, 8192,
//   8192));
//   ... run chat.completion as a completion, get its JSON ...
//   nlohmann::ordered_json answer = ChatResponse(chat, completion_json);
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "launch/http/http_api.h"
#include "nlohmann/json.hpp"
#include "runtime/text/tokenizer.h"

namespace cpfill::launch {

// Renders {"messages", "add_generation_prompt"} to the prompt text (ChatRenderer::Render).
using ChatRenderFn = std::function<absl::StatusOr<std::string>(const nlohmann::json&)>;

struct ChatRequest {
  CompletionRequest completion;  // the prompt's ids, the sampling and stop fields
  std::string prompt;            // the rendered conversation
  bool logprobs = false;         // chat's logprobs: a bool, with top_logprobs alternatives
  int top_logprobs = 0;
};

// The renderer's input from a chat body's fields: messages checked (a non-empty list of objects
// with a string role and a string content, null content, or a list of {"type": "text"} parts,
// joined with line breaks as vLLM does; "name" passed on), and add_generation_prompt (default
// true). InvalidArgument naming the field otherwise.
absl::StatusOr<nlohmann::json> ChatRenderInput(const nlohmann::json& fields);

// Fields: model, messages, add_generation_prompt, max_tokens / max_completion_tokens (default:
// the positions left after the prompt), temperature, top_p, top_k, n, seed, stop,
// stop_token_ids, include_stop_str_in_output, ignore_eos, min_tokens, logprobs (bool) and
// top_logprobs, stream, stream_options, user, skip_special_tokens,
// spaces_between_special_tokens and the neutral penalties, best_of and logit_bias. Any other is
// refused by name (sessions, echo and KV hand-offs are the completions route's). `render`'s
// errors pass through (InvalidArgument, Unavailable); FailedPrecondition without a tokenizer.
absl::StatusOr<ChatRequest> ParseChatRequest(std::string_view body, const std::string& served_model,
                                             const runtime::Tokenizer* tokenizer,
                                             const ChatRenderFn& render, int64_t max_prompt_tokens,
                                             int64_t max_model_len);

// POST /tokenize where the server has a chat template: {"messages", "add_generation_prompt",
// "add_special_tokens" (default false: the template writes them)} gives the ids of the rendered
// conversation, as vLLM's does; a body without "messages" goes to Tokenize (http_api.h).
absl::StatusOr<nlohmann::ordered_json> TokenizeChat(std::string_view body,
                                                    const std::string& served_model,
                                                    const runtime::Tokenizer* tokenizer,
                                                    const ChatRenderFn& render,
                                                    int64_t max_model_len);

// The completion's answer (CompletionResponse) as a chat.completion: each choice's text as the
// assistant's message, its logprobs as chat's {"content": [{token, logprob, bytes,
// top_logprobs}]}; usage and the "cpfill" timings kept.
nlohmann::ordered_json ChatResponse(const ChatRequest& chat, nlohmann::ordered_json completion);

// A stream's text_completion chunk (StreamChunk, UsageChunk) as chat.completion.chunk objects:
// before a choice's first chunk, one that names the role (`role_sent`, one flag per choice, is
// kept by the caller between chunks).
std::vector<nlohmann::ordered_json> ChatChunks(const ChatRequest& chat,
                                               nlohmann::ordered_json chunk,
                                               std::vector<bool>* role_sent);

}  // namespace cpfill::launch
