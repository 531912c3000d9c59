#include "launch/http_stream.h"

#include "absl/strings/str_cat.h"

namespace cpfill::launch {

std::string ServerSentEvent(const std::string& json) {
  return absl::StrCat("data: ", json, "\n\n");
}

CompletionStream::CompletionStream(const CompletionRequest& request, std::string id,
                                   int64_t created, std::string served_model,
                                   const runtime::Tokenizer* tokenizer)
    : request_(request),
      id_(std::move(id)),
      served_model_(std::move(served_model)),
      created_(created),
      tokenizer_(tokenizer),
      choices_(request.prompts.size()) {}

std::function<void(const runtime::GeneratedToken&)> CompletionStream::Sink(int index) {
  return [self = shared_from_this(), index](const runtime::GeneratedToken& t) {
    self->Push(index, t);
  };
}

void CompletionStream::Push(int index, const runtime::GeneratedToken& token) {
  std::lock_guard lock(mu_);
  pending_.push_back({index, token});
  choices_[index].started = true;
  ready_.notify_all();
}

bool CompletionStream::Started(int index) const {
  std::lock_guard lock(mu_);
  return choices_[index].started;
}

bool CompletionStream::Next(std::string* out, std::chrono::milliseconds wait) {
  std::deque<std::pair<int, runtime::GeneratedToken>> taken;
  {
    std::unique_lock lock(mu_);
    ready_.wait_for(lock, wait, [&] { return !pending_.empty(); });
    taken.swap(pending_);
  }
  for (const auto& [index, token] : taken) *out += Event(index, token);
  return finished_ < static_cast<int>(choices_.size());
}

// Only the HTTP thread (Next) reads and writes choices_' ids, sent and finished.
std::string CompletionStream::Event(int index, const runtime::GeneratedToken& token) {
  Choice& c = choices_[index];
  c.ids.push_back(token.token.id);
  const bool last = !token.finish_reason.empty();
  std::string text;
  const size_t offset = CodePoints(c.sent);
  std::string whole = DecodeText(tokenizer_, c.ids);
  const bool split = EndsSplit(whole);
  // Stop strings: the text ends before the one found (its last token), and while it runs, bytes
  // that may begin one wait for the next tokens.
  const size_t cut = StopCut(request_, whole);
  if (cut != std::string::npos) {
    whole.resize(cut);
  } else if (!last) {
    whole.resize(whole.size() - StopPrefixHeld(request_, whole));
  }
  if ((last || !split) && whole.size() >= c.sent.size() &&
      whole.compare(0, c.sent.size(), c.sent) == 0) {
    text = whole.substr(c.sent.size());
    c.sent = whole;
  }
  if (last) {
    c.finished = true;
    ++finished_;
  }
  return ServerSentEvent(JsonText(
      StreamChunk(request_, id_, created_, served_model_, index, token, text, tokenizer_, offset)));
}

}  // namespace cpfill::launch
