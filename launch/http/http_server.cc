#include "launch/http/http_server.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "launch/http/chat_api.h"
#include "launch/http/chat_renderer.h"
#include "launch/http/http_connections.h"
#include "launch/http/http_stream.h"
#include "parallel/mpi_communicator.h"

namespace cpfill::launch {
namespace {

constexpr char kJson[] = "application/json";
// How often a request waiting on the engine looks whether its client is still there, and
// whether the drain's deadline has passed.
constexpr auto kPeerCheckEvery = std::chrono::milliseconds(50);
// The status a request whose client left is logged with (nginx's "client closed request"): no
// one reads it.
constexpr int kClientClosedRequest = 499;

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void SetError(const absl::Status& status, httplib::Response& res) {
  if (absl::IsCancelled(status)) {  // the client left (HttpFront::AwaitReply)
    res.status = kClientClosedRequest;
    return;
  }
  HttpError e = ErrorResponse(status);
  res.status = e.status;
  if (e.status == 503) res.set_header("Retry-After", "1");
  res.set_content(e.body, kJson);
  if (RequestScope* scope = ThisRequest()) scope->route_refusal = RefusalOf(status);
}

// A request cancelled by HttpFront::ExpireDrain.
absl::Status DrainExpired() {
  return absl::FailedPreconditionError(
      "the server stopped before this request finished: its drain deadline (--drain-timeout-s) "
      "passed");
}

// What a 4xx or 503 that neither the connection layer nor a route named stands for: cpp-httplib's
// own answers (a malformed request line, an unknown route).
std::optional<Refusal> RefusalOfStatus(int status) {
  switch (status) {
    case 401:
      return Refusal::kUnauthorized;
    case 404:
      return Refusal::kNotFound;
    case 408:
      return Refusal::kTimeout;
    case 413:
      return Refusal::kBodyTooLarge;
    case 414:
    case 431:
      return Refusal::kHeaderTooLarge;
    case 503:
      return Refusal::kOverloaded;
    default:
      return status >= 400 && status < 500 && status != kClientClosedRequest
                 ? std::optional<Refusal>(Refusal::kBadRequest)
                 : std::nullopt;
  }
}

// The ?nonce= of a lease route: the handle's lease_nonce.
absl::StatusOr<std::string> LeaseNonceParam(const httplib::Request& req) {
  if (!req.has_param("nonce")) {
    return absl::InvalidArgumentError(
        "the lease's nonce is required: ?nonce=<the handle's lease_nonce>");
  }
  return req.get_param_value("nonce");
}

// Which replies have come. Read before the stream's events: a prompt that succeeded pushed its
// last token before its reply came, so a reply that came while its prompt has not finished
// after those events failed.
std::vector<bool> ReadyNow(std::vector<runtime::Engine::Reply>& replies) {
  std::vector<bool> ready;
  for (auto& r : replies) {
    ready.push_back(r.wait_for(std::chrono::seconds(0)) == std::future_status::ready);
  }
  return ready;
}

// The body of an answer the server made without a route's (an unknown route, a body too large,
// a status without a body): the error JSON of every other refusal.
void AnswerWithoutBody(const httplib::Request& req, httplib::Response& res) {
  if (!res.body.empty() || res.status == kClientClosedRequest) return;  // a route's own stays
  if (AnswerRefusal(res)) return;  // a head or body that did not come whole
  const absl::Status why =
      res.status >= 500   ? absl::InternalError(absl::StrCat("HTTP ", res.status))
      : res.status == 413 ? absl::ResourceExhaustedError(
                                "the body is too large (one sent as "
                                "application/x-www-form-urlencoded takes 8192 bytes at most: send "
                                "Content-Type: application/json)")
      : res.status == 404
          ? absl::NotFoundError(absl::StrCat("no route ", req.method, " ", req.path))
          : absl::InvalidArgumentError(absl::StrCat("HTTP ", res.status));
  HttpError e = ErrorResponse(why);
  res.set_content(e.body, kJson);
}

// A handler that throws (a bug) answers 500 with what it threw; the server goes on.
void AnswerException(const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
  std::string what = "unknown exception";
  try {
    std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  HttpError e = ErrorResponse(absl::InternalError(absl::StrCat("internal error: ", what)));
  res.status = e.status;
  res.set_content(e.body, kJson);
}

}  // namespace

HttpFront::HttpFront(runtime::Engine& engine, runtime::LlamaModel& model, std::string served_model,
                     const runtime::Tokenizer* tokenizer, HttpOptions options)
    : engine_(engine),
      model_(model),
      served_model_(std::move(served_model)),
      tokenizer_(tokenizer),
      max_prompt_tokens_(options.max_prompt_tokens),
      renderer_(options.chat_template_renderer.empty()
                    ? nullptr
                    : std::make_unique<ChatRenderer>(ChatRenderer::Options{
                          .command = options.chat_template_renderer,
                          .timeout = options.chat_render_timeout})),
      server_(std::make_unique<GuardedServer>(std::move(options))),
      seeds_(std::random_device{}()) {
  Routes();
}

HttpFront::~HttpFront() = default;

absl::StatusOr<int> HttpFront::Bind(const std::string& host, int port) {
  const int bound =
      port == 0 ? server_->bind_to_any_port(host) : (server_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return absl::FailedPreconditionError(absl::StrCat("--host ", host, " --port ", port,
                                                      ": cannot listen there (in use, or not "
                                                      "an address of this host)"));
  }
  return bound;
}

// Every rank's progress thread must answer (also while the ranks prefill); probed at most every
// kHealthProbeEvery, however often /health is polled, and never while another probe runs.
absl::Status HttpFront::Health() {
  if (!healthy_) return absl::UnavailableError("the engine is stopping: it drains its queue");
  std::lock_guard lock(health_mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - health_probed_ >= kHealthProbeEvery) {
    health_ = parallel::WorldAnswers();
    health_probed_ = std::chrono::steady_clock::now();
  }
  return health_;
}

void HttpFront::Serve() { server_->listen_after_bind(); }
void HttpFront::Stop() { server_->stop(); }

void HttpFront::ExpireDrain() {
  drain_expired_ = true;
  std::lock_guard lock(waiting_mu_);
  for (const auto& cancelled : waiting_) cancelled->store(true);
}

void HttpFront::WaitUntilAnswered(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    {
      std::lock_guard lock(waiting_mu_);
      if (waiting_.empty()) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // A handler untracks itself before cpp-httplib writes its answer: a moment for the writes.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

std::shared_ptr<void> HttpFront::Track(std::shared_ptr<std::atomic<bool>> cancelled) {
  {
    std::lock_guard lock(waiting_mu_);
    waiting_.insert(cancelled);
  }
  if (drain_expired_) cancelled->store(true);
  return std::shared_ptr<void>(nullptr, [this, cancelled](void*) {
    std::lock_guard lock(waiting_mu_);
    waiting_.erase(cancelled);
  });
}

absl::Status HttpFront::AwaitReply(runtime::Engine::Reply& reply,
                                   const std::function<bool()>& enough,
                                   std::atomic<bool>& cancelled) {
  const ConnectionStream* connection = ThisConnection();
  // A stream waits for its first token, which the future does not signal: it looks often.
  const auto step = enough ? std::chrono::milliseconds(2) : kPeerCheckEvery;
  auto next_check = std::chrono::steady_clock::now();
  while (!(enough && enough()) && reply.wait_for(step) != std::future_status::ready) {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_check) continue;
    next_check = now + kPeerCheckEvery;
    if (drain_expired_) {
      cancelled = true;
      return DrainExpired();
    }
    if (connection != nullptr && connection->PeerGone()) {
      cancelled = true;
      return absl::CancelledError("the client closed the connection");
    }
  }
  return absl::OkStatus();
}

// One completion: its prompts queued together (so they can share a fused batch; a refusal
// refuses them all), answered whole or streamed as they generate.
void HttpFront::Completions(const httplib::Request& req, httplib::Response& res) {
  absl::StatusOr<CompletionRequest> parsed =
      ParseCompletionRequest(req.body, served_model_, tokenizer_, max_prompt_tokens_);
  if (!parsed.ok()) return SetError(parsed.status(), res);
  if (parsed->sparq.has_value()) {
    absl::Status s = model_.backend().name() == "cpu"
                         ? runtime::CheckSparqConfig(*parsed->sparq, model_.config().head_dim)
                         : absl::InvalidArgumentError("sparq needs the CPU backend for now");
    if (!s.ok()) return SetError(s, res);
  }
  Complete(std::make_shared<CompletionRequest>(std::move(*parsed)), nullptr, res);
}

void HttpFront::ChatCompletions(const httplib::Request& req, httplib::Response& res) {
  if (renderer_ == nullptr) {
    return SetError(absl::NotFoundError(
                        "/v1/chat/completions needs a chat template renderer, which this server "
                        "does not have (serve --chat-template-renderer): render the conversation "
                        "yourself and send it to /v1/completions"),
                    res);
  }
  absl::StatusOr<ChatRequest> parsed = ParseChatRequest(
      req.body, served_model_, tokenizer_,
      [this](const nlohmann::json& input) { return renderer_->Render(input); }, max_prompt_tokens_,
      model_.config().max_position_embeddings);
  if (!parsed.ok()) return SetError(parsed.status(), res);
  auto chat = std::make_shared<ChatRequest>(std::move(*parsed));
  Complete(std::shared_ptr<CompletionRequest>(chat, &chat->completion), chat, res);
}

void HttpFront::Complete(std::shared_ptr<CompletionRequest> request,
                         std::shared_ptr<const ChatRequest> chat, httplib::Response& res) {
  std::vector<runtime::EngineRequest> prompts = EngineRequestsOf(*request, NextSeed(), tokenizer_);
  const std::string id = absl::StrCat(chat ? "chatcmpl-" : "cmpl-", next_id_++);
  std::shared_ptr<CompletionStream> stream;
  // Every prompt of the request ends together when its client leaves or the drain expires.
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  if (request->stream) {
    stream =
        std::make_shared<CompletionStream>(*request, id, UnixSeconds(), served_model_, tokenizer_);
    cancelled = stream->cancelled();
    if (chat) {
      auto role_sent = std::make_shared<std::vector<bool>>(request->choices(), false);
      stream->SetShape([chat, role_sent](nlohmann::ordered_json chunk) {
        return ChatChunks(*chat, std::move(chunk), role_sent.get());
      });
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      prompts[i].on_token = stream->Sink(static_cast<int>(i));
    }
  }
  for (runtime::EngineRequest& prompt : prompts) prompt.cancelled = cancelled;
  if (const ConnectionStream* c = ThisConnection(); c != nullptr && c->PeerGone()) {
    return SetError(absl::CancelledError("the client left before its request was queued"), res);
  }
  absl::StatusOr<std::vector<runtime::Engine::Reply>> replies =
      engine_.SubmitAll(std::move(prompts));
  if (!replies.ok()) return SetError(replies.status(), res);
  std::shared_ptr<void> tracked = Track(cancelled);
  auto shared = std::make_shared<std::vector<runtime::Engine::Reply>>(std::move(*replies));
  if (stream) return Stream(request, stream, shared, std::move(tracked), res);
  std::vector<runtime::EngineResult> results;
  for (runtime::Engine::Reply& reply : *shared) {
    if (absl::Status waited = AwaitReply(reply, nullptr, *cancelled); !waited.ok()) {
      return SetError(waited, res);
    }
    absl::StatusOr<runtime::EngineResult> r = reply.get();
    if (!r.ok()) return SetError(r.status(), res);
    if (r->finish_reason == "abort" && drain_expired_) return SetError(DrainExpired(), res);
    histograms_.Observe(*r);
    if (request->max_tokens == 0) {  // echo alone: the prompt, nothing generated
      r->tokens.clear();
      r->finish_reason = "length";
    }
    results.push_back(std::move(*r));
  }
  nlohmann::ordered_json answer =
      CompletionResponse(*request, results, id, UnixSeconds(), served_model_, tokenizer_);
  if (chat) answer = ChatResponse(*chat, std::move(answer));
  res.set_content(JsonText(answer), kJson);
}

// A streamed completion: an error before any prompt's first token is answered as JSON with its
// status, as without streaming; after that, the events, an error event if a prompt fails, the
// usage when asked, and "data: [DONE]".
void HttpFront::Stream(std::shared_ptr<CompletionRequest> request,
                       std::shared_ptr<CompletionStream> stream,
                       std::shared_ptr<std::vector<runtime::Engine::Reply>> replies,
                       std::shared_ptr<void> tracked, httplib::Response& res) {
  for (size_t i = 0; i < replies->size(); ++i) {
    auto& reply = (*replies)[i];
    const int index = static_cast<int>(i);
    const absl::Status waited = AwaitReply(
        reply, [&] { return stream->Started(index); }, *stream->cancelled());
    if (!waited.ok()) return SetError(waited, res);
    if (!stream->Started(index)) {  // answered without a token: its error
      absl::StatusOr<runtime::EngineResult> r = reply.get();
      return SetError(r.ok() ? absl::InternalError("no token was streamed") : r.status(), res);
    }
  }
  ++running_;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, request, stream, replies, tracked](size_t, httplib::DataSink& sink) {
        // A client that left ends the stream (the releaser cancels the generation) even while
        // no token comes to be written.
        if (const ConnectionStream* c = ThisConnection(); c != nullptr && c->PeerGone()) {
          return false;
        }
        const std::vector<bool> ready = ReadyNow(*replies);
        std::string events;
        bool more = stream->Next(&events, std::chrono::milliseconds(100));
        if (!events.empty() && !sink.write(events.data(), events.size())) return false;
        for (size_t i = 0; i < ready.size(); ++i) {
          if (ready[i] && !stream->Finished(static_cast<int>(i))) more = false;  // it failed
        }
        if (more) return true;
        events = Finale(*request, *stream, *replies);
        sink.write(events.data(), events.size());
        sink.done();
        return true;
      },
      [this, stream](bool success) {
        if (!success) stream->cancelled()->store(true);  // the client left: stop generating
        --running_;
      });
}

// The end of a stream once every prompt finished (or one failed): the usage chunk when asked,
// an error event for a failed prompt, then [DONE].
std::string HttpFront::Finale(const CompletionRequest& request, CompletionStream& stream,
                              std::vector<runtime::Engine::Reply>& replies) {
  std::string out;
  std::vector<runtime::EngineResult> results;
  for (auto& reply : replies) {
    absl::StatusOr<runtime::EngineResult> r = reply.get();
    if (!r.ok()) {
      out += ServerSentEvent(ErrorResponse(r.status()).body);
      continue;
    }
    histograms_.Observe(*r);
    if (request.max_tokens == 0) r->tokens.clear();  // echo alone: nothing was sent
    results.push_back(std::move(*r));
  }
  if (request.include_usage && results.size() == replies.size()) {
    out += stream.Event(UsageChunk(stream.id(), UnixSeconds(), served_model_, results, request.n));
  }
  const bool aborted = std::any_of(results.begin(), results.end(),
                                   [](const auto& r) { return r.finish_reason == "abort"; });
  if (aborted && drain_expired_) out += ServerSentEvent(ErrorResponse(DrainExpired()).body);
  return out + "data: [DONE]\n\n";
}

uint64_t HttpFront::NextSeed() {
  std::lock_guard lock(seed_mu_);
  return seeds_();
}

void HttpFront::Routes() {
  httplib::Server& s = *server_;
  // Every answer is counted by its class for /metrics, and every refusal by its reason (a
  // failing /health is an answer, not a refusal).
  s.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    (res.status >= 500 ? server_errors_ : res.status >= 400 ? client_errors_ : ok_)++;
    if (res.status < 400 || req.path == "/health") return;
    const RequestScope* scope = ThisRequest();
    std::optional<Refusal> why;
    if (scope != nullptr) why = scope->refusal ? scope->refusal : scope->route_refusal;
    if (!why) why = RefusalOfStatus(res.status);
    if (why) server_->Count(*why);
  });
  s.set_error_handler(AnswerWithoutBody);
  s.set_exception_handler(AnswerException);
  ServiceRoutes();
  SessionRoutes();
  KvLeaseRoutes();
}

// Completions, /health, /v1/models and /metrics.
void HttpFront::ServiceRoutes() {
  httplib::Server& s = *server_;
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    ++running_;
    Completions(req, res);
    --running_;
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const absl::Status health = Health();
    if (health.ok()) {
      res.set_content(R"({"status":"ok"})", kJson);
      return;
    }
    SetError(health, res);
  });
  s.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::ordered_json models = {{"object", "list"},
                                     {"data",
                                      {{{"id", served_model_},
                                        {"object", "model"},
                                        {"owned_by", "cpfill"},
                                        {"max_model_len", model_.config().max_position_embeddings},
                                        {"vocab_size", model_.config().vocab_size},
                                        {"text_prompts", tokenizer_ != nullptr}}}}};
    res.set_content(JsonText(models), kJson);
  });
  // Without --chat-template-renderer, a 404 that sends the client to completions.
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    ++running_;
    ChatCompletions(req, res);
    --running_;
  });
  // vLLM's tokenizer routes, answered on the HTTP thread (no engine work).
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    const int64_t max_model_len = model_.config().max_position_embeddings;
    absl::StatusOr<nlohmann::ordered_json> out =
        renderer_ == nullptr
            ? Tokenize(req.body, served_model_, tokenizer_, max_model_len)
            : TokenizeChat(
                  req.body, served_model_, tokenizer_,
                  [this](const nlohmann::json& input) { return renderer_->Render(input); },
                  max_model_len);
    if (!out.ok()) return SetError(out.status(), res);
    res.set_content(JsonText(*out), kJson);
  });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    absl::StatusOr<nlohmann::ordered_json> out = Detokenize(req.body, served_model_, tokenizer_);
    if (!out.ok()) return SetError(out.status(), res);
    res.set_content(JsonText(*out), kJson);
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    ServerCounters counters{.http_ok = ok_,
                            .http_client_errors = client_errors_,
                            .http_server_errors = server_errors_,
                            .running = running_};
    server_->Fill(&counters);
    res.set_content(MetricsText(engine_.stats(), counters, histograms_),
                    "text/plain; version=0.0.4");
  });
}

// The engine's sessions: listed, and ended by name.
void HttpFront::SessionRoutes() {
  httplib::Server& s = *server_;
  s.Get("/v1/sessions", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::ordered_json out = {{"sessions", engine_.sessions()}};
    res.set_content(JsonText(out), kJson);
  });
  s.Delete(R"(/v1/sessions/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.matches[1];
    const absl::Status ended = engine_.EndSession(name).get();
    if (!ended.ok()) {
      SetError(ended, res);
      return;
    }
    res.set_content(JsonText({{"deleted", name}}), kJson);
  });
}

// KV hand-off leases (runtime/serving/engine.h): a decode worker that cannot send UCX's release
// message ends one here, and one that needs longer renews it; both name the handle's lease_nonce
// (?nonce=0x...), so that only a holder of the handle can.
void HttpFront::KvLeaseRoutes() {
  httplib::Server& s = *server_;
  s.Delete(R"(/v1/kv/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    absl::StatusOr<std::string> nonce = LeaseNonceParam(req);
    const absl::Status released = nonce.ok() ? engine_.ReleaseKv(id, *nonce) : nonce.status();
    if (!released.ok()) return SetError(released, res);
    res.set_content(JsonText({{"released", id}}), kJson);
  });
  s.Post(R"(/v1/kv/([^/]+)/renew)", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1];
    absl::StatusOr<std::string> nonce = LeaseNonceParam(req);
    const absl::StatusOr<double> lease_s =
        nonce.ok() ? engine_.RenewKv(id, *nonce) : absl::StatusOr<double>(nonce.status());
    if (!lease_s.ok()) return SetError(lease_s.status(), res);
    res.set_content(JsonText({{"renewed", id}, {"lease_s", *lease_s}}), kJson);
  });
}

}  // namespace cpfill::launch
