#include "launch/http_server.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "parallel/mpi_communicator.h"

namespace cpfill::launch {
namespace {

constexpr char kJson[] = "application/json";

std::vector<double> LatencyBounds() {
  return {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
}

}  // namespace

HttpFront::HttpFront(runtime::Engine& engine, runtime::LlamaModel& model, std::string served_model,
                     const runtime::Tokenizer* tokenizer, int threads)
    : engine_(engine),
      model_(model),
      served_model_(std::move(served_model)),
      tokenizer_(tokenizer),
      server_(std::make_unique<httplib::Server>()),
      ttft_(LatencyBounds()),
      queue_(LatencyBounds()),
      batch_tokens_({16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576}) {
  server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
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

// One completion: its prompts queued together (so they can share a fused batch; a refusal
// refuses them all), then each answer awaited.
std::string HttpFront::Completions(const std::string& body, int* status) {
  absl::StatusOr<CompletionRequest> request =
      ParseCompletionRequest(body, served_model_, tokenizer_);
  if (!request.ok()) {
    HttpError e = ErrorResponse(request.status());
    *status = e.status;
    return e.body;
  }
  std::vector<runtime::EngineRequest> prompts;
  for (const std::vector<int32_t>& prompt : request->prompts) {
    prompts.push_back({.tokens = prompt, .session = request->session});
  }
  absl::StatusOr<std::vector<runtime::Engine::Reply>> replies =
      engine_.SubmitAll(std::move(prompts));
  if (!replies.ok()) {
    HttpError e = ErrorResponse(replies.status());
    *status = e.status;
    return e.body;
  }
  std::vector<runtime::EngineResult> results;
  for (runtime::Engine::Reply& reply : *replies) {
    absl::StatusOr<runtime::EngineResult> r = reply.get();
    if (!r.ok()) {
      HttpError e = ErrorResponse(r.status());
      *status = e.status;
      return e.body;
    }
    ttft_.Observe(r->queue_s + r->prefill_s);
    queue_.Observe(r->queue_s);
    batch_tokens_.Observe(static_cast<double>(r->timings.new_tokens));
    results.push_back(std::move(*r));
  }
  const int64_t created = std::chrono::duration_cast<std::chrono::seconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  *status = 200;
  return JsonText(CompletionResponse(*request, results, absl::StrCat("cmpl-", next_id_++), created,
                                     served_model_, tokenizer_));
}

void HttpFront::Routes() {
  httplib::Server& s = *server_;
  s.set_payload_max_length(kMaxBodyBytes);
  // Every answer is counted by its class for /metrics.
  s.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
    (res.status >= 500 ? server_errors_ : res.status >= 400 ? client_errors_ : ok_)++;
  });
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a route's own error body stays
    const absl::Status why =
        res.status >= 500   ? absl::InternalError(absl::StrCat("HTTP ", res.status))
        : res.status == 413 ? absl::ResourceExhaustedError(
                                  absl::StrCat("the body is larger than ", kMaxBodyBytes, " bytes"))
        : res.status == 404
            ? absl::NotFoundError(absl::StrCat("no route ", req.method, " ", req.path))
            : absl::InvalidArgumentError(absl::StrCat("HTTP ", res.status));
    HttpError e = ErrorResponse(why);
    res.set_content(e.body, kJson);
  });
  // A handler that throws (a bug) answers 500 with what it threw; the server goes on.
  s.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
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
      });
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    ++running_;
    int status = 500;
    std::string body = Completions(req.body, &status);
    --running_;
    res.status = status;
    if (status == 503) res.set_header("Retry-After", "1");
    res.set_content(body, kJson);
  });
  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const absl::Status health = Health();
    if (health.ok()) {
      res.set_content(R"({"status":"ok"})", kJson);
      return;
    }
    HttpError e = ErrorResponse(health);
    res.status = e.status;
    res.set_content(e.body, kJson);
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
  s.Get("/v1/sessions", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::ordered_json out = {{"sessions", engine_.sessions()}};
    res.set_content(JsonText(out), kJson);
  });
  s.Delete(R"(/v1/sessions/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string name = req.matches[1];
    const absl::Status ended = engine_.EndSession(name).get();
    if (!ended.ok()) {
      HttpError e = ErrorResponse(ended);
      res.status = e.status;
      res.set_content(e.body, kJson);
      return;
    }
    res.set_content(JsonText({{"deleted", name}}), kJson);
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const ServerCounters counters{.http_ok = ok_,
                                  .http_client_errors = client_errors_,
                                  .http_server_errors = server_errors_,
                                  .running = running_};
    res.set_content(MetricsText(engine_.stats(), counters, ttft_, queue_, batch_tokens_),
                    "text/plain; version=0.0.4");
  });
}

}  // namespace cpfill::launch
