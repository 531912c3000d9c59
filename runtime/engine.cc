#include "runtime/engine.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The broadcast form of a command: little-endian words and length-prefixed strings. Rank 0 is
// trusted, but a reader still checks every length against what is left.
class Writer {
 public:
  void U32(uint32_t x) { Raw(&x, 4); }
  void Str(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Ids(const std::vector<int32_t>& ids) {
    U32(static_cast<uint32_t>(ids.size()));
    Raw(ids.data(), ids.size() * 4);
  }
  std::vector<char> bytes;

 private:
  void Raw(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    bytes.insert(bytes.end(), c, c + n);
  }
};

class Reader {
 public:
  explicit Reader(const std::vector<char>& bytes) : bytes_(bytes) {}
  bool U32(uint32_t* x) { return Raw(x, 4); }
  bool Str(std::string* s) {
    uint32_t n = 0;
    if (!U32(&n) || n > left()) return false;
    s->assign(bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  bool Ids(std::vector<int32_t>* ids) {
    uint32_t n = 0;
    if (!U32(&n) || uint64_t{n} * 4 > left()) return false;
    ids->resize(n);
    return Raw(ids->data(), uint64_t{n} * 4);
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  size_t left() const { return bytes_.size() - at_; }
  bool Raw(void* p, size_t n) {
    if (n > left()) return false;
    if (n > 0) std::memcpy(p, bytes_.data() + at_, n);
    at_ += n;
    return true;
  }
  const std::vector<char>& bytes_;
  size_t at_ = 0;
};

}  // namespace

// A request or a session end waiting on rank 0, and the promise that answers it.
struct Engine::Pending {
  bool end_session = false;
  EngineRequest request;
  std::string end_name;
  std::promise<absl::StatusOr<EngineResult>> reply;
  std::promise<absl::Status> ended;
  Clock::time_point submitted = Clock::now();
  int64_t cached = 0;       // set when batched: the session's tokens already in the cache
  bool recomputed = false;  // set when batched: the session's history is in this request
};

// What every rank does next. `items` (rank 0 only) are the pendings it answers, in batch order.
struct Engine::Command {
  enum Kind : uint32_t { kHeartbeat = 0, kPrefill = 1, kEndSessions = 2, kShutdown = 3 };
  Kind kind = kHeartbeat;
  std::vector<std::string> end_sessions;  // sessions to end (kEndSessions) or evict (kPrefill)
  std::vector<PrefillRequest> batch;
  std::vector<std::unique_ptr<Pending>> items;

  std::vector<char> Encode() const {
    Writer w;
    w.U32(kind);
    w.U32(static_cast<uint32_t>(end_sessions.size()));
    for (const std::string& s : end_sessions) w.Str(s);
    w.U32(static_cast<uint32_t>(batch.size()));
    for (const PrefillRequest& r : batch) {
      w.Str(r.session);
      w.Ids(r.tokens);
    }
    return std::move(w.bytes);
  }
  static absl::StatusOr<Command> Decode(const std::vector<char>& bytes) {
    Command c;
    Reader r(bytes);
    uint32_t kind = 0, n = 0;
    bool ok = r.U32(&kind) && kind <= kShutdown && r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) ok = r.Str(&c.end_sessions.emplace_back());
    ok = ok && r.U32(&n);
    for (uint32_t i = 0; ok && i < n; ++i) {
      PrefillRequest& req = c.batch.emplace_back();
      ok = r.Str(&req.session) && r.Ids(&req.tokens);
    }
    if (!ok || !r.done()) {
      return absl::InternalError(absl::StrCat("engine: a malformed command of ", bytes.size(),
                                              " bytes from world rank 0"));
    }
    c.kind = static_cast<Kind>(kind);
    return c;
  }
};

Engine::Engine(LlamaModel& model, parallel::Communicator& world, EngineOptions options)
    : model_(model), world_(world), options_(options), root_(world.rank() == 0) {}

Engine::~Engine() = default;

absl::Status Engine::Check(const EngineRequest& request) const {
  const int vocab = model_.config().vocab_size;
  CPFILL_CHECK_ARG(!request.tokens.empty(), "the prompt is empty");
  CPFILL_CHECK_ARG(static_cast<int64_t>(request.tokens.size()) <= options_.max_batch_tokens,
                   "the prompt has ", request.tokens.size(), " tokens, more than a batch takes (",
                   options_.max_batch_tokens, ", --max-batch-tokens)");
  for (size_t i = 0; i < request.tokens.size(); ++i) {
    CPFILL_CHECK_ARG(request.tokens[i] >= 0 && request.tokens[i] < vocab, "token ", i, " is ",
                     request.tokens[i], ", outside the vocabulary [0, ", vocab, ")");
  }
  return absl::OkStatus();
}

absl::StatusOr<Engine::Reply> Engine::Submit(EngineRequest request) {
  std::vector<EngineRequest> one;
  one.push_back(std::move(request));
  CPFILL_ASSIGN_OR_RETURN(std::vector<Reply> replies, SubmitAll(std::move(one)));
  return std::move(replies[0]);
}

absl::StatusOr<std::vector<Engine::Reply>> Engine::SubmitAll(std::vector<EngineRequest> requests) {
  CPFILL_CHECK_ARG(root_, "requests go to world rank 0");
  for (const EngineRequest& request : requests) CPFILL_RETURN_IF_ERROR(Check(request));
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<Reply> replies;
  for (EngineRequest& request : requests) {
    pending.push_back(std::make_unique<Pending>());
    pending.back()->request = std::move(request);
    replies.push_back(pending.back()->reply.get_future());
  }
  std::lock_guard lock(mu_);
  if (shutdown_) return absl::FailedPreconditionError("the engine is shutting down");
  if (static_cast<int64_t>(queue_.size() + pending.size()) > options_.max_queue) {
    return absl::UnavailableError(absl::StrCat("the queue is full (", queue_.size(),
                                               " requests wait); retry later"));
  }
  for (auto& p : pending) queue_.push_back(std::move(p));
  work_.notify_one();
  return replies;
}

std::future<absl::Status> Engine::EndSession(std::string name) {
  auto p = std::make_unique<Pending>();
  p->end_session = true;
  p->end_name = std::move(name);
  std::future<absl::Status> ended = p->ended.get_future();
  std::lock_guard lock(mu_);
  if (!root_ || shutdown_) {
    p->ended.set_value(absl::FailedPreconditionError(
        root_ ? "the engine is shutting down" : "sessions are ended on world rank 0"));
    return ended;
  }
  queue_.push_back(std::move(p));
  work_.notify_one();
  return ended;
}

void Engine::Shutdown() {
  std::lock_guard lock(mu_);
  shutdown_ = true;
  work_.notify_one();
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s = stats_;
  s.waiting = static_cast<int64_t>(queue_.size());
  s.sessions = static_cast<int64_t>(sessions_.size());
  return s;
}

std::vector<std::string> Engine::sessions() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<int64_t, std::string>> by_use;
  for (const auto& [name, s] : sessions_) by_use.push_back({s.last_used, name});
  std::sort(by_use.begin(), by_use.end());
  std::vector<std::string> names;
  for (auto& [used, name] : by_use) names.push_back(std::move(name));
  return names;
}

absl::Status Engine::Run() {
  for (;;) {
    Command command;
    std::vector<char> bytes;
    if (root_) {
      CPFILL_ASSIGN_OR_RETURN(command, NextCommand());
      bytes = command.Encode();
    }
    int64_t size = static_cast<int64_t>(bytes.size());
    absl::Status s = world_.Broadcast(&size, sizeof(size), 0);
    if (s.ok()) {
      bytes.resize(static_cast<size_t>(size));
      s = world_.Broadcast(bytes.data(), bytes.size(), 0);
    }
    if (s.ok() && !root_) {
      absl::StatusOr<Command> decoded = Command::Decode(bytes);
      s = decoded.status();
      if (s.ok()) command = std::move(*decoded);
    }
    if (s.ok() && command.kind == Command::kShutdown) return absl::OkStatus();
    if (s.ok()) s = Execute(command);
    if (!s.ok()) {  // the job cannot go on: every waiting request learns why
      if (root_) Fail(command, s);
      return s;
    }
  }
}

absl::StatusOr<Engine::Command> Engine::NextCommand() {
  std::unique_lock lock(mu_);
  work_.wait_for(lock, options_.heartbeat, [&] { return !queue_.empty() || shutdown_; });
  Command c;
  if (!queue_.empty()) return FormBatch();
  c.kind = shutdown_ ? Command::kShutdown : Command::kHeartbeat;
  return c;
}

Engine::Command Engine::FormBatch() {
  Command c;
  if (queue_.front()->end_session) {  // a barrier: ends after everything queued before it
    c.kind = Command::kEndSessions;
    c.end_sessions.push_back(queue_.front()->end_name);
    c.items.push_back(std::move(queue_.front()));
    queue_.pop_front();
    return c;
  }
  c.kind = Command::kPrefill;
  c.end_sessions = std::move(evict_next_);
  evict_next_.clear();
  std::set<std::string> taken, waiting;  // sessions in this batch; sessions whose turn waits
  int64_t tokens = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    Pending& p = **it;
    if (p.end_session) break;
    const std::string& name = p.request.session;
    if (!name.empty() && (taken.count(name) || waiting.count(name))) {
      waiting.insert(name);  // a later turn: after the one in this batch
      ++it;
      continue;
    }
    PrefillRequest r{.tokens = p.request.tokens, .session = name};
    p.cached = 0;
    p.recomputed = false;
    if (auto s = sessions_.find(name); !name.empty() && s != sessions_.end()) {
      if (s->second.evicted) {
        r.tokens = s->second.history;
        r.tokens.insert(r.tokens.end(), p.request.tokens.begin(), p.request.tokens.end());
        p.recomputed = true;
      } else {
        p.cached = static_cast<int64_t>(s->second.history.size());
      }
    }
    const int64_t n = static_cast<int64_t>(r.tokens.size());
    if (!c.batch.empty() && (solo_ > 0 || tokens + n > options_.max_batch_tokens)) break;
    tokens += n;
    if (!name.empty()) taken.insert(name);
    c.batch.push_back(std::move(r));
    c.items.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  if (solo_ > 0) --solo_;
  return c;
}

absl::Status Engine::Execute(Command& command) {
  // A broadcast completes on rank 0 without waiting for anyone (an eager send): the heartbeat
  // ends in a barrier, so rank 0 too learns within the deadline that a rank stopped answering.
  if (command.kind == Command::kHeartbeat) return world_.Barrier();
  // Ending or evicting a session every rank holds: NotFound only means it was gone already.
  for (const std::string& name : command.end_sessions) (void)model_.EndSession(name);
  if (command.kind == Command::kEndSessions) {
    if (root_) Answer(command, std::vector<SequenceOutput>{}, {}, 0);
    return absl::OkStatus();
  }
  const Clock::time_point start = Clock::now();
  PrefillTimings timings;
  absl::StatusOr<std::vector<SequenceOutput>> out =
      model_.Prefill(command.batch, &timings, nullptr);
  // The model refuses a batch on every rank alike, changing nothing: answered on rank 0, the
  // loop goes on. Anything else is a fault of the job.
  if (!out.ok() && !absl::IsInvalidArgument(out.status()) &&
      !absl::IsResourceExhausted(out.status()) && !absl::IsNotFound(out.status())) {
    return out.status();
  }
  if (root_) Answer(command, std::move(out), timings, Since(start));
  return absl::OkStatus();
}

std::vector<std::string> Engine::IdleSessionsLruFirst(const Command& command) const {
  std::set<std::string> busy;
  for (const PrefillRequest& r : command.batch) busy.insert(r.session);
  std::vector<std::pair<int64_t, std::string>> idle;
  for (const auto& [name, s] : sessions_) {
    if (!s.evicted && !busy.count(name)) idle.push_back({s.last_used, name});
  }
  std::sort(idle.begin(), idle.end());
  std::vector<std::string> names;
  for (auto& [used, name] : idle) names.push_back(std::move(name));
  return names;
}

void Engine::Answer(Command& command, absl::StatusOr<std::vector<SequenceOutput>> outputs,
                    const PrefillTimings& timings, double prefill_s) {
  std::lock_guard lock(mu_);
  stats_.kv_usage_ratio = model_.kv_usage().usage_ratio();  // on the loop thread: no race
  if (command.kind == Command::kEndSessions) {
    Pending& p = *command.items.front();
    const bool held = sessions_.erase(p.end_name) > 0;
    p.ended.set_value(held ? absl::OkStatus()
                           : absl::NotFoundError(absl::StrCat("no session '", p.end_name, "'")));
    return;
  }
  if (!outputs.ok()) {
    // The KV cache is full: evict the least recently used idle session and try again; with
    // none left, for another shortfall (activations: evicting frees none of that memory), or for
    // a request the model refuses, run the batch one request at a time; a request alone gets
    // its own error.
    std::vector<std::string> idle;
    if (IsKvCacheFull(outputs.status())) idle = IdleSessionsLruFirst(command);
    if (idle.empty() && command.items.size() == 1) {
      ++stats_.requests_failed;
      command.items.front()->reply.set_value(outputs.status());
      return;
    }
    if (!idle.empty()) {
      evict_next_.push_back(idle.front());
      sessions_[idle.front()].evicted = true;
      ++stats_.evictions;
    } else {
      solo_ = static_cast<int>(command.items.size());
    }
    for (auto it = command.items.rbegin(); it != command.items.rend(); ++it) {
      queue_.push_front(std::move(*it));
    }
    return;
  }
  ++stats_.batches;
  if (options_.on_batch) {
    options_.on_batch(static_cast<int>(command.items.size()), timings.new_tokens,
                      timings.cached_tokens, timings.algorithm, prefill_s);
  }
  for (size_t i = 0; i < command.items.size(); ++i) {
    Pending& p = *command.items[i];
    EngineResult r;
    r.first_token = (*outputs)[i].first_token;
    r.logits = std::move((*outputs)[i].logits);
    r.prompt_tokens = static_cast<int64_t>(p.request.tokens.size());
    r.cached_tokens = p.cached;
    r.recomputed = p.recomputed;
    r.queue_s = std::max(0.0, Since(p.submitted) - prefill_s);
    r.prefill_s = prefill_s;
    r.batch_requests = static_cast<int>(command.items.size());
    r.timings = timings;
    if (const std::string& name = p.request.session; !name.empty()) {
      SessionState& s = sessions_[name];
      s.evicted = false;
      s.history.insert(s.history.end(), p.request.tokens.begin(), p.request.tokens.end());
      s.last_used = stats_.batches;
    }
    ++stats_.requests_ok;
    stats_.prompt_tokens += r.prompt_tokens;
    stats_.cached_tokens += r.cached_tokens;
    p.reply.set_value(std::move(r));
  }
}

void Engine::Fail(Command& command, const absl::Status& status) {
  std::lock_guard lock(mu_);
  shutdown_ = true;
  auto fail = [&](Pending& p) {
    if (p.end_session) {
      p.ended.set_value(status);
    } else {
      ++stats_.requests_failed;
      p.reply.set_value(status);
    }
  };
  for (auto& p : command.items) fail(*p);
  for (auto& p : queue_) fail(*p);
  queue_.clear();
}

}  // namespace cpfill::runtime
