// cpfill/launch/http/chat_renderer.h — renders a chat conversation into a prompt text through a
// long-lived co-process (`serve --chat-template-renderer CMD`, on world rank 0 only), because no
// C++ Jinja engine is packaged for Debian and a hand-written one would drift from the templates
// that checkpoints ship. launch/http/render_chat.py is the one this repository provides (Python's
// jinja2 over the checkpoint's tokenizer_config.json, as transformers' apply_chat_template does).
//
// Protocol, one line each way over a socket pair that is the co-process's stdin and stdout:
//   in:  {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": true}
//   out: {"prompt": "<|im_start|>user\nHi<|im_end|>\n..."}   or   {"error": "why"}
// Calls are serialized (one co-process, one mutex). A co-process that exits, answers past
// `timeout` or more than `max_output_bytes`, or answers what is not such a line, is killed; the
// call fails Unavailable (503) and the next call starts a fresh one.
//
//   ChatRenderer renderer({.command = "python3 launch/http/render_chat.py --model-dir m"});
//   absl::StatusOr<std::string> prompt = renderer.Render(request_json);
#pragma once

#include <sys/types.h>

#include <chrono>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cpfill::launch {

class ChatRenderer {
 public:
  struct Options {
    std::string command;  // run as `/bin/sh -c "exec <command>"`; its stderr is the server's
    std::chrono::milliseconds timeout{2000};  // one render: write, template, answer
    size_t max_output_bytes = 8u << 20;
  };
  explicit ChatRenderer(Options options) : options_(std::move(options)) {}
  ~ChatRenderer();
  ChatRenderer(const ChatRenderer&) = delete;
  ChatRenderer& operator=(const ChatRenderer&) = delete;

  // The prompt text of `request` ({"messages", "add_generation_prompt"}). InvalidArgument with
  // the renderer's message when it answers {"error"} (a template's raise_exception, a role it
  // does not know); Unavailable when it cannot be started, died, timed out or answered garbage.
  absl::StatusOr<std::string> Render(const nlohmann::json& request);
  int restarts() const { return restarts_; }  // co-processes started after the first

 private:
  absl::Status StartLocked();
  void StopLocked();  // kills the co-process and reaps it
  absl::Status SendLocked(const std::string& line, std::chrono::steady_clock::time_point deadline);
  absl::StatusOr<std::string> ReceiveLocked(std::chrono::steady_clock::time_point deadline);

  const Options options_;
  std::mutex mu_;
  pid_t pid_ = -1;
  int fd_ = -1;         // our end of the socket pair
  std::string buffer_;  // bytes received past the last answer's line break
  int started_ = 0, restarts_ = 0;
};

}  // namespace cpfill::launch
