// cpfill/launch/http/http_server.h — `cpfill serve`'s HTTP front on world rank 0: Debian's
// cpp-httplib parses each request, under the connection layer of http_connections.h (the API key,
// bounded heads, bodies and connections, disconnects), and a worker thread answers it by
// submitting to the engine and waiting on the engine's futures; request and response bodies go
// through http_api.h.
//
//   HttpFront front(engine, model, "tiny", /*tokenizer=*/nullptr, {.api_key = key});
//   CPFILL_ASSIGN_OR_RETURN(int port, front.Bind("127.0.0.1", 0));   // 0: a free port
//   std::thread http([&] { front.Serve(); });
//   ... engine.Run() ...;  front.Stop();  http.join();
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "launch/http/http_api.h"
#include "runtime/model/llama_model.h"
#include "runtime/serving/engine.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace cpfill::launch {

class ChatRenderer;
struct ChatRequest;
class CompletionStream;
class GuardedServer;

// How the front meets the network: `serve`'s flags (README: Security).
struct HttpOptions {
  // Requests answered at once (--http-threads). Each waits on the engine for its whole prefill
  // (and generation), so a request beyond them waits in the server, unseen by the engine's queue
  // and batches. GET /health and /metrics have two threads of their own besides.
  int threads = 64;
  // Sockets held at once (--max-connections): waiting for a request, answered, or kept alive;
  // one more is answered 503 at once and closed.
  int max_connections = 512;
  std::string api_key;  // "": no key is asked for
  size_t max_body_bytes = kMaxBodyBytes;
  size_t max_pending_bytes = 4 * kMaxBodyBytes;   // bodies held by requests read or answered
  std::chrono::milliseconds head_timeout{10000};  // a request's line and headers, whole
  // The longest pause within a body, or in taking an answer.
  std::chrono::milliseconds read_timeout{30000};
  std::chrono::milliseconds keep_alive_timeout{5000};  // an idle connection, between requests
  int keep_alive_requests = 100;                       // requests on one connection
  std::chrono::milliseconds trim_after_idle{1000};     // malloc_trim once idle this long
  // A prompt of more token ids is refused while its body is parsed (--max-batch-tokens: the
  // engine would refuse it anyway), so that no body expands to more than a few times its size.
  int64_t max_prompt_tokens = kMaxTokensPerRequest;
  // --chat-template-renderer: the command of the co-process that renders chat conversations
  // (chat_renderer.h); "": /v1/chat/completions answers 404 naming /v1/completions.
  std::string chat_template_renderer;
  std::chrono::milliseconds chat_render_timeout{2000};
};

class HttpFront {
 public:
  // `tokenizer` (may be null: token ids only) outlives the front.
  HttpFront(runtime::Engine& engine, runtime::LlamaModel& model, std::string served_model,
            const runtime::Tokenizer* tokenizer, HttpOptions options);
  ~HttpFront();
  // The threads the front starts on top of the caller's Serve thread: workers, health and
  // metrics workers, the connection waiter.
  static int ThreadsFor(int http_threads) { return http_threads + 3; }

  // Binds `host`:`port` (0: a free port) and returns the port. FailedPrecondition naming the
  // address when it cannot be bound.
  absl::StatusOr<int> Bind(const std::string& host, int port);
  void Serve();  // answers requests until Stop()
  void Stop();
  // /health answers 200 only while this is set (the engine loop runs on every rank) and every
  // rank answers a liveness probe (parallel::WorldAnswers); 503 naming the silent ranks else.
  void SetHealthy(bool healthy) { healthy_ = healthy; }
  // The drain's deadline has passed (--drain-timeout-s): every request still waiting on the
  // engine is cancelled (its generation ends at its next token, freeing its KV) and answered
  // 503; a stream already under way ends with an error event. Any thread.
  void ExpireDrain();
  // The engine has failed (every request it held is answered): waits until no request waits on
  // it any more, or `limit` passes, so that their answers (503, a stream's error event) reach
  // the clients before the job ends.
  void WaitUntilAnswered(std::chrono::milliseconds limit);

 private:
  static constexpr std::chrono::milliseconds kHealthProbeEvery{500};
  void Routes();  // the error handlers and every route
  void ServiceRoutes();
  void SessionRoutes();
  void KvLeaseRoutes();
  absl::Status Health();
  void Completions(const httplib::Request& req, httplib::Response& res);
  // /v1/chat/completions: the conversation rendered (renderer_), then run as a completion.
  void ChatCompletions(const httplib::Request& req, httplib::Response& res);
  // A parsed completion, answered whole or streamed; `chat` (may be null) reshapes the answer
  // into chat's objects.
  void Complete(std::shared_ptr<CompletionRequest> request, std::shared_ptr<const ChatRequest> chat,
                httplib::Response& res);
  // Waits until `reply` is ready or `enough` says so, while the client stays and the drain's
  // deadline has not passed; otherwise sets `cancelled` (the engine ends the generation at its
  // next token) and returns the refusal: the client left (nothing to answer) or the drain.
  absl::Status AwaitReply(runtime::Engine::Reply& reply, const std::function<bool()>& enough,
                          std::atomic<bool>& cancelled);
  // `tracked` (Track's token) is held until the stream ends.
  void Stream(std::shared_ptr<CompletionRequest> request, std::shared_ptr<CompletionStream> stream,
              std::shared_ptr<std::vector<runtime::Engine::Reply>> replies,
              std::shared_ptr<void> tracked, httplib::Response& res);
  std::string Finale(const CompletionRequest& request, CompletionStream& stream,
                     std::vector<runtime::Engine::Reply>& replies);
  uint64_t NextSeed();  // a request without a seed samples with this one
  // The cancel flags of requests waiting on the engine, for ExpireDrain; Track returns a token
  // that untracks it when released.
  std::shared_ptr<void> Track(std::shared_ptr<std::atomic<bool>> cancelled);

  runtime::Engine& engine_;
  runtime::LlamaModel& model_;
  const std::string served_model_;
  const runtime::Tokenizer* tokenizer_;
  const int64_t max_prompt_tokens_;
  std::unique_ptr<ChatRenderer> renderer_;  // null without --chat-template-renderer
  std::unique_ptr<GuardedServer> server_;
  std::atomic<bool> healthy_{false}, drain_expired_{false};
  std::mutex waiting_mu_;
  std::set<std::shared_ptr<std::atomic<bool>>> waiting_;
  std::mutex health_mu_;
  absl::Status health_;
  std::chrono::steady_clock::time_point health_probed_{};
  std::atomic<int64_t> next_id_{1}, ok_{0}, client_errors_{0}, server_errors_{0}, running_{0};
  ServingHistograms histograms_;
  std::mutex seed_mu_;
  std::mt19937_64 seeds_;
};

}  // namespace cpfill::launch
