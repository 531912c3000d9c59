// cpfill/launch/http/http_server.h — `cpfill serve`'s HTTP front on world rank 0: Debian's
// cpp-httplib answers each request on its own thread by submitting to the engine and waiting on
// the engine's futures; request and response bodies go through http_api.h.
//
//   HttpFront front(engine, model, "tiny", /*tokenizer=*/nullptr, /*threads=*/64);
//   CPFILL_ASSIGN_OR_RETURN(int port, front.Bind("127.0.0.1", 0));   // 0: a free port
//   std::thread http([&] { front.Serve(); });
//   ... engine.Run() ...;  front.Stop();  http.join();
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <random>
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

class CompletionStream;

class HttpFront {
 public:
  // `threads`: requests answered at once. Each waits on the engine for its whole prefill, so a
  // request beyond them waits in the server, unseen by the engine's queue and batches.
  // `tokenizer` (may be null: token ids only) outlives the front.
  HttpFront(runtime::Engine& engine, runtime::LlamaModel& model, std::string served_model,
            const runtime::Tokenizer* tokenizer, int threads);
  ~HttpFront();

  // Binds `host`:`port` (0: a free port) and returns the port. FailedPrecondition naming the
  // address when it cannot be bound.
  absl::StatusOr<int> Bind(const std::string& host, int port);
  void Serve();  // answers requests until Stop()
  void Stop();
  // /health answers 200 only while this is set (the engine loop runs on every rank) and every
  // rank answers a liveness probe (parallel::WorldAnswers); 503 naming the silent ranks else.
  void SetHealthy(bool healthy) { healthy_ = healthy; }

 private:
  static constexpr std::chrono::milliseconds kHealthProbeEvery{500};
  void Routes();  // the error handlers and every route
  void ServiceRoutes();
  void SessionRoutes();
  void KvLeaseRoutes();
  absl::Status Health();
  void Completions(const httplib::Request& req, httplib::Response& res);
  void Stream(std::shared_ptr<CompletionRequest> request, std::shared_ptr<CompletionStream> stream,
              std::shared_ptr<std::vector<runtime::Engine::Reply>> replies, httplib::Response& res);
  std::string Finale(const CompletionRequest& request, CompletionStream& stream,
                     std::vector<runtime::Engine::Reply>& replies);
  uint64_t NextSeed();  // a request without a seed samples with this one

  runtime::Engine& engine_;
  runtime::LlamaModel& model_;
  const std::string served_model_;
  const runtime::Tokenizer* tokenizer_;
  std::unique_ptr<httplib::Server> server_;
  std::atomic<bool> healthy_{false};
  std::mutex health_mu_;
  absl::Status health_;
  std::chrono::steady_clock::time_point health_probed_{};
  std::atomic<int64_t> next_id_{1}, ok_{0}, client_errors_{0}, server_errors_{0}, running_{0};
  ServingHistograms histograms_;
  std::mutex seed_mu_;
  std::mt19937_64 seeds_;
};

}  // namespace cpfill::launch
