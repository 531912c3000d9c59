// cpfill/launch/http/http_stream.h — a streamed completion (`"stream": true`): the engine's thread
// pushes each generated token as it is chosen; the HTTP thread pulls them as server-sent events
// (OpenAI's text_completion chunks, then "data: [DONE]"). Text is decoded on the HTTP thread,
// never on the engine's, and a character split over tokens is sent once its last byte came.
// With stop strings, text that may begin one is held back until the next tokens decide, and so
// are the chunks of the tokens it belongs to: a token goes out once its text starts in what may
// be sent. When a stop string ends the choice, the tokens past it send no text and no logprobs,
// only their ids on the closing chunk: what is streamed adds up to the whole answer
// (CompletionResponse), text, token_ids and logprobs alike.
//
//   auto stream = std::make_shared<CompletionStream>(request, "cmpl-1", created, "m", tok);
//   engine_request.on_token = stream->Sink(0);          // before Submit
//   std::string events;  while (stream->Next(&events, 100ms)) { write(events); events.clear(); }
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "launch/http/http_api.h"
#include "runtime/serving/engine.h"
#include "runtime/text/tokenizer.h"

namespace cpfill::launch {

class CompletionStream : public std::enable_shared_from_this<CompletionStream> {
 public:
  CompletionStream(const CompletionRequest& request, std::string id, int64_t created,
                   std::string served_model, const runtime::Tokenizer* tokenizer);

  // The engine's callback for prompt `index` (keeps the stream alive).
  std::function<void(const runtime::GeneratedToken&)> Sink(int index);
  // Set when the client left: the engine ends these generations ("abort").
  std::shared_ptr<std::atomic<bool>> cancelled() const { return cancelled_; }

  // Waits up to `wait` for tokens and appends their events to *out. False once every prompt's
  // last token has been given out.
  bool Next(std::string* out, std::chrono::milliseconds wait);
  // True when prompt `index` has had its first token (any thread).
  bool Started(int index) const;
  // True when prompt `index`'s last token has been given out by Next (Next's thread).
  bool Finished(int index) const { return choices_[index].finished; }
  const std::string& id() const { return id_; }
  // Chunks are given out as `shape` makes them (the chat route's chat.completion.chunk; default:
  // each as it is). Set before the first token; called on Next's thread only.
  using ChunkShape = std::function<std::vector<nlohmann::ordered_json>(nlohmann::ordered_json)>;
  void SetShape(ChunkShape shape) { shape_ = std::move(shape); }
  // The server-sent events of `chunk` as shaped (the usage chunk of the stream's end too).
  std::string Event(nlohmann::ordered_json chunk) const;

 private:
  struct Choice {
    std::vector<runtime::SampledToken> tokens;  // every token pushed so far
    std::vector<int32_t> ids;                   // of `tokens`
    std::vector<size_t> starts;  // where each token's text starts in `text` (NextTokenStart)
    std::string text;            // decoded `ids`
    size_t sent_bytes = 0;       // of `text`, given out
    size_t sent_tokens = 0;      // of `tokens`, given out in chunks
    size_t echo_points = 0;      // echo: characters of the prompt's text, sent before `text`
    bool started = false, finished = false;
  };
  void Push(int index, const runtime::GeneratedToken& token);
  std::string Events(int index, const runtime::GeneratedToken& token);  // lock not held
  // Bytes of the choice's text that may go out: all but what may begin a stop string, nothing
  // of a character not finished, nothing past a stop string (at `cut`).
  size_t Sendable(const Choice& c, size_t cut, bool last) const;
  // The chunk of token `i`, its text up to `end`.
  std::string TokenEvent(int index, size_t i, size_t end, const std::string& finish_reason);
  // continuous_usage_stats: choice `index`'s prompt and `tokens` generated tokens.
  void UsageSoFar(int index, size_t tokens, StreamDelta* delta) const;
  // The last chunk of a choice whose tokens from sent_tokens on lie past a stop string.
  std::string ClosingEvent(int index, const std::string& finish_reason);
  // echo: the choice's first chunk, its prompt's text (and prompt logprobs, which come with the
  // first token); with max_tokens 0 it ends the choice, and the token is not sent.
  std::string EchoEvent(int index, const runtime::GeneratedToken& token);

  const CompletionRequest& request_;
  const std::string id_, served_model_;
  const int64_t created_;
  const runtime::Tokenizer* tokenizer_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  ChunkShape shape_;

  mutable std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::pair<int, runtime::GeneratedToken>> pending_;
  std::vector<Choice> choices_;
  int finished_ = 0;
};

// "data: <json>\n\n"
std::string ServerSentEvent(const std::string& json);

}  // namespace cpfill::launch
