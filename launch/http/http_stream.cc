#include "launch/http/http_stream.h"

#include <algorithm>
#include <string_view>

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
      choices_(request.choices()) {}

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
  for (const auto& [index, token] : taken) *out += Events(index, token);
  return finished_ < static_cast<int>(choices_.size());
}

std::string CompletionStream::Event(nlohmann::ordered_json chunk) const {
  if (!shape_) return ServerSentEvent(JsonText(chunk));
  std::string out;
  for (const auto& shaped : shape_(std::move(chunk))) out += ServerSentEvent(JsonText(shaped));
  return out;
}

std::string CompletionStream::EchoEvent(int index, const runtime::GeneratedToken& token) {
  Choice& c = choices_[index];
  const size_t prompt = static_cast<size_t>(index / request_.n);
  const bool alone = request_.max_tokens == 0;  // the prompt only: the engine's token is dropped
  nlohmann::ordered_json chunk =
      EchoChunk(request_, prompt, index, id_, created_, served_model_, token.prompt_logprobs,
                alone ? "length" : "", tokenizer_);
  c.echo_points = CodePoints(chunk["choices"][0]["text"].get_ref<const std::string&>());
  if (alone) {
    c.finished = true;
    ++finished_;
  }
  return Event(std::move(chunk));
}

// Only the HTTP thread (Next) reads and writes choices_ but for `started`.
std::string CompletionStream::Events(int index, const runtime::GeneratedToken& token) {
  Choice& c = choices_[index];
  std::string echoed;
  if (request_.echo && c.tokens.empty()) {
    echoed = EchoEvent(index, token);
    if (c.finished) return echoed;
  }
  c.starts.push_back(c.tokens.empty() ? 0 : NextTokenStart(c.text, c.starts.back()));
  c.tokens.push_back(token.token);
  c.ids.push_back(token.token.id);
  c.text = DecodeText(tokenizer_, c.ids, request_.skip_special_tokens);
  const bool last = !token.finish_reason.empty();
  const size_t cut = StopCut(request_, c.text);
  const size_t sendable = Sendable(c, cut, last);
  // Without stop strings every token goes out at once; with them, once its text starts in what
  // may be sent, or at the end when no stop string was found.
  const bool all = request_.stop.empty() || (last && cut == std::string::npos);
  size_t until = c.sent_tokens;
  while (until < c.tokens.size() && (all || c.starts[until] < sendable)) ++until;
  std::string out;
  for (size_t i = c.sent_tokens; i < until; ++i) {
    const bool final_token = last && i + 1 == c.tokens.size();
    out += TokenEvent(index, i, i + 1 < until ? c.starts[i + 1] : sendable,
                      final_token ? token.finish_reason : "");
  }
  c.sent_tokens = until;
  if (last && until < c.tokens.size()) out += ClosingEvent(index, token.finish_reason);
  if (last) {
    c.finished = true;
    ++finished_;
  }
  return echoed + out;
}

size_t CompletionStream::Sendable(const Choice& c, size_t cut, bool last) const {
  size_t end = c.text.size();
  if (cut != std::string::npos) {
    end = cut;
  } else if (!last && EndsSplit(c.text)) {
    end = c.sent_bytes;
  } else if (!last) {
    end -= StopPrefixHeld(request_, c.text);
  }
  return std::max(end, c.sent_bytes);  // text once sent stays sent
}

std::string CompletionStream::TokenEvent(int index, size_t i, size_t end,
                                         const std::string& finish_reason) {
  Choice& c = choices_[index];
  end = std::max(end, c.sent_bytes);
  StreamDelta delta{.index = index,
                    .text = c.text.substr(c.sent_bytes, end - c.sent_bytes),
                    .token = c.tokens[i],
                    .text_offset = c.echo_points +
                                   CodePoints(std::string_view(c.text).substr(0, c.starts[i])),
                    .finish_reason = finish_reason};
  if (request_.continuous_usage_stats) UsageSoFar(index, i + 1, &delta);
  c.sent_bytes = end;
  return Event(StreamChunk(request_, id_, created_, served_model_, delta, tokenizer_));
}

void CompletionStream::UsageSoFar(int index, size_t tokens, StreamDelta* delta) const {
  delta->prompt_tokens =
      static_cast<int64_t>(request_.prompts[index / request_.n].size());
  delta->completion_tokens = static_cast<int64_t>(tokens);
}

// The tokens past the stop string: their ids, none of their text.
std::string CompletionStream::ClosingEvent(int index, const std::string& finish_reason) {
  const Choice& c = choices_[index];
  StreamDelta closing{.index = index, .finish_reason = finish_reason};
  if (request_.continuous_usage_stats) UsageSoFar(index, c.tokens.size(), &closing);
  closing.unsent_ids.assign(c.ids.begin() + static_cast<std::ptrdiff_t>(c.sent_tokens),
                            c.ids.end());
  return Event(StreamChunk(request_, id_, created_, served_model_, closing, tokenizer_));
}

}  // namespace cpfill::launch
