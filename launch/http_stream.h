// cpfill/launch/http_stream.h — a streamed completion (`"stream": true`): the engine's thread
// pushes each generated token as it is chosen; the HTTP thread pulls them as server-sent events
// (OpenAI's text_completion chunks, then "data: [DONE]"). Text is decoded on the HTTP thread,
// never on the engine's, and a character split over tokens is sent once its last byte came.
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

#include "launch/http_api.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"

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

 private:
  struct Choice {
    std::vector<int32_t> ids;
    std::string sent;  // text given out so far
    bool started = false, finished = false;
  };
  void Push(int index, const runtime::GeneratedToken& token);
  std::string Event(int index, const runtime::GeneratedToken& token);  // lock not held

  const CompletionRequest& request_;
  const std::string id_, served_model_;
  const int64_t created_;
  const runtime::Tokenizer* tokenizer_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);

  mutable std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::pair<int, runtime::GeneratedToken>> pending_;
  std::vector<Choice> choices_;
  int finished_ = 0;
};

// "data: <json>\n\n"
std::string ServerSentEvent(const std::string& json);

}  // namespace cpfill::launch
