// cpfill/launch/http/http_api.h — the OpenAI-compatible HTTP API of `cpfill serve`, as pure
// functions of JSON and text: request bodies in (parsed with nlohmann-json, every field checked),
// response bodies, error bodies and Prometheus metrics out. The server (http_server.h) wires them
// to the engine; tests call them directly.
//
//   CPFILL_ASSIGN_OR_RETURN(CompletionRequest r, ParseCompletionRequest(body, "tiny", nullptr));
//   ... engine.Submit per prompt ...
//   std::string json = CompletionResponse(r, results, id, created, "tiny", nullptr).dump();
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "runtime/serving/engine.h"
#include "runtime/text/tokenizer.h"

namespace cpfill::launch {

// POST /v1/completions.
struct CompletionRequest {
  // "prompt": [ids], [[ids], ...], "text" or ["text", ...] (text encoded with BOS, as vLLM's
  // completions do by default)
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::optional<std::string>> prompt_texts;  // per prompt: its text, if one was sent
  int n = 1;  // choices per prompt: choice i is prompt i / n (the prefix cache prefills it once)
  size_t choices() const { return prompts.size() * static_cast<size_t>(n); }
  std::string session;  // extension: keep and reuse this conversation's KV
  int logprobs = 0;     // top-k of every generated token (0: none)
  // Echoed, unless {"do_remote_decode": true}: then the prompt's KV is kept under a lease and the
  // response's kv_transfer_params is its hand-off handle (runtime/handoff/kv_handle.h; needs
  // --kv-handoff).
  std::optional<nlohmann::json> kv_transfer_params;
  bool publish_kv = false;
  // {"sparq": {"r": 16, "k": 128, "l": 16}}: decode with SparQ (cpfill's extension; CPU backend).
  std::optional<attention::sparq::SparqConfig> sparq;
  int max_tokens = 16;                         // OpenAI's default; 1: prefill and the first token
  bool stream = false, include_usage = false;  // server-sent events; a last chunk with usage
  runtime::SamplingParams sampling{.temperature = 1.0};  // OpenAI's defaults
  std::optional<uint64_t> seed;                          // none: the server draws one per request
  std::vector<int32_t> stop_token_ids;  // vLLM's extension; EOS stops unless ignore_eos
  bool ignore_eos = false;
  // "stop": up to 4 strings; generation ends when the text holds one, and the text returned ends
  // just before it (after it with vLLM's include_stop_str_in_output), its logprobs with the
  // tokens that text covers. The token ids, usage and a session keep every generated token, the
  // one that completed the match too (as vLLM's do). Needs the tokenizer.
  std::vector<std::string> stop;
  bool include_stop_str_in_output = false;
  // echo: each choice's text starts with its prompt's (the text sent, else the ids decoded); with
  // logprobs, its logprobs start with the prompt's tokens' (the first one's null, as OpenAI's and
  // vLLM's). max_tokens 0 (only with echo): the prompt alone, nothing generated.
  bool echo = false;
  // The least tokens generated before EOS or a stop id may end it (those are masked until then).
  int min_tokens = 0;
  // Text leaves special tokens (EOS, <|im_end|>, ...) out, as vLLM's by default. Byte-level BPE
  // decodes added tokens as their text, with no separators: spaces_between_special_tokens is
  // accepted and, as in vLLM with a fast tokenizer, changes nothing.
  bool skip_special_tokens = true;
  bool spaces_between_special_tokens = true;
  // stream_options.continuous_usage_stats: every chunk carries its choice's usage so far.
  bool continuous_usage_stats = false;
};

// The engine requests of a completion, one per choice (`seed` when the request names none);
// stop strings become each request's stop_when, which decodes its newest tokens with `tokenizer`.
std::vector<runtime::EngineRequest> EngineRequestsOf(const CompletionRequest& request,
                                                     uint64_t seed,
                                                     const runtime::Tokenizer* tokenizer);

inline constexpr int kMaxStopStrings = 4;  // OpenAI's limit
inline constexpr size_t kMaxStopBytes = 256;

// Where the text given to the client ends under the request's stop strings: before the earliest
// one in `text` (after it with include_stop_str_in_output); std::string::npos when none is in it.
size_t StopCut(const CompletionRequest& request, std::string_view text);
// Bytes at the end of `text` that may be the start of a stop string: a stream holds them back
// until the next tokens say whether the stop string follows.
size_t StopPrefixHeld(const CompletionRequest& request, std::string_view text);

// The largest body the server reads by default (--max-body-bytes), and the most prompts and top-k
// one request may ask for.
inline constexpr size_t kMaxBodyBytes = 64u << 20;
inline constexpr int kMaxPromptsPerRequest = 1024;
inline constexpr int kMaxLogprobs = 20;
inline constexpr int kMaxTokensPerRequest = 1 << 20;

// InvalidArgument naming the field for malformed JSON, wrong types, unknown or unsupported
// fields (penalties, best_of, logit_bias or suffix at other than neutral values; text prompts and stop strings when `tokenizer` is null: the model has
// none), a model name other than `served_model`, more than kMaxPromptsPerRequest choices, or a
// session with more than one choice.
// The body is parsed by ParseRequestBody (request_body.h): a prompt of more than
// `max_prompt_tokens` ids is refused (ResourceExhausted, 413) as soon as the parse reaches it.
absl::StatusOr<CompletionRequest> ParseCompletionRequest(
    std::string_view body, const std::string& served_model, const runtime::Tokenizer* tokenizer,
    int64_t max_prompt_tokens = kMaxTokensPerRequest);

// The response: choices (n per prompt: every generated token's id and, with a tokenizer, their
// text cut at a stop string; logprobs when asked, of the tokens that text covers; the finish
// reason), usage (prompt and cached tokens once per prompt, completion tokens of every choice), the
// echoed kv_transfer_params, and a "cpfill" object with each prompt's queue time, TTFT and its
// phases, decode time and time per output token, and the selector's choice.
// The model's share of a generation's decode steps, by phase, summed over its steps (ms): what
// `cpfill generate --json` and the server's "cpfill" timing report; the decode time beyond
// "model" is the engine's (sampling, scheduling).
nlohmann::ordered_json DecodePhasesMs(const runtime::StepTimings& d);

nlohmann::ordered_json CompletionResponse(const CompletionRequest& request,
                                          const std::vector<runtime::EngineResult>& results,
                                          const std::string& id, int64_t created,
                                          const std::string& served_model,
                                          const runtime::Tokenizer* tokenizer);

// One choice's part of a streamed chunk: its new text and the token it covers (its logprobs when
// asked, named through the tokenizer, at `text_offset` characters into the choice's text), or,
// closing a choice that a stop string ended, no token: the ids of the tokens whose text lay past
// the stop string (sent as token_ids only, so a stream's ids add up to every generated token,
// as the whole answer's do). `finish_reason` on the choice's last chunk.
struct StreamDelta {
  int index = 0;
  std::string text;
  std::optional<runtime::SampledToken> token;
  size_t text_offset = 0;
  std::vector<int32_t> unsent_ids;
  std::string finish_reason;
  // continuous_usage_stats: the choice's usage so far (completion_tokens < 0: none sent).
  int64_t prompt_tokens = 0, completion_tokens = -1;
};
// One server-sent event of a streamed completion (OpenAI's text_completion chunk).
nlohmann::ordered_json StreamChunk(const CompletionRequest& request, const std::string& id,
                                   int64_t created, const std::string& served_model,
                                   const StreamDelta& delta, const runtime::Tokenizer* tokenizer);
// echo in a stream (as vLLM's): choice `index`'s first chunk, the text of prompt `prompt` (as
// echo sends it whole) and, with logprobs, its prompt logprobs (`scored`: EngineResult's); no
// token ids. `finish_reason` "length" when nothing is generated (max_tokens 0), else "".
nlohmann::ordered_json EchoChunk(const CompletionRequest& request, size_t prompt, int index,
                                 const std::string& id, int64_t created,
                                 const std::string& served_model,
                                 const std::vector<runtime::SampledToken>& scored,
                                 const std::string& finish_reason,
                                 const runtime::Tokenizer* tokenizer);
// The last chunk when stream_options.include_usage is set: no choices, the usage.
nlohmann::ordered_json UsageChunk(const std::string& id, int64_t created,
                                  const std::string& served_model,
                                  const std::vector<runtime::EngineResult>& results, int n = 1);

// POST /tokenize (vLLM's): {"prompt": text, "add_special_tokens": true} or {"messages"} (refused:
// no chat template here) -> {"count", "max_model_len", "tokens"}; POST /detokenize:
// {"tokens": [ids]} -> {"prompt": text}. InvalidArgument naming the field; FailedPrecondition
// without a tokenizer. `model` as in completions.
absl::StatusOr<nlohmann::ordered_json> Tokenize(std::string_view body,
                                                const std::string& served_model,
                                                const runtime::Tokenizer* tokenizer,
                                                int64_t max_model_len);
absl::StatusOr<nlohmann::ordered_json> Detokenize(std::string_view body,
                                                  const std::string& served_model,
                                                  const runtime::Tokenizer* tokenizer);

// The text of `ids` (special tokens as their text): a character split over tokens decodes to
// U+FFFD until its last byte comes (EndsSplit).
// skip_special: leave special tokens out (the request's skip_special_tokens).
std::string DecodeText(const runtime::Tokenizer* tokenizer, std::span<const int32_t> ids,
                       bool skip_special = false);
// Characters (Unicode code points) of UTF-8 text: logprobs' text_offset counts what clients'
// strings count, not bytes.
size_t CodePoints(std::string_view utf8);
// True when decoded text ends in U+FFFD, what a decoder makes of a character whose last bytes
// (the next tokens) have not come yet.
bool EndsSplit(std::string_view text);
// Where the next token's text starts in its choice's text, in bytes, given `text_before` (the
// text of the tokens before it) and where the token before it started: at the end of that text,
// unless it ends in a character not finished yet (EndsSplit), which the next token finishes:
// then the same place as the token before. logprobs' text_offset and a stream's chunks place
// tokens alike by it.
size_t NextTokenStart(std::string_view text_before, size_t previous_start);
// NextTokenStart of every token of `ids` (0 for each without a tokenizer: there is no text).
std::vector<size_t> TokenTextStarts(const runtime::Tokenizer* tokenizer,
                                    std::span<const int32_t> ids, bool skip_special = false);
// The first `count` starts (bytes into `text`) in characters, plus `base`.
std::vector<size_t> CodePointOffsets(std::string_view text, const std::vector<size_t>& starts,
                                     size_t count, size_t base);
// How many of a choice's tokens its text covers, given where each starts: all of them, unless a
// stop string cut the text at `cut` (StopCut); then those that start before it. logprobs cover
// these, streamed or not.
size_t TokensBeforeCut(const std::vector<size_t>& starts, size_t cut);

// A JSON body as text. Strings that are not valid UTF-8 (a URL's bytes, a parser's message
// quoting the bad input) are written with U+FFFD in place of the bad bytes instead of throwing.
std::string JsonText(const nlohmann::ordered_json& value);

// An error as OpenAI clients expect it: {"error": {"message", "type", "code"}} with the HTTP
// status for the status code (InvalidArgument 400, Unauthenticated 401, NotFound 404,
// ResourceExhausted 413 (too large for the KV cache), Unavailable and FailedPrecondition 503,
// anything else 500).
struct HttpError {
  int status = 500;
  std::string body;
};
HttpError ErrorResponse(const absl::Status& status);

// Why the server refused a request, for /metrics (cpfill:http_refused_total{reason="..."}): the
// connection layer's refusals (http_connections.h) and the routes' 4xx and 503 answers.
enum class Refusal {
  kUnauthorized,        // 401: no key, or not the server's (--api-key)
  kBadRequest,          // 400: malformed HTTP, framing or API fields
  kNotFound,            // 404: no such route, session or lease
  kTimeout,             // 408: the head or the body did not come in time
  kHeaderTooLarge,      // 431: the request line and headers past their bound
  kBodyTooLarge,        // 413: a body past --max-body-bytes, fixed or chunked
  kTooLargeForKv,       // 413: a prompt the KV cache cannot hold
  kTooManyConnections,  // 503 at accept: --max-connections are open
  kOverloaded,          // 503: the bodies being read and answered hold --max-pending-bytes
  kQueueFull,           // 503: the engine's queue holds --max-queue prompts
  kDraining,            // 503: the server stops (SIGTERM), or its drain deadline passed
};
inline constexpr int kRefusalKinds = 11;
// The metric's label: "unauthorized", "bad_request", ... (snake case of the names above).
const char* RefusalName(Refusal why);
// The answer to a refusal: its status (above) and an error body of `message`, typed as OpenAI's
// are ("authentication_error" for 401).
HttpError RefusalResponse(Refusal why, const std::string& message);
// The refusal a route's error status stands for (InvalidArgument: bad_request, ...); none for a
// server error.
std::optional<Refusal> RefusalOf(const absl::Status& status);

// The API key (--api-key, --api-key-file, else the environment's CPFILL_API_KEY; "" when none):
// a file's trailing line break and blanks are dropped. InvalidArgument naming the source (never
// the key) when both flags are given, the file cannot be read, or the key is empty or holds a
// character an Authorization header cannot carry (only visible ASCII).
absl::StatusOr<std::string> ApiKeyFrom(const std::string& flag_key, const std::string& key_file,
                                       const char* env_key);
// Whether `authorization` (a request's Authorization header) is "Bearer <key>" (the scheme in any
// case). The key is compared through SHA-256 digests in constant time, so that neither the time
// nor the length of a guess tells how much of it was right.
bool BearerKeyMatches(std::string_view authorization, std::string_view key);

// Latency and size histograms for /metrics (thread-safe).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1) {}
  void Observe(double x);
  std::string Text(const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  int64_t count_ = 0;
};

// What /metrics reports besides the engine's counters.
struct ServerCounters {
  int64_t http_ok = 0, http_client_errors = 0, http_server_errors = 0, running = 0;
  std::array<int64_t, kRefusalKinds> refused{};  // by Refusal
  int64_t connections_open = 0;                  // sockets held: waiting, answered or closing
  int64_t pending_bytes = 0;                     // request bodies held (--max-pending-bytes)
  int64_t memory_trims = 0;                      // malloc_trim calls once the server went idle
};
// Seconds, from a millisecond to two minutes.
std::vector<double> LatencyBounds();
struct ServingHistograms {
  Histogram ttft{LatencyBounds()}, queue{LatencyBounds()}, tpot{LatencyBounds()},
      e2e{LatencyBounds()};
  Histogram batch_tokens{{16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576}};
  void Observe(const runtime::EngineResult& r);  // one answered prompt
};
std::string MetricsText(const runtime::EngineStats& engine, const ServerCounters& server,
                        const ServingHistograms& h);

}  // namespace cpfill::launch
